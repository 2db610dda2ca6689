"""`unigate` command line: serve the gateway, manage keys, run the engine, bench and doctor."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from gateway.settings import Settings

__all__ = ["app", "main"]

app = typer.Typer(name="unigate", help="One OpenAI-compatible base URL in front of every model.", no_args_is_help=True)


@app.command()
def serve(
    config: Annotated[
        Path | None, typer.Option(help="Routing file (YAML). Default: $UNIGATE_CONFIG or ./unigate.yaml")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address. Default: $UNIGATE_HOST or 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="Port. Default: $UNIGATE_PORT or 8080")] = None,
    workers: Annotated[int | None, typer.Option(help="Uvicorn worker processes.")] = None,
) -> None:
    """Start the gateway (flags override the environment)."""
    from gateway.server import run

    overrides = {k: v for k, v in {"config": config, "host": host, "port": port, "workers": workers}.items() if v}
    run(_settings(**overrides))


engine_app = typer.Typer(name="engine", help="The local inference engine.", no_args_is_help=True)
app.add_typer(engine_app)


@engine_app.command("serve")
def engine_serve(
    model: Annotated[str | None, typer.Option(help="HF directory or .gguf file. Default: the bundled SmolLM2.")] = None,
    model_id: Annotated[str | None, typer.Option(help="Public model id. Default: smollm2-135m-instruct.")] = None,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="UNIGATE_ENGINE_API_KEY", help="Require this key.")] = None,
) -> None:
    """Serve the local engine alone as an OpenAI-compatible server (route a gateway to it as `type: openai`)."""
    from gateway.engine_host.http import serve_engine
    from gateway.logging import configure_logging
    from gateway.routing_config import RoutingConfigError

    settings = _settings()
    updates = {k: v for k, v in {"model_path": model, "model_id": model_id}.items() if v}
    settings = settings.model_copy(update={"engine": settings.engine.model_copy(update=updates)})
    configure_logging(settings.log_level, settings.log_format)
    try:
        serve_engine(settings, api_key=api_key, host=host, port=port)
    except RoutingConfigError as exc:
        raise SystemExit(f"unigate: {exc}") from None


def _settings(**overrides: Any) -> Settings:
    """The settings from the environment (and `.env`) plus flags; a bad value ends the command here, before
    anything listens, with a message naming its variable (as a bad routing file does in `gateway.server.run`)."""
    from gateway.settings import InvalidSettingsError, load_settings

    try:
        return load_settings(**overrides)
    except InvalidSettingsError as exc:
        raise SystemExit(f"unigate: {exc}") from None


def _register_command_groups() -> None:
    from bench.cli import register as register_bench
    from gateway.keys_cli import register as register_keys
    from gateway.requests_cli import register as register_requests
    from gateway.teams_cli import register as register_teams

    register_keys(app)  # unigate keys create|list|show|update|rotate|revoke|usage
    register_teams(app)  # unigate teams create|list|show|update|delete|usage
    register_requests(app)  # unigate requests list|show|tail
    register_bench(app)  # unigate bench [compare], doctor, kv-plan


_register_command_groups()


def main() -> None:
    app()
