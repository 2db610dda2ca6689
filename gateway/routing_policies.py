"""How a model with `routing:` set picks among its available deployments (the default, `least_in_flight`, stays in
`Router.pick` and does none of this).

- `round_robin`: the next deployment in the routing file's order, per model and gateway instance.
- `least_load`: the lowest load per unit of weight, where a deployment's load is what its replica last reported on
  its `metrics_url` (requests running + waiting: `ReplicaLoad`, kept fresh by gateway/replica_metrics.py) plus the
  requests this gateway sent it since that report; a report older than `router.metrics_stale_s` (or none, or no
  `metrics_url`) gives way to this gateway's own in-flight count. Ties: the emptier KV cache, then weighted chance.
- `prefix_affinity`: consistent hashing with bounded loads over the request's affinity key (gateway/prefix_hash.py).
  The deployments are ranked by weighted rendezvous hashing of the key (the same order on every gateway instance,
  and adding or removing one deployment moves only the keys it wins or held); the request goes to the first in that
  order whose load, with this request, stays within `load_factor` times its weighted share of the total load (at
  least one request per deployment) plus `load_slack` requests (`choose_bounded`). A hot key therefore spills to its
  second choice, the same one everywhere.
  Each gateway remembers where it last sent a key (`ModelRoute.placements`, the `MAX_PLACEMENTS` most recent) and
  sends it there again while that deployment is within the bound, so a conversation that spilled stays where its
  prefix now is instead of moving back and forth with the load, and tells the other instances of each move
  (gateway/placement_sync.py), so a conversation's next turn follows it whichever instance takes it. Loads are
  `least_load`'s.

A deployment whose metrics poll failed `MAX_METRICS_FAILS` times in a row gets no new requests under `least_load` and
`prefix_affinity` until a poll succeeds (`is_reachable`).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.base import Json
from gateway.prefix_hash import affinity_key
from gateway.routing_config import ModelConfig

if TYPE_CHECKING:
    from gateway.router import Deployment, ModelRoute

__all__ = [
    "MAX_METRICS_FAILS",
    "Candidate",
    "ReplicaLoad",
    "choose_bounded",
    "is_reachable",
    "load_of",
    "pick_by_policy",
    "rendezvous_order",
    "request_key",
]

MAX_METRICS_FAILS = 2  # consecutive failed metrics polls that take a replica out of rotation
MAX_PLACEMENTS = 65536  # prefix_affinity keys a route remembers the deployment of (the least recent go first)


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica last said about itself on its `metrics_url` (gateway/replica_metrics.py writes it)."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_cache_usage: float = 0.0  # 0..1
    read_at: float = -math.inf  # the router clock's time of the last successful poll
    num_in_flight_at_read: int = 0  # this gateway's in-flight requests to it at that time
    num_failed_polls: int = 0  # in a row


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    weight: float
    load: float


def request_key(model: ModelConfig, body: Json | None, session_id: str | None) -> bytes | None:
    """The request's affinity key under `routing: prefix_affinity` (None otherwise: no work for other models)."""
    if model.routing != "prefix_affinity" or body is None:
        return None
    affinity = model.affinity
    return affinity_key(
        body,
        session_id,
        block_chars=affinity.block_chars,
        max_blocks=affinity.max_blocks,
        session_keys=affinity.session_keys,
    )


def is_reachable(deployment: Deployment) -> bool:
    """False while the replica's metrics have stopped answering (see the module docstring)."""
    return deployment.replica.num_failed_polls < MAX_METRICS_FAILS


def load_of(deployment: Deployment, now: float, stale_s: float) -> float:
    """The deployment's load: its replica's fresh report plus what this gateway sent since, else its in-flight."""
    replica = deployment.replica
    if deployment.config.metrics_url is None or now - replica.read_at > stale_s:
        return float(deployment.num_in_flight)
    sent_since = deployment.num_in_flight - replica.num_in_flight_at_read
    return max(0.0, replica.num_running + replica.num_waiting + sent_since)


def pick_by_policy(
    route: ModelRoute, fresh: Sequence[Deployment], key: bytes | None, now: float, stale_s: float
) -> Deployment:
    """One of `fresh` (not empty) by the route's `routing` (not `least_in_flight`)."""
    policy = route.config.routing
    if policy == "round_robin":
        chosen = fresh[route.num_picks % len(fresh)]
        route.num_picks += 1
        return chosen
    if policy == "prefix_affinity" and key is not None:
        candidates = [Candidate(d.name, d.config.weight, load_of(d, now, stale_s)) for d in fresh]
        affinity = route.config.affinity
        placements = route.placements
        before = placements.get(key)
        name = choose_bounded(key, candidates, affinity.load_factor, affinity.load_slack, before)
        if name != before and route.on_move is not None:
            if before is not None or rendezvous_order(key, candidates)[0].name != name:
                route.on_move(route, key, name)  # a move the other gateway instances should know of
        placements[key] = name
        placements.move_to_end(key)
        if len(placements) > MAX_PLACEMENTS:
            placements.popitem(last=False)
        return next(d for d in fresh if d.name == name)
    loads = [load_of(d, now, stale_s) / d.config.weight for d in fresh]
    best = min(loads)
    ties = [d for d, load in zip(fresh, loads, strict=True) if load == best]
    if len(ties) > 1:
        emptiest = min(d.replica.kv_cache_usage for d in ties)
        ties = [d for d in ties if d.replica.kv_cache_usage == emptiest]
    return random.choices(ties, weights=[d.config.weight for d in ties])[0]


def rendezvous_order(key: bytes, candidates: Sequence[Candidate]) -> list[Candidate]:
    """`candidates` ranked for `key` by weighted rendezvous hashing (highest `weight / -ln(u)` first, `u` uniform
    in (0, 1) from a hash of key and name); names break exact ties so every instance agrees."""

    def score(candidate: Candidate) -> tuple[float, str]:
        digest = hashlib.blake2b(key + candidate.name.encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2.0**64
        return candidate.weight / -math.log(u), candidate.name

    return sorted(candidates, key=score, reverse=True)


def choose_bounded(
    key: bytes,
    candidates: Sequence[Candidate],
    load_factor: float,
    load_slack: int = 0,
    placed: str | None = None,
) -> str:
    """Consistent hashing with bounded loads: the first deployment in `key`'s rendezvous order whose load with this
    request fits `ceil(load_factor × max(total load + 1, number of deployments) × weight / total weight) +
    load_slack` — `placed` (where the key went last) first when it fits. A fleet with fewer requests than
    deployments counts as having one per deployment, so a nearly idle fleet keeps conversations where their cache
    is (one request in flight is otherwise over the bound of a mean of a quarter). Whole-number loads always leave
    one that fits; fractional ones (gauges) may not, and then the least loaded per unit of weight takes it."""
    total_load = max(sum(c.load for c in candidates) + 1.0, float(len(candidates)))
    total_weight = sum(c.weight for c in candidates)
    ranked = rendezvous_order(key, candidates)
    ranked.sort(key=lambda c: c.name != placed)  # stable: `placed` first, the others in rendezvous order
    for candidate in ranked:
        capacity = math.ceil(load_factor * total_load * candidate.weight / total_weight - 1e-9) + load_slack
        if candidate.load + 1.0 <= capacity:
            return candidate.name
    return min(candidates, key=lambda c: ((c.load + 1.0) / c.weight, c.name)).name
