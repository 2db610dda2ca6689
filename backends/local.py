"""The local engine as a backend: OpenAI chat and text completions served by `local_engine.AsyncEngine`.

The model loads in a background thread when the backend is built, so start-up is not blocked. Meanwhile
`health_state()` is "loading" and requests wait for the load up to `load_wait_s`, then get 503 `engine_loading`
with a `Retry-After` (never a cooldown). Responses, chunks, usage and logprobs follow OpenAI's shapes; engine
failures surface as `gateway.errors` types, translated here from the engine's own tree (`local_engine.errors`).
Prompts are tokenized off the event loop, after a size check that refuses a prompt too long to ever fit. Closing
a stream early aborts its engine requests, which frees their KV blocks within one step.

Output limits (docs/coding-agents.md): a `max_tokens` that does not fit next to the prompt is lowered to the room
left (`clamp_max_tokens`, on by default; the response says so, see `backends.base.MAX_TOKENS_CLAMPED_KEY`), and a
request that sets none gets `default_max_tokens`. A prompt that does not fit at all is still refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from backends.base import MAX_TOKENS_CLAMPED_KEY, Endpoint, HealthState, Json, OutputLimits
from backends.tool_calls import ToolCallStream, parse_tool_calls, plain_tool_messages, tool_names
from gateway.errors import EngineError, EngineLoadingError, GatewayError, InvalidRequestError
from local_engine.errors import CheckpointError, InvalidParamError, PromptTooLongError

if TYPE_CHECKING:
    from gateway.settings import Settings
    from local_engine.async_engine import AsyncEngine
    from local_engine.output_processor import CompletionOutput, RequestOutput, TokenLogprob
    from local_engine.sampling_params import SamplingParams

__all__ = ["LocalBackend"]

logger = logging.getLogger("unigate.engine")

_NATIVE: frozenset[str] = frozenset({"chat/completions", "completions"})
# OpenAI fields this engine cannot honour: refused with a clear 400 rather than silently ignored.
_UNSUPPORTED = ("suffix", "functions", "audio", "prediction")
# Retry-After of a 503 `engine_loading`: the load's remaining time is unknown, so ask again soon (no cooldown
# follows: the first request after the load finishes is served).
ENGINE_LOADING_RETRY_AFTER_S = 5


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
    ) -> None:
        self.name = name
        self.model_id = model_id or name
        self.load_wait_s = load_wait_s
        self.clamp_max_tokens = clamp_max_tokens
        self.default_max_tokens = default_max_tokens or None  # 0 = none
        self._load_started = time.monotonic()
        self._ids = itertools.count()
        self._engine: AsyncEngine | None = None
        self._closed = False
        self._token_texts: dict[int, tuple[str, list[int]]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unigate-engine-load")
        self._loading = self._executor.submit(self._load, load)
        self._executor.shutdown(wait=False)

    @classmethod
    def from_config(cls, deployment: Any, settings: Settings) -> LocalBackend:
        """`deployment.model_path` (None = the bundled SmolLM2), engine options from `settings.engine`, converted
        weights cached under `settings.data_dir / "models"`."""
        engine_settings = settings.engine
        cache_dir = settings.data_dir / "models"
        model_path = getattr(deployment, "model_path", None) or engine_settings.model_path

        def load() -> AsyncEngine:
            import torch

            from local_engine.async_engine import AsyncEngine
            from local_engine.config import EngineConfig
            from local_engine.engine import LLMEngine
            from local_engine.loader import bundled_model_path, load_checkpoint
            from local_engine.model_runner import TORCH_DTYPES

            config = EngineConfig.from_settings(engine_settings)
            device = config.resolved_device(torch.cuda.is_available())
            dtype = TORCH_DTYPES[config.resolved_dtype(device)]
            checkpoint = load_checkpoint(model_path or bundled_model_path(), cache_dir=cache_dir, dtype=dtype)
            return AsyncEngine(LLMEngine.from_checkpoint(checkpoint, config))

        clamp = getattr(deployment, "clamp_max_tokens", None)
        default_max_tokens = getattr(deployment, "default_max_tokens", None)
        return cls(
            deployment.name,
            load,
            model_id=getattr(deployment, "id", None) or engine_settings.model_id,
            load_wait_s=engine_settings.load_wait_s,
            clamp_max_tokens=True if clamp is None else bool(clamp),
            default_max_tokens=engine_settings.default_max_tokens if default_max_tokens is None else default_max_tokens,
        )

    def _load(self, load: Callable[[], AsyncEngine]) -> AsyncEngine:
        started = time.perf_counter()
        engine = load()
        if self._closed:
            engine.stop()
            raise EngineError("the local engine was closed while loading")
        if engine.engine.tokenizer is not None:
            _max_prompt_chars(engine.engine.tokenizer, engine.engine.max_model_len)  # computed once, off the loop
        self._engine = engine
        logger.info(
            "local engine %s serving after %.1fs: %s",
            self.name,
            time.perf_counter() - started,
            engine.engine.capacity.as_dict(),
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
        return endpoint in _NATIVE

    async def send(self, endpoint: Endpoint, body: Json, *, request_id: str) -> Json:
        engine = await self._ready()
        request = await self._parse(engine, endpoint, body)
        streams = [engine.generate(ids, request.params, f"{request_id}-{next(self._ids)}") for ids in request.prompts]
        deltas: list[list[RequestOutput]] = [[] for _ in streams]
        try:
            async for prompt_index, delta in _merge(streams):
                deltas[prompt_index].append(delta)
        except ValueError as exc:
            raise _invalid(exc, endpoint) from None
        except RuntimeError as exc:
            raise EngineError(f"The local engine failed: {exc}") from None
        finally:
            for stream in streams:  # cancelled mid-way (caller gone): abort what is still running
                await stream.aclose()
        usage = _Usage()
        choices = []
        for prompt_index, prompt_deltas in enumerate(deltas):
            usage.add_prompt(prompt_deltas)
            for out in _accumulate(prompt_deltas, request.params.n):
                usage.completion_tokens += len(out.token_ids)
                choices.append(request.choice(self, prompt_index, out))
        return request.response(choices, usage.as_dict(), request_id)

    async def stream(self, endpoint: Endpoint, body: Json, *, request_id: str) -> AsyncIterator[Json]:
        engine = await self._ready()
        request = await self._parse(engine, endpoint, body)
        streams = [engine.generate(ids, request.params, f"{request_id}-{next(self._ids)}") for ids in request.prompts]
        usage = _Usage()
        started: set[int] = set()
        try:
            async for prompt_index, delta in _merge(streams):
                usage.add_prompt([delta])
                for out in delta.outputs:
                    usage.completion_tokens += len(out.token_ids)
                    index = prompt_index * request.params.n + out.index
                    if request.is_chat and index not in started:
                        started.add(index)
                        yield request.chunk(
                            request_id,
                            [
                                {
                                    "index": index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        )
                    if out.text or out.finish_reason or out.logprobs:
                        choice = request.delta_choice(self, index, out)
                        if choice.get("delta", True) or choice["finish_reason"] or choice["logprobs"]:
                            yield request.chunk(request_id, [choice])  # (text held back for a tool call: none)
            if request.include_usage:
                yield request.chunk(request_id, [], usage=usage.as_dict())
        except ValueError as exc:
            raise _invalid(exc, endpoint) from None
        except RuntimeError as exc:
            raise EngineError(f"The local engine failed: {exc}") from None
        finally:
            for stream in streams:
                await stream.aclose()

    async def count_prompt_tokens(self, body: Json) -> int:
        """The prompt tokens of a chat-completions `body` here: rendered with the model's chat template (tools
        included) and tokenized, off the event loop after the same size check as a request; what the request's
        `usage.prompt_tokens` would say. Waits for a loading model like a request does."""
        engine = await self._ready()
        tokenizer = engine.engine.tokenizer
        if tokenizer is None:
            raise EngineError("This local model has no tokenizer; it cannot count tokens.")
        _check_prompt_size(body, True, _max_prompt_chars(tokenizer, engine.engine.max_model_len))
        [ids] = await asyncio.to_thread(_chat_prompt, tokenizer, body)
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
            assert engine is not None and engine.engine.tokenizer is not None
            raw = _token_bytes(engine.engine.tokenizer, token_id)
            cached = self._token_texts[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return cached

    def stats(self) -> dict[str, Any]:
        """Engine stats for /metrics and GET /admin/engine (`loaded: false` while the model is loading)."""
        if self._engine is None:
            failed = self._loading.done() and self._loading.exception() is not None
            return {"name": self.name, "loaded": False, "load_failed": failed, "state": self.health_state()}
        return {
            "name": self.name,
            "loaded": True,
            "healthy": self._engine.is_healthy,
            "state": self.health_state(),
            "num_restarts": self._engine.num_restarts,
            **self._engine.stats(),
        }

    # -- requests -----------------------------------------------------------------------------------------------

    async def _parse(self, engine: AsyncEngine, endpoint: Endpoint, body: Json) -> _Request:
        """Check cheap things on the event loop (fields, sampling parameters, the prompt's size in characters),
        then tokenize and validate in a worker thread: a big prompt must not stall every other request."""
        if endpoint not in _NATIVE:
            raise InvalidRequestError(f"The local engine does not serve /v1/{endpoint}.", code="unsupported_endpoint")
        for name in _UNSUPPORTED:
            if body.get(name) is not None:
                raise InvalidRequestError(f"`{name}` is not supported by the local engine; remove it.", param=name)
        is_chat = endpoint == "chat/completions"
        tokenizer = engine.engine.tokenizer
        if tokenizer is None:
            raise EngineError("This local model has no tokenizer; it cannot serve OpenAI requests.")
        try:
            params = _sampling_params(body, is_chat)
        except ValueError as exc:
            raise _invalid(exc, endpoint) from None
        _check_prompt_size(body, is_chat, _max_prompt_chars(tokenizer, engine.engine.max_model_len))
        return await asyncio.to_thread(self._tokenize, engine, is_chat, params, body)

    def _tokenize(self, engine: AsyncEngine, is_chat: bool, params: SamplingParams, body: Json) -> _Request:
        """(worker thread) The prompts' token ids, checked against the engine's limits."""
        tokenizer = engine.engine.tokenizer
        prompts = _chat_prompt(tokenizer, body) if is_chat else _text_prompts(tokenizer, body)
        params, clamped = self._fit_output(engine.engine.max_model_len, prompts, params)
        try:
            for ids in prompts:
                engine.validate(ids, params)
        except ValueError as exc:
            raise _invalid(exc, "chat/completions" if is_chat else "completions") from None
        prompt_texts = _prompt_texts(tokenizer, body)
        return _Request(is_chat, prompts, params, body, self.model_id, prompt_texts=prompt_texts, clamped=clamped)

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


class _Usage:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self._seen: set[str] = set()

    def add_prompt(self, deltas: list[RequestOutput]) -> None:
        for delta in deltas:
            if delta.request_id not in self._seen:
                self._seen.add(delta.request_id)
                self.prompt_tokens += delta.num_prompt_tokens
            if delta.finished:
                self.cached_tokens += delta.num_cached_tokens

    def as_dict(self) -> Json:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class _Request:
    """One parsed request and how to shape its responses."""

    def __init__(
        self,
        is_chat: bool,
        prompts: list[list[int]],
        params: SamplingParams,
        body: Json,
        model_id: str,
        *,
        prompt_texts: list[str] | None,
        clamped: tuple[int, int] | None = None,
    ) -> None:
        self.is_chat = is_chat
        self.prompts = prompts
        self.params = params
        self.model = str(body.get("model") or model_id)
        self.created = int(time.time())
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        self.echo = bool(body.get("echo")) and not is_chat
        self.prompt_texts = prompt_texts or []
        self.tool_names = tool_names(body) if is_chat else None  # None: leave the text alone
        self.clamped = clamped  # (requested, served) max_tokens when lowered to fit; reported once
        self._tool_streams: dict[int, ToolCallStream] = {}

    @property
    def object_prefix(self) -> str:
        return "chatcmpl" if self.is_chat else "cmpl"

    def choice(self, backend: LocalBackend, prompt_index: int, out: CompletionOutput) -> Json:
        index = prompt_index * self.params.n + out.index
        if self.is_chat:
            message: Json = {"role": "assistant", "content": out.text}
            finish_reason = out.finish_reason
            parsed = parse_tool_calls(out.text, self.tool_names) if self.tool_names else None
            if parsed is not None:
                message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
                finish_reason = "tool_calls"
            return {
                "index": index,
                "message": message,
                "logprobs": _chat_logprobs(backend, out.logprobs),
                "finish_reason": finish_reason,
            }
        text = out.text
        if self.echo and prompt_index < len(self.prompt_texts):
            text = self.prompt_texts[prompt_index] + text
        return {
            "index": index,
            "text": text,
            "logprobs": _text_logprobs(backend, out.logprobs),
            "finish_reason": out.finish_reason,
        }

    def delta_choice(self, backend: LocalBackend, index: int, out: CompletionOutput) -> Json:
        if self.is_chat:
            text, finish_reason = out.text, out.finish_reason
            delta: Json = {}
            if self.tool_names:
                tools = self._tool_streams.setdefault(index, ToolCallStream(self.tool_names))
                text = tools.feed(text)
                if finish_reason is not None:
                    tail, calls = tools.finish()
                    text += tail
                    if calls:
                        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                        finish_reason = "tool_calls"
            if text:
                delta = {"content": text, **delta}
            return {
                "index": index,
                "delta": delta,
                "logprobs": _chat_logprobs(backend, out.logprobs),
                "finish_reason": finish_reason,
            }
        return {
            "index": index,
            "text": out.text,
            "logprobs": _text_logprobs(backend, out.logprobs),
            "finish_reason": out.finish_reason,
        }

    def response(self, choices: list[Json], usage: Json, request_id: str) -> Json:
        response: Json = {
            "id": f"{self.object_prefix}-{request_id}",
            "object": "chat.completion" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }
        return self._with_clamp(response)

    def _with_clamp(self, data: Json) -> Json:
        """The first response or chunk says whether max_tokens was lowered (the gateway makes it a header)."""
        if self.clamped is not None:
            data[MAX_TOKENS_CLAMPED_KEY] = list(self.clamped)
            self.clamped = None
        return data

    def chunk(self, request_id: str, choices: list[Json], usage: Json | None = None) -> Json:
        chunk: Json = {
            "id": f"{self.object_prefix}-{request_id}",
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage
        return self._with_clamp(chunk)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


# -- request parsing ----------------------------------------------------------------------------------------------


def _invalid(exc: ValueError, endpoint: Endpoint) -> InvalidRequestError:
    """The engine's refusals (`local_engine.errors.InvalidParamError`, which names the field) as 400s."""
    prompt_param = "messages" if endpoint == "chat/completions" else "prompt"
    if isinstance(exc, PromptTooLongError):
        return InvalidRequestError(str(exc), code="context_length_exceeded", param=prompt_param)
    if isinstance(exc, InvalidParamError) and exc.code is not None:
        return InvalidRequestError(str(exc), code=exc.code, param=exc.param)
    param = (exc.param or prompt_param) if isinstance(exc, InvalidParamError) else None
    return InvalidRequestError(f"Invalid request for the local engine: {exc}.", param=param)


def _max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    limit: int = tokenizer.max_prompt_chars(max_model_len)
    return limit


def _check_prompt_size(body: Json, is_chat: bool, max_chars: int) -> None:
    """400 `context_length_exceeded` for a prompt with more characters than the context could ever hold (see
    `Tokenizer.max_prompt_chars`), before any tokenizing. For chat, every string in `messages` and `tools` counts;
    for completions, each prompt string on its own (each is a separate sequence)."""
    if is_chat:
        sizes = [_num_chars(body.get("messages")) + _num_chars(body.get("tools"))]
        param = "messages"
    else:
        prompt = body.get("prompt")
        sizes = [len(p) for p in (prompt if isinstance(prompt, list) else [prompt]) if isinstance(p, str)]
        param = "prompt"
    largest = max(sizes, default=0)
    if largest > max_chars:
        raise InvalidRequestError(
            f"The prompt has {largest} characters, more than this model's context can hold ({max_chars} characters "
            "at most, whatever the text). Shorten the prompt.",
            code="context_length_exceeded",
            param=param,
        )


def _num_chars(value: Any) -> int:
    """Total length of the strings (keys included) in a JSON value; iterative, so nesting depth costs nothing."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _message_text(message: Any) -> Json:
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidRequestError("Each message must be an object with a `role`.", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError(
                    "The local engine accepts only text content parts; remove image/audio parts.", param="messages"
                )
            parts.append(str(part.get("text", "")))
        return {**message, "content": "".join(parts)}
    return message


def _chat_prompt(tokenizer: Any, body: Json) -> list[list[int]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("`messages` must be a non-empty list.", param="messages")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError("`tools` must be a list of tool objects.", param="tools")
    rendered = [_message_text(m) for m in messages]
    if not tokenizer.renders_tool_calls:
        rendered = plain_tool_messages(rendered)
    try:
        ids = tokenizer.apply_chat_template(rendered, tools=tools)
    except InvalidParamError as exc:  # the template's own refusal (e.g. roles out of order)
        raise _invalid(exc, "chat/completions") from None
    except (RecursionError, TypeError, ValueError) as exc:
        # The chat template renders what the caller sent: a value nested hundreds deep or of a type the template
        # cannot print is the caller's 400, never the engine's 500.
        raise InvalidRequestError(
            f"The messages or tools cannot be rendered into the model's chat template ({type(exc).__name__}). "
            "Send text content, tool definitions with JSON-schema parameters, and no deeply nested values.",
            code="invalid_messages",
            param="messages",
        ) from None
    return [list(ids)]


def _text_prompts(tokenizer: Any, body: Json) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequestError(
        "`prompt` must be a string, a list of strings, a list of token ids, or a list of token id lists.",
        param="prompt",
    )


def _prompt_texts(tokenizer: Any, body: Json) -> list[str] | None:
    """Prompt texts for `echo` on /completions."""
    if not body.get("echo") or "messages" in body:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tokenizer.decode(ids) for ids in _text_prompts(tokenizer, body)]


def _sampling_params(body: Json, is_chat: bool) -> SamplingParams:
    """Strict types and ranges (`local_engine.sampling_params.from_openai`); InvalidParamError names the field."""
    from local_engine.sampling_params import from_openai

    return from_openai(body, is_chat=is_chat)


# -- responses ----------------------------------------------------------------------------------------------------


def _accumulate(deltas: list[RequestOutput], n: int) -> list[CompletionOutput]:
    from local_engine.output_processor import accumulate

    return accumulate(deltas, n)


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


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes a token stands for: byte-level BPE (GPT-2 alphabet), SentencePiece (`▁`, `<0xNN>`), or
    the decoded text as a fallback."""
    hf = getattr(tokenizer, "hf", None)
    piece = hf.convert_ids_to_tokens(token_id) if hf is not None else None
    if isinstance(piece, str) and piece:
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        if all(c in _BYTE_DECODER for c in piece) and hf is not None and getattr(hf, "is_fast", False):
            special = getattr(hf, "all_special_ids", ())
            if token_id not in special:
                return bytes(_BYTE_DECODER[c] for c in piece)
        if "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8")
    return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode("utf-8")


def _chat_logprobs(backend: LocalBackend, logprobs: list[TokenLogprob] | None) -> Json | None:
    if logprobs is None:
        return None
    content = []
    for entry in logprobs:
        token, raw = backend.token_text(entry.token_id)
        top = []
        for token_id, value in entry.top:
            alt, alt_raw = backend.token_text(token_id)
            top.append({"token": alt, "logprob": value, "bytes": alt_raw})
        content.append({"token": token, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def _text_logprobs(backend: LocalBackend, logprobs: list[TokenLogprob] | None) -> Json | None:
    if logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = 0
    for entry in logprobs:
        token = backend.token_text(entry.token_id)[0]
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        tops.append({backend.token_text(t)[0]: v for t, v in entry.top})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
