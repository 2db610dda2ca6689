"""Tool calls in local models' text (`backends/tool_calls.py`): the formats, streaming at every split point."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.tool_calls import ToolCallStream, parse_tool_calls, plain_tool_messages, tool_names

NAMES = {"get_weather", "search"}
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}


def _calls(parsed: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # Hermes / Qwen: one block per call, content around them
        (f"<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
        (
            'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": {"q": "météo"}}</tool_call>',
            "Let me check.",
            [("get_weather", {"city": "Oslo"}), ("search", {"q": "météo"})],
        ),
        # SmolLM2: a list in one block, closing tag cut off by the end of generation
        ('<tool_call>[{"name": "search", "arguments": {"q": "x"}}]', None, [("search", {"q": "x"})]),
        # Mistral
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
            None,
            [("get_weather", {"city": "Rome"})],
        ),
        # Llama 3: bare JSON with "parameters", or after <|python_tag|>; arguments given as a JSON string
        ('{"name": "get_weather", "parameters": {"city": "Lima"}}', None, [("get_weather", {"city": "Lima"})]),
        ('<|python_tag|>{"name": "search", "arguments": "{\\"q\\": \\"y\\"}"}', None, [("search", {"q": "y"})]),
    ],
)
def test_formats(text: str, content: str | None, calls: list[Any]) -> None:
    parsed = parse_tool_calls(text, NAMES)
    assert parsed is not None and parsed.content == content and _calls(parsed) == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # not one of the request's tools
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '{"answer": 42}',  # JSON, but not a call
        "[1, 2, 3]",
    ],
)
def test_text_that_is_no_valid_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) is None


def test_tool_names_and_tool_choice_none() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert tool_names({"tools": tools}) == {"get_weather"}
    assert tool_names({"tools": tools, "tool_choice": "none"}) is None
    assert tool_names({"tools": []}) is None and tool_names({}) is None


def _stream(text: str, cuts: list[int]) -> tuple[list[str], list[Any]]:
    stream = ToolCallStream(NAMES)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    sent = [stream.feed(piece) for piece in pieces]
    tail, calls = stream.finish()
    return [*sent, tail], calls


@pytest.mark.parametrize(
    "text",
    [
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        '{"name": "get_weather", "parameters": {"city": "Lima"}}',
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}]',
        "No tools needed: 3 < 4 and <b>bold</b> [x] stay text, even <tool_cal without its end.",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    ],
)
def test_streaming_gives_the_same_result_at_every_split(text: str) -> None:
    expected = parse_tool_calls(text, NAMES)
    expected_content = text if expected is None else (expected.content or "")
    for cut in range(len(text) + 1):
        for cuts in ([cut], list(range(1, len(text)))):  # two pieces, or one character at a time
            sent, calls = _stream(text, cuts)
            got = "".join(sent)
            if expected is None:
                assert got == text and calls == []
            else:
                assert got.strip() == expected_content.strip() and _calls(type(expected)(None, calls)) == _calls(
                    expected
                )


def test_streaming_sends_plain_text_without_holding_it_back() -> None:
    stream = ToolCallStream(NAMES)
    assert stream.feed("Hello") == "Hello"
    assert stream.feed(" wor<") == " wor"  # "<" could start "<tool_call>": held for now
    assert stream.feed("ld>") == "<ld>"
    assert stream.finish() == ("", [])


# -- the way back: earlier calls and their results for a chat template that knows no tools (issue 20, item 4) ------


def test_plain_tool_messages_write_calls_and_results_as_text() -> None:
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    broken = {"id": "call_def", "type": "function", "function": {"name": "search", "arguments": "{not json"}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call, broken]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_def", "content": "no results"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "20C"},
    ]
    assert plain_tool_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": "{not json"}\n</tool_call>',
        },
        {
            "role": "user",
            "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\nno results\n</tool_response>\n"
            "And tomorrow?",
        },
        {
            "role": "assistant",
            "content": "Let me check.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n20C\n</tool_response>"},
    ]


def test_plain_tool_messages_read_back_as_the_same_calls() -> None:
    """What the model is shown of its earlier call is what `parse_tool_calls` reads as that call."""
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "météo"}'}}
    [message] = plain_tool_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    parsed = parse_tool_calls(message["content"], NAMES)
    assert parsed is not None and _calls(parsed) == [("search", {"q": "météo"})]
