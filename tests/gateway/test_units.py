"""Pure pieces: the routing file, body normalisation, the SSE decoder, the backend factory."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.anthropic import AnthropicBackend
from backends.openai import OpenAIBackend
from backends.sse import SSEDecoder
from gateway.app import create_app
from gateway.deployments import build_backend, upstream_config
from gateway.errors import BackendError
from gateway.logging import JsonFormatter
from gateway.normalize import normalize_chunk, normalize_response
from gateway.routing_config import RoutingConfigError, default_routing, load_routing, parse_routing
from gateway.settings import Settings

ISSUE_EXAMPLE = """
models:
  - id: gpt-4o-mini
    aliases: [fast]
    deployments:
      - type: openai
        base_url: https://api.example.com/v1
        api_key: env:UPSTREAM_KEY
        model: gpt-4o-mini
        weight: 1
        timeout_s: 60
        max_connections: 100
        max_in_flight: 20
        pool_timeout: 5
  - id: openai/*
    deployments: [{type: openai, base_url: "https://api.openai.com/v1", api_key: env:OPENAI_API_KEY}]
  - id: other-model
    deployments: [{type: local, model_path: /models/x.gguf}]
fallbacks:
  gpt-4o-mini: [other-model]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "unigate.yaml"
    path.write_text(text)
    return path


def test_issue_example_parses_with_env_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY", "sk-from-env")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    config = load_routing(write(tmp_path, ISSUE_EXAMPLE))
    first = config.models[0].deployments[0]
    assert first.api_key == "sk-from-env" and first.max_in_flight == 20 and first.pool_timeout == 5
    assert first.name == "gpt-4o-mini#0" and config.fallbacks == {"gpt-4o-mini": ["other-model"]}
    assert config.models[1].deployments[0].upstream_model("openai/gpt-4.1") == "gpt-4.1"
    assert config.models[2].deployments[0].model_path == "/models/x.gguf"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ISSUE_EXAMPLE, ["models[0].deployments[0].api_key", "UPSTREAM_KEY is not set", "export UPSTREAM_KEY"]),
        ("models:\n  - id: a\n    deployments: [{type: openai}]\n", ["models[0].deployments[0]", "needs `base_url`"]),
        ("models:\n  - id: a\n    deployments: [{type: grpc, base_url: x}]\n", ["type", "allowed values"]),
        ("models:\n  - id: a\n    deployments: []\n", ["models[0].deployments", "at least one"]),
        ("models:\n  - id: a\n    deplyments: []\n", ["deplyments", "check its spelling"]),
        ("models:\n  - {id: a, deployments: [{type: local, weight: 0}]}\n", ["weight", "positive number"]),
        (
            "models:\n  - {id: a, deployments: [{type: local}]}\n"
            "  - {id: b, aliases: [a], deployments: [{type: local}]}\n",
            ["'a' is used twice"],
        ),
        (
            "models:\n  - {id: a, deployments: [{type: local}]}\nfallbacks: {a: [zz]}\n",
            ["'zz'", "add it under `models`"],
        ),
        ("models: [\n", ["not valid YAML"]),
        (
            "models:\n  - id: a\n    deployments: [{type: openai, base_url: 'https://user:hunter2@api.example.com/v1'}]\n",
            ["models[0].deployments[0]", "must not hold credentials", "api_key"],
        ),
        ("models:\n  - id: a\n    deployments: [{type: anthropic, base_url: api.example.com}]\n", ["http(s) URL"]),
        (
            "models:\n  - id: a\n    deployments: [{type: openai, base_url: 'http://h/v1?key=1'}]\n",
            ["query or fragment"],
        ),
    ],
)
def test_invalid_config_names_file_field_and_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, expected: list[str]
) -> None:
    monkeypatch.delenv("UPSTREAM_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    path = write(tmp_path, text)
    with pytest.raises(RoutingConfigError) as info:
        load_routing(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in expected:
        assert fragment in message
    assert "hunter2" not in message  # a credential in a bad base_url is never repeated


def test_bad_config_fails_create_app(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  - id: a\n    deployments: [{type: openai}]\n")
    with pytest.raises(RoutingConfigError, match=r"unigate\.yaml"):
        create_app(Settings(_env_file=None, config=path, engine={"enabled": False}))  # type: ignore[arg-type]


def test_default_routing_follows_engine_settings() -> None:
    assert default_routing(Settings(_env_file=None, engine={"enabled": False})).models == []  # type: ignore[arg-type]
    config = default_routing(Settings(_env_file=None))
    model = config.models[0]
    assert (model.id, model.aliases, model.deployments[0].type) == ("smollm2-135m-instruct", ["local"], "local")


def test_factory_builds_openai_backend() -> None:
    config = parse_routing(
        {"models": [{"id": "m", "deployments": [{"type": "openai", "base_url": "http://h/v1"}]}]}, source="t"
    )
    backend = build_backend(config.models[0].deployments[0], Settings(_env_file=None))
    assert isinstance(backend, OpenAIBackend) and backend.name == "m#0"
    assert backend.supports("chat/completions") and not backend.supports("messages")


def test_upstream_config_takes_the_deployments_own_values_then_the_settings() -> None:
    deployments = [
        {"type": "anthropic", "base_url": "http://h/v1", "api_key": "k", "timeout_s": 7, "max_connections": 3},
        {"type": "openai", "base_url": "http://h/v1", "native_responses": True},
    ]
    config = parse_routing({"models": [{"id": "m", "deployments": deployments}]}, source="t")
    settings = Settings(_env_file=None, request_timeout_s=60, stream_idle_timeout_s=9, max_sse_event_bytes=1000)
    own, defaults = (upstream_config(d, settings) for d in config.models[0].deployments)
    assert (own.name, own.api_key, own.timeout_s, own.max_connections) == ("m#0", "k", 7, 3)
    assert (defaults.timeout_s, defaults.idle_timeout_s, defaults.max_event_bytes) == (60, 9, 1000)
    assert defaults.native_responses and not own.native_responses
    anthropic = build_backend(config.models[0].deployments[0], settings)
    assert isinstance(anthropic, AnthropicBackend) and anthropic.supports("messages")
    responses = OpenAIBackend.from_config(defaults)
    assert responses.name == "m#1" and responses.supports("responses")


GOOD_CHAT: dict[str, Any] = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]
}


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda b: b.pop("choices"), "no `choices`"),
        (lambda b: b.update(choices=[]), "`choices` is empty"),
        (lambda b: b.update(choices={}), "not a list"),
        (lambda b: b["choices"][0].pop("message"), "has no `message`"),
        (lambda b: b["choices"][0]["message"].update(content=1.5), "content` is a float"),
        (lambda b: b["choices"][0]["message"].pop("content"), "neither `content` nor `tool_calls`"),
        (lambda b: b["choices"][0]["message"].update(tool_calls="x"), "tool_calls` is a str"),
        (lambda b: b["choices"][0].update(index="0"), "index` is not an integer"),
        (lambda b: b["choices"][0].update(finish_reason=3), "finish_reason` is not a string"),
    ],
)
def test_normalize_rejects(mutate: Any, fragment: str) -> None:
    body = copy.deepcopy(GOOD_CHAT)
    mutate(body)
    with pytest.raises(BackendError, match="malformed") as info:
        normalize_response("chat/completions", body)
    assert info.value.code == "upstream_malformed_response" and fragment in info.value.message


def test_normalize_repairs_the_unambiguous() -> None:
    body = {
        "choices": [
            {"message": {"content": "hi"}},
            {"message": {"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}},
        ]
    }
    repaired = normalize_response("chat/completions", body)
    assert repaired["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
    }
    assert repaired["choices"][1]["finish_reason"] == "tool_calls"
    assert repaired["choices"][1]["message"]["content"] is None
    assert normalize_response("completions", {"choices": [{"text": "x"}]})["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(BackendError):
        normalize_response("completions", {"choices": [{"message": {}}]})
    with pytest.raises(BackendError, match="embedding"):
        normalize_response("embeddings", {"data": [{"vector": []}]})


def test_normalize_chunks() -> None:
    assert normalize_chunk("chat/completions", {"choices": [], "usage": {}})["choices"] == []
    closing = normalize_chunk("chat/completions", {"choices": [{"finish_reason": "stop"}]})
    assert closing["choices"][0] == {"finish_reason": "stop", "index": 0, "delta": {}}
    with pytest.raises(BackendError, match="has no `delta`"):
        normalize_chunk("chat/completions", {"choices": [{"index": 0}]})
    with pytest.raises(BackendError, match="not an object"):
        normalize_chunk("chat/completions", [1])


def test_sse_decoder_handles_splits_crlf_multiline_and_comments() -> None:
    decoder = SSEDecoder()
    stream = b': keep-alive\r\n\r\ndata: {"a":\r\ndata: 1}\r\n\r\nevent: ping\ndata: x\n\ndata: [DONE]\n\n'
    events = []
    for i in range(0, len(stream), 3):  # worst case: tiny network reads that split every line
        events.extend(decoder.feed(stream[i : i + 3]))
    assert events == [("message", b'{"a":\n1}'), ("ping", b"x"), ("message", b"[DONE]")]
    tail = SSEDecoder()
    assert tail.feed(b"data: last") == [] and tail.flush() == [("message", b"last")]


def test_json_log_lines_keep_extra_fields_but_not_uvicorns_coloured_copy() -> None:
    record = logging.makeLogRecord(
        {"name": "uvicorn.error", "levelname": "INFO", "msg": "Uvicorn running on %s", "args": ("http://x",)}
    )
    record.color_message = "Uvicorn running on \x1b[1m%s\x1b[0m"  # what uvicorn passes as `extra=`
    record.deployment = "a"
    line = orjson.loads(JsonFormatter().format(record))
    assert line["message"] == "Uvicorn running on http://x" and line["deployment"] == "a"
    assert "color_message" not in line
