"""A script that raises is a bug of ours, not an outage: it is counted and logged, answers 500 where a limit
could not be checked, and never opens the "Redis is down" window in which cached keys skip their limits.

The faults are injected by swapping one shipped script's source for a copy that raises at a known line (a test
double for our own bug, which by its nature is not in the shipped code)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from redis.exceptions import ResponseError

from auth.access import AccessConfig, RedisAccess
from auth.base import SettleUsage
from auth.redis_client import connect
from auth.scripts import LuaScript, ScriptError, ScriptSet, StorageError, classify_failure
from auth.store import KeyStore
from gateway.access_metrics import AccessStatsCollector
from gateway.errors import GatewayError, LimitError

MASTER = "sk-ug-master-test-key-0123456789"


def break_script(script: LuaScript, line_text: str) -> None:
    """Insert `error(...)` after the first line containing `line_text` (the script then fails at that line)."""
    lines = script.source.split("\n")
    index = next(i for i, line in enumerate(lines) if line_text in line)
    lines.insert(index + 1, "error('injected fault')")
    script.source = "\n".join(lines)
    script.sha = hashlib.sha1(script.source.encode()).hexdigest()


async def make_access(redis_url: str, tmp_path: Any, script_set: ScriptSet) -> tuple[RedisAccess, Any]:
    client = connect(redis_url)
    access = RedisAccess(client, config=AccessConfig(), master_key=MASTER, script_set=script_set)
    await access.start()
    return access, client


async def test_a_failing_settle_is_counted_and_never_turns_limits_off(
    redis_url: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    script_set = ScriptSet()
    break_script(script_set.settle, "local now = now_ms()")
    access, client = await make_access(redis_url, tmp_path, script_set)
    try:
        _, secret = await KeyStore(client).create({"rpm": 2})
        with caplog.at_level(logging.ERROR, logger="unigate.auth"):
            for _ in range(2):
                admission = await access.admit(secret, model="m", estimated_tokens=1, request_id="req-1")
                await access.settle(admission, SettleUsage(5, 4))  # never raises
        assert access.num_script_errors == {"settle_request": 2}
        assert access.num_storage_errors == 0 and access.num_limit_bypasses == 0
        logged = [r.getMessage() for r in caplog.records if "settle_request" in r.getMessage()]
        assert len(logged) == 1 and "req-1" in logged[0] and "injected fault" in logged[0]  # once per line
        with pytest.raises(LimitError) as caught:  # the RPM limit still holds: no fast-fail bypass
            await access.admit(secret, model="m", estimated_tokens=1)
        assert caught.value.code == "rate_limit_exceeded"
        assert await access.ping()
        registry = CollectorRegistry()
        registry.register(AccessStatsCollector(access))
        exported = generate_latest(registry).decode()
        assert 'unigate_redis_script_errors_total{script="settle_request"} 2.0' in exported
        assert "unigate_redis_storage_errors_total 0.0" in exported and "unigate_limit_bypasses_total 0.0" in exported
    finally:
        await access.aclose()
        await client.aclose()


async def test_a_failing_admission_is_a_500_not_an_unlimited_pass(redis_url: str, tmp_path: Any) -> None:
    script_set = ScriptSet()
    break_script(script_set.admit, "local now = now_ms()")
    access, client = await make_access(redis_url, tmp_path, script_set)
    try:
        _, secret = await KeyStore(client).create({"rpm": 1})
        for _ in range(3):
            with pytest.raises(GatewayError) as caught:
                await access.admit(secret, model="m", estimated_tokens=1)
            assert caught.value.status_code == 500 and caught.value.code == "internal_error"
            assert "No limit was skipped" in caught.value.message
        assert access.num_script_errors == {"admit_request": 3}
        assert access.num_storage_errors == 0 and access.num_limit_bypasses == 0
    finally:
        await access.aclose()
        await client.aclose()


async def test_a_failing_upstream_lease_is_a_500_not_an_uncapped_call(redis_url: str, tmp_path: Any) -> None:
    script_set = ScriptSet()
    break_script(script_set.acquire, "local now = now_ms()")
    access, client = await make_access(redis_url, tmp_path, script_set)
    try:
        with pytest.raises(ScriptError):
            await access.upstream_limiter.acquire_upstream("dep", max_in_flight=1, timeout_s=0.5)
        assert access.num_script_errors["acquire_upstream"] == 1 and access.num_limit_bypasses == 0
    finally:
        await access.aclose()
        await client.aclose()


def test_server_state_replies_are_outages_and_everything_else_is_a_bug() -> None:
    script = LuaScript("settle_request")
    for reply in (
        "READONLY You can't write against a read only replica.",
        "ERR Error running script (call to f_x): @user_script:3: @user_script: 3: -READONLY You can't write",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "LOADING Redis is loading the dataset in memory",
        "BUSY Redis is busy running a script.",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
        "CLUSTERDOWN The cluster is down",
    ):
        assert isinstance(classify_failure(ResponseError(reply), script), StorageError), reply
    for reply in (
        "ERR Error running script (call to f_x): @user_script:120: user_script:120: attempt to compare number with nil",
        "user_script:12: Script attempted to access nonexistent global variable 'x' script: abc, on @user_script:12.",
        "WRONGTYPE Operation against a key holding the wrong kind of value",
        "ERR value is not an integer or out of range",
    ):
        error = classify_failure(ResponseError(reply), script)
        assert isinstance(error, ScriptError), reply
    located = classify_failure(ResponseError(f"@user_script:{script.num_prelude_lines + 79}: x"), script)
    assert isinstance(located, ScriptError) and located.line == 79  # the line in settle_request.lua itself
    assert isinstance(classify_failure(ValueError("bad reply"), script), ScriptError)
    assert isinstance(classify_failure(ConnectionError("refused"), script), StorageError)
