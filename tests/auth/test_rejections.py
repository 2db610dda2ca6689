"""The errors and `x-ratelimit-*` headers of a refused admission, from the `admit_request` script's reply alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from auth.base import Principal
from auth.rejections import format_reset, rate_limit_headers, rejection
from auth.scripts import AdmitReply

OK = AdmitReply(
    status="ok",
    version=1,
    record={},
    rpm_limit=10,
    rpm_remaining=9,
    rpm_reset_ms=1500,
    tpm_limit=500,
    tpm_remaining=450,
    tpm_reset_ms=20,
    retry_after_ms=0,
    leases_remaining=-1,
)


def test_reset_format() -> None:
    assert [format_reset(v) for v in (20, 1500, 60_000, 360_250)] == ["20ms", "1.5s", "1m0s", "6m0.25s"]
    assert format_reset(-5) == "0ms"


def test_headers_leave_out_what_the_script_did_not_check() -> None:
    assert rate_limit_headers(OK) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "1.5s",
        "x-ratelimit-limit-tokens": "500",
        "x-ratelimit-remaining-tokens": "450",
        "x-ratelimit-reset-tokens": "20ms",
    }
    unchecked = replace(OK, tpm_remaining=-1)
    assert rate_limit_headers(unchecked)["x-ratelimit-limit-tokens"] == "500"
    assert "x-ratelimit-remaining-tokens" not in rate_limit_headers(unchecked)
    assert rate_limit_headers(replace(OK, rpm_limit=-1, tpm_limit=-1)) == {}


@pytest.mark.parametrize(
    ("status", "status_code", "code"),
    [
        ("key_revoked", 401, "key_revoked"),
        ("key_expired", 401, "key_expired"),
        ("invalid_api_key", 401, "invalid_api_key"),
        ("model_not_allowed", 403, "model_not_allowed"),
        ("concurrency_limit_exceeded", 429, "concurrency_limit_exceeded"),
        ("rate_limit_exceeded", 429, "rate_limit_exceeded"),
        ("tokens_limit_exceeded", 429, "tokens_limit_exceeded"),
        ("budget_exceeded", 429, "budget_exceeded"),
    ],
)
def test_each_refusal_has_its_status_and_code(status: str, status_code: int, code: str) -> None:
    error = rejection(replace(OK, status=status, retry_after_ms=2500), None, "m", 10)
    assert (error.status_code, error.code) == (status_code, code)
    if status_code == 429:
        assert error.headers["retry-after"] == "3"


def test_the_messages_name_what_to_change() -> None:
    principal = Principal(key_id="k", name="n", models=("a", "b/*"))
    denied = rejection(replace(OK, status="model_not_allowed"), principal, "c", 0)
    assert "Allowed models: a, b/*" in denied.message and denied.param == "model"
    budget = replace(OK, status="budget_exceeded", budget_spent=1_500_000, budget_limit=2_000_000, budget_unit="micros")
    spent = rejection(budget, None, "m", 0)
    assert "$1.5 spent of $2" in spent.message and "budget_usd" in spent.message and spent.headers == {}
    never = rejection(replace(OK, status="tokens_limit_exceeded", retry_after_ms=1000), None, "m", 501)
    assert "can never fit" in never.message and "retry-after" not in never.headers
    assert never.headers["x-ratelimit-remaining-tokens"] == "450"
