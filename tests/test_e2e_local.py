"""The bundled model end to end: the production gateway (embedded engine, Redis-backed keys) on a loopback port,
driven by the official OpenAI and Anthropic SDKs, plus `unigate engine serve` as an upstream of another gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest
import yaml
from fakes.app import MASTER
from fakes.server import ThreadedServer

from gateway.engine_host.http import create_engine_app
from gateway.server import build_app
from gateway.settings import Settings

MODEL = "smollm2-135m-instruct"
PROMPT = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")  # shared: the converted weights are cached here after the first load


def engine_settings(data_dir: Path, **extra: object) -> Settings:
    engine = {"max_num_seqs": 8, "kv_cache_memory": 64 * 2**20}
    return Settings(_env_file=None, master_key=MASTER, data_dir=data_dir, engine=engine, **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gateway(redis_server_url: str, data_dir: Path) -> Iterator[ThreadedServer]:
    with ThreadedServer(build_app(engine_settings(data_dir, redis_url=redis_server_url))) as server:
        yield server


def test_openai_sdk_chat_and_stream(gateway: ThreadedServer) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=MASTER, timeout=120)
    messages = [{"role": "user", "content": PROMPT}]
    completion = client.chat.completions.create(model="local", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    text = completion.choices[0].message.content or ""
    assert "Paris" in text
    assert completion.usage is not None and completion.usage.completion_tokens <= 8
    assert completion.usage.prompt_tokens > 10
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same answer streamed
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == completion.usage.completion_tokens


def test_anthropic_sdk_messages_and_stream(gateway: ThreadedServer) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key=MASTER, timeout=120)
    messages = [{"role": "user", "content": PROMPT}]
    message = client.messages.create(model="local", max_tokens=8, messages=messages, extra_body={"temperature": 0})  # type: ignore[arg-type]
    text = "".join(block.text for block in message.content if block.type == "text")
    assert "Paris" in text
    assert message.usage.output_tokens <= 8 and message.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(
        model="local", max_tokens=8, messages=messages, extra_body={"temperature": 0}
    ) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.usage.output_tokens == message.usage.output_tokens


def test_openai_sdk_responses(gateway: ThreadedServer) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=MASTER, timeout=120)
    response = client.responses.create(model="local", input=PROMPT, max_output_tokens=16, temperature=0)
    assert "Paris" in response.output_text
    assert response.usage is not None and response.usage.output_tokens <= 16


def test_local_usage_is_charged_exactly_and_rpm_holds(gateway: ThreadedServer) -> None:
    """Every family against the engine: the key is charged exactly the usage the responses report."""
    admin = {"authorization": f"Bearer {MASTER}"}
    key = httpx.post(f"{gateway.url}/admin/keys", json={"rpm": 4, "token_budget": 100_000}, headers=admin).json()
    user = {"authorization": f"Bearer {key['key']}"}
    messages = [{"role": "user", "content": PROMPT}]
    reported = 0
    with httpx.Client(base_url=gateway.url, headers=user, timeout=120) as client:
        chat = client.post("/v1/chat/completions", json={"model": "local", "messages": messages, "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        reported += chat.json()["usage"]["total_tokens"]
        stream = client.post(
            "/v1/chat/completions",
            json={
                "model": "local",
                "messages": messages,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        last = [line for line in stream.text.splitlines() if line.startswith("data: {")][-1]
        reported += orjson.loads(last[len("data: ") :])["usage"]["total_tokens"]
        message = client.post("/v1/messages", json={"model": "local", "messages": messages, "max_tokens": 4}).json()
        usage = message["usage"]  # Anthropic's input_tokens leave out the tokens read from the prefix cache
        reported += usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage["output_tokens"]
        response = client.post("/v1/responses", json={"model": "local", "input": PROMPT, "max_output_tokens": 4}).json()
        reported += response["usage"]["input_tokens"] + response["usage"]["output_tokens"]
        limited = client.post("/v1/chat/completions", json={"model": "local", "messages": messages, "max_tokens": 4})
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    record = httpx.get(f"{gateway.url}/admin/keys/{key['id']}", headers=admin).json()
    assert (record["num_requests"], record["tokens_spent"], record["budget_spent"]) == (4, reported, reported)


def test_engine_stats_in_admin_and_metrics(gateway: ThreadedServer) -> None:
    headers = {"authorization": f"Bearer {MASTER}"}
    stats = httpx.get(f"{gateway.url}/admin/engine", headers=headers).json()["data"]
    assert len(stats) == 1 and stats[0]["model"] == MODEL and stats[0]["loaded"] is True
    engine = stats[0]
    assert engine["kv_blocks_total"] == engine["kv_blocks_used"] + engine["kv_blocks_free"]
    assert engine["memory_bytes"]["weights"] > 100 * 2**20  # 135M params in float32
    assert engine["generation_tokens_total"] > 0
    model = httpx.get(f"{gateway.url}/v1/models/{MODEL}", headers=headers).json()
    assert model["dtype"] == engine["dtype"] == "float32" and model["max_model_len"] == engine["max_model_len"]
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert f'unigate_engine_kv_blocks_total{{deployment="{engine["name"]}",model="{MODEL}"}}' in metrics
    assert "unigate_engine_generation_tokens_total" in metrics


def test_engine_serve_as_an_upstream(redis_url: str, data_dir: Path, tmp_path: Path) -> None:
    """`unigate engine serve` (here its app) behind a gateway that routes to it as `type: openai`."""
    with ThreadedServer(create_engine_app(engine_settings(data_dir), api_key="sk-engine")) as engine:
        routing = tmp_path / "unigate.yaml"
        upstream = {"type": "openai", "base_url": f"{engine.url}/v1", "api_key": "sk-engine", "model": MODEL}
        routing.write_text(yaml.safe_dump({"models": [{"id": "remote-smol", "deployments": [upstream]}]}))
        settings = engine_settings(tmp_path, redis_url=redis_url, config=routing)
        with ThreadedServer(build_app(settings)) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=MASTER, timeout=120)
            completion = client.chat.completions.create(
                model="remote-smol", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
            )
        assert "Paris" in (completion.choices[0].message.content or "")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        denied = httpx.post(f"{engine.url}/v1/chat/completions", json=body)
        assert denied.status_code == 401  # the engine server checks its own key


def test_a_prequantized_checkpoint_is_served_through_the_gateway(redis_url: str, tmp_path: Path) -> None:
    """An AWQ checkpoint (tests/local_engine/loading/prequantized/) as a `type: local` deployment of the real
    gateway: text completions over HTTP with the key, the format in /admin/engine; and the same directory with
    `quantization: int8` asked of it fails to load with a message saying what to set."""
    awq = Path(__file__).parent / "local_engine" / "loading" / "prequantized" / "awq-w4g64"
    routing = tmp_path / "unigate.yaml"
    deployment = {"type": "local", "model_path": str(awq)}
    wrong = {"type": "local", "model_path": str(awq), "quantization": "int8"}
    routing.write_text(
        yaml.safe_dump(
            {"models": [{"id": "tiny-awq", "deployments": [deployment]}, {"id": "tiny-x", "deployments": [wrong]}]}
        )
    )
    settings = engine_settings(tmp_path, redis_url=redis_url, config=routing)
    headers = {"authorization": f"Bearer {MASTER}"}
    with ThreadedServer(build_app(settings)) as gateway:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=MASTER, timeout=120)
        completion = client.completions.create(model="tiny-awq", prompt="the quick brown fox", max_tokens=6)
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        stats = {s["model"]: s for s in httpx.get(f"{gateway.url}/admin/engine", headers=headers).json()["data"]}
        assert stats["tiny-awq"]["checkpoint_quantization"] == "awq int4 g64"
        assert stats["tiny-awq"]["quantization"] == "int4"
        refused = httpx.post(
            f"{gateway.url}/v1/completions",
            headers=headers,
            json={"model": "tiny-x", "prompt": "hi", "max_tokens": 2},
            timeout=120,
        )
    error = refused.json()["error"]  # a model that cannot load: 500 with the loader's code and account
    assert refused.status_code == 500 and error["code"] == "checkpoint_unsupported", refused.text
    assert "already quantized (awq int4 g64)" in error["message"] and "quantization: none" in error["message"]
