"""A recording `AccessControl` and `UpstreamLimiter` in one object for tests: the master key plus named keys with
model allowlists, and a log of every admit / settle / acquire_upstream / release_upstream call (to prove usage is
settled and leases freed). Deployments named in `full` answer every acquire with 503 `upstream_at_capacity`, as a
saturated pool does. `fakes.app.build_app` passes it as both."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field

from auth.base import (
    NO_COST,
    Admission,
    BudgetCost,
    MasterKeyAccess,
    Principal,
    Priority,
    SettleUsage,
    UpstreamLease,
)
from gateway.errors import AuthError, PermissionDeniedError, UnavailableError

__all__ = ["RecordingAccess", "Settled"]


@dataclass
class Settled:
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int = 0
    is_priced: bool = False


@dataclass
class RecordingAccess(MasterKeyAccess):
    master_key: str = "sk-ug-master-test-key-0123456789"  # as fakes.app.MASTER
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> allowed models ("" = all)
    is_redis_up: bool | None = None  # None: no `ping` (duck-typed away below)
    admitted: list[str] = field(default_factory=list)
    settled: list[Settled] = field(default_factory=list)
    acquired: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    full: set[str] = field(default_factory=set)  # deployments whose every slot stays busy: 503 upstream_at_capacity
    slot_wait_s: float = 0.0  # how long each acquire waits before its slot frees up (a busy pool)

    def __post_init__(self) -> None:
        super().__init__(self.master_key)
        if self.is_redis_up is None:
            self.ping = None  # type: ignore[assignment]

    async def ping(self) -> bool:
        return bool(self.is_redis_up)

    async def authenticate(self, credential: str) -> Principal:
        if credential in self.keys:
            return Principal(key_id=credential, name=credential, models=self.keys[credential])
        return await super().authenticate(credential)

    async def admit(
        self, credential: str, *, model: str, estimated_tokens: int, request_id: str = "", budget: BudgetCost = NO_COST
    ) -> Admission:
        principal = await self.authenticate(credential)
        if not principal.may_use(model):
            raise PermissionDeniedError(f"This key may not use {model!r}.", code="model_not_allowed")
        self.admitted.append(model)
        return Admission(
            principal=principal,
            model=model,
            reserved_tokens=estimated_tokens,
            headers={"x-ratelimit-remaining-requests": "99"},
        )

    def begin_settle(self, admission: Admission, usage: SettleUsage) -> Awaitable[None]:
        if admission.is_settled:
            raise AuthError("settled twice")  # the pipeline must settle exactly once
        self.settled.append(
            Settled(admission.model, usage.prompt_tokens, usage.completion_tokens, usage.cost_micros, usage.is_priced)
        )
        return super().begin_settle(admission, usage)

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
        self.acquired.append(deployment)
        if self.slot_wait_s:
            await asyncio.sleep(min(self.slot_wait_s, timeout_s))
        if deployment in self.full:
            raise UnavailableError(
                f"The upstream for this model is at capacity (max_in_flight={max_in_flight}) and no slot freed up "
                f"within {timeout_s:g} s. Retry shortly.",
                code="upstream_at_capacity",
                headers={"retry-after": "1"},
            )
        return UpstreamLease(deployment=deployment, lease_id=f"lease-{len(self.acquired)}")

    async def release_upstream(self, lease: UpstreamLease) -> None:
        self.released.append(lease.deployment)
