"""`unigate keys …` and `unigate teams …` against a real gateway-shaped server (uvicorn on a loopback port, real
Redis)."""

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
from gateway.teams_cli import register as register_teams

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


def _invoker(base_url: str, group: str) -> Any:
    app = typer.Typer()
    register(app)
    register_teams(app)
    runner = CliRunner(env={"COLUMNS": "250"})

    def invoke(*args: str, as_json: bool = True, master_key: str = MASTER_KEY) -> Any:
        extra = ["--base-url", base_url, "--master-key", master_key] + (["--json"] if as_json else [])
        result = runner.invoke(app, [group, *args, *extra])
        return result if not as_json or result.exit_code else orjson.loads(result.output)

    return invoke


@pytest.fixture
def cli(base_url: str) -> Any:
    return _invoker(base_url, "keys")


@pytest.fixture
def teams(base_url: str) -> Any:
    return _invoker(base_url, "teams")


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
                                  "token_budget", "budget_usd", "spend_usd", "revoked", "team_id"]  # fmt: skip
    assert [row.split("\t")[:2] for row in rows] == [[ids[0], "a-long-key-name-for-the-search-team"], [ids[1], "b"]]
    assert all(len(row.split("\t")) == len(header.split("\t")) for row in rows)
    paged = runner.invoke(app, ["keys", "list", "--limit", "1", *common])  # the next-page hint goes to stderr
    assert paged.stdout.splitlines()[1].split("\t")[0] == ids[0] and len(paged.stdout.splitlines()) == 2
    assert f"--after {ids[0]}" in paged.stderr
    shown = runner.invoke(app, ["keys", "show", ids[0], *common])
    assert f"id\t{ids[0]}" in shown.output.splitlines()
    usage = runner.invoke(app, ["keys", "usage", *common])
    assert usage.exit_code == 0 and usage.output.splitlines()[0].split("\t")[0] == "model"


def test_team_lifecycle_through_the_cli(cli: Any, teams: Any) -> None:
    created = teams(
        "create", "--name", "search", "--model", "openai/*", "--rpm", "600", "--budget-usd", "25.5",
        "--budget-period", "month", "--weight", "3", "--priority", "high", "--metadata", '{"owner": "ana"}',
    )  # fmt: skip
    team_id = created["id"]
    assert created["object"] == "team" and team_id.startswith("team_")
    assert (created["models"], created["rpm"], created["budget_usd"], created["budget_period"]) == (
        ["openai/*"],
        600,
        25.5,
        "month",
    )
    assert (created["weight"], created["priority"], created["metadata"]) == (3.0, "high", {"owner": "ana"})
    assert [t["id"] for t in teams("list")["data"]] == [team_id]

    updated = teams("update", team_id, "--tpm", "5000", "--unset", "rpm", "--priority", "low")
    assert (updated["rpm"], updated["tpm"], updated["priority"]) == (None, 5000, "low")
    assert teams("update", team_id, as_json=False).exit_code == 1  # nothing to change

    # Keys join at creation or later, move out with --unset team_id; the team counts them.
    member = cli("create", "--name", "m1", "--team", team_id, "--weight", "2", "--priority", "low")
    assert (member["team_id"], member["weight"], member["priority"]) == (team_id, 2.0, "low")
    other = cli("create", "--name", "m2")
    assert cli("update", other["id"], "--team", team_id)["team_id"] == team_id
    assert teams("show", team_id)["num_keys"] == 2
    assert sorted(k["id"] for k in teams("show", team_id, "--keys")["data"]) == sorted([member["id"], other["id"]])
    assert cli("update", other["id"], "--unset", "team_id")["team_id"] is None
    assert teams("usage", team_id) == {"object": "list", "team_id": team_id, "data": []}

    refused = teams("delete", team_id, as_json=False)
    assert refused.exit_code == 1 and "team_has_keys" in refused.output and "--force" in refused.output
    deleted = teams("delete", team_id, "--force")
    assert deleted["deleted"] is True and deleted["detached_keys"] == [member["id"]]
    assert cli("show", member["id"])["team_id"] is None
    missing = teams("show", team_id, as_json=False)
    assert missing.exit_code == 1 and "404 team_not_found" in missing.output
    assert cli("create", "--team", team_id, as_json=False).exit_code == 1


def test_teams_piped_output_keeps_whole_values(base_url: str) -> None:
    app = typer.Typer()
    register(app)
    register_teams(app)
    runner = CliRunner(env={"COLUMNS": None, "LINES": None})
    common = ["--base-url", base_url, "--master-key", MASTER_KEY]
    ids = []
    for name in ("a-long-team-name-for-the-search-people", "b"):
        created = runner.invoke(app, ["teams", "create", "--name", name, "--rpm", "60", "--json", *common])
        ids.append(orjson.loads(created.output)["id"])
    listed = runner.invoke(app, ["teams", "list", *common])
    assert listed.exit_code == 0, listed.output
    header, *rows = listed.output.splitlines()
    assert header.split("\t") == ["id", "name", "num_keys", "models", "rpm", "tpm", "max_concurrent",
                                  "token_budget", "budget_usd", "spend_usd", "weight", "priority"]  # fmt: skip
    assert [row.split("\t")[:5] for row in rows] == [
        [ids[0], "a-long-team-name-for-the-search-people", "0", "all", "60"],
        [ids[1], "b", "0", "all", "60"],
    ]
    paged = runner.invoke(app, ["teams", "list", "--limit", "1", *common])
    assert len(paged.stdout.splitlines()) == 2 and f"--after {ids[0]}" in paged.stderr
    shown = runner.invoke(app, ["teams", "show", ids[1], *common])
    assert f"id\t{ids[1]}" in shown.output.splitlines() and "priority\tnormal" in shown.output.splitlines()
    deleted = runner.invoke(app, ["teams", "delete", ids[1], *common])
    assert deleted.exit_code == 0 and deleted.output.strip() == f"deleted {ids[1]}"
