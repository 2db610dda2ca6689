"""Consistent hashing with bounded loads (`choose_bounded`) against a small reference, and the load signal."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.router import Router
from gateway.routing_config import parse_routing
from gateway.routing_policies import Candidate, choose_bounded, load_of, rendezvous_order

candidates_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.sampled_from([0.5, 1.0, 2.0, 3.0])), min_size=1, max_size=12
).map(lambda rows: [Candidate(f"d{i}", weight, float(load)) for i, (load, weight) in enumerate(rows)])


def reference(key: bytes, candidates: list[Candidate], factor: float, slack: int, placed: str | None) -> str:
    """The definition, spelled out: the last placement, then the others ranked by hash; the first whose load with
    this request fits its share wins."""
    total, weight = max(sum(c.load for c in candidates) + 1, len(candidates)), sum(c.weight for c in candidates)
    ranked = [c for c in candidates if c.name == placed] + [
        c for c in rendezvous_order(key, candidates) if c.name != placed
    ]
    fits = [c for c in ranked if c.load + 1 <= math.ceil(factor * total * c.weight / weight - 1e-9) + slack]
    return (fits or sorted(candidates, key=lambda c: ((c.load + 1) / c.weight, c.name)))[0].name


@settings(max_examples=300, deadline=None)
@given(
    st.binary(min_size=1, max_size=16),
    candidates_strategy,
    st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    st.integers(0, 3),
    st.one_of(st.none(), st.sampled_from(["d0", "d3", "gone"])),
)
def test_bounded_choice_matches_the_reference_and_respects_the_bound(
    key: bytes, candidates: list[Candidate], factor: float, slack: int, placed: str | None
) -> None:
    chosen = choose_bounded(key, candidates, factor, slack, placed)
    assert chosen == reference(key, candidates, factor, slack, placed)
    winner = next(c for c in candidates if c.name == chosen)
    total, weight = max(sum(c.load for c in candidates) + 1, len(candidates)), sum(c.weight for c in candidates)
    # whole-number loads always leave a deployment within the bound
    bound = math.ceil(factor * total * winner.weight / weight - 1e-9) + slack
    assert winner.load + 1 <= bound or factor * total < 1 + 1e-6


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=16), st.integers(2, 12), st.integers(0, 11))
def test_removing_another_deployment_keeps_an_idle_keys_choice(key: bytes, num: int, removed: int) -> None:
    """Consistency: with no load, a key moves only when its own deployment goes."""
    candidates = [Candidate(f"d{i}", 1.0, 0.0) for i in range(num)]
    chosen = choose_bounded(key, candidates, 1.25)
    gone = f"d{removed % num}"
    if gone != chosen:
        assert choose_bounded(key, [c for c in candidates if c.name != gone], 1.25) == chosen


def test_keys_spread_evenly_by_weight() -> None:
    candidates = [Candidate("a", 1.0, 0.0), Candidate("b", 1.0, 0.0), Candidate("c", 2.0, 0.0)]
    counts = {"a": 0, "b": 0, "c": 0}
    for i in range(4000):
        counts[choose_bounded(i.to_bytes(4, "big"), candidates, 1.25)] += 1
    assert 800 < counts["a"] < 1200 and 800 < counts["b"] < 1200 and 1800 < counts["c"] < 2200


def test_a_stale_or_missing_report_gives_way_to_in_flight_counts() -> None:
    now = [100.0]
    routing = parse_routing(
        {
            "models": [
                {
                    "id": "m",
                    "routing": "least_load",
                    "deployments": [
                        {"type": "openai", "base_url": "http://a/v1", "name": "a", "metrics_url": "http://a/metrics"},
                        {"type": "openai", "base_url": "http://b/v1", "name": "b"},
                    ],
                }
            ],
            "router": {"metrics_stale_s": 3},
        },
        source="test.yaml",
    )
    router = Router(routing, {"a": None, "b": None}, clock=lambda: now[0])  # type: ignore[dict-item]
    a, b = router.routes[0].deployments
    a.num_in_flight, b.num_in_flight = 2, 1
    assert load_of(a, now[0], 3) == 2  # never read
    a.replica.num_running, a.replica.num_waiting, a.replica.read_at = 5, 4, 99.0
    a.replica.num_in_flight_at_read = 1
    assert load_of(a, now[0], 3) == 5 + 4 + 1  # the report plus what was sent since
    assert load_of(b, now[0], 3) == 1  # no metrics_url
    assert router.pick(router.routes[0]) is b
    now[0] = 103.5
    assert load_of(a, now[0], 3) == 2  # stale
