"""AsyncEngine: the step loop in its own thread, streams on the event loop, aborts on early close."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from local_engine.async_engine import AsyncEngine
from local_engine.output_processor import RequestOutput, accumulate
from local_engine.sampling_params import SamplingParams
from local_engine.scheduler import PromptTooLongError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
async def engine(llama: Any) -> AsyncIterator[AsyncEngine]:
    async_engine = AsyncEngine(llama.engine(max_num_seqs=4))
    yield async_engine
    await async_engine.shutdown()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params)]


async def wait_until(predicate: Any, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_concurrent_streams_match_the_sync_engine(engine: AsyncEngine, llama: Any) -> None:
    prompts = [list(range(3, 3 + n)) for n in (4, 30, 9, 17, 50, 2)]  # more than max_num_seqs at once
    results = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
    expected = llama.engine().generate(prompts, GREEDY)
    for deltas, choices in zip(results, expected, strict=True):
        assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)  # one delta per generated token
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        merged = accumulate(deltas, 1)[0]
        assert merged.token_ids == choices[0].token_ids
        assert merged.finish_reason == "length"


async def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    stream = engine.generate(list(range(3, 60)), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    async for _ in stream:
        break
    await stream.aclose()  # what the gateway does when the client disconnects
    await wait_until(lambda: engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running_seqs"] == 0)
    # The engine keeps serving afterwards.
    deltas = await collect(engine, [5, 6, 7], GREEDY)
    assert deltas[-1].finished


async def test_prompt_that_cannot_fit_fails_before_streaming(engine: AsyncEngine) -> None:
    too_long = [5] * (engine.engine.max_model_len + 1)
    with pytest.raises(PromptTooLongError, match="maximum context length"):
        await collect(engine, too_long, GREEDY)
    with pytest.raises(PromptTooLongError):
        await collect(engine, [5] * 10, SamplingParams(max_tokens=engine.engine.max_model_len))
    assert engine.is_healthy


async def test_stats_snapshot(engine: AsyncEngine) -> None:
    await collect(engine, list(range(3, 40)), GREEDY)
    stats = engine.stats()
    assert stats["generation_tokens_total"] == 10
    assert stats["prompt_tokens_total"] == 37
    assert stats["memory_bytes"]["weights"] > 0 and stats["memory_bytes"]["kv_cache"] > 0
    assert stats["capacity"]["num_blocks"] == stats["kv_blocks_total"]


async def test_shutdown_fails_new_requests(llama: Any) -> None:
    engine = AsyncEngine(llama.engine())
    await engine.shutdown()
    assert not engine.is_healthy
    with pytest.raises(RuntimeError, match="shutting down"):
        await collect(engine, [5, 6], GREEDY)


async def test_abort_from_outside_ends_the_stream(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    deltas = []
    async for delta in engine.generate(list(range(3, 30)), params, request_id="cancel-me"):
        deltas.append(delta)
        if len(deltas) == 2:
            engine.abort("cancel-me")
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "abort"
    assert len(deltas) < 50
    await wait_until(lambda: engine.stats()["kv_blocks_used"] == 0)
