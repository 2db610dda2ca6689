from __future__ import annotations

import orjson

from gateway.errors import (
    AuthError,
    BudgetExceededError,
    UnavailableError,
    UpstreamTimeoutError,
    render_anthropic,
    render_openai,
)


def test_openai_envelope_carries_type_code_param() -> None:
    body = orjson.loads(render_openai(AuthError("no key", code="missing_api_key")))
    assert body == {
        "error": {"message": "no key", "type": "authentication_error", "param": None, "code": "missing_api_key"}
    }


def test_subclass_defaults() -> None:
    assert UpstreamTimeoutError("slow").status_code == 504
    assert UpstreamTimeoutError("slow").code == "upstream_timeout"
    err = BudgetExceededError("spent")
    assert (err.status_code, err.type, err.code) == (429, "insufficient_quota", "budget_exceeded")


def test_anthropic_envelope_maps_types() -> None:
    body = orjson.loads(render_anthropic(UnavailableError("busy", code="upstream_at_capacity")))
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert body["error"]["message"] == "busy"
