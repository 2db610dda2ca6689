"""The local engine as a backend: OpenAI chat and text completions served by `local_engine.AsyncEngine`.

This module adapts the engine (loading, health, stats, output limits); the OpenAI request and response shapes are
in `backends.local_mapping`, which also translates the engine's errors (`local_engine.errors`) into `gateway.errors`
at one point, `engine_errors`. It takes its configuration as `LocalBackendConfig` (the model's options whole, as
`backends.config.LocalEngineOptions`), built by the gateway from the routing entry and the settings.

The model loads in a background thread when the backend is built, so start-up is not blocked. Meanwhile
`health_state()` is "loading" and requests wait for the load up to `load_wait_s`, then get 503 `engine_loading`
with a `Retry-After` (never a cooldown). Prompts are tokenized off the event loop, after a size check that refuses
a prompt too long to ever fit. Closing a stream early aborts its engine requests, which frees their KV blocks
within one step; the stream still reports what the engine counted until then (`usage_so_far`), which is what the
gateway charges a client that left. When the request reached each stage in the engine (queued, scheduled, first
token, finished) comes with the answer (`backends.base.ENGINE_STAGES_KEY`) or from the stream
(`ReportsEngineStages`), for the gateway's trace. Each call runs under its caller's tenancy (`backends.base.Tenancy`),
by which the engine shares itself between tenants (local_engine/fair_share.py).

Output limits (docs/coding-agents.md): a `max_tokens` that does not fit next to the prompt is lowered to the room
left (`clamp_max_tokens`, on by default; the response says so, see `backends.base.MAX_TOKENS_CLAMPED_KEY`), and a
request that sets none gets `default_max_tokens`. A prompt that does not fit at all is still refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from backends.base import ENGINE_STAGES_KEY, Endpoint, HealthState, Json, MeteredStream, OutputLimits, Tenancy
from backends.config import LocalEngineOptions
from backends.local_mapping import (
    NATIVE_ENDPOINTS,
    ParsedRequest,
    StageTimes,
    Usage,
    check_prompt_size,
    check_request,
    engine_errors,
    prompt_ids,
    prompt_texts,
)
from gateway.errors import EngineError, EngineLoadingError, GatewayError
from local_engine.config import EngineConfig
from local_engine.errors import CheckpointError
from local_engine.fair_share import DEFAULT_TENANCY
from local_engine.output_processor import RequestOutput, accumulate

if TYPE_CHECKING:
    from local_engine.async_engine import AsyncEngine
    from local_engine.sampling_params import SamplingParams
    from local_engine.tokenizer import Tokenizer

__all__ = ["LocalBackend", "LocalBackendConfig"]

logger = logging.getLogger("unigate.engine")

# Retry-After of a 503 `engine_loading`: the load's remaining time is unknown, so ask again soon (no cooldown
# follows: the first request after the load finishes is served).
ENGINE_LOADING_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class LocalBackendConfig:
    """One `type: local` deployment. The gateway builds it from the routing entry and its settings; the defaults
    are the gateway's, for tests and scripts that build a backend by hand. The model's options come whole, as
    `engine` (`backends.config.LocalEngineOptions`: the checkpoint, the engine's run options, the output limit and
    sampling defaults, `load_wait_s`), declared there once."""

    name: str  # the deployment's stable name (metrics, cooldowns, leases)
    model_id: str  # the public model id responses name when the request sets no `model`
    cache_dir: Path  # converted weights are cached here (the gateway: `<data_dir>/models`)
    engine: LocalEngineOptions = field(default_factory=LocalEngineOptions)
    clamp_max_tokens: bool = True  # lower a max_tokens that does not fit next to the prompt to the room left


def load_engine(config: LocalBackendConfig) -> AsyncEngine:
    """(loader thread) The checkpoint at `config.engine.model_path` (or the bundled model) served by a new engine."""
    import torch

    from local_engine.async_engine import AsyncEngine
    from local_engine.engine import LLMEngine
    from local_engine.loader import bundled_model_path, load_checkpoint
    from local_engine.model_runner import TORCH_DTYPES

    options = config.engine
    device = options.resolved_device(torch.cuda.is_available())
    dtype = TORCH_DTYPES[options.resolved_dtype(device)]
    path = options.model_path or bundled_model_path()
    checkpoint = load_checkpoint(
        path,
        cache_dir=config.cache_dir,
        dtype=dtype,
        quantization=options.quantization,
        quantization_group_size=options.quantization_group_size,
    )
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig.of(options), cache_dir=config.cache_dir)
    if options.quantization_check and engine.checkpoint_quantization is not None:
        logger.info(
            "quantization check skipped: the checkpoint comes quantized (%s), so there are no float weights to "
            "compare with; check the float checkpoint with UNIGATE_ENGINE__QUANTIZATION=int4 instead",
            engine.checkpoint_quantization,
        )
    elif options.quantization_check:  # served vs float32 perplexity on the evaluation text (a few seconds)
        from local_engine.perplexity import check_quality

        check_quality(engine, lambda: load_checkpoint(path, cache_dir=config.cache_dir, dtype=torch.float32))
    return AsyncEngine(engine)


class LocalBackend:
    """One `type: local` deployment: a model served in this process."""

    def __init__(
        self,
        name: str,
        load: Callable[[], AsyncEngine],
        *,
        model_id: str | None = None,
        load_wait_s: float = 30.0,
        clamp_max_tokens: bool = True,
        default_max_tokens: int | None = None,
        sampling_defaults: Mapping[str, float] | None = None,
    ) -> None:
        self.name = name
        self.model_id = model_id or name
        self.load_wait_s = load_wait_s
        self.clamp_max_tokens = clamp_max_tokens
        self.default_max_tokens = default_max_tokens or None  # 0 = none
        self._sampling_override = None if sampling_defaults is None else dict(sampling_defaults)
        self.sampling_defaults: dict[str, float] = {}  # what requests get: the override, else the model's own
        self._load_started = time.monotonic()
        self._ids = itertools.count()
        self._engine: AsyncEngine | None = None
        self._closed = False
        self._token_texts: dict[int, tuple[str, list[int]]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unigate-engine-load")
        self._loading = self._executor.submit(self._load, load)
        self._executor.shutdown(wait=False)

    @classmethod
    def from_local_config(cls, config: LocalBackendConfig) -> LocalBackend:
        """The backend for `config`; its model starts loading now, in a background thread."""
        return cls(
            config.name,
            functools.partial(load_engine, config),
            model_id=config.model_id,
            load_wait_s=config.engine.load_wait_s,
            clamp_max_tokens=config.clamp_max_tokens,
            default_max_tokens=config.engine.default_max_tokens,
            sampling_defaults=config.engine.sampling_defaults,
        )

    def _load(self, load: Callable[[], AsyncEngine]) -> AsyncEngine:
        started = time.perf_counter()
        try:
            engine = load()
        except Exception as exc:  # logged now, at start-up: otherwise only its requests' 500s would tell
            code, message = _load_error(exc)
            logger.error(
                "local deployment %s could not load its model: %s (%s). Its requests get this error; /health/ready "
                "shows it as load_failed.",
                self.name,
                message.rstrip(". "),
                code,
            )
            raise
        if self._closed:
            engine.stop()
            raise EngineError("the local engine was closed while loading")
        if engine.engine.tokenizer is not None:
            _tokenizer(engine).max_prompt_chars(engine.engine.max_model_len)  # computed once, off the loop
        model_defaults = getattr(engine.engine, "model_sampling_defaults", {})
        self.sampling_defaults = model_defaults if self._sampling_override is None else self._sampling_override
        self._engine = engine
        logger.info(
            "local engine %s serving after %.1fs: %s",
            self.name,
            time.perf_counter() - started,
            engine.engine.capacity.as_dict(),
        )
        if self.sampling_defaults:
            logger.info(
                "local engine %s: requests that leave them out sample with %s (%s)",
                self.name,
                ", ".join(f"{name}={value}" for name, value in self.sampling_defaults.items()),
                "the model's own" if self._sampling_override is None else "sampling_defaults",
            )
        return engine

    @property
    def engine(self) -> AsyncEngine | None:
        """The serving engine; None while the model loads (or after its load failed)."""
        return self._engine

    async def _ready(self) -> AsyncEngine:
        """The engine, waiting up to `load_wait_s` for a load in progress (then 503 `engine_loading`)."""
        if self._engine is not None:
            return self._engine
        if not self._loading.done():
            waiting = asyncio.wrap_future(self._loading)
            # The load's outcome is read from `self._loading` below; this copy's must never go unretrieved (its
            # "exception never retrieved" report would run from the garbage collector at an arbitrary moment).
            waiting.add_done_callback(_retrieve)
            try:
                async with asyncio.timeout(self.load_wait_s):
                    await asyncio.shield(waiting)
            except TimeoutError:
                if not self._loading.done():
                    raise self._still_loading() from None
            except Exception:
                pass  # the load failed: reported below, from the future itself
        error = self._loading.exception()
        if error is None:
            return self._loading.result()
        if isinstance(error, GatewayError):
            raise error
        if isinstance(error, CheckpointError):  # the engine's own account of what is wrong with the model
            raise EngineError(error.message, code=error.code) from None
        raise EngineError(f"The local model failed to load ({type(error).__name__}: {error}).") from error

    def _still_loading(self) -> EngineLoadingError:
        elapsed = time.monotonic() - self._load_started
        return EngineLoadingError(
            f"The local model is still loading ({elapsed:.0f} s so far); retry in {ENGINE_LOADING_RETRY_AFTER_S} s. "
            "GET /health/ready shows it as `loading` until it serves.",
            headers={"retry-after": str(ENGINE_LOADING_RETRY_AFTER_S)},
        )

    # -- Backend protocol ---------------------------------------------------------------------------------------

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in NATIVE_ENDPOINTS

    async def send(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> Json:
        """`tenancy`: whose share of the engine serves it (the gateway passes the caller's; None: nobody's)."""
        engine = await self._ready()
        request = await self._parse(engine, endpoint, body)
        streams = self._generate(engine, request, request_id, tenancy or DEFAULT_TENANCY)
        deltas: list[list[RequestOutput]] = [[] for _ in streams]
        try:
            with engine_errors(endpoint):
                async for prompt_index, delta in _merge(streams):
                    deltas[prompt_index].append(delta)
        finally:
            for stream in streams:  # cancelled mid-way (caller gone): abort what is still running
                await stream.aclose()
        usage = Usage()
        stages = StageTimes(len(streams))
        choices = []
        for prompt_index, prompt_deltas in enumerate(deltas):
            usage.add_prompt(prompt_deltas)
            for delta in prompt_deltas[:1] + prompt_deltas[-1:]:  # a request's stages come with these two
                stages.add(delta)
            for out in accumulate(prompt_deltas, request.params.n):
                usage.completion_tokens += len(out.token_ids)
                choices.append(request.choice(prompt_index, out))
        response = request.response(choices, usage.as_dict(), request_id)
        if (times := stages.combined()) is not None:
            response[ENGINE_STAGES_KEY] = list(times)  # the gateway takes it out (gateway/attempt.py)
        return response

    def stream(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> MeteredStream:
        """The chunks; the stream reports the engine's counts so far (`usage_so_far`), which is what a stream
        closed before its usage chunk used: every prompt token (cached ones too) and every token generated; and the
        stages its request reached in the engine (`engine_stages`)."""
        usage = Usage()
        stages = StageTimes()
        chunks = self._stream(endpoint, body, request_id, tenancy or DEFAULT_TENANCY, usage, stages)
        return MeteredStream(chunks, lambda: usage.as_dict() if usage.has_counts else None, stages.combined)

    async def _stream(
        self, endpoint: Endpoint, body: Json, request_id: str, tenancy: Tenancy, usage: Usage, stages: StageTimes
    ) -> AsyncGenerator[Json, None]:
        engine = await self._ready()
        request = await self._parse(engine, endpoint, body)
        streams = self._generate(engine, request, request_id, tenancy)
        stages.num_requests = len(streams)
        started: set[int] = set()
        try:
            with engine_errors(endpoint):
                async for prompt_index, delta in _merge(streams):
                    usage.add_prompt([delta])
                    if delta.stages is not None:
                        stages.add(delta)
                    for out in delta.outputs:
                        usage.completion_tokens += len(out.token_ids)
                        index = prompt_index * request.params.n + out.index
                        if request.is_chat and index not in started:
                            started.add(index)
                            yield request.chunk(request_id, [request.role_choice(index)])
                        if out.text or out.finish_reason or out.logprobs:
                            choice = request.delta_choice(index, out)
                            if choice.get("delta", True) or choice["finish_reason"] or choice["logprobs"]:
                                yield request.chunk(request_id, [choice])  # (text held back for a tool call: none)
                if request.include_usage:
                    yield request.chunk(request_id, [], usage=usage.as_dict())
        finally:
            for stream in streams:
                await stream.aclose()

    async def count_prompt_tokens(self, body: Json) -> int:
        """The prompt tokens of a chat-completions `body` here: rendered with the model's chat template (tools
        included) and tokenized, off the event loop after the same size check as a request; what the request's
        `usage.prompt_tokens` would say. Waits for a loading model like a request does."""
        engine = await self._ready()
        tokenizer = _tokenizer(engine)
        check_prompt_size(body, True, tokenizer.max_prompt_chars(engine.engine.max_model_len))
        with engine_errors("chat/completions"):
            [ids] = await asyncio.to_thread(prompt_ids, tokenizer, True, body)
        return len(ids)

    def output_limits(self) -> OutputLimits:
        """The engine's context length (None while the model loads), the clamp and the default output limit."""
        context_length = self._engine.engine.max_model_len if self._engine is not None else None
        return OutputLimits(context_length, self.clamp_max_tokens, self.default_max_tokens)

    async def check_health(self) -> bool:
        return self.health_state() == "up"

    def health_state(self) -> HealthState:
        """Known without a probe: `loading` (the model is loading), `up`, `restarting` (a step failed and the
        engine is resetting itself) or `down` (the load failed, or the engine stopped)."""
        from local_engine.async_engine import EngineState

        if self._engine is None:
            return "down" if self._loading.done() else "loading"
        state = self._engine.state
        if state is EngineState.RUNNING:
            return "up"
        return "restarting" if state is EngineState.RESTARTING else "down"

    async def aclose(self) -> None:
        self._closed = True
        if self._engine is not None:
            await self._engine.shutdown()

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """(text, exact UTF-8 bytes) of one token, for logprobs; a token holding part of a character shows
        U+FFFD in its text while `bytes` stays exact, as OpenAI reports it."""
        cached = self._token_texts.get(token_id)
        if cached is None:
            engine = self._engine
            assert engine is not None
            raw = _tokenizer(engine).token_bytes(token_id)
            cached = self._token_texts[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return cached

    def stats(self) -> dict[str, Any]:
        """Engine stats for /metrics and GET /admin/engine (`loaded: false` while the model is loading)."""
        if self._engine is None:
            error = self._loading.exception() if self._loading.done() else None
            stats: dict[str, Any] = {"name": self.name, "loaded": False, "load_failed": error is not None}
            if error is not None:  # the code a request gets (`_ready`), e.g. checkpoint_not_found
                stats["load_error"] = _load_error(error)[0]
            return {**stats, "state": self.health_state()}
        return {
            "name": self.name,
            "loaded": True,
            "healthy": self._engine.is_healthy,
            "state": self.health_state(),
            "num_restarts": self._engine.num_restarts,
            "sampling_defaults": dict(self.sampling_defaults),
            **self._engine.stats(),
        }

    # -- requests -----------------------------------------------------------------------------------------------

    def _generate(
        self, engine: AsyncEngine, request: ParsedRequest, request_id: str, tenancy: Tenancy
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """One engine stream per prompt."""
        return [
            engine.generate(ids, request.params, f"{request_id}-{next(self._ids)}", tenancy=tenancy)
            for ids in request.prompts
        ]

    async def _parse(self, engine: AsyncEngine, endpoint: Endpoint, body: Json) -> ParsedRequest:
        """Check cheap things on the event loop (fields, sampling parameters, the prompt's size in characters),
        then tokenize and validate in a worker thread: a big prompt must not stall every other request."""
        tokenizer = _tokenizer(engine)
        max_chars = tokenizer.max_prompt_chars(engine.engine.max_model_len)
        params = check_request(endpoint, body, max_chars, sampling_defaults=self.sampling_defaults)
        return await asyncio.to_thread(self._tokenize, engine, endpoint, params, body)

    def _tokenize(self, engine: AsyncEngine, endpoint: Endpoint, params: SamplingParams, body: Json) -> ParsedRequest:
        """(worker thread) The prompts' token ids, checked against the engine's limits."""
        is_chat = endpoint == "chat/completions"
        tokenizer = _tokenizer(engine)
        with engine_errors(endpoint):
            prompts = prompt_ids(tokenizer, is_chat, body)
            params, clamped = self._fit_output(engine.engine.max_model_len, prompts, params)
            for ids in prompts:
                engine.validate(ids, params)
        return ParsedRequest(
            is_chat,
            prompts,
            params,
            body,
            self.model_id,
            token_text=self.token_text,
            prompt_texts=prompt_texts(tokenizer, body),
            clamped=clamped,
        )

    def _fit_output(
        self, max_model_len: int, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[SamplingParams, tuple[int, int] | None]:
        """The output limit to run with: the client's, lowered to the room the longest prompt leaves in the context
        when clamping is on (then also returned as `(requested, served)`); else `default_max_tokens`, within that
        room. A prompt that leaves no room is left for the engine to refuse."""
        room = max_model_len - max((len(ids) for ids in prompts), default=0)
        requested = params.max_tokens
        if room < 1:
            return params, None
        if requested is None:
            if self.default_max_tokens is None:
                return params, None
            served = min(max(self.default_max_tokens, params.min_tokens), room)
            return replace(params, max_tokens=served, min_tokens=min(params.min_tokens, served)), None
        if not self.clamp_max_tokens or requested <= room:
            return params, None
        logger.debug(
            "max_tokens clamped %d -> %d: the prompt has %d tokens of this model's %d",
            requested,
            room,
            max_model_len - room,
            max_model_len,
        )
        return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room)), (requested, room)


def _load_error(exc: BaseException) -> tuple[str, str]:
    """(code, message) of a failed load: the code its requests get (`_ready`) and what to log."""
    if isinstance(exc, CheckpointError):  # its message names the path and the fix
        return exc.code, exc.message
    if isinstance(exc, GatewayError):
        return exc.code, str(exc)
    return "engine_error", f"{type(exc).__name__}: {exc}"


def _tokenizer(engine: AsyncEngine) -> Tokenizer:
    """The engine's tokenizer (the loader always gives one; an engine built without one cannot serve OpenAI)."""
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise EngineError("This local model has no tokenizer; it cannot serve OpenAI requests.")
    return cast("Tokenizer", tokenizer)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _merge(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams (a /completions call with a list of prompts) as deltas arrive."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
