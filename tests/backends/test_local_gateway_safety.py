"""The local engine behind the real gateway app, tried as a hostile tenant would (issue 25, items 1, 5 and 9):
bad sampling fields are 400s and never stop the engine, one request's failure is that request's alone, a failed
step restarts the engine (readiness says `restarting`), prompts are tokenized off the event loop after a size check,
and a loading engine is `loading` (never cooled down) while requests wait for it or get 503 `engine_loading`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, MASTER, asgi_client, make_settings
from fakes.engine_models import tiny_engine_options
from starlette.applications import Starlette

from backends.local import LocalBackend, LocalBackendConfig
from gateway.app import create_app
from gateway.errors import InvalidRequestError
from gateway.routing_config import parse_routing

NAME = "tiny#0"
OTHER_KEY = "sk-ug-other-tenant"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about spring"}], "max_tokens": 8}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about spring"}], "max_tokens": 8}
ENGINE = tiny_engine_options()


def build_backend(model_dir: Path, data_dir: Path, *, load_wait_s: float = 30.0) -> LocalBackend:
    engine = ENGINE.model_copy(update={"model_path": str(model_dir), "load_wait_s": load_wait_s})
    config = LocalBackendConfig(NAME, "tiny", data_dir / "models", engine)
    return LocalBackend.from_local_config(config)


def gateway(backend: LocalBackend, **settings: Any) -> Starlette:
    routing = parse_routing({"models": [{"id": "tiny", "deployments": [{"type": "local", "name": NAME}]}]}, source="t")
    access = RecordingAccess(master_key=MASTER, keys={OTHER_KEY: ("tiny",)})
    return create_app(make_settings(**settings), access=access, routing=routing, backends={NAME: backend})


@pytest.fixture
async def backend(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[LocalBackend]:
    local = build_backend(tiny_model_dir, tmp_path)
    await local.send("chat/completions", {**CHAT, "max_tokens": 1}, request_id="warm")  # loaded and serving
    yield local
    await local.aclose()


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def ready_state(client: httpx.AsyncClient) -> tuple[int, str]:
    response = await client.get("/health/ready")
    return response.status_code, response.json()["deployments"][NAME]


# -- item 1: bad fields -------------------------------------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": "user", "content": "hi", "name": nested(900)}]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": nested(900)}}}]},
        {"tools": "x"},
    ],
)
async def test_what_the_chat_template_cannot_render_is_a_400(backend: LocalBackend, fields: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await backend.send("chat/completions", {**CHAT, **fields}, request_id="deep")
    assert info.value.status_code == 400 and info.value.param in ("messages", "tools")
    assert (await backend.send("chat/completions", CHAT, request_id="good"))["choices"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"stop": [1]}, "stop"), ({"seed": 1e20}, "seed"), ({"stop": ["a"] * 5}, "stop"), ({"n": 500}, "n")],
)
async def test_the_backend_refuses_bad_fields_naming_them(backend: LocalBackend, fields: Any, param: str) -> None:
    """The engine-side defence, whatever the gateway's edge checks: 400 before anything reaches the engine."""
    with pytest.raises(InvalidRequestError) as info:
        await backend.send("chat/completions", {**CHAT, **fields}, request_id="bad")
    assert (info.value.status_code, info.value.code, info.value.param) == (400, "invalid_request", param)
    assert (await backend.send("chat/completions", CHAT, request_id="good"))["choices"]


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"stop": [1]}),
        ("/v1/chat/completions", {"seed": 1e20}),
        ("/v1/chat/completions", {"top_k": 1e30}),
        ("/v1/messages", {"stop_sequences": [1]}),
    ],
)
async def test_bad_sampling_fields_never_stop_the_engine(backend: LocalBackend, path: str, fields: Any) -> None:
    async with asgi_client(gateway(backend)) as client:
        body = {**(CHAT if path == "/v1/chat/completions" else MESSAGES), **fields}
        bad = await client.post(path, json=body, headers=AUTH)
        assert bad.status_code in (200, 400), bad.text  # refused (or, for a huge top_k, served as "no top-k")
        for _ in range(2):  # every later request, from any key, is served
            good = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {OTHER_KEY}"}
            )
            assert good.status_code == 200, good.text
    assert backend.health_state() == "up"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_refusal_names_the_field_the_client_sent(backend: LocalBackend, stream: bool) -> None:
    """The local engine refuses an image part of the translated chat request: the Responses client sent `input`."""
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    body = {"model": "tiny", "input": [{"role": "user", "content": [image]}], "stream": stream}
    async with asgi_client(gateway(backend)) as client:
        refused = await client.post("/v1/responses", json=body, headers=AUTH)
        unreadable = await client.post(
            "/v1/responses", json={**body, "input": [{"type": "item_reference", "id": "x"}]}, headers=AUTH
        )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
    assert unreadable.status_code == 400 and "'item_reference'" in unreadable.json()["error"]["message"]


# -- item 1: failure isolation and self-restart -------------------------------------------------------------------


async def test_one_failing_request_fails_alone(backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend.engine is not None
    llm = backend.engine.engine
    process_token = llm._process_token

    def faulty(seq: Any, request: Any) -> Any:
        if seq.request_id.startswith("poison") and seq.num_output_tokens >= 2:
            raise RuntimeError("injected per-sequence fault")
        return process_token(seq, request)

    monkeypatch.setattr(llm, "_process_token", faulty)
    other_auth = {"authorization": f"Bearer {OTHER_KEY}"}
    async with asgi_client(gateway(backend)) as client:
        other = asyncio.create_task(
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 24}, headers=other_auth)
        )
        failed = await client.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "x-request-id": "poison-1"})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
        served = await other
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 24
        later = await client.post("/v1/chat/completions", json=CHAT, headers=other_auth)
        assert later.status_code == 200
        assert await ready_state(client) == (200, "up")
    assert backend.engine.num_restarts == 0
    await wait_until(lambda: backend.stats()["kv_blocks_used"] == 0)


async def test_a_failed_step_restarts_the_engine_and_readiness_says_so(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert backend.engine is not None
    llm = backend.engine.engine
    run, reset = llm.runner.run, llm.reset
    resetting, release = threading.Event(), threading.Event()

    def faulty_run(batch: Any) -> Any:
        if any(s.request_id.startswith("victim") for s in batch.seqs):
            raise RuntimeError("injected step fault")
        return run(batch)

    def held_reset() -> None:
        resetting.set()
        release.wait(60)  # holds the engine in its restart while the test looks at readiness
        reset()

    monkeypatch.setattr(llm.runner, "run", faulty_run)
    monkeypatch.setattr(llm, "reset", held_reset)
    app = gateway(backend)
    async with asgi_client(app) as client:
        victim = asyncio.create_task(
            client.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "x-request-id": "victim-1"})
        )
        assert await asyncio.to_thread(resetting.wait, 60)
        assert await ready_state(client) == (503, "restarting")  # its only deployment is not serving right now
        release.set()
        failed = await victim
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
        await wait_until(lambda: backend.health_state() == "up")
        assert await ready_state(client) == (200, "up")
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
        assert not app.state.router.is_cooling(app.state.router.deployments[0])
    assert backend.engine.num_restarts == 1


# -- item 5: the size guard and tokenizing off the event loop -----------------------------------------------------


async def test_a_prompt_too_big_for_the_context_is_refused_before_tokenizing(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert backend.engine is not None
    tokenizer = backend.engine.engine.tokenizer
    limit = tokenizer.max_prompt_chars(backend.engine.engine.max_model_len)
    calls: list[str] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: calls.append(text) or encode(text, *a, **k))
    huge = "word " * (limit // 5 + 1)
    async with asgi_client(gateway(backend, max_body_bytes=64 * 2**20)) as client:
        chat = {**CHAT, "messages": [{"role": "user", "content": huge}]}
        prompts = {"model": "tiny", "prompt": ["fine", huge], "max_tokens": 2}
        for path, body, param in (("/v1/chat/completions", chat, "messages"), ("/v1/completions", prompts, "prompt")):
            response = await client.post(path, json=body, headers=AUTH)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "context_length_exceeded"
            assert response.json()["error"]["param"] == param
        assert calls == []  # refused without tokenizing anything
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200


def test_the_size_guard_never_refuses_a_prompt_that_fits(real_tokenizer: Any) -> None:
    """`max_token_chars` bounds how much text one token covers, also for the longest tokens of the vocabulary."""
    for text in (" " * 5000, "#" * 5000, "=" * 5000, "\n" * 5000, "Hello, world! " * 300, "春天 🌸" * 500):
        assert len(text) <= len(real_tokenizer.encode(text)) * real_tokenizer.max_token_chars


async def test_prompts_are_tokenized_off_the_event_loop(backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend.engine is not None
    tokenizer = backend.engine.engine.tokenizer
    apply_chat_template = tokenizer.apply_chat_template
    loop_thread = threading.get_ident()
    tokenizing, release = threading.Event(), threading.Event()
    threads: list[int] = []

    def held(messages: Any, **options: Any) -> Any:
        threads.append(threading.get_ident())
        if threading.get_ident() != loop_thread:  # (on the loop it would block everything, this test included)
            tokenizing.set()
            release.wait(60)
        return apply_chat_template(messages, **options)

    monkeypatch.setattr(tokenizer, "apply_chat_template", held)
    # Admissible by its size in characters, so it is tokenized; then too many tokens for the tiny model's context.
    big = {**CHAT, "messages": [{"role": "user", "content": "spring " * 2000}], "max_tokens": 1}
    async with asgi_client(gateway(backend)) as client:
        request = asyncio.create_task(client.post("/v1/chat/completions", json=big, headers=AUTH))
        assert await asyncio.to_thread(tokenizing.wait, 60), f"tokenized on the event loop thread: {threads}"
        live = await client.get("/health/live")  # answered while that prompt is being tokenized
        assert live.status_code == 200
        release.set()
        response = await request
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert threads and loop_thread not in threads


# -- item 9: a loading engine is loading, not down ----------------------------------------------------------------


async def test_a_loading_engine_is_loading_and_requests_wait_or_get_503(tiny_model_dir: Path, tmp_path: Path) -> None:
    release = threading.Event()

    def load() -> Any:  # what `LocalBackend.from_local_config` loads, held back until `release`
        from local_engine.async_engine import AsyncEngine
        from local_engine.engine import LLMEngine
        from local_engine.loader import load_checkpoint

        release.wait(120)
        checkpoint = load_checkpoint(tiny_model_dir, cache_dir=tmp_path / "models")
        return AsyncEngine(LLMEngine.from_checkpoint(checkpoint, ENGINE))

    local = LocalBackend(NAME, load, model_id="tiny", load_wait_s=0.01)
    app = gateway(local, health_probe_interval_s=0.01)
    try:
        async with asgi_client(app) as client:
            prober = app.state.health_prober
            await wait_until(lambda: prober.num_rounds >= 3)  # the gateway's own probes ran meanwhile
            assert await ready_state(client) == (503, "loading")
            refused = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_loading"
            assert refused.headers["retry-after"] == "5"
            router = app.state.router
            deployment = router.deployments[0]
            assert not router.is_cooling(deployment)  # never a cooldown
            local.load_wait_s = 120
            waiting = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=AUTH))
            await wait_until(lambda: deployment.num_in_flight == 1)  # inside the backend, waiting for the load
            release.set()
            assert (await waiting).status_code == 200
            assert await ready_state(client) == (200, "up")
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
            assert not router.is_cooling(deployment)
    finally:
        release.set()
        await local.aclose()


# -- issue 27, item 8: count_tokens counts with the model's own tokenizer and chat template --------------------------


async def test_count_tokens_is_what_the_request_is_billed(backend: LocalBackend) -> None:
    body = {
        "model": "tiny",
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
    }
    async with asgi_client(gateway(backend)) as client:
        counted = await client.post("/v1/messages/count_tokens", json=body, headers=AUTH)
        sent = await client.post("/v1/messages", json={**body, "max_tokens": 1}, headers=AUTH)
    assert counted.status_code == 200 and sent.status_code == 200, (counted.text, sent.text)
    assert counted.json() == {"input_tokens": sent.json()["usage"]["input_tokens"]}  # exact: no "estimated"
