"""Output limits of the local engine behind the gateway (issue 20, items 1 and 2): a max_tokens too big for the
context is lowered to the room the prompt leaves, on the chat, Anthropic and Responses routes alike, and said in
`x-unigate-max-tokens-clamped` and a debug line; a prompt that does not fit is still 400 `context_length_exceeded`;
a request without an output limit gets `default_max_tokens`. A tiny random model with the bundled tokenizer; its
context is 256 tokens."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, MASTER, asgi_client, make_settings
from starlette.applications import Starlette

from auth.base import NO_COST, Admission, BudgetCost
from backends.local import LocalBackend
from gateway.app import create_app
from gateway.deployments import build_backend
from gateway.output_limits import CLAMP_HEADER
from gateway.routing_config import DeploymentConfig, parse_routing
from gateway.settings import EngineSettings, Settings

NAME = "tiny#0"
CONTEXT = 256  # the tiny model's max_position_embeddings
ENGINE = EngineSettings(device="cpu", kv_cache_memory=2 * 2**20, max_num_seqs=8, max_num_batched_tokens=64)
QUESTION = "Tell me about spring"
SURFACES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32000}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32000}),
    "responses": ("/v1/responses", {"input": QUESTION, "max_output_tokens": 32000}),
}


class ReservingAccess(RecordingAccess):
    """Also records what each admission reserved."""

    def __init__(self) -> None:
        super().__init__(master_key=MASTER)
        self.reserved: list[int] = []

    async def admit(
        self, credential: str, *, model: str, estimated_tokens: int, request_id: str = "", budget: BudgetCost = NO_COST
    ) -> Admission:
        self.reserved.append(estimated_tokens)
        return await super().admit(credential, model=model, estimated_tokens=estimated_tokens, request_id=request_id)


async def loaded(
    model_dir: Path, data_dir: Path, *, engine: EngineSettings = ENGINE, **deployment: Any
) -> LocalBackend:
    """Built as the gateway builds it (`gateway.deployments`): the deployment's settings over the engine's."""
    settings = Settings(_env_file=None, data_dir=data_dir, engine=engine)
    config = DeploymentConfig(type="local", name=NAME, id="tiny", model_path=str(model_dir), **deployment)
    local = build_backend(config, settings)
    assert isinstance(local, LocalBackend)
    await local.send(
        "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}, request_id="w"
    )
    return local


def gateway(backend: LocalBackend, access: RecordingAccess | None = None) -> Starlette:
    routing = parse_routing({"models": [{"id": "tiny", "deployments": [{"type": "local", "name": NAME}]}]}, source="t")
    return create_app(
        make_settings(), access=access or RecordingAccess(master_key=MASTER), routing=routing, backends={NAME: backend}
    )


@pytest.fixture
async def backend(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[LocalBackend]:
    local = await loaded(tiny_model_dir, tmp_path)
    yield local
    await local.aclose()


def prompt_tokens(surface: str, data: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) from a response of `surface`."""
    usage = data["usage"]
    if surface == "chat":
        return usage["prompt_tokens"], usage["completion_tokens"]
    if surface == "messages":
        return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0), usage["output_tokens"]
    return usage["input_tokens"], usage["output_tokens"]


@pytest.mark.parametrize("surface", list(SURFACES))
async def test_an_output_limit_too_big_for_the_context_is_lowered(
    backend: LocalBackend, caplog: pytest.LogCaptureFixture, surface: str
) -> None:
    path, fields = SURFACES[surface]
    async with asgi_client(gateway(backend)) as client:
        with caplog.at_level(logging.DEBUG, logger="unigate.engine"):
            response = await client.post(path, json={"model": "tiny", "temperature": 0, **fields}, headers=AUTH)
        assert response.status_code == 200, response.text
        num_prompt, num_completion = prompt_tokens(surface, response.json())
        room = CONTEXT - num_prompt
        assert response.headers[CLAMP_HEADER] == f"32000 -> {room}" and 0 < num_completion <= room
        [line] = [r.getMessage() for r in caplog.records if "max_tokens clamped" in r.getMessage()]
        assert (
            line == f"max_tokens clamped 32000 -> {room}: the prompt has {num_prompt} tokens of this model's {CONTEXT}"
        )

        streamed = await client.post(path, json={"model": "tiny", "stream": True, **fields}, headers=AUTH)
        assert streamed.status_code == 200 and streamed.headers[CLAMP_HEADER] == f"32000 -> {room}"
        assert any(end in streamed.text for end in ("data: [DONE]", "event: message_stop", "event: response.completed"))

        fits = {**fields, "max_tokens" if "max_tokens" in fields else "max_output_tokens": 2}
        response = await client.post(path, json={"model": "tiny", **fits}, headers=AUTH)
        assert response.status_code == 200 and CLAMP_HEADER not in response.headers


@pytest.mark.parametrize("surface", list(SURFACES))
async def test_a_prompt_that_does_not_fit_is_still_refused(backend: LocalBackend, surface: str) -> None:
    path, fields = SURFACES[surface]
    too_long = "spring " * 400  # about 400 tokens: more than the whole context
    body = (
        {**fields, "input": too_long}
        if surface == "responses"
        else {**fields, "messages": [{"role": "user", "content": too_long}]}
    )
    async with asgi_client(gateway(backend)) as client:
        response = await client.post(path, json={"model": "tiny", **body}, headers=AUTH)
    assert response.status_code == 400 and CLAMP_HEADER not in response.headers
    error = response.json()["error"]
    assert error.get("code", "context_length_exceeded") == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in error["message"]


async def test_clamp_max_tokens_false_refuses_as_before(tiny_model_dir: Path, tmp_path: Path) -> None:
    local = await loaded(tiny_model_dir, tmp_path, clamp_max_tokens=False)
    try:
        async with asgi_client(gateway(local)) as client:
            path, fields = SURFACES["chat"]
            response = await client.post(path, json={"model": "tiny", **fields}, headers=AUTH)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert "you requested" in response.json()["error"]["message"] and "32000 for the completion" in response.text
    finally:
        await local.aclose()


async def test_admission_reserves_the_room_the_context_leaves(backend: LocalBackend) -> None:
    access = ReservingAccess()
    async with asgi_client(gateway(backend, access)) as client:
        path, fields = SURFACES["chat"]
        assert (
            await client.post(path, json={"model": "tiny", **fields, "max_tokens": 2}, headers=AUTH)
        ).status_code == 200
        assert (await client.post(path, json={"model": "tiny", **fields}, headers=AUTH)).status_code == 200
    estimate = len(QUESTION) // 4 + 1  # the gateway's admission estimate (characters / 4)
    assert access.reserved == [estimate + 2, CONTEXT]


@pytest.mark.parametrize(
    ("engine_default", "deployment_default", "expected"),
    [(1024, 5, 5), (7, None, 7), (0, None, None)],
    ids=["deployment", "engine-setting", "none"],
)
async def test_a_request_without_an_output_limit_gets_the_default(
    tiny_model_dir: Path, tmp_path: Path, engine_default: int, deployment_default: int | None, expected: int | None
) -> None:
    engine = ENGINE.model_copy(update={"default_max_tokens": engine_default})
    local = await loaded(tiny_model_dir, tmp_path, engine=engine, default_max_tokens=deployment_default)
    try:
        async with asgi_client(gateway(local)) as client:
            # Codex sends no output limit; nor may a chat client.
            codex = await client.post(
                "/v1/responses", json={"model": "tiny", "input": QUESTION, "temperature": 0}, headers=AUTH
            )
            chat_body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
            chat = await client.post("/v1/chat/completions", json=chat_body, headers=AUTH)
    finally:
        await local.aclose()
    assert codex.status_code == 200 and chat.status_code == 200 and CLAMP_HEADER not in chat.headers
    [choice] = chat.json()["choices"]
    num_prompt, num_completion = chat.json()["usage"]["prompt_tokens"], chat.json()["usage"]["completion_tokens"]
    limit = expected if expected is not None else CONTEXT - num_prompt
    assert choice["finish_reason"] == "length" and num_completion == limit
    assert codex.json()["usage"]["output_tokens"] == limit and codex.json()["status"] == "incomplete"
