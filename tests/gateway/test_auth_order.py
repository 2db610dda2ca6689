"""A missing or malformed key header is reported before anything about the body, on every route family."""

from __future__ import annotations

import pytest
from fakes.app import asgi_client, build_app, single_model
from fakes.upstream import FakeUpstream


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
async def test_bad_auth_header_wins_over_a_bad_body(fake_upstream: FakeUpstream, path: str) -> None:
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        no_bearer = await client.post(path, content=b"{not json", headers={"authorization": "sk-ug-abc"})
        missing = await client.post(path, json={})
    assert no_bearer.status_code == 401 and missing.status_code == 401
    codes = [r.json()["error"]["code"] for r in (no_bearer, missing)]
    assert codes == ["invalid_auth_header", "missing_api_key"]
    assert len(fake_upstream.requests) == 0
