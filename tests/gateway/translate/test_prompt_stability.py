"""Translated requests are the same on every turn that resends a conversation (issue 20, item 3): no fresh ids, no
per-request billing line, tools in the client's order, so the next turn's chat messages start with this turn's and
a backend's prefix cache keeps matching. (The rendered prompts and the cache hits themselves are tested on the
local engine: tests/backends/test_local_agent_turns.py.)"""

from __future__ import annotations

from typing import Any

from gateway.translate.anthropic import messages_to_chat
from gateway.translate.responses import responses_to_chat

TOOLS = [
    {"name": name, "description": f"The {name} tool.", "input_schema": {"type": "object"}}
    for name in ("Read", "Bash", "Edit", "Glob", "Grep")
]


def claude_code_turn(nonce: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    billing = f"x-anthropic-billing-header: cc_version=2.1.42.834; cc_entrypoint=cli; cch={nonce};"
    system = [
        {"type": "text", "text": billing},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}},
    ]
    return {"model": "m", "max_tokens": 32000, "system": system, "tools": TOOLS, "messages": messages, "stream": True}


def test_claude_code_turns_translate_to_growing_prefixes() -> None:
    first_messages = [{"role": "user", "content": [{"type": "text", "text": "List the files"}]}]
    call = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}
    second_messages = [
        *first_messages,
        {"role": "assistant", "content": [{"type": "text", "text": "Listing."}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "README.md"}]},
    ]
    first = messages_to_chat(claude_code_turn("36ee5", first_messages))
    second = messages_to_chat(claude_code_turn("0aaa9", second_messages))
    assert first["messages"][0] == {"role": "system", "content": "You are Claude Code.\n\nBe concise."}
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assert first["tools"] == second["tools"]
    assert [tool["function"]["name"] for tool in first["tools"]] == ["Read", "Bash", "Edit", "Glob", "Grep"]
    assert "x-anthropic-billing-header" not in str(second)


def test_a_system_that_is_only_the_billing_line_is_no_system() -> None:
    body = claude_code_turn("36ee5", [{"role": "user", "content": "Hi"}])
    body["system"] = body["system"][:1]
    assert messages_to_chat(body)["messages"] == [{"role": "user", "content": "Hi"}]
    body["system"] = "x-anthropic-billing-header: a plain string system is the user's own text"
    assert messages_to_chat(body)["messages"][0]["role"] == "system"


def test_items_sent_without_ids_get_the_same_ids_every_time() -> None:
    anthropic_body = claude_code_turn(
        "36ee5",
        [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": [{"type": "tool_use", "name": "Read", "input": {"path": "a"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "", "content": "x"}]},
        ],
    )
    translated = messages_to_chat(anthropic_body)
    assert translated == messages_to_chat(anthropic_body)
    assert translated["messages"][-2]["tool_calls"][0]["id"] == "toolu_1_0"

    responses_body = {
        "model": "m",
        "instructions": "You are Codex.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Go"}]},
            {"type": "function_call", "name": "shell", "arguments": '{"command": ["ls"]}'},
            {"type": "function_call_output", "call_id": "", "output": "README.md"},
        ],
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
    }
    translated = responses_to_chat(responses_body)
    assert translated == responses_to_chat(responses_body)
    assert translated["messages"][-2]["tool_calls"][0]["id"] == "call_1"


def test_codex_turns_translate_to_growing_prefixes() -> None:
    tools = [
        {"type": "function", "name": "shell", "parameters": {"type": "object"}},
        {"type": "function", "name": "update_plan", "parameters": {"type": "object"}},
    ]
    first_input = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files"}]},
    ]
    second_input = [
        *first_input,
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
    ]
    first = responses_to_chat({"model": "m", "instructions": "You are Codex.", "input": first_input, "tools": tools})
    second = responses_to_chat({"model": "m", "instructions": "You are Codex.", "input": second_input, "tools": tools})
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assert first["tools"] == second["tools"]
