"""OpenAI requests and responses for the local engine, with no engine in sight.

Requests: an OpenAI chat or text-completions body becomes sampling parameters (`check_request`, cheap, on the event
loop) and prompt token ids (`prompt_ids`, in a worker thread). Responses: the engine's outputs become OpenAI
responses and stream chunks (`ParsedRequest`, `Usage`; when the engine reached each stage: `StageTimes`), logprobs
included. Engine errors become gateway errors in one place, `engine_errors`. Everything here takes a tokenizer and
plain values, so it is tested without a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from backends.base import MAX_TOKENS_CLAMPED_KEY, Endpoint, EngineStageTimes, Json
from backends.tool_calls import ToolCallStream, parse_tool_calls, plain_tool_messages, tool_names
from gateway.errors import EngineError, InvalidRequestError
from local_engine.errors import DuplicateRequestError, InvalidParamError, LocalEngineError, PromptTooLongError
from local_engine.output_processor import CompletionOutput, EngineStages, RequestOutput, TokenLogprob
from local_engine.sampling_params import SamplingParams, from_openai

__all__ = [
    "NATIVE_ENDPOINTS",
    "ParsedRequest",
    "StageTimes",
    "TokenText",
    "Usage",
    "check_prompt_size",
    "check_request",
    "engine_errors",
    "invalid_request",
    "place_system_messages",
    "prompt_ids",
    "prompt_texts",
]

NATIVE_ENDPOINTS: frozenset[str] = frozenset({"chat/completions", "completions"})
# OpenAI fields this engine cannot honour: refused with a clear 400 rather than silently ignored.
UNSUPPORTED_FIELDS = ("suffix", "functions", "audio", "prediction")

# (text, exact UTF-8 bytes) of one token id, for logprobs.
TokenText = Callable[[int], tuple[str, list[int]]]


# -- engine errors ------------------------------------------------------------------------------------------------


@contextmanager
def engine_errors(endpoint: Endpoint) -> Iterator[None]:
    """The engine's errors (`local_engine.errors`) as the gateway's, for a request to `endpoint`: a refusal
    (`InvalidParamError`, `DuplicateRequestError`) is a 400 naming the field, any other engine error (a request
    that failed, a dead engine) a 500 `engine_error`. Anything else passes through: gateway errors as they are,
    and a builtin error is a bug, not the engine's answer."""
    try:
        yield
    except (InvalidParamError, DuplicateRequestError) as exc:
        raise invalid_request(exc, endpoint) from None
    except LocalEngineError as exc:
        raise EngineError(f"The local engine failed: {exc}") from None


def invalid_request(exc: InvalidParamError | DuplicateRequestError, endpoint: Endpoint) -> InvalidRequestError:
    """The engine's refusals as 400s: `InvalidParamError` names the field (the prompt's when it names none)."""
    prompt_param = "messages" if endpoint == "chat/completions" else "prompt"
    if isinstance(exc, PromptTooLongError):
        return InvalidRequestError(str(exc), code="context_length_exceeded", param=prompt_param)
    if isinstance(exc, InvalidParamError) and exc.code is not None:
        return InvalidRequestError(str(exc), code=exc.code, param=exc.param)
    param = (exc.param or prompt_param) if isinstance(exc, InvalidParamError) else None
    return InvalidRequestError(f"Invalid request for the local engine: {exc}.", param=param)


# -- requests -----------------------------------------------------------------------------------------------------


def check_request(
    endpoint: Endpoint, body: Json, max_prompt_chars: int, *, sampling_defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """The cheap checks, before any tokenizing: the endpoint, fields the engine cannot honour, the sampling
    parameters (strict types and ranges, `local_engine.sampling_params.from_openai`; the fields the body leaves out
    from `sampling_defaults`) and the prompt's size."""
    if endpoint not in NATIVE_ENDPOINTS:
        raise InvalidRequestError(f"The local engine does not serve /v1/{endpoint}.", code="unsupported_endpoint")
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequestError(f"`{name}` is not supported by the local engine; remove it.", param=name)
    is_chat = endpoint == "chat/completions"
    with engine_errors(endpoint):
        params = from_openai(body, is_chat=is_chat, defaults=sampling_defaults)
    check_prompt_size(body, is_chat, max_prompt_chars)
    return params


def check_prompt_size(body: Json, is_chat: bool, max_chars: int) -> None:
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


def prompt_ids(tokenizer: Any, is_chat: bool, body: Json) -> list[list[int]]:
    """The token ids of each prompt: one for chat (rendered with the model's chat template), one per prompt for
    completions. Refusals are `InvalidRequestError`s, or the tokenizer's `InvalidParamError`s for `engine_errors`
    (a chat template that refuses the messages or cannot render them)."""
    return _chat_prompt(tokenizer, body) if is_chat else _text_prompts(tokenizer, body)


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


def place_system_messages(messages: list[Json]) -> list[Json]:
    """Where the chat template gets system text: the roles the supported templates are trained on.

    - `developer` (OpenAI's name for system instructions since o1) is `system`: no Llama, Mistral or Qwen template
      knows it (Qwen3's drops it unrendered, SmolLM2's prints an unknown role).
    - A system message right after a user turn is placed before that turn (consecutive user messages are one
      turn). Claude Code sends its agent list that way, after the first user message; rendered in place, the prompt
      ends with 6 KB of system text instead of the user's question, and a small model answers the list instead
      (docs/coding-agents.md has the measurement).
    - Adjacent system messages with text contents become one, joined by a blank line: templates that take a single
      leading system message (Mistral's) render them instead of refusing.

    The result depends only on the messages, and a system message is never moved before an earlier assistant turn,
    so a conversation resent with more turns renders the previous prompt again, token for token."""
    placed: list[Json] = []
    turn_start: int | None = None  # where the user turn that `placed` ends with starts
    for message in messages:
        role = message.get("role")
        if role == "developer":
            message = {**message, "role": "system"}
            role = "system"
        if role == "system" and turn_start is not None:
            placed.insert(turn_start, message)
            turn_start += 1
            continue
        if role == "user":
            turn_start = len(placed) if turn_start is None else turn_start
        else:
            turn_start = None
        placed.append(message)
    joined: list[Json] = []
    for message in placed:
        previous = joined[-1] if joined else None
        if previous is not None and _is_plain_system(previous) and _is_plain_system(message):
            text = "\n\n".join(part for part in (previous["content"], message["content"]) if part)
            joined[-1] = {"role": "system", "content": text}
        else:
            joined.append(message)
    return joined


def _is_plain_system(message: Json) -> bool:
    return message.keys() == {"role", "content"} and message["role"] == "system" and isinstance(message["content"], str)


def _chat_prompt(tokenizer: Any, body: Json) -> list[list[int]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("`messages` must be a non-empty list.", param="messages")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError("`tools` must be a list of tool objects.", param="tools")
    rendered = place_system_messages([_message_text(m) for m in messages])
    if not tokenizer.renders_tool_calls:
        rendered = plain_tool_messages(rendered)
    return [list(tokenizer.apply_chat_template(rendered, tools=tools))]


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


def prompt_texts(tokenizer: Any, body: Json) -> list[str] | None:
    """Prompt texts for `echo` on /completions (None without echo)."""
    if not body.get("echo") or "messages" in body:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tokenizer.decode(ids) for ids in _text_prompts(tokenizer, body)]


# -- responses ----------------------------------------------------------------------------------------------------


class Usage:
    """Token counts over a request's engine outputs (each prompt's tokens counted once)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.spec_proposed = 0
        self.spec_accepted = 0
        self._cached: dict[str, int] = {}  # engine request -> its prompt's cached tokens, as its latest delta says

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    @property
    def has_counts(self) -> bool:
        """Whether the engine reported anything yet (its first delta names the prompt's size)."""
        return bool(self._cached)

    def add_prompt(self, deltas: list[RequestOutput]) -> None:
        """Each delta's prompt: counted once per engine request, its cached tokens as its latest delta says (so a
        stream cut before its end counts them too)."""
        for delta in deltas:
            if delta.request_id not in self._cached:
                self.prompt_tokens += delta.num_prompt_tokens
            self._cached[delta.request_id] = delta.num_cached_tokens
            if delta.finished:
                self.spec_proposed += delta.num_spec_proposed
                self.spec_accepted += delta.num_spec_accepted

    def as_dict(self) -> Json:
        usage: Json = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.spec_proposed:  # an extension field, only where speculative decoding ran
            usage["speculative"] = {"proposed": self.spec_proposed, "accepted": self.spec_accepted}
        return usage


class StageTimes:
    """When a call's engine requests (one per prompt) reached each stage in the engine, as their outputs say
    (`EngineStages`, on a request's first and final outputs), as one: the first arrival, admission and first token of
    any, and the last end of all (0 until every one ended: a stream cut short never finished)."""

    def __init__(self, num_requests: int = 1) -> None:
        self.num_requests = num_requests
        self._by_request: dict[str, EngineStages] = {}
        self._latest: EngineStages | None = None

    def add(self, delta: RequestOutput) -> None:
        if delta.stages is not None:
            self._by_request[delta.request_id] = self._latest = delta.stages

    def combined(self) -> EngineStageTimes | None:
        """`(queued, scheduled, first token, finished)` ns; None before the engine reported any. (Read after each
        chunk of a stream the engine host serves: one request's costs an attribute read.)"""
        if self.num_requests == 1:
            return self._latest
        seen = list(self._by_request.values())
        if not seen:
            return None
        is_finished = len(seen) == self.num_requests and all(stages.finished_ns for stages in seen)
        return (
            _earliest(stages.queued_ns for stages in seen),
            _earliest(stages.scheduled_ns for stages in seen),
            _earliest(stages.first_token_ns for stages in seen),
            max(stages.finished_ns for stages in seen) if is_finished else 0,
        )


def _earliest(times: Iterator[int]) -> int:
    return min((t for t in times if t), default=0)


class ParsedRequest:
    """One parsed request (its prompts' ids and sampling parameters) and how to shape its responses."""

    def __init__(
        self,
        is_chat: bool,
        prompts: list[list[int]],
        params: SamplingParams,
        body: Json,
        model_id: str,
        *,
        token_text: TokenText,
        prompt_texts: list[str] | None = None,
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
        self._token_text = token_text
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._text_offsets: dict[int, int] = {}  # per choice: characters of its text so far (echoed prompt included)

    @property
    def object_prefix(self) -> str:
        return "chatcmpl" if self.is_chat else "cmpl"

    def choice(self, prompt_index: int, out: CompletionOutput) -> Json:
        """A non-streaming choice: the whole output of sample `out.index` of prompt `prompt_index`."""
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
                "logprobs": self._chat_logprobs(out.logprobs),
                "finish_reason": finish_reason,
            }
        return {
            "index": index,
            "text": self._echoed(index) + out.text,
            "logprobs": self._text_logprobs(index, out.logprobs),
            "finish_reason": out.finish_reason,
        }

    def role_choice(self, index: int) -> Json:
        """A chat stream's first choice for `index`: the assistant role, before any text."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta_choice(self, index: int, out: CompletionOutput) -> Json:
        """A streaming choice for one engine delta (text held back while it may be a tool call)."""
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
                "logprobs": self._chat_logprobs(out.logprobs),
                "finish_reason": finish_reason,
            }
        return {
            "index": index,
            "text": self._echoed(index) + out.text,
            "logprobs": self._text_logprobs(index, out.logprobs),
            "finish_reason": out.finish_reason,
        }

    def _echoed(self, index: int) -> str:
        """With `echo`, the prompt's text before a choice's first text (once per choice, streamed or not); the
        choice's text offsets then count from its end."""
        if not self.echo or index in self._text_offsets:
            return ""
        prompt_index = index // self.params.n
        prompt = self.prompt_texts[prompt_index] if prompt_index < len(self.prompt_texts) else ""
        self._text_offsets[index] = len(prompt)
        return prompt

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

    def _with_clamp(self, data: Json) -> Json:
        """The first response or chunk says whether max_tokens was lowered (the gateway makes it a header)."""
        if self.clamped is not None:
            data[MAX_TOKENS_CLAMPED_KEY] = list(self.clamped)
            self.clamped = None
        return data

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> Json | None:
        if logprobs is None:
            return None
        content = []
        for entry in logprobs:
            token, raw = self._token_text(entry.token_id)
            top = []
            for token_id, value in entry.top:
                alt, alt_raw = self._token_text(token_id)
                top.append({"token": alt, "logprob": value, "bytes": alt_raw})
            content.append({"token": token, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def _text_logprobs(self, index: int, logprobs: list[TokenLogprob] | None) -> Json | None:
        """Completions logprobs of choice `index`'s new tokens; `text_offset` counts into the whole text the
        client receives for the choice (an echoed prompt, earlier chunks of a stream)."""
        if logprobs is None:
            return None
        tokens: list[str] = []
        token_logprobs: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        offset = self._text_offsets.get(index, 0)
        for entry in logprobs:
            token = self._token_text(entry.token_id)[0]
            tokens.append(token)
            token_logprobs.append(entry.logprob)
            tops.append({self._token_text(t)[0]: v for t, v in entry.top})
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
