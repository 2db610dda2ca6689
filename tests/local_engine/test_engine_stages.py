"""When a request reached each stage in the engine (`EngineStages`: queued, scheduled, first token, finished, wall
clock): on its first output and its final one only, in order, and a request that waited behind a full batch was
scheduled only once the batch had room."""

from __future__ import annotations

import time
from typing import Any

from local_engine.async_engine import AsyncEngine
from local_engine.output_processor import EngineStages, RequestOutput
from local_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run(engine: Any) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def assert_in_order(stages: EngineStages, after_ns: int, before_ns: int) -> None:
    assert after_ns <= stages.queued_ns <= stages.scheduled_ns <= stages.first_token_ns <= stages.finished_ns
    assert stages.finished_ns <= before_ns


def test_a_request_behind_a_full_batch_is_scheduled_once_there_is_room(llama: Any) -> None:
    engine = llama.engine(max_num_seqs=1)  # one seat: the second request waits for the first to finish
    started = time.time_ns()
    engine.add_request("first", [3, 4, 5, 6], GREEDY)
    engine.add_request("second", [7, 8, 9], GREEDY)
    outputs = run(engine)
    ended = time.time_ns()

    for deltas in outputs.values():
        assert len(deltas) == GREEDY.max_tokens  # one output per token
        # Only the first output and the final one carry stages (nothing per token in between).
        assert all(d.stages is None for d in deltas[1:-1])
        first, final = deltas[0].stages, deltas[-1].stages
        assert first is not None and final is not None
        assert first.finished_ns == 0 and first[:3] == final[:3]
        assert_in_order(final, started, ended)
    ahead, behind = outputs["first"][-1].stages, outputs["second"][-1].stages
    assert ahead is not None and behind is not None
    assert behind.queued_ns <= ahead.scheduled_ns  # both arrived before the first step
    assert behind.scheduled_ns >= ahead.finished_ns  # ... and the second waited for the seat


def test_a_request_aborted_while_waiting_reached_only_its_queue(llama: Any) -> None:
    engine = llama.engine(max_num_seqs=1)
    engine.add_request("running", [3, 4, 5], GREEDY)
    engine.add_request("waiting", [6, 7, 8], GREEDY)
    engine.step()
    final = engine.abort_request("waiting")
    assert final is not None and final.stages is not None
    queued, scheduled, first_token, finished = final.stages
    assert (scheduled, first_token) == (0, 0) and 0 < queued <= finished


def test_one_output_is_both_first_and_final(llama: Any) -> None:
    engine = llama.engine()
    engine.add_request("one", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    [[output]] = run(engine).values()
    assert output.finished and output.stages is not None and all(output.stages)


async def test_the_queue_starts_when_the_async_engine_is_handed_the_request(llama: Any) -> None:
    engine = AsyncEngine(llama.engine(max_num_seqs=1))
    try:
        started = time.time_ns()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
        deltas = [out async for out in engine.generate([3, 4, 5, 6], params)]
        ended = time.time_ns()
    finally:
        await engine.shutdown()
    carrying = [d for d in deltas if d.stages is not None]
    assert carrying[0] is deltas[0] and carrying[-1] is deltas[-1] and len(carrying) == 2
    final = deltas[-1].stages
    assert final is not None
    assert_in_order(final, started, ended)
