"""Tool calls in a local model's text, returned as OpenAI `tool_calls`.

The chat template puts the request's `tools` into the prompt; the model answers in its family's own format. Read
here (the formats vLLM's `hermes`, `mistral` and `llama3_json` parsers read):

- Hermes / Qwen2.5 / Qwen3 / SmolLM2: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
  call, or a JSON list of calls inside one block;
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- Llama 3.x: the whole answer is one JSON object (or a list) `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`.

A call counts only when it parses and names one of the request's tools; anything else stays content, so a model
that merely talks about JSON is never turned into a broken call. Streaming passes content through until a
marker (or, before any content, a leading `{`/`[`) may begin, then holds the rest and emits the calls whole at
the end — arguments are not streamed piece by piece. `tool_choice: "none"` turns parsing off; "required" or a
named function cannot be enforced on a local model (no constrained decoding), so they parse like "auto".

The way back: a chat template that writes tool calls itself gets the conversation as it is; for one that does not
(SmolLM2's prints each message's role and content only) `plain_tool_messages` writes earlier calls and their results
as text in the Hermes format above.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedToolCalls", "ToolCallStream", "parse_tool_calls", "plain_tool_messages", "tool_names"]

_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


@dataclass
class ParsedToolCalls:
    content: str | None  # the text outside the calls, None when there is none
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI `tool_calls` entries


def tool_names(body: dict[str, Any]) -> set[str] | None:
    """Names of the request's function tools, or None when tool calls must not be parsed."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none":
        return None
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names or None


def _openai_call(item: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    if name is None and isinstance(item.get("function"), dict):  # {"function": {"name", "arguments"}}
        item = item["function"]
        name = item.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _calls_from_json(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """All calls in one JSON value (an object or a list of objects); None unless every item is a valid call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_openai_call(item, names) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def parse_tool_calls(text: str, names: set[str]) -> ParsedToolCalls | None:
    """The calls in a finished answer, or None when it holds none (then it is plain content)."""
    if "<tool_call>" in text:
        calls: list[dict[str, Any]] = []
        for body in _TAGGED.findall(text):
            found = _calls_from_json(body.strip(), names)
            if found is None:
                return None
            calls += found
        content = _TAGGED.sub("", text).strip()
        return ParsedToolCalls(content or None, calls)
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        if marker in text:
            before, _, after = text.partition(marker)
            found = _calls_from_json(after.strip(), names)
            return None if found is None else ParsedToolCalls(before.strip() or None, found)
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        found = _calls_from_json(stripped, names)
        return None if found is None else ParsedToolCalls(None, found)
    return None


class ToolCallStream:
    """One streamed choice: `feed` returns the content that may go out now; `finish` the rest and the calls."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.pending = ""  # text not sent yet: a possible marker prefix, or everything once holding
        self.sent = ""  # content already sent
        self.is_holding = False

    def feed(self, text: str) -> str:
        self.pending += text
        if self.is_holding:
            return ""
        if not self.sent.strip() and self.pending.lstrip()[:1] in ("{", "["):
            self.is_holding = True  # Llama 3 style: the answer may be one JSON call
            return ""
        starts = [i for i in (self.pending.find(m) for m in _MARKERS) if i >= 0]
        if starts:
            cut = min(starts)
            self.is_holding = True
        else:  # keep a tail that could still grow into a marker
            cut = len(self.pending)
            for marker in _MARKERS:
                for size in range(min(len(marker) - 1, len(self.pending)), 0, -1):
                    if self.pending.endswith(marker[:size]):
                        cut = min(cut, len(self.pending) - size)
                        break
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, tool calls). Held text that is no valid call goes out as content."""
        rest, self.pending = self.pending, ""
        if self.is_holding:
            parsed = parse_tool_calls(rest, self.names)
            if parsed is not None:
                return parsed.content or "", parsed.calls
        return rest, []


def plain_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (text contents) for a chat template that knows no tools: an assistant's `tool_calls` become
    `<tool_call>` blocks after its text, the format the model's own calls are read in; each `tool` message becomes a
    `<tool_response>` block in a user turn, shared by consecutive results and the user text right after them (one
    Anthropic user turn stays one turn, and roles still alternate). Ids are left out and nothing varies between
    calls, so each turn of a conversation renders the previous turn's prompt again, byte for byte."""
    result: list[dict[str, Any]] = []
    results_turn: dict[str, Any] | None = None  # the user turn holding the latest tool results, while it is open
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results_turn is None:
                results_turn = {"role": "user", "content": block}
                result.append(results_turn)
            else:
                results_turn["content"] += "\n" + block
            continue
        if role == "user" and results_turn is not None:
            if content:
                results_turn["content"] += "\n" + content
            results_turn = None
            continue
        results_turn = None
        if role == "assistant":
            parts = [content] if content else []
            parts += [_call_text(call) for call in message.get("tool_calls") or [] if isinstance(call, dict)]
            kept = {key: value for key, value in message.items() if key != "tool_calls"}
            result.append({**kept, "content": "\n".join(parts)})
        else:
            result.append({**message, "content": content})
    return result


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function")
    if not isinstance(function, dict):
        function = {}
    arguments: Any = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # shown as the string it is
    text = json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{text}\n</tool_call>"
