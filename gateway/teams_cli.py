"""`unigate teams …`: the admin API's teams from the command line, over HTTP to a running gateway (the same
options and output as `unigate keys`: a table on a terminal, tab-separated lines otherwise, `--json`)."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
import typer

from gateway.keys_cli import (
    _DEFAULT_BASE_URL,
    AsJson,
    BaseUrl,
    BudgetPeriod,
    BudgetUsd,
    MasterKey,
    MaxConcurrent,
    Metadata,
    Models,
    Priority,
    Rpm,
    TokenBudget,
    Tpm,
    Weight,
    _call,
    _cell,
    _fail,
    _limits_body,
    _print_page,
    _print_record,
    _print_rows,
    _print_usage,
)

__all__ = ["register", "teams_app"]

_TEAM_COLUMNS = (
    "id",
    "name",
    "num_keys",
    "models",
    "rpm",
    "tpm",
    "max_concurrent",
    "token_budget",
    "budget_usd",
    "spend_usd",
    "weight",
    "priority",
)
_KEY_COLUMNS = ("id", "name", "key_prefix", "revoked", "tokens_spent", "spend_usd")

teams_app = typer.Typer(name="teams", help="Manage teams (shared limits and budgets of keys).", no_args_is_help=True)

TeamName = Annotated[str | None, typer.Option(help="The team's name.")]


def _team_body(
    name: str | None,
    model: list[str] | None,
    rpm: int | None,
    tpm: int | None,
    max_concurrent: int | None,
    token_budget: int | None,
    budget_usd: float | None,
    budget_period: str | None,
    weight: float | None,
    priority: str | None,
    metadata: str | None,
) -> dict[str, Any]:
    return _limits_body(
        name,
        model,
        rpm,
        tpm,
        max_concurrent,
        token_budget,
        budget_usd,
        budget_period,
        None,
        metadata,
        weight=weight,
        priority=priority,
    )


@teams_app.command("create")
def create(
    name: Annotated[str, typer.Option(help="The team's name.")],
    model: Models = None,
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_concurrent: MaxConcurrent = None,
    token_budget: TokenBudget = None,
    budget_usd: BudgetUsd = None,
    budget_period: BudgetPeriod = None,
    weight: Weight = None,
    priority: Priority = None,
    metadata: Metadata = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Create a team; add keys with `unigate keys create --team ID` or `unigate keys update KEY --team ID`."""
    body = _team_body(
        name, model, rpm, tpm, max_concurrent, token_budget, budget_usd, budget_period, weight, priority, metadata
    )
    _print_record(_call("POST", base_url, master_key, "/admin/teams", json=body), as_json)


@teams_app.command("list")
def list_(
    limit: Annotated[int, typer.Option(help="Teams per page.")] = 50,
    after: Annotated[str | None, typer.Option(help="Start after this team id.")] = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """List teams."""
    params: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
    page = _call("GET", base_url, master_key, "/admin/teams", params=params)
    _print_page(page, _TEAM_COLUMNS, "unigate teams list", as_json)


@teams_app.command("show")
def show(
    team_id: str,
    keys: Annotated[bool, typer.Option("--keys", help="List the team's keys instead.")] = False,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Show one team (its limits, budgets against spend, number of keys), or with --keys its keys."""
    if not keys:
        _print_record(_call("GET", base_url, master_key, f"/admin/teams/{team_id}"), as_json)
        return
    data = _call("GET", base_url, master_key, f"/admin/teams/{team_id}/keys")
    if as_json:
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    _print_rows(_KEY_COLUMNS, [[_cell(key.get(column)) for column in _KEY_COLUMNS] for key in data["data"]])


@teams_app.command("update")
def update(
    team_id: str,
    name: TeamName = None,
    model: Models = None,
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_concurrent: MaxConcurrent = None,
    token_budget: TokenBudget = None,
    budget_usd: BudgetUsd = None,
    budget_period: BudgetPeriod = None,
    weight: Weight = None,
    priority: Priority = None,
    metadata: Metadata = None,
    unset: Annotated[
        list[str] | None,
        typer.Option(help="Remove a limit: rpm, tpm, max_concurrent, token_budget, budget_usd."),
    ] = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Change a team's name, models, limits, budgets, weight or priority."""
    body = _team_body(
        name, model, rpm, tpm, max_concurrent, token_budget, budget_usd, budget_period, weight, priority, metadata
    )
    body.update(dict.fromkeys(unset or []))
    if not body:
        _fail("nothing to change: pass at least one option")
    _print_record(_call("PATCH", base_url, master_key, f"/admin/teams/{team_id}", json=body), as_json)


@teams_app.command("delete")
def delete(
    team_id: str,
    force: Annotated[bool, typer.Option("--force", help="Delete even with keys in it (they leave the team).")] = False,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Delete a team. A team with keys is refused unless --force, which takes its keys out of it first."""
    params = {"force": "true"} if force else {}
    data = _call("DELETE", base_url, master_key, f"/admin/teams/{team_id}", params=params)
    if as_json:
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    detached = data["detached_keys"]
    typer.echo(f"deleted {data['id']}" + (f"; keys out of the team: {', '.join(detached)}" if detached else ""))


@teams_app.command("usage")
def usage(
    team_id: str,
    days: Annotated[int | None, typer.Option(help="Only the last N days.")] = None,
    base_url: BaseUrl = _DEFAULT_BASE_URL,
    master_key: MasterKey = None,
    as_json: AsJson = False,
) -> None:
    """Requests, tokens and spend per model per day of a team (every request of its keys while in it)."""
    params = {"days": days} if days else {}
    data = _call("GET", base_url, master_key, f"/admin/teams/{team_id}/usage", params=params)
    _print_usage(data, data["data"], is_totals=False, as_json=as_json)


def register(app: typer.Typer) -> None:
    """Add the `teams` command group to the `unigate` CLI."""
    app.add_typer(teams_app, name="teams")
