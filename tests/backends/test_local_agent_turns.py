"""Coding-agent turns on the local engine (issue 20, items 3 and 4), through a real gateway server and the clients'
own SDKs: a tool call in the model's text arrives as Anthropic `tool_use` blocks and as Responses `function_call`
items (streaming too); the next turn renders the call and its result into the chat template; that turn's prompt
starts with the previous turn's prompt token for token and reports it as cached.

The model is a tiny random Llama with the bundled model's tokenizer and chat template; what it "samples" is forced
by `ScriptedSampler`, a test double standing in for the engine's sampler (a random model calls no tools)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from fakes.access import RecordingAccess
from fakes.app import MASTER, make_settings
from fakes.engine_models import ScriptedSampler, tiny_engine_options
from fakes.server import ThreadedServer

from backends.local import LocalBackend, LocalBackendConfig
from gateway.app import create_app
from gateway.routing_config import parse_routing

NAME = "tiny#0"
BLOCK_SIZE = 16
SYSTEM = "You are a coding agent. Use the tools to read files before you answer."
TOOL_CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>'
TOOL_RESULT = "# unigate\nAn LLM gateway."
ANTHROPIC_TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {"name": "list_files", "description": "List the repository's files.", "input_schema": {"type": "object"}},
]
RESPONSES_TOOLS = [
    {"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
    for t in ANTHROPIC_TOOLS
]
# What the chat template is given for the second turn, after the first turn's prompt: the call as the model wrote
# it, then its result in a user turn (SmolLM2's template knows no tools: backends.tool_calls.plain_tool_messages).
SECOND_TURN_TAIL = (
    f"{TOOL_CALL}<|im_end|>\n"
    f"<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture
async def backend(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[LocalBackend]:
    engine = tiny_engine_options(tiny_model_dir, block_size=BLOCK_SIZE)
    config = LocalBackendConfig(NAME, "tiny", tmp_path / "models", engine)
    local = LocalBackend.from_local_config(config)
    await local.send(
        "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}, request_id="w"
    )
    yield local
    await local.aclose()


@pytest.fixture
def sampler(backend: LocalBackend, real_tokenizer: Any) -> ScriptedSampler:
    assert backend.engine is not None
    [eos] = real_tokenizer.eos_token_ids
    scripted = ScriptedSampler(eos)
    backend.engine.engine.sampler = scripted  # type: ignore[assignment]
    return scripted


@pytest.fixture
def server(backend: LocalBackend) -> Iterator[ThreadedServer]:
    routing = parse_routing({"models": [{"id": "tiny", "deployments": [{"type": "local", "name": NAME}]}]}, source="t")
    app = create_app(
        make_settings(), access=RecordingAccess(master_key=MASTER), routing=routing, backends={NAME: backend}
    )
    with ThreadedServer(app) as running:
        yield running


def say(sampler: ScriptedSampler, tokenizer: Any, text: str) -> None:
    sampler.token_ids = tokenizer.encode(text)


def claude(server: ThreadedServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=MASTER, max_retries=0, timeout=120)


def codex(server: ThreadedServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=MASTER, max_retries=0)


def system_blocks(nonce: str) -> list[dict[str, Any]]:
    """Claude Code's `system`: a billing line whose `cch` changes on every request, then the prompt itself."""
    billing = f"x-anthropic-billing-header: cc_version=2.1.42.834; cc_entrypoint=cli; cch={nonce};"
    return [
        {"type": "text", "text": billing},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]


def check_turns(sampler: ScriptedSampler, tokenizer: Any) -> tuple[list[int], list[int]]:
    first, second = sampler.prompts[-2:]
    assert second[: len(first)] == first, "the second turn's prompt does not start with the first turn's"
    assert tokenizer.decode(second[len(first) :], skip_special_tokens=False) == SECOND_TURN_TAIL
    return first, second


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_claude_code_turns_call_a_tool_and_reuse_the_prefix_cache(
    server: ThreadedServer, sampler: ScriptedSampler, real_tokenizer: Any, stream: bool
) -> None:
    client = claude(server)
    question = {"role": "user", "content": "What is this repository?"}
    request: dict[str, Any] = {"model": "tiny", "max_tokens": 32000, "tools": ANTHROPIC_TOOLS}

    say(sampler, real_tokenizer, TOOL_CALL)
    if stream:
        async with client.messages.stream(system=system_blocks("36ee5"), messages=[question], **request) as events:
            kinds = [event.type async for event in events]
            first = await events.get_final_message()
        assert "content_block_start" in kinds and "input_json" in kinds
    else:
        first = await client.messages.create(system=system_blocks("36ee5"), messages=[question], **request)
    [call] = first.content
    assert call.type == "tool_use" and call.name == "read_file" and call.input == {"path": "README.md"}
    assert first.stop_reason == "tool_use"
    assert not first.usage.cache_read_input_tokens

    say(sampler, real_tokenizer, "It is an LLM gateway.")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": TOOL_RESULT}
    messages = [question, {"role": "assistant", "content": [call.model_dump()]}, {"role": "user", "content": [result]}]
    second = await client.messages.create(system=system_blocks("0aaa9"), messages=messages, **request)
    assert second.content[0].type == "text" and second.content[0].text == "It is an LLM gateway."

    first_prompt, second_prompt = check_turns(sampler, real_tokenizer)
    cached = second.usage.cache_read_input_tokens or 0
    assert cached >= len(first_prompt) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert second.usage.input_tokens + cached == len(second_prompt)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_codex_turns_call_a_function_and_reuse_the_prefix_cache(
    server: ThreadedServer, sampler: ScriptedSampler, real_tokenizer: Any, stream: bool
) -> None:
    client = codex(server)
    question = {"role": "user", "content": [{"type": "input_text", "text": "What is this repository?"}]}
    request: dict[str, Any] = {"model": "tiny", "instructions": SYSTEM, "tools": RESPONSES_TOOLS, "store": False}

    say(sampler, real_tokenizer, TOOL_CALL)
    if stream:
        events = [event async for event in await client.responses.create(input=[question], stream=True, **request)]
        kinds = [event.type for event in events]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
        first = events[-1].response
    else:
        first = await client.responses.create(input=[question], **request)
    [call] = first.output
    assert call.type == "function_call" and call.name == "read_file"
    assert json.loads(call.arguments) == {"path": "README.md"}
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0

    say(sampler, real_tokenizer, "It is an LLM gateway.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    echoed = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    second = await client.responses.create(input=[question, echoed, output], **request)
    assert second.output_text == "It is an LLM gateway."

    first_prompt, second_prompt = check_turns(sampler, real_tokenizer)
    assert second.usage is not None and second.usage.input_tokens == len(second_prompt)
    assert second.usage.input_tokens_details.cached_tokens >= len(first_prompt) // BLOCK_SIZE * BLOCK_SIZE > 0


async def test_text_around_a_tool_call_and_a_text_answer_stay_text(
    server: ThreadedServer, sampler: ScriptedSampler, real_tokenizer: Any
) -> None:
    say(sampler, real_tokenizer, f"Let me look.\n{TOOL_CALL}")
    message = await claude(server).messages.create(
        model="tiny", max_tokens=100, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": "Read it"}]
    )
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me look."  # type: ignore[union-attr]
    say(sampler, real_tokenizer, '{"path": "README.md"} is a JSON object.')  # no call: a tool's arguments only
    message = await claude(server).messages.create(
        model="tiny", max_tokens=100, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": "Show JSON"}]
    )
    assert [block.type for block in message.content] == ["text"] and message.stop_reason == "end_turn"


async def test_claude_codes_agent_list_is_rendered_before_the_question_on_every_turn(
    server: ThreadedServer, sampler: ScriptedSampler, real_tokenizer: Any
) -> None:
    # Claude Code 2.1.197 sends its agent list as a system message after the first user message, on every turn.
    client = claude(server)
    question = {"role": "user", "content": [{"type": "text", "text": "Say hello in one line.", "cache_control": {}}]}
    agents = {"role": "system", "content": "Available agent types for the Agent tool:\n- Explore: read-only search."}
    request: dict[str, Any] = {"model": "tiny", "max_tokens": 32000, "tools": ANTHROPIC_TOOLS}

    say(sampler, real_tokenizer, "Hello!")
    first = await client.messages.create(system=system_blocks("36ee5"), messages=[question, agents], **request)
    assert first.content[0].text == "Hello!"  # type: ignore[union-attr]
    rendered = real_tokenizer.decode(sampler.prompts[-1], skip_special_tokens=False)
    assert rendered == (
        f"<|im_start|>system\n{SYSTEM}\n\n{agents['content']}<|im_end|>\n"
        "<|im_start|>user\nSay hello in one line.<|im_end|>\n<|im_start|>assistant\n"
    )

    say(sampler, real_tokenizer, "Goodbye!")
    answer = {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}
    follow_up = {"role": "user", "content": "Now say goodbye."}
    second = await client.messages.create(
        system=system_blocks("0aaa9"), messages=[question, agents, answer, follow_up], **request
    )
    first_prompt, second_prompt = sampler.prompts[-2:]
    assert second_prompt[: len(first_prompt)] == first_prompt
    assert real_tokenizer.decode(second_prompt[len(first_prompt) :], skip_special_tokens=False) == (
        "Hello!<|im_end|>\n<|im_start|>user\nNow say goodbye.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (second.usage.cache_read_input_tokens or 0) >= len(first_prompt) // BLOCK_SIZE * BLOCK_SIZE > 0
