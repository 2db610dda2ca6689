"""Chat-completions clients on `type: anthropic` upstreams: the reverse of the gateway's Messages translation
(`gateway.translate.anthropic`). Pure functions over dicts, no I/O.

chat_to_messages(body)                       chat-completions request → Messages request
message_to_chat(message, model=...)          Messages response        → chat completion
events_to_chat_chunks(events, model=...)     Anthropic events         → chat chunks (and a final usage chunk)
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from backends.base import Json
from backends.wire import (
    DropLog,
    aclose_source,
    content_text,
    dumps,
    has_usage_count,
    new_id,
    parse_arguments,
    usage_count,
)
from gateway.errors import BackendError, InvalidRequestError, UpstreamRateLimitedError, upstream_malformed

__all__ = ["chat_to_messages", "error_from_event", "events_to_chat_chunks", "message_to_chat"]

# Anthropic requires max_tokens; chat clients often leave it out.
DEFAULT_MAX_TOKENS = 4096

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


# ---------------------------------------------------------------- request: chat → Messages


def chat_to_messages(body: Json, *, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Json:
    """A chat-completions request as the equivalent Messages request (`model` is kept for the route to rewrite)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequestError("'messages' must be a list of {role, content} objects.", param="messages")
    if (body.get("n") or 1) > 1:
        raise InvalidRequestError(
            "n > 1 is not supported for this model (its upstream returns one choice); send n separate requests.",
            code="unsupported_parameter",
            param="n",
        )
    drops = DropLog("the Anthropic upstream")
    system_texts, turns = _turns(messages, drops)
    request: Json = {
        "model": body.get("model"),
        "messages": turns,
        "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens,
    }
    if system_texts:
        request["system"] = "\n\n".join(system_texts)
    if body.get("temperature") is not None:
        request["temperature"] = min(float(body["temperature"]), 1.0)  # OpenAI's range is 0-2, Anthropic's 0-1
    for name in ("top_p", "top_k"):
        if body.get(name) is not None:
            request[name] = body[name]
    stop = body.get("stop")
    if stop:
        request["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("stream"):
        request["stream"] = True
    if isinstance(body.get("user"), str):
        request["metadata"] = {"user_id": body["user"]}
    _add_tools(request, body, drops)
    _add_response_format(request, body.get("response_format"), drops)
    for name in _NO_EQUIVALENT:
        if body.get(name) not in (None, False, 0):
            drops.add("field", name)
    drops.log()
    return request


# Chat fields a Messages request has nothing for: dropped, and named in the request's one warning line.
_NO_EQUIVALENT = ("logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "seed")


def _add_response_format(request: Json, response_format: Any, drops: DropLog) -> None:
    """A JSON schema becomes Anthropic's structured output (`output_config.format`); `json_object` (no schema)
    has no equivalent and is logged as dropped; `text` is the default."""
    if not isinstance(response_format, dict) or response_format.get("type") in (None, "text"):
        return
    json_schema = response_format.get("json_schema")
    if response_format.get("type") == "json_schema" and isinstance(json_schema, dict):
        schema = json_schema.get("schema")
        request["output_config"] = {
            "format": {"type": "json_schema", "schema": schema if isinstance(schema, dict) else {}}
        }
    else:
        drops.add("response_format of type", response_format.get("type"))


def _turns(messages: list[Json], drops: DropLog) -> tuple[list[str], list[Json]]:
    """(system texts, alternating user/assistant turns) from chat messages."""
    system_texts: list[str] = []
    turns: list[Json] = []
    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            # Anthropic has one top-level system prompt; instructions given mid-conversation join it in order.
            system_texts.append(content_text(message.get("content"), separator="\n\n"))
        elif role == "user":
            _append_turn(turns, "user", _user_blocks(message.get("content"), drops))
        elif role == "assistant":
            _append_turn(turns, "assistant", _assistant_blocks(message))
        elif role == "tool":
            result = {
                "type": "tool_result",
                "tool_use_id": message.get("tool_call_id", ""),
                "content": content_text(message.get("content")),
            }
            _append_turn(turns, "user", [result])
        else:
            raise InvalidRequestError(f"Unsupported message role {role!r} for this model.", param="messages")
    return system_texts, turns


def _append_turn(turns: list[Json], role: str, blocks: list[Json]) -> None:
    """Merge consecutive same-role messages (tool results, then the user's next words): Anthropic turns alternate.
    Empty messages are left out; Anthropic rejects empty turns."""
    if not blocks:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


def _user_blocks(content: Any, drops: DropLog) -> list[Json]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[Json] = []
    for part in content or []:
        kind = part.get("type")
        if kind == "text":
            if part.get("text"):
                blocks.append({"type": "text", "text": part.get("text", "")})
        elif kind == "image_url":
            blocks.append(_image_block(part.get("image_url") or {}))
        else:
            drops.add("content part", kind)
    return blocks


def _image_block(image_url: Json) -> Json:
    url = str(image_url.get("url", ""))
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        media_type = header.removeprefix("data:").split(";")[0] or "image/png"
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _assistant_blocks(message: Json) -> list[Json]:
    blocks: list[Json] = []
    text = content_text(message.get("content")) or message.get("refusal") or ""
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu_"),
                "name": function.get("name", ""),
                "input": parse_arguments(function.get("arguments")),
            }
        )
    return blocks


def _add_tools(request: Json, body: Json, drops: DropLog) -> None:
    tools: list[Json] = []
    for tool in body.get("tools") or []:
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            drops.add("tool of type", tool.get("type"))
            continue
        converted: Json = {
            "name": function.get("name", ""),
            "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
        }
        if function.get("description"):
            converted["description"] = function["description"]
        tools.append(converted)
    if not tools:
        return
    request["tools"] = tools
    choice = body.get("tool_choice")
    tool_choice: Json | None = None
    if choice == "auto":
        tool_choice = {"type": "auto"}
    elif choice == "required":
        tool_choice = {"type": "any"}
    elif choice == "none":
        tool_choice = {"type": "none"}
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        tool_choice = {"type": "tool", "name": choice["function"].get("name", "")}
    if body.get("parallel_tool_calls") is False:
        tool_choice = tool_choice or {"type": "auto"}
        if tool_choice["type"] != "none":
            tool_choice["disable_parallel_tool_use"] = True
    if tool_choice is not None:
        request["tool_choice"] = tool_choice


# ---------------------------------------------------------------- response: Messages → chat


def message_to_chat(message: Json, *, model: str, created: int | None = None) -> Json:
    """A Messages response as a chat completion (`model` is the name the client asked for)."""
    message = _object(message, "the body")
    texts: list[str] = []
    tool_calls: list[Json] = []
    content = message.get("content") or []
    if not isinstance(content, list):
        raise upstream_malformed(f"`content` is a {type(content).__name__}, not a list of blocks")
    for position, block in enumerate(content):
        block = _object(block, f"content[{position}]")
        if block.get("type") == "text":
            texts.append(_string(block.get("text", ""), f"content[{position}].text"))
        elif block.get("type") == "tool_use":
            name = _string(block.get("name", ""), f"content[{position}].name")
            function = {"name": name, "arguments": dumps(block.get("input") or {})}
            call_id = _string(block.get("id") or new_id("call_"), f"content[{position}].id")
            tool_calls.append({"id": call_id, "type": "function", "function": function})
    chat_message: Json = {"role": "assistant", "content": "".join(texts) if texts or not tool_calls else None}
    if tool_calls:
        chat_message["tool_calls"] = tool_calls
    choice = {
        "index": 0,
        "message": chat_message,
        "finish_reason": _FINISH_REASONS.get(_stop_reason(message.get("stop_reason")), "stop"),
        "logprobs": None,
    }
    return {
        "id": message["id"] if isinstance(message.get("id"), str) and message["id"] else new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": chat_usage(message.get("usage")),
    }


def _stop_reason(value: Any) -> str:
    return value if isinstance(value, str) and value else "end_turn"


def _object(value: Any, where: str) -> Json:
    if not isinstance(value, dict):
        raise upstream_malformed(f"`{where}` is a {type(value).__name__}, not an object")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise upstream_malformed(f"`{where}` is a {type(value).__name__}, not a string")
    return value


def _index(event: Json) -> int:
    index = event.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise upstream_malformed(f"a {event.get('type')} event's `index` is not an integer")
    return index


_ANTHROPIC_COUNTS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def chat_usage(usage: Any) -> Json | None:
    """Chat usage counts cache reads and writes inside `prompt_tokens`; Anthropic counts them apart. None when the
    upstream gave no count as a number: the gateway then charges its estimate, never a made-up 0."""
    usage = usage if isinstance(usage, dict) else {}
    if not has_usage_count(usage, _ANTHROPIC_COUNTS):
        return None
    cache_read = usage_count(usage.get("cache_read_input_tokens"))
    cache_write = usage_count(usage.get("cache_creation_input_tokens"))
    prompt_tokens = usage_count(usage.get("input_tokens")) + cache_read + cache_write
    completion_tokens = usage_count(usage.get("output_tokens"))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cache_read},
    }


# ---------------------------------------------------------------- stream: Anthropic events → chat chunks


def error_from_event(data: Json) -> BackendError:
    """An upstream `error` event as the gateway error it stands for (the message is the upstream's own)."""
    error = data["error"] if isinstance(data.get("error"), dict) else {}
    kind = str(error.get("type", "api_error"))
    message = f"The Anthropic upstream reported {kind}: {error.get('message', 'no message')}"
    if kind == "rate_limit_error":
        return UpstreamRateLimitedError(message)
    if kind == "overloaded_error":
        return BackendError(message, code="upstream_overloaded", status_code=503)
    return BackendError(message, code="upstream_error")


async def events_to_chat_chunks(
    events: AsyncIterator[Json], *, model: str, created: int | None = None, include_usage: bool = True
) -> AsyncGenerator[Json, None]:
    """Anthropic stream events as chat chunks: a role chunk, content and tool-call deltas (tool calls numbered in
    order), a chunk with `finish_reason`, then (with `include_usage`) a `choices: []` chunk with usage.

    An `error` event raises its gateway error; a stream that ends before `message_stop` raises `BackendError`.
    """
    builder = _ChunkBuilder(model=model, created=created if created is not None else int(time.time()))
    try:
        async for event in events:
            for chunk in builder.feed(event, include_usage=include_usage):
                yield chunk
            if builder.is_done:
                return
    finally:
        await aclose_source(events)
    raise BackendError("The Anthropic upstream ended its stream before message_stop. Retry the request.")


class _ChunkBuilder:
    def __init__(self, *, model: str, created: int) -> None:
        self.model = model
        self.created = created
        self.chunk_id = new_id("chatcmpl-")
        self.usage: Json = {}
        self.stop_reason: str | None = None
        self.tool_indexes: dict[int, int] = {}  # Anthropic block index → chat tool-call index
        self.is_done = False

    def chunk(self, delta: Json, finish_reason: str | None = None) -> Json:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {
            "id": self.chunk_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def feed(self, event: Json, *, include_usage: bool) -> list[Json]:
        kind = _object(event, "a stream event").get("type")
        if kind == "message_start":
            message = _object(event.get("message") or {}, "message_start.message")
            chunk_id = message.get("id")
            self.chunk_id = chunk_id if isinstance(chunk_id, str) and chunk_id else self.chunk_id
            self.usage.update(_object(message.get("usage") or {}, "message_start.message.usage"))
            return [self.chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = _object(event.get("content_block") or {}, "content_block_start.content_block")
            return self._block_start(_index(event), block)
        if kind == "content_block_delta":
            return self._block_delta(_index(event), _object(event.get("delta") or {}, "content_block_delta.delta"))
        if kind == "message_delta":
            delta = _object(event.get("delta") or {}, "message_delta.delta")
            stop_reason = delta.get("stop_reason")
            self.stop_reason = stop_reason if isinstance(stop_reason, str) and stop_reason else self.stop_reason
            usage = _object(event.get("usage") or {}, "message_delta.usage")
            self.usage.update({k: v for k, v in usage.items() if v is not None})
            return []
        if kind == "message_stop":
            self.is_done = True
            chunks = [self.chunk({}, _FINISH_REASONS.get(self.stop_reason or "end_turn", "stop"))]
            if include_usage:
                final = self.chunk({})
                final["choices"] = []
                final["usage"] = chat_usage(self.usage)
                chunks.append(final)
            return chunks
        if kind == "error":
            raise error_from_event(event)
        return []  # ping, and event types added later, carry nothing for chat clients

    def _block_start(self, index: int, block: Json) -> list[Json]:
        if block.get("type") == "tool_use":
            tool_index = self.tool_indexes[index] = len(self.tool_indexes)
            function = {"name": _string(block.get("name", ""), "content_block.name"), "arguments": ""}
            call_id = _string(block.get("id") or new_id("call_"), "content_block.id")
            call = {"index": tool_index, "id": call_id, "type": "function"}
            return [self.chunk({"tool_calls": [{**call, "function": function}]})]
        if block.get("type") == "text" and block.get("text"):
            return [self.chunk({"content": _string(block["text"], "content_block.text")})]
        return []

    def _block_delta(self, index: int, delta: Json) -> list[Json]:
        if delta.get("type") == "text_delta":
            return [self.chunk({"content": _string(delta.get("text", ""), "text_delta.text")})]
        if delta.get("type") == "input_json_delta" and index in self.tool_indexes:
            arguments = _string(delta.get("partial_json", ""), "input_json_delta.partial_json")
            call = {"index": self.tool_indexes[index], "function": {"arguments": arguments}}
            return [self.chunk({"tool_calls": [call]})]
        return []  # thinking and signature deltas have no chat equivalent
