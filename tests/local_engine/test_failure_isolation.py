"""One request's failure stays that request's: the engine keeps serving everyone else, and a failed step makes
the engine restart itself instead of stopping for good.

Faults are injected with test doubles on the engine's own per-request and per-step paths (the detokenizing step,
a sampler's seeded generator, the model runner), since no valid request reaches them any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from local_engine.async_engine import MAX_CONSECUTIVE_RESTARTS, AsyncEngine, EngineState
from local_engine.errors import EngineDeadError, RequestFailedError
from local_engine.output_processor import RequestOutput, accumulate
from local_engine.sampler import Sampler
from local_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
POISON_SEED = 666
PROMPT = list(range(3, 20))


@pytest.fixture
async def engine(llama: Any) -> AsyncIterator[AsyncEngine]:
    async_engine = AsyncEngine(llama.engine(max_num_seqs=4))
    yield async_engine
    await async_engine.shutdown()


async def collect(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str | None = None
) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_until(predicate: Any, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def token_ids(deltas: list[RequestOutput]) -> list[int]:
    return accumulate(deltas, 1)[0].token_ids


async def test_a_request_whose_processing_raises_fails_alone(
    engine: AsyncEngine, llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engine.engine
    process_token = llm._process_token

    def faulty(seq: Any, request: Any) -> Any:
        if seq.request_id == "poison" and seq.num_output_tokens >= 2:
            raise RuntimeError("injected per-sequence fault")
        return process_token(seq, request)

    monkeypatch.setattr(llm, "_process_token", faulty)
    other = asyncio.create_task(collect(engine, PROMPT, GREEDY, "other"))
    with pytest.raises(RequestFailedError, match="injected per-sequence fault"):
        await collect(engine, list(range(5, 40)), GREEDY, "poison")
    expected = llama.engine().generate([PROMPT], GREEDY)[0][0].token_ids
    assert token_ids(await other) == expected  # the concurrent request is untouched
    assert token_ids(await collect(engine, PROMPT, GREEDY)) == expected  # and the engine serves on
    assert engine.is_healthy and engine.num_restarts == 0
    await wait_until(lambda: engine.stats()["kv_blocks_used"] == 0)  # the failed request's blocks were freed


async def test_a_request_whose_sampling_raises_fails_alone(
    engine: AsyncEngine, llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_generator = Sampler._generator

    def faulty(self: Sampler, seq: Any, device: Any) -> Any:
        if seq.params.seed == POISON_SEED:
            raise RuntimeError("injected sampling fault")
        return make_generator(self, seq, device)

    monkeypatch.setattr(Sampler, "_generator", faulty)
    poison = SamplingParams(temperature=1.0, max_tokens=12, seed=POISON_SEED, ignore_eos=True)
    greedy = asyncio.create_task(collect(engine, PROMPT, GREEDY, "greedy"))
    seeded = asyncio.create_task(collect(engine, PROMPT, SEEDED, "seeded"))
    with pytest.raises(RequestFailedError, match="injected sampling fault"):
        await collect(engine, PROMPT, poison, "poison")
    sync = llama.engine()
    assert token_ids(await greedy) == sync.generate([PROMPT], GREEDY)[0][0].token_ids
    assert token_ids(await seeded) == sync.generate([PROMPT], SEEDED)[0][0].token_ids  # still reproducible
    assert engine.is_healthy and engine.num_restarts == 0
    await wait_until(lambda: engine.stats()["kv_blocks_used"] == 0)


async def test_a_failed_step_fails_its_requests_and_the_engine_restarts(
    engine: AsyncEngine, llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = engine.engine.runner
    run = runner.run
    fired: list[bool] = []

    def faulty(batch: Any) -> Any:
        if not fired and any(s.request_id == "victim" for s in batch.seqs):
            fired.append(True)
            raise RuntimeError("injected step fault")
        return run(batch)

    monkeypatch.setattr(runner, "run", faulty)
    with pytest.raises(EngineDeadError, match="restarting"):
        await collect(engine, PROMPT, GREEDY, "victim")
    assert token_ids(await collect(engine, PROMPT, GREEDY)) == llama.engine().generate([PROMPT], GREEDY)[0][0].token_ids
    assert engine.state is EngineState.RUNNING and engine.num_restarts == 1
    await wait_until(lambda: engine.stats()["kv_blocks_used"] == 0)


async def test_a_step_that_keeps_failing_leaves_the_engine_dead(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(batch: Any) -> Any:
        raise RuntimeError("injected permanent fault")

    monkeypatch.setattr(engine.engine.runner, "run", broken)
    for _ in range(MAX_CONSECUTIVE_RESTARTS + 1):  # each request meets one failed step
        with pytest.raises(EngineDeadError):
            await collect(engine, PROMPT, GREEDY)
    assert engine.state is EngineState.DEAD and engine.num_restarts == MAX_CONSECUTIVE_RESTARTS
    with pytest.raises(EngineDeadError, match="stopped after an error"):
        await collect(engine, PROMPT, GREEDY)


async def test_a_request_that_fails_while_being_added_fails_alone(
    engine: AsyncEngine, llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engine.engine
    build_request = llm._build_request

    def faulty(request_id: str, *args: Any) -> Any:
        if request_id == "poison":
            raise TypeError("injected intake fault")
        return build_request(request_id, *args)

    monkeypatch.setattr(llm, "_build_request", faulty)
    with pytest.raises(RequestFailedError, match="injected intake fault") as info:  # the engine's own error...
        await collect(engine, PROMPT, GREEDY, "poison")
    assert isinstance(info.value.__cause__, TypeError)  # ...with the fault as its cause
    assert token_ids(await collect(engine, PROMPT, GREEDY)) == llama.engine().generate([PROMPT], GREEDY)[0][0].token_ids
    assert engine.is_healthy and engine.num_restarts == 0
