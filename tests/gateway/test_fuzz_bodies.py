"""Fuzz every route family's body against the real gateway.

The gateway runs as in production (`gateway.server.build_app` under uvicorn on a loopback port: Redis-backed keys
and limits on a real Redis, the header limits, the admin API) with a normal key and the master key, in front of
fake upstreams on loopback (one answering, one failing on purpose: model `broken`) and a local engine serving a
tiny random model (model `tiny`). Bodies come from hypothesis strategies that follow each family's request
schema (chat/completions, completions, embeddings, messages, responses), with any field sometimes of the wrong
type or out of range and unknown fields mixed in.

Every answer must be below 500 — except 502/503/504 for `broken`, whose upstream answers 500 on purpose — and
arrive, streams included, within the client's timeout (no hangs); after each family the gateway, and the local
engine, still serve normal requests.

`UNIGATE_FUZZ_EXAMPLES` sets the examples per family (default 60, derandomized so `make test` is repeatable;
set it to explore further with fresh random examples each run).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.server import ThreadedServer
from fakes.upstream import Behavior, FakeUpstream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.server import build_app
from gateway.settings import EngineSettings, Settings

MASTER = "sk-ug-master-fuzz-key-0123456789"
EXAMPLES = int(os.environ.get("UNIGATE_FUZZ_EXAMPLES", "60"))
IS_DEFAULT_RUN = "UNIGATE_FUZZ_EXAMPLES" not in os.environ
LOCAL = "tiny"
BROKEN = "broken"
MODELS = ["gpt-test", "fast", "openai/fuzz-model", "native-resp", BROKEN, LOCAL]
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=IS_DEFAULT_RUN,
    database=None if IS_DEFAULT_RUN else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
pytestmark = pytest.mark.timeout(max(180, EXAMPLES * 3))


# --- the gateway under test ---------------------------------------------------------------------------------------


def _tiny_checkpoint(directory: Path) -> Path:
    return tiny_llama_checkpoint(directory)


class Gateway:
    def __init__(self, server: ThreadedServer, key: str) -> None:
        self.server = server
        self.keys = {"master": MASTER, "key": key, "bogus": "sk-ug-not-a-key"}
        self.client = httpx.Client(base_url=server.url, timeout=60)


@pytest.fixture(scope="module")
def gateway(redis_server_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    directory = tmp_path_factory.mktemp("fuzz")
    with FakeUpstream() as upstream, FakeUpstream() as failing:
        failing.behave(Behavior(mode="status", status=500))
        upstream.is_recording = failing.is_recording = False  # thousands of requests: keep no log of them
        openai = {"type": "openai", "base_url": upstream.base_url, "api_key": "sk-upstream"}
        routing = {
            "models": [
                {"id": "gpt-test", "aliases": ["fast"], "deployments": [openai]},
                {"id": "openai/*", "deployments": [openai]},
                {"id": "native-resp", "deployments": [{**openai, "native_responses": True}]},
                {"id": BROKEN, "deployments": [{**openai, "base_url": failing.base_url}]},
                {"id": LOCAL, "deployments": [{"type": "local", "model_path": str(_tiny_checkpoint(directory))}]},
            ],
            "router": {"num_retries": 0, "retry_backoff_s": 0.001, "max_backoff_s": 0.01},
        }
        config = directory / "unigate.yaml"
        config.write_text(yaml.safe_dump(routing))
        engine = EngineSettings(
            device="cpu",
            kv_cache_memory=4 * 2**20,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            cpu_kernels=False,
            pack_cpu_weights=False,
        )
        app_settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            redis_url=redis_server_url,
            master_key=MASTER,  # type: ignore[arg-type]
            data_dir=directory / "data",
            config=config,
            engine=engine,
            log_level="warning",
        )
        with ThreadedServer(build_app(app_settings)) as server:
            admin = {"authorization": f"Bearer {MASTER}"}
            created = httpx.post(f"{server.url}/admin/keys", json={"name": "fuzz"}, headers=admin, timeout=30)
            assert created.status_code == 201, created.text
            gateway = Gateway(server, created.json()["key"])
            assert_still_serving(gateway)  # also waits out the engine's load
            yield gateway
            gateway.client.close()


def assert_still_serving(gateway: Gateway) -> None:
    headers = {"authorization": f"Bearer {gateway.keys['key']}"}
    for model in ("gpt-test", LOCAL):
        body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        for _ in range(600):  # the engine may still be loading (first call only)
            response = gateway.client.post("/v1/chat/completions", json=body, headers=headers)
            if response.status_code != 503:
                break
        assert response.status_code == 200, (model, response.text)
    messages = {"model": LOCAL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert gateway.client.post("/v1/messages", json=messages, headers=headers).status_code == 200
    assert (
        gateway.client.post("/v1/responses", json={"model": LOCAL, "input": "Hi"}, headers=headers).status_code == 200
    )
    assert gateway.client.get("/health/live").status_code == 200


_LENGTH_FIELDS = {"/v1/responses": "max_output_tokens", "/v1/chat/completions": "max_completion_tokens"}


def cheap_for_local(path: str, body: Any) -> Any:
    """The tiny model on 2 CPU cores: valid lengths and choice counts cut to a few tokens (a random model rarely
    stops by itself); invalid values are left for the gateway to reject."""
    if not isinstance(body, dict) or body.get("model") != LOCAL:
        return body
    body = dict(body)
    limits = {
        "max_tokens": 8,
        "max_completion_tokens": 8,
        "max_output_tokens": 8,
        "min_tokens": 4,
        "n": 2,
        "best_of": 2,
    }
    for name, limit in limits.items():
        value = body.get(name)
        if type(value) is int and value > limit:
            body[name] = limit
    if all(body.get(name) is None for name in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        body[_LENGTH_FIELDS.get(path, "max_tokens")] = 8
    return body


def send(gateway: Gateway, path: str, body: Any, key: str) -> None:
    """Post `body` (streamed answers read to the end) and check the status."""
    body = cheap_for_local(path, body)
    content = json.dumps(body).encode()  # the stdlib writes integers past 64 bits, which orjson refuses
    headers = {"authorization": f"Bearer {gateway.keys[key]}", "content-type": "application/json"}
    with gateway.client.stream("POST", path, content=content, headers=headers) as response:
        data = response.read()
    model = body.get("model") if isinstance(body, dict) else None
    allowed = (502, 503, 504) if model == BROKEN else ()
    assert response.status_code < 500 or response.status_code in allowed, (response.status_code, data[:500])
    if response.status_code >= 400:
        assert b'"error"' in data[:2000], data[:500]


# --- strategies: each family's schema, every field sometimes wrong ------------------------------------------------

SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
ANY = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
TEXT = st.text(max_size=40)
NAME = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)


def number(low: float, high: float) -> st.SearchStrategy[Any]:
    return st.floats(low, high) | st.integers(int(low), int(high))


def integer(low: int, high: int) -> st.SearchStrategy[Any]:
    return st.integers(low, high)


WRONG = ANY | st.floats(-1e30, 1e30) | st.integers(-(2**70), 2**70) | st.text(max_size=3000)


@st.composite
def mutated(draw: st.DrawFn, strategy: st.SearchStrategy[Any]) -> Any:
    """A body from `strategy`, valid by its schema; half the time one value in it, at any depth, replaced by a
    value of any type or out of range. Rarely not an object at all."""
    if draw(st.integers(0, 20)) == 10:
        return draw(ANY)
    body = copy.deepcopy(draw(strategy))  # strategies may share objects (st.just): never mutate those
    if not draw(st.booleans()):
        return body
    node = body
    while isinstance(node, dict | list) and node:
        key = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        child = node[key]
        if not isinstance(child, dict | list) or not child or draw(st.booleans()):
            node[key] = draw(WRONG)
            break
        node = child
    return body


MODEL = st.sampled_from(MODELS)
KEY = st.sampled_from(["master", "key", "bogus", "key", "master"])
STOP_STRING = st.text(min_size=1, max_size=8)
STOP = STOP_STRING | st.lists(STOP_STRING, max_size=4)
SCHEMA = st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
EXTRA = st.dictionaries(st.from_regex(r"x_[a-z]{1,6}", fullmatch=True), ANY, max_size=2)  # unknown fields

OPENAI_SAMPLING = {
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "n": integer(1, 3),
    "seed": integer(-(2**63), 2**63 - 1),
    "stop": STOP,
    "max_tokens": integer(1, 8),
    "logit_bias": (st.dictionaries(st.integers(0, 300).map(str), st.integers(-100, 100), max_size=3)),
    "top_k": integer(-1, 50),
    "min_p": number(0, 1),
    "repetition_penalty": number(0.5, 2),
    "min_tokens": integer(0, 4),
    "stop_token_ids": (st.lists(st.integers(0, 300), max_size=3)),
    "stream": (st.booleans()),
    "user": (TEXT),
}

CHAT_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": (TEXT)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": (st.fixed_dictionaries({"url": TEXT}))}),
    st.dictionaries(st.text(max_size=5), ANY, max_size=3),
)
TOOL_CALL = st.fixed_dictionaries(
    {
        "id": TEXT,
        "type": st.just("function"),
        "function": (st.fixed_dictionaries({"name": NAME, "arguments": (TEXT)})),
    }
)
CHAT_MESSAGE = st.fixed_dictionaries(
    {
        "role": (st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
        "content": (TEXT | st.lists(CHAT_PART, max_size=3) | st.none()),
    },
    optional={"name": (NAME), "tool_calls": (st.lists(TOOL_CALL, max_size=2)), "tool_call_id": TEXT},
)
FUNCTION_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": (st.fixed_dictionaries({"name": NAME}, optional={"description": TEXT, "parameters": SCHEMA})),
    }
)
CHAT = st.fixed_dictionaries(
    {"model": MODEL, "messages": (st.lists(CHAT_MESSAGE, min_size=1, max_size=4))},
    optional={
        **OPENAI_SAMPLING,
        "max_completion_tokens": integer(1, 8),
        "logprobs": (st.booleans()),
        "top_logprobs": integer(0, 20),
        "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()})),
        "tools": (st.lists(FUNCTION_TOOL, max_size=2)),
        "tool_choice": (
            st.sampled_from(["auto", "none", "required"])
            | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAME})})
        ),
        "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
        "parallel_tool_calls": (st.booleans()),
        "metadata": ANY,
    },
)
TOKEN_IDS = st.lists(st.integers(0, 300), max_size=6)
COMPLETIONS = st.fixed_dictionaries(
    {
        "model": MODEL,
        "prompt": (TEXT | st.lists(TEXT, max_size=3) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=2)),
    },
    optional={
        **OPENAI_SAMPLING,
        "logprobs": integer(0, 5),
        "echo": (st.booleans()),
        "best_of": integer(1, 2),
        "suffix": (TEXT),
    },
)
EMBEDDINGS = st.fixed_dictionaries(
    {"model": MODEL, "input": (TEXT | st.lists(TEXT, min_size=1, max_size=3) | TOKEN_IDS)},
    optional={
        "encoding_format": (st.sampled_from(["float", "base64"])),
        "dimensions": integer(1, 64),
        "user": TEXT,
    },
)

ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": (TEXT)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": (
                st.fixed_dictionaries({"type": st.just("base64"), "media_type": st.just("image/png"), "data": TEXT})
                | st.fixed_dictionaries({"type": st.just("url"), "url": TEXT})
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": (TEXT),
            "name": (NAME),
            "input": (st.dictionaries(NAME, ANY, max_size=2)),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": (TEXT),
            "content": (TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)),
        },
        optional={"is_error": st.booleans()},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("document"),
            "source": (st.fixed_dictionaries({"type": st.just("text"), "data": TEXT})),
        }
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT, "signature": TEXT}),
    st.dictionaries(st.text(max_size=5), ANY, max_size=3),
)
ANTHROPIC_TOOL = st.one_of(
    st.fixed_dictionaries({"name": (NAME), "input_schema": SCHEMA}, optional={"description": (TEXT)}),
    st.just({"type": "web_search_20250305", "name": "web_search"}),
)
MESSAGES = st.fixed_dictionaries(
    {
        "model": MODEL,
        "max_tokens": integer(1, 8),
        "messages": (
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": (st.sampled_from(["user", "assistant"])),
                        "content": (TEXT | st.lists(ANTHROPIC_BLOCK, max_size=3)),
                    }
                ),
                min_size=1,
                max_size=4,
            )
        ),
    },
    optional={
        "system": (TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)),
        "temperature": number(0, 1),
        "top_p": number(0, 1),
        "top_k": integer(0, 50),
        "stop_sequences": st.lists(STOP_STRING, max_size=4),
        "stream": (st.booleans()),
        "tools": (st.lists(ANTHROPIC_TOOL, max_size=2)),
        "tool_choice": (
            st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool"])}, optional={"name": NAME})
        ),
        "metadata": (st.fixed_dictionaries({"user_id": TEXT})),
        "thinking": ANY,
        "output_config": ANY,
    },
)

RESPONSE_PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": (TEXT)}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": (TEXT)}),
    st.dictionaries(st.text(max_size=5), ANY, max_size=3),
)
RESPONSE_ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": (st.sampled_from(["user", "assistant", "system", "developer"])),
            "content": (TEXT | st.lists(RESPONSE_PART, max_size=3)),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": (TEXT),
            "name": (NAME),
            "arguments": (TEXT),
        }
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": (TEXT), "output": (TEXT)}),
    st.just({"type": "reasoning", "summary": []}),
    st.dictionaries(st.text(max_size=5), ANY, max_size=3),
)
RESPONSES = st.fixed_dictionaries(
    {"model": MODEL, "input": (TEXT | st.lists(RESPONSE_ITEM, min_size=1, max_size=4))},
    optional={
        "instructions": (TEXT),
        "max_output_tokens": integer(1, 8),
        "temperature": number(0, 2),
        "top_p": number(0, 1),
        "top_logprobs": integer(0, 20),
        "stream": (st.booleans()),
        "store": (st.booleans()),
        "previous_response_id": (TEXT),
        "conversation": ANY,
        "tools": (
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.just("function"), "name": (NAME)},
                    optional={"parameters": SCHEMA, "description": TEXT, "strict": st.booleans()},
                )
                | st.just({"type": "web_search"}),
                max_size=2,
            )
        ),
        "tool_choice": (st.sampled_from(["auto", "none", "required"])),
        "text": (
            st.fixed_dictionaries(
                {"format": (st.fixed_dictionaries({"type": st.just("json_schema"), "name": NAME, "schema": SCHEMA}))}
            )
        ),
        "parallel_tool_calls": (st.booleans()),
        "reasoning": ANY,
        "user": (TEXT),
    },
)


def with_extra(strategy: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    """The family's body with unknown fields mixed in, then perhaps one value made wrong (`mutated`)."""
    return mutated(st.builds(lambda known, extra: {**extra, **known}, strategy, EXTRA))


# --- the tests: one per family ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "strategy"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETIONS),
        ("/v1/embeddings", EMBEDDINGS),
        ("/v1/messages", MESSAGES),
        ("/v1/responses", RESPONSES),
    ],
    ids=["chat", "completions", "embeddings", "messages", "responses"],
)
def test_fuzzed_bodies_never_fail_the_gateway(gateway: Gateway, path: str, strategy: st.SearchStrategy[Any]) -> None:
    @FUZZ
    @given(body=with_extra(strategy), key=KEY)
    def run(body: Any, key: str) -> None:
        send(gateway, path, body, key)

    run()
    assert_still_serving(gateway)
