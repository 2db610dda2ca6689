"""`/v1/messages/count_tokens` on the local engine counts the whole prompt, which Anthropic's usage splits: on a
repeated prompt `input_tokens` leaves out what was read from the prefix cache (docs/clients.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, MASTER, asgi_client, make_settings
from fakes.engine_models import tiny_engine_options
from starlette.applications import Starlette

from backends.local import LocalBackend, LocalBackendConfig
from gateway.app import create_app
from gateway.routing_config import parse_routing

NAME = "tiny#0"
ENGINE = tiny_engine_options()
# Long enough to fill whole KV blocks (16 tokens each), which a repeated prompt finds in the prefix cache.
BODY = {
    "model": "tiny",
    "system": "You are terse and answer in one short sentence, without any preamble or apology.",
    "messages": [{"role": "user", "content": "Tell me about the first days of spring in the mountains."}],
}


@pytest.fixture
async def backend(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[LocalBackend]:
    engine = ENGINE.model_copy(update={"model_path": str(tiny_model_dir)})
    config = LocalBackendConfig(NAME, "tiny", tmp_path / "models", engine)
    local = LocalBackend.from_local_config(config)
    yield local
    await local.aclose()


def gateway(backend: LocalBackend) -> Starlette:
    routing = parse_routing({"models": [{"id": "tiny", "deployments": [{"type": "local", "name": NAME}]}]}, source="t")
    return create_app(
        make_settings(), access=RecordingAccess(master_key=MASTER), routing=routing, backends={NAME: backend}
    )


async def test_count_tokens_is_input_plus_cache_read_tokens(backend: LocalBackend) -> None:
    async with asgi_client(gateway(backend)) as client:
        counted = await client.post("/v1/messages/count_tokens", json=BODY, headers=AUTH)
        first = await client.post("/v1/messages", json={**BODY, "max_tokens": 1}, headers=AUTH)
        repeated = await client.post("/v1/messages", json={**BODY, "max_tokens": 1}, headers=AUTH)
    assert counted.status_code == first.status_code == repeated.status_code == 200, (counted.text, repeated.text)
    num_tokens = counted.json()["input_tokens"]
    assert first.json()["usage"]["input_tokens"] == num_tokens  # nothing cached yet
    usage = repeated.json()["usage"]
    assert usage["cache_read_input_tokens"] > 0  # the prompt's whole blocks came from the prefix cache
    assert usage["input_tokens"] < num_tokens
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == num_tokens
