"""An upstream's Retry-After (issue 25 item 7, issue 27 item 2): only finite, non-negative seconds or an HTTP-date
count, honoured up to `router.max_retry_after_s`; anything else means the default cooldown, never for ever."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakes.app import AUTH, CHAT, asgi_client, build_app, single_model
from fakes.upstream import FakeUpstream
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.retry_after import parse_retry_after
from gateway.errors import UpstreamRateLimitedError
from gateway.router import Router
from gateway.routing_config import RouterConfig, parse_routing

NOW = 100.0
COOLDOWN_S = 10.0
MAX_RETRY_AFTER_S = 300.0


class IdleBackend:
    def __init__(self, name: str) -> None:
        self.name = name

    def supports(self, endpoint: str) -> bool:
        return True

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


def one_deployment(clock: list[float]) -> Router:
    config = parse_routing(
        {
            "models": [{"id": "m", "deployments": [{"type": "openai", "base_url": "http://x/v1", "name": "d0"}]}],
            "router": {"cooldown_s": COOLDOWN_S, "max_retry_after_s": MAX_RETRY_AFTER_S},
        },
        source="t",
    )
    return Router(config, {"d0": IdleBackend("d0")}, clock=lambda: clock[0])  # type: ignore[dict-item]


def cooldown_after_429(retry_after: str) -> tuple[float, dict[str, str]]:
    """How long the deployment is out after a 429 carrying `retry-after`, and the headers the client gets."""
    clock = [NOW]
    router = one_deployment(clock)
    deployment = router.routes[0].deployments[0]
    error = UpstreamRateLimitedError("slow down", headers={"retry-after": retry_after})
    router.record_failure(deployment, error)
    return deployment.cooldown_until - NOW, error.headers


@pytest.mark.parametrize(
    "value", ["nan", "NaN", "inf", "-inf", "Infinity", "-5", "1e3", "1e400", "", "soon", "5s", "Thu, 99 Foo 2020"]
)
def test_unusable_retry_after_means_the_default_cooldown(value: str) -> None:
    cooldown_s, headers = cooldown_after_429(value)
    assert cooldown_s == COOLDOWN_S
    assert headers["retry-after"] == "10"  # the client learns when the deployment is back, not the garbage


@pytest.mark.parametrize(
    ("value", "expected_s"),
    [
        ("5", 5.0),
        ("0", 0.0),
        ("2.5", 2.5),
        ("120", 120.0),  # longer than cooldown_s: honoured
        ("100000", MAX_RETRY_AFTER_S),  # bounded
        ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER_S),
        ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0),  # already past
    ],
)
def test_retry_after_is_honoured_up_to_the_maximum(value: str, expected_s: float) -> None:
    cooldown_s, headers = cooldown_after_429(value)
    assert cooldown_s == expected_s
    assert headers["retry-after"] == str(math.ceil(expected_s))


def test_the_deployment_comes_back_after_a_nan_retry_after() -> None:
    clock = [NOW]
    router = one_deployment(clock)
    route = router.routes[0]
    router.record_failure(route.deployments[0], UpstreamRateLimitedError("x", headers={"retry-after": "nan"}))
    assert router.pick(route) is None
    clock[0] += COOLDOWN_S + 0.5
    assert router.pick(route) is route.deployments[0]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), st.floats().map(str), st.integers().map(str), st.floats().map(repr)))
def test_any_retry_after_leaves_a_finite_bounded_cooldown(value: str) -> None:
    cooldown_s, headers = cooldown_after_429(value)
    assert math.isfinite(cooldown_s) and 0 <= cooldown_s <= max(COOLDOWN_S, MAX_RETRY_AFTER_S)
    assert headers["retry-after"].isdigit()


def test_parse_retry_after_reads_both_forms() -> None:
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert parse_retry_after("Tue, 14 Nov 2023 22:15:20 GMT", now=now) == 120.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:15:20 -0000", now=now) == 120.0
    assert parse_retry_after(" 7 ") == 7.0
    assert parse_retry_after(None) is None and parse_retry_after("nan") is None


async def test_upstream_429_with_nan_retry_after_cools_down_for_a_while(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="status", status=429, retry_after="nan")
    app = build_app(single_model(fake_upstream, router={"num_retries": 0, "cooldown_s": 30}))
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        deployment: Any = app.state.router.deployments[0]
        assert math.isfinite(deployment.cooldown_until)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "30"
    assert "nan" not in response.text


def test_the_documented_router_settings_are_the_defaults() -> None:
    page = (Path(__file__).parents[2] / "docs" / "upstreams.md").read_text()
    block = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    documented = parse_routing(yaml.safe_load(block), source="docs/upstreams.md").router
    assert documented == RouterConfig()
