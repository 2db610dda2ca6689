"""`unigate requests list|show|tail`: the request log (`GET /admin/requests`) from the command line, with the same
options and output as `unigate keys` (a table on a terminal, tab-separated lines otherwise, `--json`)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import orjson
import typer

from gateway.keys_cli import _DEFAULT_BASE_URL, AsJson, BaseUrl, MasterKey, _call, _cell, _print_record, _print_rows

__all__ = ["register", "requests_app"]

_COLUMNS = (
    "time",
    "request_id",
    "key",
    "model",
    "deployment",
    "status",
    "code",
    "ended_by",
    "tokens",
    "cost_usd",
    "ttft_ms",
    "duration_ms",
)

requests_app = typer.Typer(
    name="requests",
    help="Read the request log of a running gateway (what happened to request X).",
    no_args_is_help=True,
)

Key = Annotated[str | None, typer.Option("--key", help="Only this key id ('master' for the master key).")]
Team = Annotated[str | None, typer.Option("--team", help="Only this team id.")]
Model = Annotated[str | None, typer.Option("--model", help="Only requests for this model id.")]
DeploymentName = Annotated[str | None, typer.Option("--deployment", help="Only those this deployment answered.")]
Status = Annotated[int | None, typer.Option("--status", help="Only this HTTP status (e.g. 429).")]
Code = Annotated[str | None, typer.Option("--code", help="Only this error code (e.g. rate_limit_exceeded).")]
Since = Annotated[str | None, typer.Option("--since", help="RFC 3339 time or ms since the epoch.")]
Until = Annotated[str | None, typer.Option("--until", help="RFC 3339 time or ms since the epoch (exclusive).")]
Limit = Annotated[int, typer.Option("--limit", help="Records to print (newest first).")]


def _row(record: dict[str, Any]) -> list[str]:
    usage = record.get("usage") or {}
    tokens = f"{usage.get('prompt_tokens', 0)}+{usage.get('completion_tokens', 0)}"
    if usage.get("estimated"):
        tokens += " (est.)"
    return [
        _cell(record.get("time")),
        _cell(record.get("request_id")),
        _cell(record.get("key_name") or record.get("key_id")),
        _cell(record.get("model")),
        _cell(record.get("deployment")),
        _cell(record.get("status")),
        _cell(record.get("code")),
        _cell(record.get("ended_by")),
        tokens,
        _cell(record.get("cost_usd")),
        _cell(record.get("ttft_ms")),
        _cell(record.get("duration_ms")),
    ]


@requests_app.command("list")
def list_(
    key: Key = None,
    team: Team = None,
    model: Model = None,
    deployment: DeploymentName = None,
    status: Status = None,
    code: Code = None,
    since: Since = None,
    until: Until = None,
    limit: Limit = 50,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """The newest requests, filtered."""
    params = {
        "key": key,
        "team": team,
        "model": model,
        "deployment": deployment,
        "status": status,
        "code": code,
        "since": since,
        "until": until,
    }
    params = {name: value for name, value in params.items() if value is not None}
    records: list[dict[str, Any]] = []
    cursor: str | None = None
    while len(records) < limit:
        page_params = {**params, "limit": min(500, limit - len(records)), **({"cursor": cursor} if cursor else {})}
        data = _call("GET", base_url, master_key, "/admin/requests", params=page_params)
        records += data["data"]
        cursor = data.get("next_cursor")
        if not cursor:
            break
    if as_json:
        typer.echo(orjson.dumps({"object": "list", "data": records}, option=orjson.OPT_INDENT_2).decode())
        return
    _print_rows(_COLUMNS, [_row(r) for r in records])


@requests_app.command("show")
def show(
    request_id: Annotated[str, typer.Argument(help="The request id (the x-request-id response header).")],
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """One request: who, which deployment, each attempt, status, tokens, cost, timings."""
    record = _call("GET", base_url, master_key, f"/admin/requests/{request_id}")
    if as_json:
        _print_record(record, True)
        return
    attempts = record.pop("attempts", [])
    usage = record.pop("usage", {})
    _print_record({**record, **usage}, False)
    if attempts:
        _print_rows(
            ("attempt", "deployment", "status", "duration_ms", "code"),
            [
                [str(n), a["deployment"], str(a["status"]), str(a["duration_ms"]), _cell(a["code"])]
                for n, a in enumerate(attempts, 1)
            ],
        )


@requests_app.command("tail")
def tail(
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls.")] = 1.0,
    count: Annotated[int | None, typer.Option("--count", help="Stop after this many records.")] = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Print requests as they finish (Ctrl-C to stop)."""
    position = _call("GET", base_url, master_key, "/admin/requests", params={"after": "now"})["position"]
    num_printed = 0
    while count is None or num_printed < count:
        data = _call("GET", base_url, master_key, "/admin/requests", params={"after": position})
        position = data["position"]
        for record in data["data"][: None if count is None else count - num_printed]:
            typer.echo(orjson.dumps(record).decode() if as_json else "\t".join(_row(record)))
            num_printed += 1
        if not data["data"]:
            time.sleep(interval)


def register(app: typer.Typer) -> None:
    app.add_typer(requests_app)
