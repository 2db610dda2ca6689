"""OpenAI Responses clients (Codex CLI) on chat-completions backends, stateless (`store: false` semantics).

    responses_to_chat(body)                          Responses request → chat-completions request
    chat_to_response(response, request=...)          chat completion   → Responses object
    chat_chunks_to_response_events(chunks, request=...)  chat chunks   → Responses SSE events `(name, data)`

Only `function` tools translate; other tool types (web_search, custom, namespace, tool_search, ...) are dropped
with a warning, and `reasoning` is ignored. Pure functions over dicts. A translated request is the same on every turn
that resends the same conversation (tools in the client's order, no fresh ids), so the prompt a backend renders from
it keeps its prefix and a prefix cache keeps matching.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.errors import GatewayError, InvalidRequestError
from gateway.translate.common import (
    DropLog,
    Event,
    Json,
    TextHoldingBuilder,
    content_text,
    dumps_request,
    logger,
    new_id,
    position_id,
    translate_stream,
    usage_counts,
    wrong_type,
)

__all__ = ["chat_chunks_to_response_events", "chat_to_response", "responses_to_chat"]


# ---------------------------------------------------------------- request: Responses → chat


def responses_to_chat(body: Json) -> Json:
    """A Responses request as the equivalent chat-completions request (`model` is kept for the route to rewrite).

    Fields the translation reads must have their documented types (400 `invalid_request` naming the field
    otherwise); what the target cannot carry is dropped and summed up in one warning line."""
    if body.get("previous_response_id"):
        raise InvalidRequestError(
            "previous_response_id is not supported: unigate stores no responses (store: false). Resend the whole "
            "conversation in `input`.",
            code="unsupported_parameter",
            param="previous_response_id",
        )
    for name in _ECHOED:  # the Response object repeats them: they must be writable one event level deeper
        if body.get(name) is not None:
            dumps_request({"response": {name: body[name]}}, param=name)
    dropped = DropLog("chat completions")
    messages = _input_messages(body, dropped)
    chat: Json = {"model": body.get("model"), "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    # (checked by gateway.validate.check_responses; `top_k`, `stop` and `seed` are extensions a chat target reads)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop"):
        chat["stop"] = body["stop"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    _add_user(chat, body)
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    tools = function_tools(body.get("tools"), dropped)
    if tools:
        chat["tools"] = [{"type": "function", "function": _chat_function(tool)} for tool in tools]
        tool_choice = _chat_tool_choice(body.get("tool_choice"), dropped)
        if tool_choice is not None:
            chat["tool_choice"] = tool_choice
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = bool(body["parallel_tool_calls"])
    dropped.log()
    return chat


def _input_messages(body: Json, dropped: DropLog) -> list[Json]:
    """`instructions` and `input` (a string, or message / function_call / function_call_output items) as chat
    messages."""
    messages: list[Json] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise wrong_type("instructions", "a string", instructions)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for index, item in enumerate(items):
            _add_item(messages, item, f"input[{index}]", dropped)
    elif items is not None:
        raise InvalidRequestError("'input' must be a string or a list of input items.", param="input")
    if not messages:
        if isinstance(items, list) and items:
            kinds = ", ".join(sorted({repr(i.get("type")) for i in items if isinstance(i, dict)})) or "none"
            raise InvalidRequestError(
                f"'input' holds no item this model can read (item types: {kinds}). Send `message`, "
                "`function_call` and `function_call_output` items (an `item_reference` needs stored responses, "
                "which this model does not keep).",
                code="invalid_request",
                param="input",
            )
        raise InvalidRequestError("'input' is required: give a string or a list of input items.", param="input")
    return messages


def _add_user(chat: Json, body: Json) -> None:
    user = body.get("user") or body.get("safety_identifier")
    if isinstance(user, str):
        chat["user"] = user


def _string(item: Json, name: str, param: str, default: str = "") -> str:
    """`item[name]`, which must be a string when present."""
    value = item.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise wrong_type(f"{param}.{name}", "a string", value)
    return value


def _parts_text(content: Any, param: str, *, separator: str) -> str:
    """The text of a string or a list of content parts (objects whose `text`, when present, is a string)."""
    if content is None or isinstance(content, str):
        return content or ""
    for index, part in enumerate(_require_parts(content, param)):
        _string(part, "text", f"{param}[{index}]")
    return content_text(content, separator=separator)


def _require_parts(content: Any, param: str) -> list[Json]:
    if not isinstance(content, list):
        raise wrong_type(param, "a string or a list of content parts", content)
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            raise wrong_type(f"{param}[{index}]", "a content part object", part)
    return content


def _add_item(messages: list[Json], item: Any, param: str, dropped: DropLog) -> None:
    if not isinstance(item, dict):
        raise InvalidRequestError(f"Each item of 'input' must be an object ({param} is not).", param="input")
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        messages.append(_chat_message(item, param, dropped))
    elif kind == "function_call":
        function = {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param) or "{}"}
        call_id = _string(item, "call_id", param) or position_id("call_", param)
        call = {"id": call_id, "type": "function", "function": function}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            # Parallel calls (and the text before them) are one assistant turn in chat completions.
            last.setdefault("tool_calls", []).append(call)
            if not last.get("content"):
                last["content"] = None
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        text = _parts_text(item.get("output"), f"{param}.output", separator="\n")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
    elif kind == "reasoning":
        return  # the target has no reasoning items to resend
    else:
        dropped.add("input item of type", kind)


def _chat_message(item: Json, param: str, dropped: DropLog) -> Json:
    role = item.get("role")
    content = item.get("content")
    where = f"{param}.content"
    if role in ("system", "developer"):
        # Many chat servers (and chat templates) know no `developer` role.
        return {"role": "system", "content": _parts_text(content, where, separator="\n\n")}
    if role == "assistant":
        return {"role": "assistant", "content": _parts_text(content, where, separator="")}
    if role != "user":
        role_text = repr(role) if len(repr(role)) <= 40 else repr(role)[:37] + "..."
        raise InvalidRequestError(
            f"Input message role ({param}.role) must be user, assistant, system or developer, not {role_text}.",
            param="input",
        )
    if content is None or isinstance(content, str):
        return {"role": "user", "content": content or ""}
    parts: list[Json] = []
    for index, part in enumerate(_require_parts(content, where)):
        part_param = f"{where}[{index}]"
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": _string(part, "text", part_param)})
        elif kind == "input_image" and part.get("image_url"):
            image_url: Json = {"url": _string(part, "image_url", part_param)}
            if part.get("detail") in ("low", "high"):
                image_url["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image_url})
        else:
            dropped.add("input part of type", kind)
    if len(parts) == 1 and parts[0]["type"] == "text":
        return {"role": "user", "content": parts[0]["text"]}
    return {"role": "user", "content": parts}


def function_tools(tools: Any, dropped: DropLog | None = None) -> list[Json]:
    """The request's `function` tools (400 for a malformed one); the rest cannot be served by a chat-completions
    target and are noted in `dropped`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise wrong_type("tools", "a list of tool objects", tools)
    kept: list[Json] = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise wrong_type(param, "a tool object", tool)
        if tool.get("type") == "function" and tool.get("name"):
            _string(tool, "name", param)
            _string(tool, "description", param)
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
                raise wrong_type(f"{param}.parameters", "a JSON Schema object", tool["parameters"])
            kept.append(tool)
        elif dropped is not None:
            dropped.add("tool of type", tool.get("type"), name=tool.get("name"))
    return kept


def _chat_function(tool: Json) -> Json:
    function: Json = {
        "name": tool["name"],
        "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
    }
    if tool.get("description"):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return function


def _chat_tool_choice(choice: Any, dropped: DropLog) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str) and choice["name"]:
            return {"type": "function", "function": {"name": choice["name"]}}
        if choice.get("type") == "allowed_tools" and choice.get("mode") in ("auto", "required"):
            return choice["mode"]
        dropped.add("tool_choice of type", choice.get("type"))
    return None


def _response_format(text: Any) -> Json | None:
    output_format = text.get("format") if isinstance(text, dict) else None
    if not isinstance(output_format, dict):
        return None
    if output_format.get("type") == "json_object":
        return {"type": "json_object"}
    if output_format.get("type") == "json_schema":
        schema: Json = {"name": output_format.get("name", "output"), "schema": output_format.get("schema", {})}
        if isinstance(output_format.get("strict"), bool):
            schema["strict"] = output_format["strict"]
        return {"type": "json_schema", "json_schema": schema}
    return None


# ---------------------------------------------------------------- response: chat → Responses


_ECHOED = ("tools", "text", "tool_choice", "reasoning", "metadata")  # request fields `response_object` repeats


def response_object(request: Json, *, response_id: str, created_at: int, status: str) -> Json:
    """The Response object's frame, echoing the request's settings; `output` and `usage` are filled in later."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model"),
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": request.get("reasoning"),
        "store": False,
        "temperature": request.get("temperature"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": [tool for tool in request.get("tools") or [] if tool.get("type") == "function" and tool.get("name")],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def chat_to_response(
    response: Json, *, request: Json, response_id: str | None = None, created_at: int | None = None
) -> Json:
    """A chat completion as a completed (or `incomplete`, when cut by max tokens) Response object."""
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[Json] = []
    text = content_text(message.get("content")) or message.get("refusal") or ""
    if text:
        output.append(_message_item(new_id("msg_"), text, "completed"))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(
            _function_call_item(
                new_id("fc_"),
                call.get("id") or new_id("call_"),
                function.get("name", ""),
                function.get("arguments") or "",
                "completed",
            )
        )
    result = response_object(
        request,
        response_id=response_id or new_id("resp_"),
        created_at=created_at if created_at is not None else int(time.time()),
        status="completed",
    )
    result["output"] = output
    result["usage"] = responses_usage(response.get("usage"))
    _mark_incomplete(result, choice.get("finish_reason"))
    return result


def _message_item(item_id: str, text: str, status: str) -> Json:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [_text_part(text)]}


def _text_part(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Json:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def _mark_incomplete(result: Json, finish_reason: Any) -> None:
    if finish_reason == "length":
        result["status"] = "incomplete"
        result["incomplete_details"] = {"reason": "max_output_tokens"}
    elif finish_reason == "content_filter":
        result["status"] = "incomplete"
        result["incomplete_details"] = {"reason": "content_filter"}


def responses_usage(usage: Any) -> Json:
    prompt_tokens, completion_tokens, cached_tokens = usage_counts(usage)
    details = usage.get("completion_tokens_details") if isinstance(usage, dict) else None
    reasoning_tokens = int(details.get("reasoning_tokens") or 0) if isinstance(details, dict) else 0
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def failure_code(error: Exception) -> str:
    """The Responses error code a client acts on (Codex retries rate limits, stops on context/quota errors)."""
    if not isinstance(error, GatewayError):
        return "server_error"
    if error.code in ("context_length_exceeded", "budget_exceeded"):
        return "insufficient_quota" if error.code == "budget_exceeded" else "context_length_exceeded"
    if error.status_code == 429:
        return "rate_limit_exceeded"
    if error.status_code == 400:
        return "invalid_prompt"
    return "server_error"


# ---------------------------------------------------------------- stream: chat chunks → Responses events


def chat_chunks_to_response_events(
    chunks: AsyncIterator[Json], *, request: Json, response_id: str | None = None, created_at: int | None = None
) -> AsyncIterator[Event]:
    """Chat chunks as Responses events: `response.created`, `response.in_progress`, per output item its
    `added` / deltas / `done` events, then `response.completed` with usage — or `response.failed` with the error
    (and the output so far) when `chunks` raises. Every event carries a `sequence_number`."""
    builder = _ResponseBuilder(
        request,
        response_id=response_id or new_id("resp_"),
        created_at=created_at if created_at is not None else int(time.time()),
    )
    return translate_stream(builder, chunks)


class _ResponseBuilder(TextHoldingBuilder):
    def __init__(self, request: Json, *, response_id: str, created_at: int) -> None:
        super().__init__()
        self.request = request
        self.response_id = response_id
        self.created_at = created_at
        self.num_events = 0
        self.output: list[Json] = []  # items done so far, in output order
        self.open_item: Json | None = None  # the item being streamed; its output_index is len(self.output)
        self.open_text = ""
        self.open_tool_key: Any = None
        self.closed_tool_keys: set[Any] = set()

    def _event(self, name: str, **data: Any) -> Event:
        event = {"type": name, "sequence_number": self.num_events, **data}
        self.num_events += 1
        return name, event

    def _response(self, status: str) -> Json:
        return response_object(self.request, response_id=self.response_id, created_at=self.created_at, status=status)

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def finish(self) -> list[Event]:
        events = self._close_all()
        response = self._response("completed")
        response["output"] = self.output
        response["usage"] = responses_usage(self.usage)
        _mark_incomplete(response, self.finish_reason)
        # Clients treat a stream without response.completed as failed, so a max-tokens cut still completes.
        events.append(self._event("response.completed", response=response))
        return events

    def fail(self, error: Exception) -> list[Event]:
        if isinstance(error, GatewayError):
            message = error.message
        else:
            logger.warning("chat stream failed mid-response: %s", type(error).__name__)
            message = "The upstream stream failed mid-response. Retry the request."
        response = self._response("failed")
        response["output"] = [*self.output, *self._partial_item()]
        response["error"] = {"code": failure_code(error), "message": message}
        return [self._event("response.failed", response=response)]

    def _partial_item(self) -> list[Json]:
        """The output cut off by a failure, marked incomplete, with what had arrived of it."""
        items: list[Json] = []
        if self.open_item is not None and self.open_item["type"] == "message":
            items.append(_message_item(self.open_item["id"], self.open_text, "incomplete"))
        elif self.open_item is not None:
            items.append({**self.open_item, "status": "incomplete"})
        if self.pending_text:
            items.append(_message_item(new_id("msg_"), self.pending_text, "incomplete"))
        return items

    def _text(self, text: str) -> list[Event]:
        if self.open_item is not None and self.open_item["type"] == "function_call":
            # An item cannot reopen, so text arriving while a call may still get arguments waits for it.
            self.pending_text += text
            return []
        events: list[Event] = []
        if self.open_item is None or self.open_item["type"] != "message":
            events.extend(self._close())
            item = {
                "id": new_id("msg_"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.open_item, self.open_text = item, ""
            index = len(self.output)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            part = _text_part("")
            events.append(
                self._event(
                    "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        self.open_text += text
        assert self.open_item is not None
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.open_item["id"],
                output_index=len(self.output),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _tool_call(self, call: Json) -> list[Event]:
        key = call.get("index")
        if key is None:
            key = call.get("id") or self.open_tool_key or 0
        function = call.get("function") or {}
        events: list[Event] = []
        if self.open_item is None or self.open_item["type"] != "function_call" or key != self.open_tool_key:
            if key in self.closed_tool_keys:
                logger.warning("dropping a late argument fragment for an already closed tool call")
                return []
            events.extend(self._close_all())
            item = _function_call_item(
                new_id("fc_"), call.get("id") or new_id("call_"), function.get("name") or "", "", "in_progress"
            )
            self.open_item, self.open_tool_key = item, key
            events.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
        assert self.open_item is not None
        if function.get("arguments"):
            self.open_item["arguments"] += function["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.open_item["id"],
                    output_index=len(self.output),
                    delta=function["arguments"],
                )
            )
        return events

    def _close(self) -> list[Event]:
        item = self.open_item
        if item is None:
            return []
        index = len(self.output)
        events: list[Event] = []
        if item["type"] == "message":
            part = _text_part(self.open_text)
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self._event("response.output_text.done", **common, text=self.open_text, logprobs=[]))
            events.append(self._event("response.content_part.done", **common, part=part))
            done = _message_item(item["id"], self.open_text, "completed")
        else:
            common = {"item_id": item["id"], "output_index": index}
            events.append(self._event("response.function_call_arguments.done", **common, arguments=item["arguments"]))
            done = {**item, "status": "completed"}
            self.closed_tool_keys.add(self.open_tool_key)
            self.open_tool_key = None
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.open_item, self.open_text = None, ""
        return events
