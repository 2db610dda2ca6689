"""`backends.local_mapping`: OpenAI bodies to prompt ids and sampling parameters, engine outputs to OpenAI responses
and chunks, and the engine's errors as the gateway's, all without an engine (a fake tokenizer, plain outputs)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.base import MAX_TOKENS_CLAMPED_KEY
from backends.local_mapping import (
    ParsedRequest,
    StageTimes,
    Usage,
    check_request,
    engine_errors,
    place_system_messages,
    prompt_ids,
    prompt_texts,
)
from gateway.errors import EngineError, InvalidRequestError, NotFoundError
from local_engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidParamError,
    PromptTooLongError,
    RequestFailedError,
)
from local_engine.output_processor import CompletionOutput, EngineStages, RequestOutput, TokenLogprob
from local_engine.sampling_params import SamplingParams

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


class FakeTokenizer:
    """One id per character; the chat template joins `role: content` lines."""

    renders_tool_calls = False

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        if messages[0]["role"] == "assistant":
            raise InvalidParamError("roles must start with user", code="invalid_messages", param="messages")
        if any(not isinstance(m.get("content"), str | None) for m in messages):  # as `Tokenizer` refuses a TypeError
            raise InvalidParamError("cannot render", code="invalid_messages", param="messages")
        return self.encode("".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages))


def token_text(token_id: int) -> tuple[str, list[int]]:
    text = chr(token_id)
    return text, list(text.encode())


def parsed(body: dict[str, Any], *, is_chat: bool = True, **options: Any) -> ParsedRequest:
    params = options.pop("params", SamplingParams(max_tokens=4))
    prompts = prompt_ids(FakeTokenizer(), is_chat, body)
    return ParsedRequest(is_chat, prompts, params, body, "tiny", token_text=token_text, **options)


# -- requests ---------------------------------------------------------------------------------------------------------


def test_check_request_reads_sampling_parameters() -> None:
    params = check_request("chat/completions", {**CHAT, "max_tokens": 5, "temperature": 0, "n": 2}, 1000)
    assert params.max_tokens == 5 and params.temperature == 0 and params.n == 2


@pytest.mark.parametrize(
    ("endpoint", "body", "code", "param"),
    [
        ("embeddings", {"input": "x"}, "unsupported_endpoint", None),
        ("completions", {"prompt": "x", "suffix": "y"}, None, "suffix"),
        ("chat/completions", {**CHAT, "functions": []}, None, "functions"),
        ("chat/completions", {**CHAT, "temperature": "hot"}, None, "temperature"),
        (
            "chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x" * 101}]},
            "context_length_exceeded",
            "messages",
        ),
        ("completions", {"prompt": ["short", "y" * 101]}, "context_length_exceeded", "prompt"),
    ],
    ids=["endpoint", "suffix", "functions", "sampling", "chat-size", "prompt-size"],
)
def test_check_request_refuses_with_a_400_naming_the_field(
    endpoint: Any, body: dict[str, Any], code: str | None, param: str | None
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_request(endpoint, body, max_prompt_chars=100)
    assert info.value.param == param
    if code is not None:
        assert info.value.code == code


def test_prompt_ids_for_chat_and_each_form_of_prompt() -> None:
    tokenizer = FakeTokenizer()
    [chat] = prompt_ids(tokenizer, True, CHAT)
    assert tokenizer.decode(chat) == "user: Hi\n"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert tokenizer.decode(prompt_ids(tokenizer, True, parts)[0]) == "user: ab\n"
    assert prompt_ids(tokenizer, False, {"prompt": "ab"}) == [[97, 98]]
    assert prompt_ids(tokenizer, False, {"prompt": ["a", "b"]}) == [[97], [98]]
    assert prompt_ids(tokenizer, False, {"prompt": [1, 2]}) == [[1, 2]]
    assert prompt_ids(tokenizer, False, {"prompt": [[1], [2, 3]]}) == [[1], [2, 3]]


@pytest.mark.parametrize(
    ("is_chat", "body", "param"),
    [
        (True, {"messages": []}, "messages"),
        (True, {"messages": ["hi"]}, "messages"),
        (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        (True, {**CHAT, "tools": "get_weather"}, "tools"),
        (True, {"messages": [{"role": "user", "content": {"nested": 1}}]}, "messages"),
        (False, {"prompt": [1, "a"]}, "prompt"),
        (False, {"prompt": []}, "prompt"),
    ],
)
def test_prompt_ids_refuses_what_cannot_be_a_prompt(is_chat: bool, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info, engine_errors("chat/completions" if is_chat else "completions"):
        prompt_ids(FakeTokenizer(), is_chat, body)
    assert info.value.param == param


def test_the_templates_own_refusal_becomes_a_400_through_engine_errors() -> None:
    body = {"messages": [{"role": "assistant", "content": "x"}]}
    with pytest.raises(InvalidRequestError) as info, engine_errors("chat/completions"):
        prompt_ids(FakeTokenizer(), True, body)
    assert (info.value.code, info.value.param) == ("invalid_messages", "messages")


def test_a_system_message_after_the_user_turn_is_rendered_before_it() -> None:
    # Claude Code 2.1.197: the agent list as a system message after the first user message, on every turn.
    tokenizer = FakeTokenizer()
    agents = {"role": "system", "content": "Agents: Explore, Plan."}
    first = {"messages": [{"role": "system", "content": "You are Claude Code."}, CHAT["messages"][0], agents]}
    [first_ids] = prompt_ids(tokenizer, True, first)
    assert tokenizer.decode(first_ids) == "system: You are Claude Code.\n\nAgents: Explore, Plan.\nuser: Hi\n"
    second = {
        "messages": [*first["messages"], {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    }
    [second_ids] = prompt_ids(tokenizer, True, second)
    assert second_ids[: len(first_ids)] == first_ids
    assert tokenizer.decode(second_ids[len(first_ids) :]) == "assistant: Hello\nuser: Bye\n"


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "system: Be brief.\nuser: Hi\n",
        ),
        (  # consecutive user messages are one turn; two system messages after it keep their order
            [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "system", "content": "x"},
                {"role": "developer", "content": "y"},
            ],
            "system: x\n\ny\nuser: a\nuser: b\n",
        ),
        (  # after an assistant turn or a tool result a system message stays where it is
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "system", "content": "x"},
                {"role": "tool", "content": "r"},
                {"role": "system", "content": "y"},
            ],
            "user: a\nassistant: b\nsystem: x\nuser: <tool_response>\nr\n</tool_response>\nsystem: y\n",
        ),
        (  # a system message with a name, or without text, is moved but not merged
            [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "a"},
                {"role": "system", "content": "x", "name": "policy"},
            ],
            "system: s\nsystem: x\nuser: a\n",
        ),
    ],
    ids=["developer", "user-turn", "in-place", "not-merged"],
)
def test_where_system_messages_are_rendered(messages: list[dict[str, Any]], expected: str) -> None:
    tokenizer = FakeTokenizer()
    assert tokenizer.decode(prompt_ids(tokenizer, True, {"messages": messages})[0]) == expected


_ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    roles = draw(st.lists(_ROLES, min_size=1, max_size=12))
    return [{"role": role, "content": f"{role[0]}{i}"} for i, role in enumerate(roles)]


def _is_system(message: dict[str, Any]) -> bool:
    return message["role"] in ("system", "developer")


@given(conversations())
def test_placing_system_messages_against_a_reference(messages: list[dict[str, Any]]) -> None:
    placed = place_system_messages(messages)
    others = [m for m in messages if not _is_system(m)]
    assert [m for m in placed if m["role"] != "system"] == others  # the conversation itself, in order, untouched
    texts = [part for m in placed if m["role"] == "system" for part in m["content"].split("\n\n")]
    assert texts == [m["content"] for m in messages if _is_system(m)]  # each once, in the order sent
    assert all(not (a["role"] == b["role"] == "system") for a, b in itertools.pairwise(placed))
    assert all(not (a["role"] == "user" and b["role"] == "system") for a, b in itertools.pairwise(placed))
    # Reference: a system text has before it the conversation's messages that came before it, less the user turn
    # (a run of user messages, systems between them skipped) that it directly followed.
    for i, message in enumerate(messages):
        if not _is_system(message):
            continue
        before = [m for m in messages[:i] if not _is_system(m)]
        trailing_users = 0
        for earlier in reversed(messages[:i]):
            if _is_system(earlier):
                continue
            if earlier["role"] != "user":
                break
            trailing_users += 1
        [position] = [
            k
            for k, m in enumerate(placed)
            if m["role"] == "system" and message["content"] in m["content"].split("\n\n")
        ]
        assert sum(1 for m in placed[:position] if m["role"] != "system") == len(before) - trailing_users


@given(conversations(), st.sampled_from(["assistant", "tool"]), conversations())
def test_a_resent_conversation_renders_the_previous_placement_first(
    earlier: list[dict[str, Any]], next_role: str, later: list[dict[str, Any]]
) -> None:
    # The prefix cache's promise: what a turn rendered, the next turn (which adds an answer and more) renders again.
    continued = [
        *earlier,
        {"role": next_role, "content": "next"},
        *[{**m, "content": "L" + m["content"]} for m in later],
    ]
    first = place_system_messages(earlier)
    assert place_system_messages(continued)[: len(first)] == first


def test_prompt_texts_for_echo() -> None:
    tokenizer = FakeTokenizer()
    assert prompt_texts(tokenizer, {"prompt": "ab"}) is None
    assert prompt_texts(tokenizer, {"prompt": "ab", "echo": True}) == ["ab"]
    assert prompt_texts(tokenizer, {"prompt": [[97, 98]], "echo": True}) == ["ab"]


# -- engine errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "endpoint", "expected", "code", "param"),
    [
        (PromptTooLongError("too long"), "completions", InvalidRequestError, "context_length_exceeded", "prompt"),
        (
            PromptTooLongError("too long"),
            "chat/completions",
            InvalidRequestError,
            "context_length_exceeded",
            "messages",
        ),
        (InvalidParamError("bad n", param="n"), "chat/completions", InvalidRequestError, "invalid_request", "n"),
        (
            InvalidParamError("no", code="chat_template_missing", param="messages"),
            "chat/completions",
            InvalidRequestError,
            "chat_template_missing",
            "messages",
        ),
        (DuplicateRequestError("odd"), "completions", InvalidRequestError, "invalid_request", None),
        (RequestFailedError("stop string failed"), "completions", EngineError, "engine_error", None),
        (EngineDeadError("stopped"), "completions", EngineError, "engine_error", None),
    ],
    ids=["too-long-text", "too-long-chat", "param", "coded", "duplicate", "request-failed", "dead"],
)
def test_engine_errors_become_the_gateways(
    error: Exception, endpoint: Any, expected: type[Exception], code: str, param: str | None
) -> None:
    with pytest.raises(expected) as info, engine_errors(endpoint):
        raise error
    assert info.value.code == code  # type: ignore[attr-defined]
    assert getattr(info.value, "param", None) == param


@pytest.mark.parametrize("error", [NotFoundError("gone"), ValueError("a bug"), RuntimeError("a bug")])
def test_only_the_engines_own_errors_are_translated(error: Exception) -> None:
    """Gateway errors pass through as they are; a builtin error is a bug, never read as the engine's answer."""
    with pytest.raises(type(error)) as info, engine_errors("completions"):
        raise error
    assert info.value is error


# -- responses --------------------------------------------------------------------------------------------------------


def test_stage_times_are_the_engine_requests_as_one() -> None:
    """One engine request: its own stages. Several (a list of prompts): the first arrival, admission and token of
    any, and the last end once every one ended (a stream cut before that never finished)."""
    one = StageTimes()
    assert one.combined() is None
    one.add(RequestOutput("a", [], 3))  # an output in the middle carries none
    one.add(RequestOutput("a", [], 3, stages=EngineStages(10, 20, 30, 0)))
    assert one.combined() == (10, 20, 30, 0)
    one.add(RequestOutput("a", [], 3, finished=True, stages=EngineStages(10, 20, 30, 40)))
    assert one.combined() == (10, 20, 30, 40)

    several = StageTimes(num_requests=3)
    several.add(RequestOutput("a", [], 3, finished=True, stages=EngineStages(10, 25, 35, 50)))
    several.add(RequestOutput("b", [], 3, stages=EngineStages(12, 20, 30, 0)))
    assert several.combined() == (10, 20, 30, 0)  # "b" is running, "c" has not been heard of
    several.add(RequestOutput("b", [], 3, finished=True, stages=EngineStages(12, 20, 30, 60)))
    several.add(RequestOutput("c", [], 3, finished=True, stages=EngineStages(11, 0, 0, 45)))  # aborted in the queue
    assert several.combined() == (10, 20, 30, 60)


def test_usage_counts_each_prompt_once_and_cached_tokens_when_finished() -> None:
    usage = Usage()
    usage.add_prompt([RequestOutput("a", [], num_prompt_tokens=7, num_cached_tokens=4)])
    usage.add_prompt([RequestOutput("a", [], num_prompt_tokens=7, num_cached_tokens=4, finished=True)])
    usage.add_prompt([RequestOutput("b", [], num_prompt_tokens=3, finished=True)])
    usage.completion_tokens = 5
    assert usage.as_dict() == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_chat_response_with_logprobs_and_the_clamp_reported_once() -> None:
    request = parsed(CHAT, clamped=(100, 10))
    logprobs = [TokenLogprob(ord("é"), -0.5, [(ord("é"), -0.5), (ord("e"), -1.0)])]
    choice = request.choice(0, CompletionOutput(0, text="é", token_ids=[233], logprobs=logprobs, finish_reason="stop"))
    assert choice["message"] == {"role": "assistant", "content": "é"} and choice["finish_reason"] == "stop"
    [entry] = choice["logprobs"]["content"]
    assert entry["token"] == "é" and entry["bytes"] == [0xC3, 0xA9] and entry["top_logprobs"][1]["token"] == "e"
    response = request.response([choice], {"prompt_tokens": 1}, "r1")
    assert response["id"] == "chatcmpl-r1" and response["object"] == "chat.completion" and response["model"] == "tiny"
    assert response[MAX_TOKENS_CLAMPED_KEY] == [100, 10]
    assert MAX_TOKENS_CLAMPED_KEY not in request.response([choice], {}, "r1")


def test_chat_tool_calls_parsed_whole_and_streamed() -> None:
    body = {**CHAT, "tools": [TOOL]}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    whole = parsed(body).choice(0, CompletionOutput(0, text=call, finish_reason="stop"))
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )
    streaming = parsed(body)
    first = streaming.delta_choice(0, CompletionOutput(0, text=call[:10]))
    last = streaming.delta_choice(0, CompletionOutput(0, text=call[10:], finish_reason="stop"))
    assert first["delta"] == {} and last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_stream_chunks_role_first_and_usage_only_when_asked() -> None:
    request = parsed({**CHAT, "stream_options": {"include_usage": True}})
    role = request.chunk("s", [request.role_choice(0)])
    assert role["object"] == "chat.completion.chunk" and role["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    assert role["usage"] is None
    assert request.chunk("s", [], usage={"total_tokens": 3})["usage"] == {"total_tokens": 3}
    assert "usage" not in parsed(CHAT).chunk("s", [])


def test_text_completion_echo_and_logprobs() -> None:
    body = {"model": "tiny", "prompt": ["ab", "cd"], "echo": True}
    request = parsed(body, is_chat=False, params=SamplingParams(max_tokens=4, n=2), prompt_texts=["ab", "cd"])
    logprobs = [TokenLogprob(ord("x"), -0.1, [(ord("x"), -0.1)]), TokenLogprob(ord("y"), -0.2, [])]
    choice = request.choice(1, CompletionOutput(1, text="xy", logprobs=logprobs, finish_reason="length"))
    assert choice["index"] == 3 and choice["text"] == "cdxy"
    assert choice["logprobs"] == {
        "tokens": ["x", "y"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"x": -0.1}, {}],
        "text_offset": [2, 3],  # into "cdxy": after the echoed prompt
    }
    assert request.response([choice], {}, "t")["id"] == "cmpl-t"
    delta = request.delta_choice(3, CompletionOutput(1, text="z"))
    assert delta == {"index": 3, "text": "z", "logprobs": None, "finish_reason": None}
