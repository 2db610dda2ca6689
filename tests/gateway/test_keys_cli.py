"""`unigate keys …` against a real gateway-shaped server (uvicorn on a loopback port, real Redis)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import typer
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from typer.testing import CliRunner

from auth.redis_client import connect
from auth.store import KeyStore
from gateway.errors import GatewayError, render_openai
from gateway.keys_cli import register
from gateway.routes.admin import admin_routes
from gateway.settings import Settings

MASTER_KEY = "sk-ug-cli-master-key-000000000000"


async def _render(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return Response(render_openai(exc), status_code=exc.status_code, headers=exc.headers, media_type="application/json")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def base_url(redis_url: str, tmp_path: Path) -> Iterator[str]:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        client = connect(redis_url)  # created inside the server's own event loop
        app.state.key_store = KeyStore(client)
        yield
        await client.aclose()

    app = Starlette(routes=admin_routes(), exception_handlers={GatewayError: _render}, lifespan=lifespan)
    app.state.settings = Settings(_env_file=None, data_dir=tmp_path, master_key=MASTER_KEY)  # type: ignore[call-arg, arg-type]
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def cli(base_url: str) -> Any:
    app = typer.Typer()
    register(app)
    runner = CliRunner(env={"COLUMNS": "250"})

    def invoke(*args: str, as_json: bool = True, master_key: str = MASTER_KEY) -> Any:
        extra = ["--base-url", base_url, "--master-key", master_key] + (["--json"] if as_json else [])
        result = runner.invoke(app, ["keys", *args, *extra])
        return result if not as_json or result.exit_code else orjson.loads(result.output)

    return invoke


def test_key_lifecycle_through_the_cli(cli: Any) -> None:
    created = cli(
        "create",
        "--name",
        "ci",
        "--model",
        "openai/*",
        "--model",
        "local",
        "--rpm",
        "10",
        "--metadata",
        '{"team": "x"}',
    )
    key_id, secret = created["id"], created["key"]
    assert (
        secret.startswith("sk-ug-")
        and created["models"] == ["openai/*", "local"]
        and created["metadata"] == {"team": "x"}
    )

    listing = cli("list")
    assert [k["id"] for k in listing["data"]] == [key_id] and secret not in str(listing)
    assert cli("show", key_id)["rpm"] == 10

    updated = cli("update", key_id, "--tpm", "500", "--unset", "rpm")
    assert (updated["rpm"], updated["tpm"]) == (None, 500)
    priced = cli("update", key_id, "--budget-usd", "12.5", "--budget-period", "month")
    assert (priced["budget_usd"], priced["budget_usd_spent"], priced["spend_usd"]) == (12.5, 0, 0)
    assert cli("update", key_id, "--unset", "budget_usd")["budget_usd"] is None

    rotated = cli("rotate", key_id)
    assert rotated["id"] == key_id and rotated["key"] != secret
    assert cli("revoke", key_id)["revoked"] is True
    assert cli("usage", key_id)["data"] == []
    assert cli("usage")["num_keys"] == 1


def test_tables_errors_and_the_master_key(cli: Any) -> None:
    created = cli("create", "--name", "table-key")
    table = cli("list", as_json=False)
    assert table.exit_code == 0 and "table-key" in table.output and created["key"] not in table.output
    shown = cli("create", as_json=False)
    assert shown.exit_code == 0 and "shown only now" in shown.output

    missing = cli("show", "key_0000000000000000", as_json=False)
    assert missing.exit_code == 1 and "404 key_not_found" in missing.output
    normal_key = cli("show", created["id"], as_json=False, master_key=created["key"])
    assert normal_key.exit_code == 1 and "403 admin_only" in normal_key.output
    bad_metadata = cli("create", "--metadata", "{nope", as_json=False)
    assert bad_metadata.exit_code == 1 and "JSON object" in bad_metadata.output


def test_unreachable_gateway_is_a_clear_error() -> None:
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(
        app, ["keys", "list", "--base-url", f"http://127.0.0.1:{_free_port()}", "--master-key", MASTER_KEY]
    )
    assert result.exit_code == 1 and "cannot reach the gateway" in result.output


def test_piped_output_keeps_whole_values(base_url: str) -> None:
    """Not on a terminal (a script's pipe, no COLUMNS): tab-separated lines with whole ids, not a table cut to 80
    columns."""
    app = typer.Typer()
    register(app)
    runner = CliRunner(env={"COLUMNS": None, "LINES": None})
    common = ["--base-url", base_url, "--master-key", MASTER_KEY]
    ids = []
    for name in ("a-long-key-name-for-the-search-team", "b"):
        created = runner.invoke(app, ["keys", "create", "--name", name, "--model", "openai/*", "--json", *common])
        ids.append(orjson.loads(created.output)["id"])
    listed = runner.invoke(app, ["keys", "list", *common])
    assert listed.exit_code == 0, listed.output
    header, *rows = listed.output.splitlines()
    assert header.split("\t") == ["id", "name", "key_prefix", "models", "rpm", "tpm", "max_concurrent",
                                  "token_budget", "budget_usd", "spend_usd", "revoked"]  # fmt: skip
    assert [row.split("\t")[:2] for row in rows] == [[ids[0], "a-long-key-name-for-the-search-team"], [ids[1], "b"]]
    assert all(len(row.split("\t")) == len(header.split("\t")) for row in rows)
    paged = runner.invoke(app, ["keys", "list", "--limit", "1", *common])  # the next-page hint goes to stderr
    assert paged.stdout.splitlines()[1].split("\t")[0] == ids[0] and len(paged.stdout.splitlines()) == 2
    assert f"--after {ids[0]}" in paged.stderr
    shown = runner.invoke(app, ["keys", "show", ids[0], *common])
    assert f"id\t{ids[0]}" in shown.output.splitlines()
    usage = runner.invoke(app, ["keys", "usage", *common])
    assert usage.exit_code == 0 and usage.output.splitlines()[0].split("\t")[0] == "model"
