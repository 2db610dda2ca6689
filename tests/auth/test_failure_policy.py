"""`FailurePolicy`: the fast-fail window, the failure modes' decisions, and the counters and logs of failures."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from auth import failure_policy
from auth.base import AccessStats, Principal
from auth.failure_policy import FailurePolicy
from auth.key_cache import CachedKey
from auth.scripts import ScriptError, StorageError
from gateway.access_metrics import AccessStatsCollector
from gateway.errors import AuthError, PermissionDeniedError, UnavailableError


class Disconnects:
    def __init__(self) -> None:
        self.num_calls = 0

    async def __call__(self) -> None:
        self.num_calls += 1


def outage(*, is_outage: bool = True) -> StorageError:
    error = StorageError("down")
    error.is_outage = is_outage
    return error


def cached_key(*, models: tuple[str, ...] = (), is_revoked: bool = False) -> CachedKey:
    principal = Principal(key_id="k", name="n", models=models)
    return CachedKey("k", 1, principal, expires_at_ms=None, is_revoked=is_revoked, verified_at=time.monotonic())


async def test_a_failure_opens_the_fast_fail_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failure_policy, "_FAST_FAIL_S", 0.05)
    disconnects = Disconnects()
    policy = FailurePolicy(failure_mode="closed", disconnect=disconnects)
    policy.check_redis_up()
    await policy.note_failure("admit", outage(is_outage=False))
    assert policy.is_down() and (policy.num_storage_errors, disconnects.num_calls) == (1, 1)
    with pytest.raises(StorageError) as caught:
        policy.check_redis_up()
    assert caught.value.is_outage is False  # as the failure that opened the window
    await policy.note_failure("admit", caught.value)  # Redis was not asked: not a new failure
    assert (policy.num_storage_errors, disconnects.num_calls) == (1, 1)
    time.sleep(0.06)
    assert not policy.is_down()
    policy.check_redis_up()


@pytest.mark.parametrize("failure_mode", ["closed", "open"])
def test_a_fresh_cached_key_is_served_in_both_modes_a_stale_one_only_when_open(failure_mode: Any) -> None:
    policy = FailurePolicy(failure_mode=failure_mode, disconnect=Disconnects())
    cached = cached_key()
    assert policy.without_redis(cached, "m", outage(), is_fresh=True) is cached.principal
    assert policy.num_limit_bypasses == 1
    if failure_mode == "open":
        assert policy.without_redis(cached, "m", outage(), is_fresh=False) is cached.principal
    else:
        with pytest.raises(UnavailableError, match="cannot be verified"):
            policy.without_redis(cached, "m", outage(), is_fresh=False)
    with pytest.raises(UnavailableError) as unknown:
        policy.without_redis(None, "m", outage(), is_fresh=False)
    assert unknown.value.code == "limits_unavailable"


def test_a_redis_that_answers_wrongly_is_never_a_bypass() -> None:
    policy = FailurePolicy(failure_mode="open", disconnect=Disconnects())
    with pytest.raises(UnavailableError):
        policy.without_redis(cached_key(), "m", outage(is_outage=False), is_fresh=True)
    assert policy.num_limit_bypasses == 0


def test_the_cached_record_and_allowlist_still_apply_without_redis() -> None:
    policy = FailurePolicy(failure_mode="open", disconnect=Disconnects())
    with pytest.raises(AuthError, match="revoked"):
        policy.without_redis(cached_key(is_revoked=True), None, outage(), is_fresh=True)
    with pytest.raises(PermissionDeniedError):
        policy.without_redis(cached_key(models=("a/*",)), "b", outage(), is_fresh=True)
    assert policy.without_redis(cached_key(models=("a/*",)), "a/x", outage(), is_fresh=True).key_id == "k"
    assert policy.num_limit_bypasses == 1


def test_a_script_error_is_counted_each_time_and_logged_once_per_line(caplog: pytest.LogCaptureFixture) -> None:
    policy = FailurePolicy(failure_mode="closed", disconnect=Disconnects())
    with caplog.at_level(logging.ERROR, logger="unigate.auth"):
        for line in (3, 3, 4):
            policy.note_script_error(ScriptError("admit_request", f"user_script:{line}: boom"), "req")
    assert policy.num_script_errors == {"admit_request": 3}
    assert len(caplog.records) == 2 and not policy.is_down() and policy.num_storage_errors == 0


async def test_redis_access_reports_the_policys_counters_to_metrics(make_access: Any) -> None:
    access = await make_access()
    assert isinstance(access, AccessStats)
    access._failures.note_bypass()
    access._failures.note_script_error(ScriptError("settle_request", "user_script:1: boom"), "req")
    samples = {
        (sample.name, sample.labels.get("script", "")): sample.value
        for family in AccessStatsCollector(access).collect()
        for sample in family.samples
    }
    assert samples == {
        ("unigate_redis_script_errors_total", "settle_request"): 1,
        ("unigate_redis_storage_errors_total", ""): 0,
        ("unigate_limit_bypasses_total", ""): 1,
    }
