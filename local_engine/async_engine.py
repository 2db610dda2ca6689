"""`AsyncEngine`: the step loop in its own thread, per-request asyncio streams on the caller's event loop.

The event loop never computes: `generate()` validates, hands the request to the engine thread through a
thread-safe inbox and awaits deltas, which the engine thread pushes with `call_soon_threadsafe` (one hand-off per
event loop per step). Closing the stream early (client gone) aborts the request, freeing its blocks within one step.

Failures: a request the engine failed alone (see `LLMEngine.step`) raises `RequestFailedError` in its own stream.
A step that raises fails the requests then in the engine with `EngineDeadError`, `reset()`s the engine and serves
on (`state` is RESTARTING meanwhile); after `MAX_CONSECUTIVE_RESTARTS` failed steps in a row with no good step in
between, the engine stays DEAD.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from enum import Enum
from typing import Any

from local_engine.engine import LLMEngine
from local_engine.errors import DuplicateRequestError, EngineDeadError, LocalEngineError, RequestFailedError
from local_engine.fair_share import DEFAULT_TENANCY, Tenancy
from local_engine.output_processor import RequestOutput
from local_engine.sampling_params import SamplingParams

__all__ = ["MAX_CONSECUTIVE_RESTARTS", "AsyncEngine", "EngineDeadError", "EngineState"]

logger = logging.getLogger("unigate.engine")

# Failed steps in a row (no successful step between them) after which the engine gives up and stays DEAD: a fault
# that survives a reset (e.g. a lost GPU) must not turn into an endless fail-restart loop.
MAX_CONSECUTIVE_RESTARTS = 3


_Added = tuple[str, list[int], SamplingParams, Tenancy, int]


class EngineState(Enum):
    RUNNING = "running"
    RESTARTING = "restarting"  # a step failed: in-flight requests failed, the engine is being reset
    STOPPED = "stopped"  # shut down on purpose
    DEAD = "dead"  # failed and could not restart


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | LocalEngineError] = asyncio.Queue()


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # (request id, prompt ids, params, tenancy, arrival) of a request to add, or the id of one to abort
        self._inbox: queue.SimpleQueue[_Added | str] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams between the loop thread and the engine thread
        self._ids = itertools.count()
        self._stats: dict[str, Any] = engine.stats()
        self._error: BaseException | None = None
        self._stopping = False
        self._is_restarting = False
        self._num_failed_steps = 0
        self.num_restarts = 0
        self._thread = threading.Thread(target=self._run, name="unigate-engine", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        if self._error is not None:
            return EngineState.DEAD
        if self._stopping or not self._thread.is_alive():
            return EngineState.STOPPED
        return EngineState.RESTARTING if self._is_restarting else EngineState.RUNNING

    @property
    def is_healthy(self) -> bool:
        return self.state is EngineState.RUNNING

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raises InvalidParamError / PromptTooLongError before anything is queued; returns the resolved
        max_tokens."""
        return self.engine.validate(prompt_token_ids, params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        tenancy: Tenancy = DEFAULT_TENANCY,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's deltas until it finishes. Invalid requests raise before the first delta."""
        self._check_alive()
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise DuplicateRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._inbox.put((request_id, prompt_token_ids, params, tenancy, time.time_ns()))  # its queue starts here
        self._wakeup.set()
        if not self._thread.is_alive():  # died after the first check: nobody would ever answer
            with self._lock:
                self._streams.pop(request_id, None)
            self._check_alive()
            raise EngineDeadError("the local engine is not running")
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, LocalEngineError):
                    raise item
                if item.error is not None:
                    finished = True  # the engine already dropped it
                    raise RequestFailedError(f"the local engine failed this request: {item.error!r}") from item.error
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe; takes effect before the next step."""
        self._inbox.put(request_id)
        self._wakeup.set()

    def stats(self) -> dict[str, Any]:
        """A snapshot taken by the engine thread after the latest step (no locking on the hot path)."""
        return dict(self._stats)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the current step; open streams fail with EngineDeadError."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        await asyncio.to_thread(self.stop, timeout_s)

    # -- engine thread ------------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the local engine stopped after an error: {self._error!r}") from self._error
        if self._stopping:
            raise EngineDeadError("the local engine is shutting down")

    def _drain_inbox(self) -> None:
        engine = self.engine
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                request_id, prompt, params, tenancy, queued_ns = item
                with self._lock:
                    is_live = request_id in self._streams
                if is_live:
                    try:
                        engine.add_request(request_id, prompt, params, tenancy, queued_ns=queued_ns)
                    except LocalEngineError as error:  # e.g. a refusal: the request's stream raises it
                        self._deliver([(request_id, error)])  # (add_request registers nothing when it raises)
                    except Exception as error:  # validated already: fail this request alone, never the loop
                        failed = RequestFailedError(f"the local engine failed this request: {error!r}")
                        failed.__cause__ = error
                        self._deliver([(request_id, failed)])
            else:
                final = engine.abort_request(item)
                if final is not None:  # an abort from outside the stream: let its reader finish
                    self._deliver([(item, final)])

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._serve()
                except Exception as error:
                    self._num_failed_steps += 1
                    if self._num_failed_steps > MAX_CONSECUTIVE_RESTARTS:
                        raise
                    self._restart(error)
        except BaseException as error:
            logger.exception("local engine failed %d steps in a row; it is stopped", self._num_failed_steps)
            self._error = error
        finally:
            self._fail_all(self._error or EngineDeadError("the local engine shut down"))

    def _serve(self) -> None:
        """Step until stopped, or until a step raises (propagates); a good step ends a streak of failed ones."""
        engine = self.engine
        while not self._stopping:
            self._drain_inbox()
            if not engine.has_unfinished_requests:
                self._stats = engine.stats()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            outputs = engine.step()
            self._num_failed_steps = 0
            self._stats = engine.stats()
            if outputs:
                self._deliver([(o.request_id, o) for o in outputs])

    def _restart(self, error: Exception) -> None:
        """After a failed step: fail the requests in the engine, rebuild its scheduling state, serve on."""
        self._is_restarting = True
        logger.error("local engine step failed; failing its requests and restarting the engine", exc_info=error)
        in_flight = list(self.engine.requests)
        dead = EngineDeadError(f"the local engine failed ({error!r}) and is restarting; retry the request")
        self._deliver([(request_id, dead) for request_id in in_flight])
        self.engine.reset()
        self.num_restarts += 1
        self._is_restarting = False
        logger.info("local engine restarted (%d restarts so far)", self.num_restarts)

    def _deliver(self, items: list[tuple[str, RequestOutput | LocalEngineError]]) -> None:
        """Push items to their streams, one thread-safe hand-off per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | LocalEngineError]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass  # that event loop is closed: its requests are gone and get aborted by their finally

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            request_ids = list(self._streams)
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(f"the local engine failed: {error!r}")
        self._deliver([(r, dead) for r in request_ids])


def _put_all(batch: list[tuple[_Stream, RequestOutput | LocalEngineError]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
