"""Who the engine serves next when tenants compete: a priority class, then a virtual token counter per tenant.

The counter follows Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): every token a step
computes for a tenant (prefill, recompute and decode alike) adds 1 / weight to its counter; the scheduler admits the
waiting sequence whose (priority, counter) is lowest, in arrival order among equals. A tenant that becomes active
again is lifted to the lowest counter of the active ones, so idle time banks no credit. Counters of idle tenants are
dropped (they only matter relative to each other). One tenant alone: every key ties, so the order is arrival order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Literal

__all__ = ["PRIORITIES", "FairShare", "Priority", "Tenancy"]

Priority = Literal["high", "normal", "low"]
PRIORITIES: dict[Priority, int] = {"high": 0, "normal": 1, "low": 2}  # served in this order, before the counters


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Whose request this is: its tenant (the gateway's key id; "" for anonymous), weight and priority class."""

    tenant: str = ""
    weight: float = 1.0
    priority: Priority = "normal"

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"a tenant's weight must be positive, not {self.weight!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {self.priority!r}")

    @property
    def rank(self) -> int:
        return PRIORITIES[self.priority]


DEFAULT_TENANCY = Tenancy()


class FairShare:
    """Virtual token counters of the active tenants, and what each tenant was served since start."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.num_active: Counter[str] = Counter()  # tenant -> its unfinished sequences
        self.served_tokens: Counter[str] = Counter()  # tenant -> tokens computed for it (never reset)
        self.preemptions: Counter[str] = Counter()  # tenant -> its sequences preempted
        # tenant -> seconds its sequences waited before admission
        self.queue_time_s: defaultdict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = {}  # tenant -> the weight its latest sequence came with

    def join(self, tenant: str, weight: float = 1.0) -> None:
        """A sequence of `tenant` arrives; a tenant that was idle starts at the lowest active counter."""
        self.weights[tenant] = weight
        if not self.num_active[tenant]:
            floor = min(self.counters.values(), default=0.0)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.num_active[tenant] += 1

    def leave(self, tenant: str) -> None:
        self.num_active[tenant] -= 1
        if self.num_active[tenant] <= 0:
            del self.num_active[tenant]
            self.counters.pop(tenant, None)

    def charge(self, tenancy: Tenancy, num_tokens: int) -> None:
        """`num_tokens` computed for the tenant (negative: refunded, when a scheduled sequence is preempted)."""
        self.counters[tenancy.tenant] = self.counters.get(tenancy.tenant, 0.0) + num_tokens / tenancy.weight
        self.served_tokens[tenancy.tenant] += num_tokens

    def key(self, tenancy: Tenancy) -> tuple[int, float]:
        """Lower is served first."""
        return tenancy.rank, self.counters.get(tenancy.tenant, 0.0)

    def may_preempt(self, waiting: Tenancy, victim: Tenancy, gap: float) -> bool:
        """Whether a waiting sequence may take a running one's place: never within a tenant; a better priority
        class always; else only when the victim's tenant is ahead by `gap` tokens (no thrashing back and forth)."""
        if waiting.tenant == victim.tenant or waiting.rank > victim.rank:
            return False
        if waiting.rank < victim.rank:
            return True
        return self.counters.get(victim.tenant, 0.0) - self.counters.get(waiting.tenant, 0.0) >= gap

    def shares(self) -> dict[str, dict[str, float]]:
        """Per tenant: its counter (active ones), weight (its latest sequence's), unfinished sequences, and served
        tokens, preemptions and queue time since start."""
        tenants = set(self.counters) | set(self.served_tokens)
        return {
            tenant: {
                "counter": self.counters.get(tenant, 0.0),
                "weight": self.weights.get(tenant, 1.0),
                "active_seqs": float(self.num_active[tenant]),
                "served_tokens": float(self.served_tokens[tenant]),
                "preemptions": float(self.preemptions[tenant]),
                "queue_time_s": self.queue_time_s.get(tenant, 0.0),
            }
            for tenant in sorted(tenants)
        }
