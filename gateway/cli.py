"""`unigate` command line: serve the gateway, manage keys, run the engine, bench and doctor."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
    from gateway.settings import Settings

    overrides = {k: v for k, v in {"config": config, "host": host, "port": port, "workers": workers}.items() if v}
    settings = Settings(**overrides)  # type: ignore[arg-type]
    run(settings)


def _register_command_groups() -> None:
    from auth.cli import register as register_keys
    from bench.cli import register as register_bench

    register_keys(app)  # unigate keys create|list|show|update|rotate|revoke|usage
    register_bench(app)  # unigate bench [compare], doctor, kv-plan


_register_command_groups()


def main() -> None:
    app()
