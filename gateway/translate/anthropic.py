"""Anthropic Messages clients on chat-completions backends (OpenAI-compatible upstreams, the local engine).

    messages_to_chat(body)                            Messages request  → chat-completions request
    chat_to_message(response, model=...)              chat completion   → Messages response
    chat_chunks_to_events(chunks, model=...)          chat chunks       → Anthropic SSE events `(name, data)`
    guard_events(events)                              native Anthropic events, closed properly if the source breaks

Pure functions over dicts. What the target cannot express (server tools, documents it cannot read, `thinking`,
`cache_control`) is dropped, with a logged warning where the model's behaviour may change. A translated request is
the same on every turn that resends the same conversation (no fresh ids; Claude Code's per-request billing line in
`system` is left out), so the prompt a backend renders from it keeps its prefix and a prefix cache keeps matching.
The opposite direction (chat clients on `type: anthropic` upstreams) is in `backends.anthropic_translate`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway.errors import GatewayError, InvalidRequestError, anthropic_error_type
from gateway.translate.common import (
    DropLog,
    Event,
    Json,
    TextHoldingBuilder,
    aclose_source,
    content_text,
    dumps,
    dumps_request,
    logger,
    new_id,
    parse_arguments,
    position_id,
    translate_stream,
    usage_counts,
    wrong_type,
)

__all__ = ["chat_chunks_to_events", "chat_to_message", "error_event", "guard_events", "messages_to_chat"]


# ---------------------------------------------------------------- request: Messages → chat


def messages_to_chat(body: Json) -> Json:
    """A Messages request as the equivalent chat-completions request (`model` is kept for the route to rewrite).

    Fields the translation reads must have their documented types (400 `invalid_request` naming the field
    otherwise); what the target cannot carry is dropped and summed up in one warning line."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequestError(
            "'messages' must be a list of {role, content} objects.", code="invalid_request", param="messages"
        )
    dropped = DropLog("chat completions")
    chat_messages: list[Json] = []
    system = _system_text(body.get("system"))
    if system:
        chat_messages.append({"role": "system", "content": system})
    for position, message in enumerate(messages):
        chat_messages.extend(_chat_messages(message, f"messages[{position}]", dropped))

    chat: Json = {"model": body.get("model"), "messages": chat_messages}
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p", "top_k", "seed"):  # (checked by gateway.validate.check_messages)
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    response_format = _response_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    _add_tools(chat, body, dropped)
    dropped.log()
    return chat


# Claude Code (2.1.36 and later) opens `system` with a block like `x-anthropic-billing-header: cc_version=2.1.42.834;
# cc_entrypoint=cli; cch=65abc;` whose `cch` changes on every request: metadata for Anthropic's API, not prompt text.
# Kept, it would make every request's prompt differ from its first token on, so no prefix cache could ever match.
_BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


def _system_text(system: Any) -> str:
    """The top-level `system` (a string or text blocks, whose `cache_control` is meaningless downstream), without
    Claude Code's billing line."""
    if system is None or isinstance(system, str):
        return system or ""
    if isinstance(system, list):
        system = [block for block in system if not _is_billing_header(block)]
    return _blocks_text(system, "system", separator="\n\n")


def _is_billing_header(block: Any) -> bool:
    text = block.get("text") if isinstance(block, dict) else None
    return isinstance(text, str) and text.startswith(_BILLING_HEADER_PREFIX)


def _blocks_text(content: Any, param: str, *, separator: str = "\n") -> str:
    """The text of a string or a list of blocks, each an object whose `text` (when present) is a string."""
    if content is None or isinstance(content, str):
        return content or ""
    _require_blocks(content, param)
    for index, block in enumerate(content):
        if block.get("text") is not None and not isinstance(block["text"], str):
            raise wrong_type(f"{param}[{index}].text", "a string", block["text"])
    return content_text(content, separator=separator)


def _require_blocks(content: Any, param: str) -> list[Json]:
    if not isinstance(content, list):
        raise wrong_type(param, "a string or a list of content blocks", content)
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            raise wrong_type(f"{param}[{index}]", "a content block object", block)
    return content


def _string(block: Json, name: str, param: str, default: str = "") -> str:
    """`block[name]`, which must be a string when present."""
    value = block.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise wrong_type(f"{param}.{name}", "a string", value)
    return value


def _chat_messages(message: Any, param: str, dropped: DropLog) -> list[Json]:
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{param} must be an object.", code="invalid_request", param=param)
    role, content = message.get("role"), message.get("content")
    if role == "user":
        return _user_messages(content, f"{param}.content", dropped)
    if role == "assistant":
        return [_assistant_message(content, f"{param}.content", dropped)]
    if role == "system":
        # Claude Code sends these inside `messages`; chat completions accepts them in place.
        return [{"role": "system", "content": _blocks_text(content, f"{param}.content", separator="\n\n")}]
    raise InvalidRequestError(
        f"{param}.role must be 'user', 'assistant' or 'system', not {_short(role)}.",
        code="invalid_request",
        param=f"{param}.role",
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _user_messages(content: Any, param: str, dropped: DropLog) -> list[Json]:
    """One user turn: its tool results become `tool` messages (which must directly follow the assistant's
    tool calls), the rest one user message after them."""
    if content is None or isinstance(content, str):
        return [{"role": "user", "content": content or ""}]
    tool_messages: list[Json] = []
    parts: list[Json] = []
    for index, block in enumerate(_require_blocks(content, param)):
        where = f"{param}[{index}]"
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", where)})
        elif kind == "image":
            parts.extend(_image_parts(block, where, dropped))
        elif kind == "tool_result":
            tool_message, images = _tool_result(block, where, dropped)
            tool_messages.append(tool_message)
            parts.extend(images)
        elif kind == "document":
            parts.extend(_document_parts(block, where, dropped))
        else:
            dropped.add("content block", kind)
    if not parts and tool_messages:
        return tool_messages
    return [*tool_messages, {"role": "user", "content": _simplify(parts)}]


def _simplify(parts: list[Json]) -> str | list[Json]:
    """A lone text part as a plain string: the form every chat-completions server accepts."""
    if not parts:
        return ""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _source(block: Json, param: str) -> Json:
    source = block.get("source")
    if source is None:
        return {}
    if not isinstance(source, dict):
        raise wrong_type(f"{param}.source", "an object", source)
    return source


def _image_parts(block: Json, param: str, dropped: DropLog) -> list[Json]:
    source = _source(block, param)
    where = f"{param}.source"
    if source.get("type") == "base64":
        media_type = _string(source, "media_type", where, "image/png")
        url = f"data:{media_type};base64,{_string(source, 'data', where)}"
    elif source.get("type") == "url":
        url = _string(source, "url", where)
    else:
        dropped.add("image with source type", source.get("type"))
        return []
    return [{"type": "image_url", "image_url": {"url": url}}]


def _document_parts(block: Json, param: str, dropped: DropLog) -> list[Json]:
    source = _source(block, param)
    if source.get("type") == "text":
        return [{"type": "text", "text": _string(source, "data", f"{param}.source")}]
    if source.get("type") == "content":
        return [{"type": "text", "text": _blocks_text(source.get("content"), f"{param}.source.content")}]
    dropped.add("document with source type", source.get("type"))
    return []


def _tool_result(block: Json, param: str, dropped: DropLog) -> tuple[Json, list[Json]]:
    """A `tool_result` block as a `tool` message; images in it (tool messages carry text only) come back
    separately, to be sent in the user message that follows."""
    content = block.get("content")
    images: list[Json] = []
    text = _blocks_text(content, f"{param}.content")
    if isinstance(content, list):
        for index, item in enumerate(content):
            if item.get("type") == "image":
                images.extend(_image_parts(item, f"{param}.content[{index}]", dropped))
    if block.get("is_error"):
        text = f"Error: {text}"
    tool_call_id = _string(block, "tool_use_id", param)
    return {"role": "tool", "tool_call_id": tool_call_id, "content": text}, images


def _assistant_message(content: Any, param: str, dropped: DropLog) -> Json:
    if content is None or isinstance(content, str):
        return {"role": "assistant", "content": content or ""}
    texts: list[str] = []
    tool_calls: list[Json] = []
    for index, block in enumerate(_require_blocks(content, param)):
        where = f"{param}[{index}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "tool_use":
            arguments = dumps_request(block.get("input") or {}, param=f"{where}.input")
            function = {"name": _string(block, "name", where), "arguments": arguments}
            call_id = _string(block, "id", where) or position_id("toolu_", where)
            tool_calls.append({"id": call_id, "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the target has no thinking; earlier turns' thoughts are not part of the conversation
        else:
            dropped.add("assistant block", kind)
    message: Json = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _add_tools(chat: Json, body: Json, dropped: DropLog) -> None:
    raw_tools = body.get("tools")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise wrong_type("tools", "a list of tool objects", raw_tools)
    tools = [
        {"type": "function", "function": function}
        for index, tool in enumerate(raw_tools or ())
        if (function := _function(tool, f"tools[{index}]", dropped)) is not None
    ]
    if not tools:
        return
    chat["tools"] = tools
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _function(tool: Any, param: str, dropped: DropLog) -> Json | None:
    """A custom tool as a chat `function`; None for tools only Anthropic can run."""
    if not isinstance(tool, dict):
        raise wrong_type(param, "a tool object", tool)
    if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
        # Anthropic-defined tools (web_search_*, bash_*, text_editor_*, computer_*) run on Anthropic's side.
        dropped.add("tool of type", tool.get("type"), name=tool.get("name"))
        return None
    name = _string(tool, "name", param)
    if not name:
        raise InvalidRequestError(
            f"`{param}.name` must be a non-empty string.", code="invalid_request", param=f"{param}.name"
        )
    schema = tool["input_schema"]
    if schema is not None and not isinstance(schema, dict):
        raise wrong_type(f"{param}.input_schema", "a JSON Schema object", schema)
    function: Json = {"name": name, "parameters": schema or {"type": "object"}}
    description = _string(tool, "description", param)
    if description:
        function["description"] = description
    return function


def _response_format(output_config: Any) -> Json | None:
    """Structured output (`output_config.format`) as chat's `response_format`; `effort` has no equivalent."""
    if not isinstance(output_config, dict):
        return None
    output_format = output_config.get("format")
    if isinstance(output_format, dict) and output_format.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format.get("schema", {})}}
    return None


# ---------------------------------------------------------------- response: chat → Messages


def chat_to_message(response: Json, *, model: str, stop_sequences: Sequence[str] | None = None) -> Json:
    """A chat completion as a Messages response. `model` is the public id of the model that served; `stop_sequences`
    (the request's) tells a stop-sequence stop from a natural one when the upstream reports the match."""
    choices = response.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[Json] = []
    text = content_text(message.get("content")) or message.get("refusal") or ""
    if text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu_"),
                "name": function.get("name", ""),
                "input": parse_arguments(function.get("arguments")),
            }
        )
    has_tool_use = any(block["type"] == "tool_use" for block in content)
    stop_reason, stop_sequence = stop_reason_of(
        choice.get("finish_reason"), choice.get("stop_reason"), has_tool_use=has_tool_use, stop_sequences=stop_sequences
    )
    return {
        "id": message_id_of(response.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": anthropic_usage(response.get("usage")),
    }


def message_id_of(chat_id: Any) -> str:
    if isinstance(chat_id, str) and chat_id:
        return "msg_" + chat_id.removeprefix("chatcmpl-")
    return new_id("msg_")


def stop_reason_of(
    finish_reason: Any, matched_stop: Any, *, has_tool_use: bool, stop_sequences: Sequence[str] | None
) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) from a chat `finish_reason` (and vLLM-style `stop_reason`, the
    matched stop string, when the upstream sends it)."""
    if finish_reason in ("tool_calls", "function_call") or (has_tool_use and finish_reason in (None, "stop")):
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    if isinstance(matched_stop, str) and stop_sequences and matched_stop in stop_sequences:
        return "stop_sequence", matched_stop
    return "end_turn", None


def anthropic_usage(usage: Any) -> Json:
    """Anthropic counts cache reads apart from `input_tokens`; chat counts them inside `prompt_tokens`."""
    prompt_tokens, completion_tokens, cached_tokens = usage_counts(usage)
    result: Json = {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens}
    if cached_tokens:
        result["cache_read_input_tokens"] = cached_tokens
    return result


# ---------------------------------------------------------------- stream: chat chunks → Anthropic events


def chat_chunks_to_events(
    chunks: AsyncIterator[Json],
    *,
    model: str,
    input_tokens: int = 0,
    stop_sequences: Sequence[str] | None = None,
    message_id: str | None = None,
) -> AsyncIterator[Event]:
    """Chat chunks as Anthropic's exact event sequence: `message_start`, per block `content_block_start` /
    `content_block_delta`… / `content_block_stop`, `message_delta` (stop reason, usage), `message_stop`.

    `input_tokens` is the prompt estimate shown in `message_start` (the real count, known only from the final
    usage chunk, goes in `message_delta`). When `chunks` raises, the open block is closed and an `error` event in
    Anthropic's shape ends the stream, since a client that sees no `content_block_stop` shows an empty answer.
    """
    builder = _EventBuilder(
        model=model, input_tokens=input_tokens, stop_sequences=stop_sequences, message_id=message_id
    )
    return translate_stream(builder, chunks)


class _EventBuilder(TextHoldingBuilder):
    """The translator's state: which block is open, what the upstream said about stopping and usage."""

    def __init__(
        self, *, model: str, input_tokens: int, stop_sequences: Sequence[str] | None, message_id: str | None
    ) -> None:
        super().__init__()
        self.model = model
        self.input_tokens = input_tokens
        self.stop_sequences = stop_sequences
        self.message_id = message_id or new_id("msg_")
        self.num_closed_blocks = 0  # also the index of the open block
        self.open_kind: str | None = None  # "text" | "tool_use" (tool calls being collected)
        # Tool calls by their chat `index`, in order of arrival, each {"id", "name", "arguments"}: sent as whole
        # blocks once the answer's tool calls are complete (see `_tool_call`).
        self.tool_calls: dict[Any, Json] = {}
        self.last_tool_key: Any = None
        self.has_tool_use = False

    def start(self) -> list[Event]:
        message: Json = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def finish(self) -> list[Event]:
        events = self._close_all()
        stop_reason, stop_sequence = stop_reason_of(
            self.finish_reason, self.matched_stop, has_tool_use=self.has_tool_use, stop_sequences=self.stop_sequences
        )
        usage = anthropic_usage(self.usage) if self.usage is not None else {"input_tokens": self.input_tokens}
        usage.setdefault("output_tokens", 0)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def fail(self, error: Exception) -> list[Event]:
        return [*self._close_all(), error_event(error)]

    def _text(self, text: str) -> list[Event]:
        if self.open_kind == "tool_use":
            # A block cannot reopen, so text arriving while a tool call may still get arguments waits for it.
            self.pending_text += text
            return []
        events: list[Event] = []
        if self.open_kind != "text":
            events.extend(self._close())
            events.append(self._open({"type": "text", "text": ""}, "text"))
        delta = {"type": "text_delta", "text": text}
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": self.num_closed_blocks, "delta": delta})
        )
        return events

    def _tool_call(self, call: Json) -> list[Event]:
        """Collect a tool call's fragments; its block goes out whole when the tool calls end (`_close`).

        A client builds `input` by parsing the concatenated `input_json_delta`s, and the Anthropic SDK's stream
        helper fails on text that is not a JSON object, which small models and some servers produce. Collected,
        the arguments go out as `parse_arguments` repairs them, as in a non-streaming answer, and fragments of
        several calls may interleave."""
        key = call.get("index")
        if key is None:  # some servers omit `index`; a new id means a new call
            key = call.get("id") or self.last_tool_key or 0
        function = call.get("function") or {}
        events: list[Event] = []
        if key not in self.tool_calls:
            if self.open_kind == "text":
                events.extend(self._close())
            self.open_kind = "tool_use"  # text arriving from now on waits for the tool calls' blocks
            self.tool_calls[key] = {"id": call.get("id") or new_id("toolu_"), "name": "", "arguments": ""}
            self.has_tool_use = True
        collected = self.tool_calls[key]
        if function.get("name") and not collected["name"]:
            collected["name"] = function["name"]
        if function.get("arguments"):
            collected["arguments"] += function["arguments"]
        self.last_tool_key = key
        return events

    def _open(self, content_block: Json, kind: str) -> Event:
        self.open_kind = kind
        data = {"type": "content_block_start", "index": self.num_closed_blocks, "content_block": content_block}
        return "content_block_start", data

    def _close(self) -> list[Event]:
        if self.open_kind is None:
            return []
        if self.open_kind == "tool_use":
            return self._tool_blocks()
        index = self.num_closed_blocks
        self.open_kind = None
        self.num_closed_blocks += 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _tool_blocks(self) -> list[Event]:
        """The collected tool calls, each a whole block: start, its arguments as one JSON object, stop."""
        events: list[Event] = []
        for collected in self.tool_calls.values():
            index = self.num_closed_blocks
            block = {"type": "tool_use", "id": collected["id"], "name": collected["name"], "input": {}}
            events.append(
                ("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})
            )
            arguments = parse_arguments(collected["arguments"])
            if arguments:
                delta = {"type": "input_json_delta", "partial_json": dumps(arguments)}
                events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
            self.num_closed_blocks += 1
        self.tool_calls.clear()
        self.open_kind = None
        return events


def error_event(error: Exception) -> Event:
    """Anthropic's in-stream error: `{"type": "error", "error": {"type", "message"}}`, never a traceback."""
    if isinstance(error, GatewayError):
        kind, message = anthropic_error_type(error), error.message
    else:
        logger.warning("stream failed mid-response: %s", type(error).__name__)
        kind, message = "api_error", "The upstream stream failed mid-response. Retry the request."
    return "error", {"type": "error", "error": {"type": kind, "message": message}}


async def guard_events(events: AsyncIterator[Json]) -> AsyncIterator[Event]:
    """Events from an Anthropic upstream, named for SSE. If the source raises, the blocks it left open are
    closed and an `error` event follows, as `chat_chunks_to_events` does for translated streams."""
    open_indexes: list[Any] = []
    try:
        async for event in events:
            kind = str(event.get("type", ""))
            if kind == "content_block_start":
                open_indexes.append(event.get("index"))
            elif kind == "content_block_stop" and event.get("index") in open_indexes:
                open_indexes.remove(event.get("index"))
            yield kind, event
    except Exception as error:
        for index in open_indexes:
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        yield error_event(error)
    finally:
        await aclose_source(events)
