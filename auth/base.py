"""What the gateway asks of access control (who is calling, may they, settle afterwards) and of the upstream
limiter (a deployment's cluster-wide `max_in_flight` slots): two seams, two protocols.

The gateway calls, per request:
    credential = extract_credential(headers)            # 401 for missing / malformed headers
    admission = await access.admit(credential, model=..., estimated_tokens=...)   # ONE Redis round trip
    lease = await upstream.acquire_upstream(deployment, max_in_flight=..., timeout_s=...)   # capped deployments
    ... call the backend ...
    await upstream.release_upstream(lease)
    await access.settle(admission, SettleUsage(prompt_tokens=..., completion_tokens=...))

and settles in every outcome: success, error, disconnect.
"""

from __future__ import annotations

import fnmatch
import hmac
from collections.abc import Awaitable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from gateway.errors import AuthError

__all__ = [
    "KEY_PREFIX",
    "NO_COST",
    "AccessControl",
    "AccessStats",
    "Admission",
    "BudgetCost",
    "MasterKeyAccess",
    "NoUpstreamLimit",
    "Principal",
    "Priority",
    "SettleUsage",
    "UpstreamLease",
    "UpstreamLimiter",
    "extract_credential",
    "model_allowed",
]

KEY_PREFIX = "sk-ug-"


def model_allowed(patterns: tuple[str, ...], model_id: str) -> bool:
    """Empty allowlist = every model; otherwise exact IDs or shell-style wildcards (`openai/*`)."""
    if not patterns:
        return True
    return any(p == model_id or fnmatch.fnmatchcase(model_id, p) for p in patterns)


Priority = Literal["high", "normal", "low"]


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str | None  # None for the master key
    name: str
    is_master: bool = False
    models: tuple[str, ...] = ()
    team_id: str | None = None  # the key's team, whose limits and budgets also apply
    team_models: tuple[str, ...] = ()  # the team's allowlist: a key in a team may use what both allow
    team_name: str = ""
    weight: float = 1.0  # share of the local engine against other tenants (the team's weight when in a team)
    priority: Priority = "normal"  # class served ahead of (high) or behind (low) the fair share

    @property
    def tenant(self) -> str:
        """Who the local engine and the upstream queues share among: the team, else the key ("master" for it)."""
        return self.team_id or self.key_id or "master"

    def may_use(self, model_id: str) -> bool:
        return self.is_master or (model_allowed(self.models, model_id) and model_allowed(self.team_models, model_id))


@dataclass(slots=True)
class Admission:
    """The result of a successful admit; hand it back to `settle` exactly once."""

    principal: Principal
    model: str
    reserved_tokens: int = 0
    budget_tokens: int = 0  # the budget hold: worst-case tokens and cost (micros) reserved until the settle
    reserved_micros: int = 0
    lease_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* headers for the response
    is_settled: bool = False
    # The settle may complete after the response is sent: no later admission can depend on it finishing first
    # (the master key; or a key without a budget or TPM limit whose concurrency limit, if any, still had a free
    # slot). Same-instance admissions queue behind it on the one Redis connection anyway. False: the client waits
    # for the settle, because its next request, possibly on another instance, reads what it writes (the spend a
    # budget checks, the true token count of a TPM window, or the lease of the last free slot).
    settles_late: bool = False
    request_id: str = ""  # the gateway's request id (x-request-id), for logs
    # The team admitted with the key (None: no team, or its admission could not be taken); the settle charges it
    # the same usage and removes its own budget hold (`team_reserved_micros`: the team's worst-case cost).
    team_id: str | None = None
    team_reserved_micros: int = 0


@dataclass(frozen=True, slots=True)
class SettleUsage:
    """What a finished request really used, to settle its admission with."""

    prompt_tokens: int
    completion_tokens: int
    cost_micros: int = 0  # integer micro-units of the price currency
    is_priced: bool = False  # False: the model has no price configured, so it cost 0
    is_estimated: bool = False  # the upstream reported no counts: these are the gateway's conservative estimate


@dataclass(frozen=True, slots=True)
class BudgetCost:
    """What a request reserves against a key's budgets: worst-case tokens (a prompt bound that never undercounts
    plus every output) and its worst-case cost (micros) for the requested model, then for each fallback."""

    tokens: int = 0
    costs: tuple[tuple[str, int], ...] = ()


NO_COST = BudgetCost()


@dataclass(slots=True)
class UpstreamLease:
    deployment: str
    lease_id: str | None  # None: no slot was taken (no cap, or the cap could not be checked)


class AccessControl(Protocol):
    async def authenticate(self, credential: str) -> Principal:
        """Verify a key (401 `invalid_api_key` / `key_revoked` / `key_expired`)."""
        ...

    async def admit(
        self, credential: str, *, model: str, estimated_tokens: int, request_id: str = "", budget: BudgetCost = NO_COST
    ) -> Admission:
        """Verify the key, its model allowlist (403 `model_not_allowed`) and its limits (429 / 503), reserving
        `estimated_tokens` and a concurrency slot, and holding `budget` against a budgeted key's budgets (429
        `budget_exceeded` when it does not fit). `request_id` only labels logs."""
        ...

    def begin_settle(self, admission: Admission, usage: SettleUsage) -> Awaitable[None]:
        """Charge real usage (refunding the reservation's difference) and its cost (`usage.is_priced` False when
        the model has no price), record usage, release the lease. Idempotent. The settle is queued before this
        returns (so every admission this instance makes afterwards sees it); await the result for it to be done.
        Never fails for storage errors."""
        ...

    async def settle(self, admission: Admission, usage: SettleUsage) -> None:
        """`begin_settle` and wait for it."""
        ...

    async def aclose(self) -> None: ...


class UpstreamLimiter(Protocol):
    """Caps the requests in flight to each deployment with `max_in_flight`, across every gateway instance."""

    async def acquire_upstream(
        self,
        deployment: str,
        *,
        max_in_flight: int,
        timeout_s: float,
        tenant: str = "",
        weight: float = 1.0,
        priority: Priority = "normal",
    ) -> UpstreamLease:
        """Wait for one of a deployment's cluster-wide `max_in_flight` slots, served across tenants in fair order
        (`priority` class first, then the fewest hand-offs per `weight`; FIFO within a tenant); 503
        `upstream_at_capacity`."""
        ...

    async def release_upstream(self, lease: UpstreamLease) -> None:
        """Free the lease's slot (handing it to the next waiter). Call once per acquired lease."""
        ...


@runtime_checkable
class AccessStats(Protocol):
    """Counters an access control may keep for /metrics (the Redis-backed one does), read at scrape time."""

    @property
    def num_storage_errors(self) -> int:
        """Redis calls that failed for the store itself."""
        ...

    @property
    def num_limit_bypasses(self) -> int:
        """Requests served without their limits checked (Redis down, failure mode)."""
        ...

    @property
    def num_script_errors(self) -> dict[str, int]:
        """Our own script bugs, by script name."""
        ...


def extract_credential(headers: Mapping[str, str]) -> str:
    """The caller's key from `Authorization: Bearer …` (OpenAI style) or `x-api-key: …` (Anthropic style)."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise AuthError(
                "Malformed Authorization header: expected 'Authorization: Bearer <key>' but the value has no "
                "'Bearer ' prefix. Add the prefix (or send the key as 'x-api-key: <key>').",
                code="invalid_auth_header",
            )
        value = value.strip()
        if not value:
            raise AuthError(
                "Malformed Authorization header: 'Bearer' is followed by no key. Send 'Authorization: Bearer <key>'.",
                code="invalid_auth_header",
            )
        return value
    api_key = headers.get("x-api-key")
    if api_key is not None and api_key.strip():
        return api_key.strip()
    raise AuthError(
        "No API key provided. Send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
        code="missing_api_key",
    )


def wrong_prefix_error() -> AuthError:
    return AuthError(
        f"Invalid API key: unigate keys start with '{KEY_PREFIX}'; this one does not (is it a key for another "
        "service, e.g. an upstream provider key?). Use a key from `unigate keys create`.",
        code="invalid_api_key",
    )


class _Done:
    """An awaitable that is already done (a settle with nothing to wait for)."""

    def __await__(self) -> Generator[None, None, None]:
        return
        yield


_DONE = _Done()


class MasterKeyAccess:
    """Access control with only the master key and no limits (used when no Redis-backed store is wired)."""

    def __init__(self, master_key: str) -> None:
        self._master_key = master_key.encode()
        self._principal = Principal(key_id=None, name="master", is_master=True)

    async def authenticate(self, credential: str) -> Principal:
        if hmac.compare_digest(credential.encode(), self._master_key):
            return self._principal
        if not credential.startswith(KEY_PREFIX):
            raise wrong_prefix_error()
        raise AuthError("Invalid API key: no such key. Check for typos or create one with `unigate keys create`.")

    async def admit(
        self, credential: str, *, model: str, estimated_tokens: int, request_id: str = "", budget: BudgetCost = NO_COST
    ) -> Admission:
        principal = await self.authenticate(credential)
        return Admission(principal=principal, model=model, settles_late=True, request_id=request_id)

    def begin_settle(self, admission: Admission, usage: SettleUsage) -> Awaitable[None]:
        admission.is_settled = True
        return _DONE

    async def settle(self, admission: Admission, usage: SettleUsage) -> None:
        await self.begin_settle(admission, usage)

    async def aclose(self) -> None:
        return None


class NoUpstreamLimit:
    """The `UpstreamLimiter` without shared state (master-key-only gateways): every lease is granted at once and
    `max_in_flight` is not enforced."""

    async def acquire_upstream(
        self,
        deployment: str,
        *,
        max_in_flight: int,
        timeout_s: float,
        tenant: str = "",
        weight: float = 1.0,
        priority: Priority = "normal",
    ) -> UpstreamLease:
        return UpstreamLease(deployment=deployment, lease_id=None)

    async def release_upstream(self, lease: UpstreamLease) -> None:
        return None
