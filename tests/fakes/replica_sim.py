"""A simulated fleet of LLM replicas (vLLM-like): real HTTP servers on loopback, one event loop for all of them.

    fleet = ReplicaFleet(4, SimParams(time_scale=0.1)).start()   # 4 replicas, a daemon thread, one asyncio loop
    fleet.replicas[0].base_url       # "http://127.0.0.1:<port>/v1": chat/completions (+ stream), /v1/models
    fleet.replicas[0].metrics_url    # "http://127.0.0.1:<port>/metrics": vLLM's names (below)
    fleet.replicas[0].metrics_mode = "down"   # ok | down (503) | hang | empty (200 without the load metrics)
    fleet.replicas[0].stats           # ReplicaStats: requests, prompt/cached tokens, load over time, ...
    fleet.stop()

Each replica models what makes routing matter, with every parameter in `SimParams`:
- a prefix cache: the prompt (the messages rendered `role\\ncontent\\n`, `chars_per_token` characters a token) in
  blocks of `block_tokens`, keyed by chained hashes like vLLM's automatic prefix caching, LRU over
  `num_cache_blocks` blocks; a request's cached tokens are its leading blocks found there;
- continuous batching: a step admits waiting requests up to `max_batch` running, prefills their uncached tokens
  (`prefill_s_per_token` each) and decodes one token for every running request (`decode_step_s` plus
  `decode_s_per_seq` per running request); more than `max_waiting` waiting answer 503;
- `/metrics` in vLLM's names: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (blocks held by running requests over `num_cache_blocks`), `vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total` (tokens).

Time is simulated by sleeping: `time_scale` < 1 runs the same schedule faster (every duration times the scale), so
16 replicas fit in one process on 2 cores. Two presets, every value in `SimParams`:
- `SimParams()` (also `SimParams.vllm_h100()`), the defaults: a 7-8B model on one H100-class GPU under vLLM (~20k
  prefill tokens/s, a ~12 ms decode step growing ~0.3 ms per running request, 64k tokens of prefix cache), set by
  hand from those engines' published figures, not measured here;
- `SimParams.bundled_engine()`: the bundled SmolLM2-135M on the local engine's defaults, measured on a CPU host by
  `benchmarks/calibrate_replica_sim.py`, which writes `replica_sim_bundled_engine.json` next to this file.
Run standalone: `python tests/fakes/replica_sim.py --replicas 4 --port 9100` (ports 9100, 9101, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

__all__ = [
    "CALIBRATION_PATH",
    "ReplicaFleet",
    "ReplicaSim",
    "ReplicaStats",
    "SimParams",
    "prompt_blocks",
    "render_prompt",
]

# benchmarks/calibrate_replica_sim.py's output: {"params": {SimParams field: value}, what they were measured from}
CALIBRATION_PATH = Path(__file__).with_name("replica_sim_bundled_engine.json")


@dataclass(frozen=True)
class SimParams:
    chars_per_token: int = 4
    block_tokens: int = 16
    num_cache_blocks: int = 4096  # 64k tokens of prefix cache
    prefill_s_per_token: float = 50e-6
    decode_step_s: float = 0.012
    decode_s_per_seq: float = 0.0003
    max_batch: int = 64
    max_waiting: int = 1024
    default_max_tokens: int = 16
    time_scale: float = 1.0

    @classmethod
    def vllm_h100(cls, time_scale: float = 1.0) -> SimParams:
        """The defaults: a 7-8B model under vLLM on one H100-class GPU, from published figures (module docstring)."""
        return cls(time_scale=time_scale)

    @classmethod
    def bundled_engine(cls, time_scale: float = 1.0, path: Path = CALIBRATION_PATH) -> SimParams:
        """The bundled SmolLM2-135M on the local engine's default settings, as measured on a CPU host by
        benchmarks/calibrate_replica_sim.py (`path`: its JSON; the fields it does not set keep their defaults)."""
        values = orjson.loads(path.read_bytes())["params"]
        return cls(**values, time_scale=time_scale)


@dataclass
class ReplicaStats:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    load_seconds: float = 0.0  # integral over time of (running + waiting), in simulated seconds
    busy_seconds: float = 0.0  # simulated seconds spent in steps
    peak_load: int = 0  # the most requests running + waiting at once
    first_messages: list[str] = field(default_factory=list)  # each request's first non-system message, as sent


def render_prompt(body: dict[str, Any]) -> str:
    """The text the simulated engine prefills: each message as `role\\ncontent\\n` (or a completion's prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return str(body.get("prompt", ""))
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', 'user')}\n{content}\n")
    return "".join(parts)


def prompt_blocks(text: str, params: SimParams) -> tuple[int, list[bytes]]:
    """`(prompt tokens, chained hashes of its whole blocks)`."""
    num_tokens = max(1, -(-len(text) // params.chars_per_token))
    block_chars = params.block_tokens * params.chars_per_token
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start : start + block_chars].encode(), digest_size=12).digest()
        hashes.append(previous)
    return num_tokens, hashes


@dataclass
class _Seq:
    num_prompt_tokens: int
    blocks: list[bytes]
    max_tokens: int
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    num_cached_tokens: int = 0
    num_generated: int = 0
    is_aborted: bool = False


class ReplicaSim:
    """One simulated replica (see the module docstring); runs on its fleet's loop."""

    def __init__(self, name: str, params: SimParams) -> None:
        self.name = name
        self.params = params
        self.port = 0
        self.metrics_mode = "ok"
        self.extra_waiting = 0  # reported on /metrics on top of its own (another gateway's traffic, say)
        self.stats = ReplicaStats()
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()  # ends a `hang` answer
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def start(self, port: int = 0) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._loop_task = asyncio.create_task(self._step_loop())

    async def stop(self) -> None:
        self._stopping.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the engine --------------------------------------------------------------------------------------------

    def _admit(self, seq: _Seq) -> None:
        num_hit = 0
        for block in seq.blocks:
            if block not in self._cache:
                break
            num_hit += 1
        for block in seq.blocks:
            self._cache[block] = None
            self._cache.move_to_end(block)
        while len(self._cache) > self.params.num_cache_blocks:
            self._cache.popitem(last=False)
        seq.num_cached_tokens = min(num_hit * self.params.block_tokens, seq.num_prompt_tokens - 1)
        self.stats.num_prompt_tokens += seq.num_prompt_tokens
        self.stats.num_cached_tokens += seq.num_cached_tokens
        self._running.append(seq)

    async def _step_loop(self) -> None:
        params = self.params
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            num_prefill = 0
            while self._waiting and len(self._running) < params.max_batch:
                seq = self._waiting.popleft()
                if not seq.is_aborted:
                    self._admit(seq)
                    num_prefill += seq.num_prompt_tokens - seq.num_cached_tokens
            step_s = (
                params.decode_step_s
                + params.decode_s_per_seq * len(self._running)
                + params.prefill_s_per_token * num_prefill
            )
            self.stats.load_seconds += step_s * (len(self._running) + len(self._waiting))
            self.stats.busy_seconds += step_s
            await asyncio.sleep(step_s * params.time_scale)
            for seq in self._running:
                seq.num_generated += 1
                seq.out.put_nowait(seq.num_generated)
                if seq.num_generated >= seq.max_tokens:
                    seq.out.put_nowait(None)
            self._running = [s for s in self._running if s.num_generated < s.max_tokens and not s.is_aborted]

    # -- HTTP ------------------------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if len(self._waiting) >= self.params.max_waiting:
            return web.json_response({"error": {"message": "queue full", "type": "overloaded"}}, status=503)
        num_tokens, blocks = prompt_blocks(render_prompt(body), self.params)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or self.params.default_max_tokens)
        seq = _Seq(num_tokens, blocks, max(1, max_tokens))
        self.stats.num_requests += 1
        self.stats.first_messages.append(_first_message(body))
        self._waiting.append(seq)
        self.stats.peak_load = max(self.stats.peak_load, len(self._waiting) + len(self._running))
        self._wake.set()
        try:
            if body.get("stream"):
                return await self._stream(request, body, seq)
            while await seq.out.get() is not None:
                pass
            return web.Response(body=orjson.dumps(self._completion(body, seq)), content_type="application/json")
        finally:
            seq.is_aborted = True  # done or the client left: either way out of the batch

    async def _stream(self, request: web.Request, body: dict[str, Any], seq: _Seq) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "chatcmpl-sim", "object": "chat.completion.chunk", "created": 0, "model": body.get("model")}
        while (index := await seq.out.get()) is not None:
            delta = {"role": "assistant", "content": "tok "} if index == 1 else {"content": "tok "}
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        finish = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        await response.write(b"data: " + orjson.dumps(finish) + b"\n\n")
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            usage_chunk: dict[str, Any] = {**base, "choices": [], "usage": _usage(seq)}
            await response.write(b"data: " + orjson.dumps(usage_chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _completion(self, body: dict[str, Any], seq: _Seq) -> dict[str, Any]:
        message = {"role": "assistant", "content": "tok " * seq.num_generated}
        return {
            "id": "chatcmpl-sim",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
            "usage": _usage(seq),
        }

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim", "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_mode == "down":
            return web.Response(status=503, text="down")
        if self.metrics_mode == "hang":
            await self._stopping.wait()
            return web.Response(status=503, text="stopping")
        if self.metrics_mode == "empty":
            return web.Response(text="# no load metrics here\nprocess_cpu_seconds_total 1.0\n")
        held = sum(len(s.blocks) for s in self._running)
        label = '{model_name="sim"}'
        lines = [
            f"vllm:num_requests_running{label} {len(self._running)}",
            f"vllm:num_requests_waiting{label} {len(self._waiting) + self.extra_waiting}",
            f"vllm:kv_cache_usage_perc{label} {min(1.0, held / self.params.num_cache_blocks)}",
            f"vllm:prefix_cache_queries_total{label} {self.stats.num_prompt_tokens}",
            f"vllm:prefix_cache_hits_total{label} {self.stats.num_cached_tokens}",
        ]
        return web.Response(text="\n".join(lines) + "\n")


def _first_message(body: dict[str, Any]) -> str:
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") not in ("system", "developer"):
            return str(message.get("content"))
    return ""


def _usage(seq: _Seq) -> dict[str, Any]:
    return {
        "prompt_tokens": seq.num_prompt_tokens,
        "completion_tokens": seq.num_generated,
        "total_tokens": seq.num_prompt_tokens + seq.num_generated,
        "prompt_tokens_details": {"cached_tokens": seq.num_cached_tokens},
    }


class ReplicaFleet:
    """`n` replicas on one event loop in a daemon thread (see the module docstring)."""

    def __init__(self, num_replicas: int, params: SimParams | None = None, *, base_port: int = 0) -> None:
        self.params = params or SimParams()
        self.base_port = base_port
        self.replicas: list[ReplicaSim] = []
        self._num_replicas = num_replicas
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="replica-fleet", daemon=True)

    def start(self) -> ReplicaFleet:
        self._thread.start()
        self._call(self._start_all())
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._stop_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def kill(self, index: int) -> None:
        """Stop one replica: its port refuses connections from now on."""
        self._call(self.replicas[index].stop())

    def __enter__(self) -> ReplicaFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    async def _start_all(self) -> None:
        for index in range(self._num_replicas):
            replica = ReplicaSim(f"r{index}", self.params)
            await replica.start(self.base_port + index if self.base_port else 0)
            self.replicas.append(replica)

    async def _stop_all(self) -> None:
        for replica in self.replicas:
            await replica.stop()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--preset", choices=["vllm-h100", "bundled-engine"], default="vllm-h100")
    args = parser.parse_args()
    preset = SimParams.bundled_engine if args.preset == "bundled-engine" else SimParams.vllm_h100
    fleet = ReplicaFleet(args.replicas, preset(time_scale=args.time_scale), base_port=args.port).start()
    for replica in fleet.replicas:
        print(replica.base_url, replica.metrics_url)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    fleet.stop()


if __name__ == "__main__":
    main()
