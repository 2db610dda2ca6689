"""LocalBackend end to end on a tiny random model saved as a Hugging Face directory with the real tokenizer."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakes.engine_models import tiny_engine_options

from backends.base import Backend
from backends.config import LocalEngineOptions
from backends.local import LocalBackend, LocalBackendConfig
from gateway.errors import InvalidRequestError

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say something about 春天 🌸"}]}


@pytest.fixture
async def backend(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[LocalBackend]:
    engine = tiny_engine_options(tiny_model_dir)
    config = LocalBackendConfig("tiny#0", "tiny", tmp_path / "models", engine)
    local = LocalBackend.from_local_config(config)
    yield local
    await local.aclose()


async def test_is_a_backend_and_becomes_healthy(backend: LocalBackend) -> None:
    assert isinstance(backend, Backend)
    assert backend.supports("chat/completions") and backend.supports("completions")
    assert not backend.supports("embeddings")
    await backend.send("chat/completions", {**CHAT, "max_tokens": 1}, request_id="warm")
    assert await backend.check_health()
    stats = backend.stats()
    assert stats["loaded"] and stats["kv_blocks_total"] == stats["capacity"]["num_blocks"]
    assert set(stats["memory_bytes"]) == {"weights", "kv_cache", "peak"}


async def test_chat_non_streaming(backend: LocalBackend, real_tokenizer: Any) -> None:
    body = {**CHAT, "max_tokens": 6, "temperature": 0}
    response = await backend.send("chat/completions", body, request_id="r1")
    assert response["object"] == "chat.completion" and response["id"] == "chatcmpl-r1"
    [choice] = response["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    prompt_tokens = len(real_tokenizer.apply_chat_template(CHAT["messages"]))
    assert response["usage"]["prompt_tokens"] == prompt_tokens
    assert response["usage"]["completion_tokens"] == 6
    assert response["usage"]["total_tokens"] == prompt_tokens + 6


async def test_chat_stream_matches_non_streaming_and_reports_usage(backend: LocalBackend) -> None:
    body = {**CHAT, "max_tokens": 12, "temperature": 0}
    whole = await backend.send("chat/completions", body, request_id="a")
    chunks = [
        c
        async for c in backend.stream(
            "chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}, request_id="b"
        )
    ]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_with_tools_text_that_is_no_call_streams_and_returns_as_content(backend: LocalBackend) -> None:
    """The tool-call reader sits in both paths; on text that holds no call, both give the plain answer."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {**CHAT, "max_tokens": 24, "temperature": 0}
    plain = await backend.send("chat/completions", body, request_id="p")
    whole = await backend.send("chat/completions", {**body, "tools": tools}, request_id="w")
    message = whole["choices"][0]["message"]
    assert message["content"] == plain["choices"][0]["message"]["content"] and "tool_calls" not in message
    assert whole["choices"][0]["finish_reason"] == "length"
    chunks = [c async for c in backend.stream("chat/completions", {**body, "tools": tools}, request_id="s")]
    assert all(c["choices"][0]["delta"] or c["choices"][0]["finish_reason"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_text_completions_with_several_prompts_and_n(backend: LocalBackend) -> None:
    body = {"model": "tiny", "prompt": ["Once upon", "The sky"], "n": 2, "max_tokens": 4, "seed": 3, "echo": True}
    response = await backend.send("completions", body, request_id="c")
    assert response["object"] == "text_completion"
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    assert response["choices"][0]["text"].startswith("Once upon")
    assert response["choices"][2]["text"].startswith("The sky")
    assert response["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("seed", [3, 4])
async def test_echo_and_text_offsets_agree_streamed_or_not(backend: LocalBackend, seed: int) -> None:
    """`echo` puts the prompt before each choice's text in a stream too, and `text_offset` points each token at
    its place in the text the client receives (after the echoed prompt, across a stream's chunks)."""
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 5, "seed": seed, "echo": True, "logprobs": 1}
    whole = (await backend.send("completions", body, request_id="e"))["choices"][0]
    chunks = [c async for c in backend.stream("completions", {**body, "stream": True}, request_id="es")]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(choice["text"] for choice in streamed)
    tokens = [t for choice in streamed if choice["logprobs"] for t in choice["logprobs"]["tokens"]]
    offsets = [o for choice in streamed if choice["logprobs"] for o in choice["logprobs"]["text_offset"]]
    assert text == whole["text"] and text.startswith("Once upon")
    assert (tokens, offsets) == (whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"])
    assert offsets[0] == len("Once upon")
    assert all(b - a == len(token) for a, b, token in zip(offsets, offsets[1:], tokens, strict=False))
    whole_tokens = [(t, o) for t, o in zip(tokens, offsets, strict=True) if "\ufffd" not in t]  # (part of a character)
    assert all(text[offset : offset + len(token)] == token for token, offset in whole_tokens)


async def test_logprobs_in_openai_shape(backend: LocalBackend) -> None:
    body = {**CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    [choice] = (await backend.send("chat/completions", body, request_id="l"))["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["logprob"] <= 0 and isinstance(entry["bytes"], list) and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
    legacy = await backend.send(
        "completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logprobs": 1}, request_id="l2"
    )
    logprobs = legacy["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 2 and len(logprobs["top_logprobs"][0]) == 1


async def test_stop_string_cuts_the_output(backend: LocalBackend) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 24, "temperature": 0}
    text = (await backend.send("completions", body, request_id="s1"))["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop
    stopped = (await backend.send("completions", {**body, "stop": [stop]}, request_id="s2"))["choices"][0]
    assert stopped["text"] == text[: text.index(stop)]
    assert stopped["finish_reason"] == "stop"


async def test_errors_are_gateway_errors(backend: LocalBackend) -> None:
    too_long = {"model": "tiny", "prompt": list(range(300)), "max_tokens": 4}
    with pytest.raises(InvalidRequestError) as info:
        await backend.send("completions", too_long, request_id="e1")
    assert info.value.code == "context_length_exceeded" and info.value.status_code == 400
    too_long_chat = {**CHAT, "messages": [{"role": "user", "content": "spring " * 400}]}  # (a max_tokens is clamped)
    with pytest.raises(InvalidRequestError) as info:
        [c async for c in backend.stream("chat/completions", too_long_chat, request_id="e2")]
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="top_p"):
        await backend.send("chat/completions", {**CHAT, "top_p": 0}, request_id="e3")
    for bias, reason in (({"1": 101}, "in \\[-100, 100\\]"), ({"x": 1}, "token ids"), ({"999999": 1}, "token ids in")):
        with pytest.raises(InvalidRequestError, match=f"logit_bias.*{reason}"):
            await backend.send("chat/completions", {**CHAT, "logit_bias": bias}, request_id="e4")


async def test_logit_bias_bans_and_forces_tokens(backend: LocalBackend, real_tokenizer: Any) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    text = (await backend.send("completions", body, request_id="b1"))["choices"][0]["text"]
    first = real_tokenizer.hf.encode(text)[0]
    banned = await backend.send("completions", {**body, "logit_bias": {str(first): -100}}, request_id="b2")
    assert real_tokenizer.hf.encode(banned["choices"][0]["text"])[0] != first
    forced_id = real_tokenizer.hf.encode(" sun")[0]
    forced = await backend.send("completions", {**body, "logit_bias": {str(forced_id): 100}}, request_id="b3")
    assert forced["choices"][0]["text"] == real_tokenizer.hf.decode([forced_id] * 6)


async def test_closing_a_stream_aborts_the_engine_request(backend: LocalBackend) -> None:
    stream = backend.stream("chat/completions", {**CHAT, "max_tokens": 200, "stream": True}, request_id="d")
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    async with asyncio.timeout(30):
        while backend.stats()["num_running_seqs"] or backend.stats()["kv_blocks_used"]:
            await asyncio.sleep(0.01)


async def test_missing_model_fails_clearly(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.gguf")
    config = LocalBackendConfig(
        "missing#0", "missing", tmp_path / "models", LocalEngineOptions(model_path=missing, device="cpu")
    )
    local = LocalBackend.from_local_config(config)
    with pytest.raises(Exception) as info:
        await local.send("chat/completions", CHAT, request_id="m")
    assert getattr(info.value, "status_code", 0) >= 400
    assert not await local.check_health()
    await local.aclose()


async def test_sampling_defaults_fill_what_a_request_leaves_out(
    backend: LocalBackend, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The model's own defaults (its generation_config.json) unless the deployment sets `sampling_defaults`; a
    field the request sends is the request's. Observed through the answers: greedy decoding is temperature 0."""
    body = {**CHAT, "max_tokens": 8, "seed": 7}

    async def answer(local: LocalBackend, **fields: Any) -> str:
        response = await local.send("chat/completions", {**body, **fields}, request_id="d")
        return str(response["choices"][0]["message"]["content"])

    greedy, sampled = await answer(backend, temperature=0), await answer(backend, temperature=1)
    assert greedy != sampled and await answer(backend) == sampled  # no defaults here: OpenAI's temperature 1
    assert backend.stats()["sampling_defaults"] == {}

    model_dir = tmp_path / "with-generation-config"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    options = {"device": "cpu", "kv_cache_memory": 2 * 2**20, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    for override, expected in ((None, {"temperature": 0.0, "top_k": 5}), ({"temperature": 1.0}, {"temperature": 1.0})):
        engine = LocalEngineOptions(model_path=str(model_dir), sampling_defaults=override, **options)
        config = LocalBackendConfig("tiny#1", "tiny", tmp_path / "models", engine)
        local = LocalBackend.from_local_config(config)
        try:
            assert await answer(local) == (greedy if override is None else sampled)
            assert await answer(local, temperature=1, top_k=0) == sampled  # the request's own fields win
            assert local.stats()["sampling_defaults"] == expected
        finally:
            await local.aclose()
