"""Golden tests: Anthropic Messages requests → chat-completions requests, one block type at a time."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest

from gateway.errors import InvalidRequestError
from gateway.translate import messages_to_chat


def _chat(**body: Any) -> dict[str, Any]:
    return messages_to_chat({"model": "claude-x", "max_tokens": 100, **body})


def test_minimal_request() -> None:
    chat = _chat(messages=[{"role": "user", "content": "Hi"}])
    assert chat == {"model": "claude-x", "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}]}


def test_system_string_and_blocks_ignoring_cache_control() -> None:
    assert _chat(system="Be brief.", messages=[])["messages"] == [{"role": "system", "content": "Be brief."}]
    blocks = [
        {"type": "text", "text": "You are a CLI."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ]
    chat = _chat(system=blocks, messages=[{"role": "user", "content": "Hi"}])
    assert chat["messages"][0] == {"role": "system", "content": "You are a CLI.\n\nBe brief."}


def test_system_role_inside_messages_stays_in_place() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder"}]},
        {"role": "user", "content": "Go"},
    ]
    assert [m["role"] for m in _chat(messages=messages)["messages"]] == ["user", "system", "user"]
    assert _chat(messages=messages)["messages"][1]["content"] == "Reminder"


def test_user_text_blocks_images_and_documents() -> None:
    content = [
        {"type": "text", "text": "Look:", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.org/cat.png"}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc body"}},
    ]
    chat = _chat(messages=[{"role": "user", "content": content}])
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
                {"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}},
                {"type": "text", "text": "doc body"},
            ],
        }
    ]


def test_a_lone_text_block_becomes_a_plain_string() -> None:
    chat = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]


def test_assistant_tool_use_and_user_tool_result_round() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "no data"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    chat = _chat(messages=messages)["messages"]
    assert chat[1]["role"] == "assistant" and chat[1]["content"] == "Checking."
    assert [(c["id"], c["type"], c["function"]["name"]) for c in chat[1]["tool_calls"]] == [
        ("toolu_1", "function", "weather"),
        ("toolu_2", "function", "weather"),
    ]
    assert orjson.loads(chat[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert chat[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
        {"role": "user", "content": "Thanks"},
    ]


def test_assistant_with_only_tool_use_has_null_content() -> None:
    content = [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]
    message = _chat(messages=[{"role": "assistant", "content": content}])["messages"][0]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == "{}"


def test_tool_result_images_follow_the_tool_messages() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "shot"}, image]}
    chat = _chat(messages=[{"role": "user", "content": [result]}])["messages"]
    assert chat[0] == {"role": "tool", "tool_call_id": "t1", "content": "shot"}
    assert chat[1] == {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}],
    }


def test_tools_keep_their_schemas_and_server_tools_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [
        {
            "name": "weather",
            "description": "Get weather",
            "input_schema": schema,
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "custom", "name": "noop", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"type": "bash_20250124", "name": "bash"},
    ]
    with caplog.at_level(logging.WARNING, logger="unigate.translate"):
        chat = _chat(messages=[{"role": "user", "content": "Hi"}], tools=tools)
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": schema, "description": "Get weather"}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
    ]
    assert "web_search" in caplog.text and "bash" in caplog.text


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}}),
    ],
)
def test_tool_choice(tool_choice: dict[str, Any], expected: Any) -> None:
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    chat = _chat(messages=[{"role": "user", "content": "Hi"}], tools=tools, tool_choice=tool_choice)
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_disable_parallel_tool_use() -> None:
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    chat = _chat(messages=[{"role": "user", "content": "Hi"}], tools=tools, tool_choice=choice)
    assert chat["parallel_tool_calls"] is False


def test_tool_choice_without_usable_tools_is_left_out() -> None:
    tools = [{"type": "web_search_20250305", "name": "web_search"}]
    chat = _chat(messages=[{"role": "user", "content": "Hi"}], tools=tools, tool_choice={"type": "any"})
    assert "tools" not in chat and "tool_choice" not in chat


def test_sampling_stop_metadata_stream_and_ignored_fields() -> None:
    chat = _chat(
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0.3,
        top_p=0.9,
        top_k=40,
        stop_sequences=["\n\nHuman:", "END"],
        metadata={"user_id": "user-42"},
        stream=True,
        thinking={"type": "enabled", "budget_tokens": 1024},
        service_tier="auto",
    )
    assert chat == {
        "model": "claude-x",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 100,
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["\n\nHuman:", "END"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "user-42",
    }


def test_structured_output_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = _chat(
        messages=[{"role": "user", "content": "Hi"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("Hi", "messages"),
        (None, "messages"),
        (["Hi"], "messages[0]"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ],
)
def test_malformed_requests_are_invalid_request_errors(messages: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        messages_to_chat({"model": "m", "max_tokens": 1, "messages": messages})
    assert caught.value.param == param
    assert caught.value.status_code == 400
