"""One attempt (gateway/attempt.py): a send and a stream share one preamble — the body for the deployment, its
`max_in_flight` slot, the clock — and give the slot back exactly once in every outcome; a stream holds it until it
is closed. Failures are explained on their way out (the wait for the slot; an upstream's text withheld)."""

from __future__ import annotations

import logging

import pytest
from fakes.access import RecordingAccess
from fakes.app import MASTER
from fakes.stages import ScriptedBackend, make_context, one_model_router

from backends.base import MAX_TOKENS_CLAMPED_KEY
from gateway.attempt import Attempt
from gateway.errors import BackendError, GatewayError, InvalidRequestError, UpstreamTimeoutError

BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def attempt_on(backend: ScriptedBackend, access: RecordingAccess, **deployment: object) -> Attempt:
    router = one_model_router(backend, max_in_flight=2, **deployment)
    target = router.resolve("m")
    return Attempt(make_context(router, access), "chat/completions", BODY, target.route.deployments[0], target)


@pytest.mark.parametrize("answer", [None, BackendError("upstream down")], ids=["ok", "error"])
async def test_a_send_gives_its_slot_back_once_in_every_outcome(answer: GatewayError | None) -> None:
    access = RecordingAccess(master_key=MASTER)
    backend = ScriptedBackend() if answer is None else ScriptedBackend(answer=answer)
    attempt = attempt_on(backend, access)
    if answer is None:
        assert (await attempt.send())["choices"][0]["finish_reason"] == "stop"  # checked and repaired
    else:
        with pytest.raises(BackendError):
            await attempt.send()
    await attempt.release()  # idempotent
    assert access.acquired == access.released == ["d0"]
    assert attempt.deployment.num_in_flight == 0
    assert backend.sent == [BODY] and backend.sent[0] is not BODY  # each attempt sends its own copy


async def test_a_stream_holds_its_slot_until_it_is_closed() -> None:
    access = RecordingAccess(master_key=MASTER)
    backend = ScriptedBackend()
    attempt = attempt_on(backend, access)
    stream = await attempt.open_stream()
    assert stream.first == {"choices": [{"delta": {"content": "hi"}, "index": 0}]}
    assert access.released == [] and attempt.deployment.num_in_flight == 1
    assert backend.sent[0]["stream"] is True
    assert backend.sent[0]["stream_options"] == {"include_usage": True}  # for accounting, asked or not
    await stream.aclose()
    await stream.aclose()
    assert access.released == ["d0"] and attempt.deployment.num_in_flight == 0 and backend.is_stream_closed


@pytest.mark.parametrize(
    ("chunks", "code"),
    [([], "upstream_malformed_response"), ([BackendError("upstream down")], "upstream_error")],
    ids=["empty", "error"],
)
async def test_a_stream_that_fails_before_its_first_chunk_gives_everything_back(
    chunks: list[object], code: str
) -> None:
    access = RecordingAccess(master_key=MASTER)
    backend = ScriptedBackend(chunks=chunks)
    attempt = attempt_on(backend, access)
    with pytest.raises(BackendError) as raised:
        await attempt.open_stream()
    assert raised.value.code == code
    assert access.released == ["d0"] and attempt.deployment.num_in_flight == 0 and backend.is_stream_closed


async def test_an_unsupported_endpoint_is_refused_before_a_slot_is_taken() -> None:
    access = RecordingAccess(master_key=MASTER)
    router = one_model_router(ScriptedBackend(), max_in_flight=2)
    target = router.resolve("m")
    attempt = Attempt(make_context(router, access), "embeddings", {"input": "x"}, target.route.deployments[0], target)
    with pytest.raises(InvalidRequestError) as raised:
        await attempt.send()
    assert raised.value.code == "unsupported_endpoint" and access.acquired == []


async def test_a_timeout_says_how_long_the_request_waited_for_its_slot() -> None:
    access = RecordingAccess(master_key=MASTER, slot_wait_s=0.1)
    attempt = attempt_on(ScriptedBackend(answer=UpstreamTimeoutError("The upstream did not answer in 1 s.")), access)
    with pytest.raises(UpstreamTimeoutError) as raised:
        await attempt.send()
    assert "waited 0.1 s for a free slot of this deployment (max_in_flight)" in raised.value.message


async def test_an_upstreams_own_text_is_logged_not_relayed(caplog: pytest.LogCaptureFixture) -> None:
    error = BackendError("The upstream failed.")
    error.upstream_text = "pool-7.internal refused"
    attempt = attempt_on(ScriptedBackend(answer=error), RecordingAccess(master_key=MASTER))
    with caplog.at_level(logging.WARNING, logger="unigate.pipeline"), pytest.raises(BackendError):
        await attempt.send()
    assert "pool-7" not in error.message and "request id req-1" in error.message
    assert ["pool-7.internal refused" in r.getMessage() and "req-1" in r.getMessage() for r in caplog.records] == [True]


async def test_the_backends_own_clamp_report_wins_over_the_gateways() -> None:
    access = RecordingAccess(master_key=MASTER)
    backend = ScriptedBackend(answer={"choices": [{"message": {"content": "hi"}}], MAX_TOKENS_CLAMPED_KEY: [8, 3]})
    attempt = attempt_on(backend, access, context_length=30)
    data = await attempt.send()
    assert backend.sent[0]["max_tokens"] < 8  # the gateway lowered it too, from its own estimate
    assert attempt.clamped == (8, 3) and MAX_TOKENS_CLAMPED_KEY not in data
