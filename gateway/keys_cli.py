"""`unigate keys …`: the admin API from the command line, over HTTP to a running gateway."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import httpx
import orjson
import typer
from rich.console import Console
from rich.table import Table

__all__ = ["keys_app", "register"]

_RECORD_COLUMNS = (
    "id",
    "name",
    "key_prefix",
    "models",
    "rpm",
    "tpm",
    "max_concurrent",
    "token_budget",
    "budget_usd",
    "spend_usd",
    "revoked",
    "team_id",
)

BaseUrl = Annotated[str, typer.Option("--base-url", envvar="UNIGATE_BASE_URL", help="The running gateway.")]
MasterKey = Annotated[
    str | None,
    typer.Option(
        "--master-key",
        envvar="UNIGATE_MASTER_KEY",
        show_envvar=True,
        help="Default: $UNIGATE_MASTER_KEY, else the master_key file in the data directory.",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the raw JSON response.")]
_DEFAULT_BASE_URL = "http://127.0.0.1:8080"

keys_app = typer.Typer(name="keys", help="Manage API keys on a running gateway.", no_args_is_help=True)


def _console() -> Console:
    return Console()  # built per use, so it sees the terminal (and COLUMNS) of this invocation


def _tsv_cell(value: str) -> str:
    return value.replace("\t", " ").replace("\r", " ").replace("\n", " ")


def _print_rows(columns: tuple[str, ...], rows: list[list[str]], *, header: bool = True) -> None:
    """A table on a terminal; otherwise (a pipe, a file) tab-separated lines with whole values: rich cuts columns
    to the terminal's width, 80 when there is none, so a script would read `key_01…` instead of an id."""
    if _console().is_terminal:
        table = Table(*columns) if header else Table(show_header=False, box=None)
        for row in rows:
            table.add_row(*row)
        _console().print(table)
        return
    lines = [columns] if header else []
    for line in [*lines, *rows]:
        typer.echo("\t".join(_tsv_cell(cell) for cell in line))


def _fail(message: str) -> NoReturn:
    _console().print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(1)


def _master_key(explicit: str | None) -> str:
    if explicit:
        return explicit
    from auth.master_key import read_master_key
    from gateway.settings import Settings

    settings = Settings()
    configured = settings.master_key.get_secret_value() if settings.master_key is not None else None
    key = read_master_key(configured, settings.data_dir)
    if key is None:
        _fail("no master key: pass --master-key, set UNIGATE_MASTER_KEY, or run from the gateway's directory.")
    return key


def _call(method: str, base_url: str, master_key: str | None, path: str, **kwargs: Any) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {_master_key(master_key)}"}
    try:
        with httpx.Client(base_url=base_url, headers=headers, timeout=30.0) as client:
            response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the gateway at {base_url} ({type(exc).__name__}). Is `unigate serve` running?")
    try:
        data: dict[str, Any] = response.json()
    except ValueError:
        _fail(f"the gateway answered {response.status_code} with a non-JSON body")
    if response.is_error:
        error = data.get("error", {}) if isinstance(data, dict) else {}
        _fail(f"{response.status_code} {error.get('code', '')}: {error.get('message', response.text)}")
    return data


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "all"
    return str(value)


def _note(text: str) -> None:
    """A line about the rows printed: below them on a terminal, on stderr otherwise (stdout stays all rows)."""
    if _console().is_terminal:
        _console().print(text, highlight=False)
    else:
        typer.echo(text, err=True)


def _print_record(record: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(orjson.dumps(record, option=orjson.OPT_INDENT_2).decode())
        return
    rows = [[name, _cell(value)] for name, value in record.items() if name not in ("key", "object")]
    if not _console().is_terminal:
        _print_rows(("name", "value"), [*rows, *([["key", record["key"]]] if "key" in record else [])], header=False)
        if "key" in record:
            _note("the key is shown only now: store it safely")
        return
    _print_rows(("name", "value"), [[f"[bold]{name}[/bold]", value] for name, value in rows], header=False)
    if "key" in record:
        _console().print(
            f"\n[bold green]key[/bold green] (shown only now, store it safely): {record['key']}", highlight=False
        )


def _limits_body(
    name: str | None,
    models: list[str] | None,
    rpm: int | None,
    tpm: int | None,
    max_concurrent: int | None,
    token_budget: int | None,
    budget_usd: float | None,
    budget_period: str | None,
    expires_at: str | None,
    metadata: str | None,
    **more: Any,
) -> dict[str, Any]:
    """The JSON body of a create or update from the options given (absent ones are left out)."""
    body: dict[str, Any] = {
        "name": name,
        "models": models or None,
        "rpm": rpm,
        "tpm": tpm,
        "max_concurrent": max_concurrent,
        "token_budget": token_budget,
        "budget_usd": budget_usd,
        "budget_period": budget_period,
        "expires_at": expires_at,
        **more,
    }
    if metadata is not None:
        try:
            body["metadata"] = orjson.loads(metadata)
        except orjson.JSONDecodeError:
            _fail('--metadata must be a JSON object, e.g. \'{"team": "search"}\'')
    return {k: v for k, v in body.items() if v is not None}


Name = Annotated[str | None, typer.Option(help="A label for the key.")]
Models = Annotated[
    list[str] | None, typer.Option("--model", help="Allowed model id or wildcard (repeat). Default: all.")
]
Rpm = Annotated[int | None, typer.Option(help="Requests per minute.")]
Tpm = Annotated[int | None, typer.Option(help="Tokens per minute.")]
MaxConcurrent = Annotated[int | None, typer.Option(help="Requests in flight at once.")]
TokenBudget = Annotated[int | None, typer.Option(help="Prompt + completion tokens allowed (per budget period).")]
BudgetUsd = Annotated[
    float | None, typer.Option(help="Spend allowed in USD (per budget period), priced from the routing file.")
]
BudgetPeriod = Annotated[str | None, typer.Option(help="total, day or month (shared by both budgets).")]
ExpiresAt = Annotated[str | None, typer.Option(help="RFC 3339 time, e.g. 2030-01-01T00:00:00Z.")]
Metadata = Annotated[str | None, typer.Option(help="JSON object stored with the key.")]
Team = Annotated[str | None, typer.Option("--team", help="A team id: the key joins it (its limits apply too).")]
Weight = Annotated[float | None, typer.Option(help="Share of the local engine against other tenants (default 1).")]
Priority = Annotated[
    str | None, typer.Option(help="high, normal or low: served ahead of or behind the fair share (default normal).")
]


def _print_usage(data: dict[str, Any], rows: list[dict[str, Any]], *, is_totals: bool, as_json: bool) -> None:
    if as_json:
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    columns: tuple[str, ...] = (
        "date",
        "model",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "spend_usd",
    )
    if is_totals:
        columns = columns[1:]
    _print_rows(columns, [[_cell(row.get(column)) for column in columns] for row in rows])
    if is_totals:
        _note(
            f"total: {data['requests']} requests, {data['total_tokens']} tokens, ${data['spend_usd']:.6f} "
            f"over {data['num_keys']} keys"
        )


@keys_app.command("create")
def create(
    name: Name = None,
    model: Models = None,
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_concurrent: MaxConcurrent = None,
    token_budget: TokenBudget = None,
    budget_usd: BudgetUsd = None,
    budget_period: BudgetPeriod = None,
    expires_at: ExpiresAt = None,
    metadata: Metadata = None,
    team: Team = None,
    weight: Weight = None,
    priority: Priority = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Create a key; its secret is printed this once."""
    body = _limits_body(
        name,
        model,
        rpm,
        tpm,
        max_concurrent,
        token_budget,
        budget_usd,
        budget_period,
        expires_at,
        metadata,
        team_id=team,
        weight=weight,
        priority=priority,
    )
    _print_record(_call("POST", base_url, master_key, "/admin/keys", json=body), as_json)


@keys_app.command("list")
def list_(
    limit: Annotated[int, typer.Option(help="Keys per page.")] = 50,
    after: Annotated[str | None, typer.Option(help="Start after this key id.")] = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """List keys (never their secrets)."""
    params: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
    page = _call("GET", base_url, master_key, "/admin/keys", params=params)
    _print_page(page, _RECORD_COLUMNS, "unigate keys list", as_json)


def _print_page(page: dict[str, Any], columns: tuple[str, ...], command: str, as_json: bool) -> None:
    """One page of an admin listing: its records' columns, and how to get the next page when there is one."""
    if as_json:
        typer.echo(orjson.dumps(page, option=orjson.OPT_INDENT_2).decode())
        return
    _print_rows(columns, [[_cell(record.get(column)) for column in columns] for record in page["data"]])
    if page.get("has_more"):
        _note(f"more: {command} --after {page['last_id']}")


@keys_app.command("show")
def show(
    key_id: str, base_url: BaseUrl = _DEFAULT_BASE_URL, master_key: MasterKey = None, as_json: AsJson = False
) -> None:
    """Show one key."""
    _print_record(_call("GET", base_url, master_key, f"/admin/keys/{key_id}"), as_json)


@keys_app.command("update")
def update(
    key_id: str,
    name: Name = None,
    model: Models = None,
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_concurrent: MaxConcurrent = None,
    token_budget: TokenBudget = None,
    budget_usd: BudgetUsd = None,
    budget_period: BudgetPeriod = None,
    expires_at: ExpiresAt = None,
    metadata: Metadata = None,
    team: Team = None,
    weight: Weight = None,
    priority: Priority = None,
    unset: Annotated[
        list[str] | None,
        typer.Option(
            help="Remove a limit: rpm, tpm, max_concurrent, token_budget, budget_usd, expires_at; or team_id "
            "(the key leaves its team)."
        ),
    ] = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Change a key's name, models, limits, budget, expiry, team, weight or priority."""
    body = _limits_body(
        name,
        model,
        rpm,
        tpm,
        max_concurrent,
        token_budget,
        budget_usd,
        budget_period,
        expires_at,
        metadata,
        team_id=team,
        weight=weight,
        priority=priority,
    )
    body.update(dict.fromkeys("team_id" if field == "team" else field for field in unset or []))
    if not body:
        _fail("nothing to change: pass at least one option")
    _print_record(_call("PATCH", base_url, master_key, f"/admin/keys/{key_id}", json=body), as_json)


@keys_app.command("rotate")
def rotate(
    key_id: str, base_url: BaseUrl = _DEFAULT_BASE_URL, master_key: MasterKey = None, as_json: AsJson = False
) -> None:
    """Issue a new secret for the same key; the old one stops working now."""
    _print_record(_call("POST", base_url, master_key, f"/admin/keys/{key_id}/rotate"), as_json)


@keys_app.command("revoke")
def revoke(
    key_id: str, base_url: BaseUrl = _DEFAULT_BASE_URL, master_key: MasterKey = None, as_json: AsJson = False
) -> None:
    """Revoke a key (it answers 401 key_revoked from now on)."""
    _print_record(_call("DELETE", base_url, master_key, f"/admin/keys/{key_id}"), as_json)


@keys_app.command("usage")
def usage(
    key_id: Annotated[str | None, typer.Argument(help="A key id; omit for totals over all keys.")] = None,
    days: Annotated[int | None, typer.Option(help="Only the last N days.")] = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Requests and tokens per model per day for a key, or totals for the gateway."""
    if key_id is None:
        data = _call("GET", base_url, master_key, "/admin/usage")
        rows = data["by_model"]
    else:
        params = {"days": days} if days else {}
        data = _call("GET", base_url, master_key, f"/admin/keys/{key_id}/usage", params=params)
        rows = data["data"]
    _print_usage(data, rows, is_totals=key_id is None, as_json=as_json)


def register(app: typer.Typer) -> None:
    """Add the `keys` command group to the `unigate` CLI."""
    app.add_typer(keys_app, name="keys")
