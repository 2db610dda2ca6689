"""The console's Engine page shows how the local engine shares itself between tenants (issue 38): a real browser
(headless Chromium driven by Playwright) on the production gateway with real Redis and a tiny local model. Two keys
stream at once, one with weight 2, on an engine with two seats: the page lists each key's tenant with its weight,
its running and waiting sequences, the tokens served and its share."""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.server import ThreadedServer

from gateway.server import build_app
from gateway.settings import Settings

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
WAIT_MS = 60_000  # a loaded machine: every wait ends as soon as its condition holds
ADMIN = {"authorization": f"Bearer {MASTER}"}

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)
pytestmark = [
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing: browser tests skipped"),
    pytest.mark.timeout(300),
]
expect = playwright_api.expect


@pytest.fixture
def gateway(redis_url: str, tmp_path: Path) -> Iterator[ThreadedServer]:
    checkpoint = tiny_llama_checkpoint(tmp_path / "tiny", max_position_embeddings=4096)
    engine = {"device": "cpu", "kv_cache_memory": 8 * 2**20, "max_num_seqs": 2, "cpu_kernels": False}
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
        engine={**engine, "model_path": str(checkpoint), "pack_cpu_weights": False},  # type: ignore[arg-type]
    )
    with ThreadedServer(build_app(settings)) as server:
        yield server


@pytest.fixture
def page() -> Iterator[Any]:
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        tab = browser.new_page(viewport={"width": 1280, "height": 900})
        tab.set_default_timeout(WAIT_MS)
        errors: list[str] = []
        tab.on("pageerror", lambda error: errors.append(str(error)))
        tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        yield tab
        browser.close()
    # The session check before logging in answers 401 ("Failed to load resource"); nothing else may fail.
    assert [e for e in errors if "Failed to load resource" not in e] == []


def create_key(url: str, **fields: Any) -> tuple[str, str]:
    response = httpx.post(f"{url}/admin/keys", json=fields, headers=ADMIN, timeout=30)
    assert response.status_code in (200, 201), response.text
    return response.json()["id"], response.json()["key"]


def stream(url: str, key: str, stop: threading.Event) -> None:
    """A long stream, left as soon as `stop` is set (the engine aborts it)."""
    body = {
        "model": "local",
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 3000,
        "min_tokens": 3000,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


def test_the_engine_page_shows_each_tenants_share(gateway: ThreadedServer, page: Any) -> None:
    url = gateway.url
    a_id, a = create_key(url, name="a", weight=2)
    b_id, b = create_key(url, name="b")
    page.goto(url + "/ui", wait_until="load")
    page.fill("#login-key", MASTER)
    page.click("#login-form button")
    expect(page.locator("#keys-table")).to_be_visible()
    page.goto(url + "/ui#/engine")
    expect(page.locator("[data-stat=gen_total] .value")).to_be_visible(timeout=120_000)  # the model loaded

    stop = threading.Event()
    threads = [threading.Thread(target=stream, args=(url, key, stop)) for key in (a, a, b)]
    for thread in threads:
        thread.start()
    try:
        shares = page.locator("[data-shares]")
        row_a, row_b = shares.locator(f"tr[data-tenant='{a_id}']"), shares.locator(f"tr[data-tenant='{b_id}']")
        expect(row_a.locator("[data-col=weight]")).to_have_text("2")
        expect(row_b.locator("[data-col=weight]")).to_have_text("1")
        expect(row_a.locator("[data-col=served]")).not_to_have_text("0")
        expect(row_b.locator("[data-col=served]")).not_to_have_text("0")
        expect(row_a.locator("[data-col=share]")).to_have_text(re.compile(r"^\d+\.\d %$"))
        # Three streams on two seats: one of them waits (whose turn it is changes as the shares move).
        waiting = shares.locator("[data-col=waiting]")
        expect(waiting.filter(has_text=re.compile("^1$"))).to_have_count(1)
        expect(shares).to_contain_text("Shares by tenant")
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
