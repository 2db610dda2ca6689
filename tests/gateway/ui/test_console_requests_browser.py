"""The console's Requests page in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright for
Python) against the production gateway on loopback with real Redis and a fake OpenAI-compatible upstream.

A few requests go through the gateway (a stream that succeeds, then a 429 from a key with rpm 1, and another key's
request); the operator follows the key's "Requests" link from the Keys page, filters by status 429, opens a
detail with its attempts timeline and TTFT mark, turns the live tail on and sees a new request arrive (and not
another key's), downloads the rows as CSV, sees the tail stop when the page is left, follows a deployment's and a
model's link from the Models page, pages with "Load more", and looks at it on a phone-sized screen. No prompt text
shows anywhere, in the page or the CSV."""

from __future__ import annotations

import csv
import io
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes.app import MASTER
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

from gateway.server import build_app
from gateway.settings import Settings

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ADMIN = {"authorization": f"Bearer {MASTER}"}
SECRET_PROMPT = "the vault opens with 4711 walrus"
UPSTREAM_KEY = "sk-upstream-SECRET-123"
WAIT_MS = 30_000  # a loaded machine: every wait below ends as soon as its condition holds

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)
pytestmark = [
    pytest.mark.skipif(
        shutil.which(CHROMIUM) is None,
        reason=f"{CHROMIUM} is missing (apt-get install chromium): browser tests skipped",
    ),
    pytest.mark.timeout(300),
]
expect = playwright_api.expect
expect.set_options(timeout=WAIT_MS)


@pytest.fixture
def gateway(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[ThreadedServer]:
    deployment = {"type": "openai", "name": "up", "base_url": fake_upstream.base_url, "api_key": UPSTREAM_KEY}
    routing = tmp_path / "unigate.yaml"
    routing.write_text(yaml.safe_dump({"models": [{"id": "gpt-test", "deployments": [deployment]}]}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        master_key=MASTER,
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
        engine={"enabled": False},  # type: ignore[arg-type]
    )
    with ThreadedServer(build_app(settings)) as server:
        yield server


@pytest.fixture
def page() -> Iterator[Any]:
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        context.set_default_timeout(WAIT_MS)
        tab = context.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda error: errors.append(str(error)))
        tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        yield tab
        browser.close()
    # The session check before logging in answers 401 ("Failed to load resource"); nothing else may fail (a CSP
    # violation or a script error would).
    assert [e for e in errors if "Failed to load resource" not in e] == []


def create_key(url: str, **fields: Any) -> tuple[str, str]:
    response = httpx.post(f"{url}/admin/keys", json=fields, headers=ADMIN, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()["id"], response.json()["key"]


def chat(url: str, key: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": SECRET_PROMPT}], "stream": stream}
    response = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    response.read()
    return response


def logged(url: str, request_id: str) -> dict[str, Any]:
    """The record, once the gateway's writer has put it in (it batches off the request's path: a bounded wait)."""
    for _ in range(600):
        response = httpx.get(f"{url}/admin/requests/{request_id}", headers=ADMIN, timeout=30)
        if response.status_code == 200:
            return dict(response.json())
        assert response.status_code == 404, response.text
        time.sleep(0.05)
    raise AssertionError(f"no record for {request_id}")


def shoot(page: Any, name: str) -> None:
    """A screenshot under `$UNIGATE_SCREENSHOT_DIR` when it is set (to look at the page; nothing is compared)."""
    directory = os.environ.get("UNIGATE_SCREENSHOT_DIR")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(directory) / f"{name}.png"), full_page=True)


def assert_no_prompt(text: str) -> None:
    assert "vault" not in text and "walrus" not in text and UPSTREAM_KEY not in text


def test_the_requests_page_filters_tails_details_and_downloads(gateway: ThreadedServer, page: Any) -> None:
    url = gateway.url
    reader_id, reader = create_key(url, name="reader", rpm=1)
    other_id, other = create_key(url, name="other")
    ok = chat(url, reader, stream=True)
    limited = chat(url, reader)
    elsewhere = chat(url, other)
    assert (ok.status_code, limited.status_code, elsewhere.status_code) == (200, 429, 200)
    ok_id, limited_id, elsewhere_id = (r.headers["x-request-id"] for r in (ok, limited, elsewhere))
    for request_id in (ok_id, limited_id, elsewhere_id):
        logged(url, request_id)

    page.goto(url + "/ui", wait_until="load")
    page.fill("#login-key", MASTER)
    page.click("#login-form button")
    expect(page.locator("#keys-table")).to_be_visible()

    # From the Keys page: the key's "Requests" link opens the page filtered by that key, newest first.
    page.click(f"tr[data-key-id='{reader_id}'] a[data-action=requests]")
    expect(page).to_have_url(f"{url}/ui#/requests?key={reader_id}")
    expect(page.locator("#nav a[data-page=requests]")).to_have_class("active")
    expect(page.locator("#req-key")).to_have_value(reader_id)
    rows = page.locator("#req-table tbody tr[data-request-id]")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_have_attribute("data-request-id", limited_id)
    expect(rows.nth(1)).to_have_attribute("data-request-id", ok_id)
    expect(rows.nth(0)).to_contain_text("429")
    expect(rows.nth(1)).to_contain_text("→ up")

    # Filter by status 429: only the limited request; the filter goes into the hash.
    page.fill("#req-status", "429")
    page.click("#req-apply")
    expect(rows).to_have_count(1)
    expect(rows.nth(0)).to_have_attribute("data-status", "429")
    expect(page).to_have_url(f"{url}/ui#/requests?key={reader_id}&status=429")
    page.fill("#req-status", "")
    page.click("#req-apply")
    expect(rows).to_have_count(2)

    # The detail of the streamed request: every field, its one attempt as a bar, the TTFT marked.
    page.click(f"button[data-open='{ok_id}']")
    detail = page.locator(f"[data-detail='{ok_id}']")
    expect(detail).to_be_visible()
    expect(detail).to_contain_text("reader")
    expect(detail).to_contain_text("/v1/chat/completions · stream")
    expect(detail.locator("#req-timeline rect[data-attempt='0']")).to_have_attribute("data-status", "200")
    expect(detail.locator("#req-timeline line[data-ttft]")).to_have_count(1)
    expect(detail.locator("#req-attempts tbody tr")).to_have_count(1)
    width = detail.locator("#req-timeline rect[data-attempt='0']").get_attribute("width")
    assert width is not None and width.endswith("%") and 0 < float(width[:-1]) <= 100
    expect(page).to_have_url(f"{url}/ui#/requests?key={reader_id}&id={ok_id}")
    shoot(page, "requests-detail")
    page.click("#req-detail-close")
    expect(detail).to_have_count(0)
    # The 429's detail: no attempt (the gateway answered itself), its code shown.
    page.click(f"button[data-open='{limited_id}']")
    expect(page.locator(f"[data-detail='{limited_id}']")).to_contain_text("No attempt")
    page.click("#req-detail-close")
    # A request id from a user's report opens directly; an unknown one says so.
    page.fill("#req-lookup", elsewhere_id)
    page.click("#req-open button")
    expect(page.locator(f"[data-detail='{elsewhere_id}']")).to_contain_text("other")
    page.fill("#req-lookup", "req_unknown")
    page.click("#req-open button")
    expect(page.locator("#req-detail")).to_contain_text("No request 'req_unknown' in the request log")
    page.click("#req-detail-close")

    # The live tail: a new request of this key appears on top; another key's does not.
    page.check("#req-tail")
    expect(page.locator("#req-tail[data-ready]")).to_have_count(1)
    late_other = chat(url, other)
    late = chat(url, reader)
    assert late_other.status_code == 200 and late.status_code in (200, 429)  # 200 if a minute went by (a slow run)
    expect(rows).to_have_count(3)
    expect(rows.nth(0)).to_have_attribute("data-request-id", late.headers["x-request-id"])
    expect(page.locator(f"tr[data-request-id='{late_other.headers['x-request-id']}']")).to_have_count(0)
    shoot(page, "requests-tail")

    # Download CSV: the rows loaded now, under this filter.
    with page.expect_download() as download_info:
        page.click("#req-csv")
    download = download_info.value
    assert download.suggested_filename.startswith("unigate-requests-") and download.suggested_filename.endswith(".csv")
    text = Path(download.path()).read_text()
    table = list(csv.DictReader(io.StringIO(text)))
    assert [r["request_id"] for r in table] == [late.headers["x-request-id"], limited_id, ok_id]
    assert {r["key_id"] for r in table} == {reader_id}
    assert table[2]["status"] == "200" and table[2]["attempts"].startswith("up:200:")
    assert table[1]["status"] == "429" and table[1]["code"]
    assert_no_prompt(text)
    assert_no_prompt(page.content())

    # A reload keeps the filter (it is in the hash); the detail opens from the hash too. Leaving the page (a new
    # hash renders it anew) stops the tail: no poll of `after=` follows.
    polls: list[str] = []
    page.on("request", lambda request: polls.append(request.url) if "after=" in request.url else None)
    page.goto(f"{url}/ui#/requests?key={other_id}&id={elsewhere_id}")
    expect(page.locator("#req-tail")).not_to_be_checked()
    polls.clear()
    page.wait_for_timeout(2500)  # more than two tail periods: only ever passes more easily under load
    assert polls == []
    page.reload(wait_until="load")
    expect(page.locator(f"[data-detail='{elsewhere_id}']")).to_be_visible()
    expect(rows).to_have_count(2)
    assert_no_prompt(page.content())

    # From the Models page: a deployment opens the page filtered by it.
    page.click("#nav a[data-page=models]")
    page.click("tr[data-deployment='up'] a[data-requests=deployment]")
    expect(page.locator("#req-deployment")).to_have_value("up")
    expect(rows).to_have_count(3 + (late.status_code == 200))  # what "up" answered (a 429 has no deployment)
    page.click("#nav a[data-page=models]")
    page.click("[data-model='gpt-test'] a[data-requests=model]")
    expect(page.locator("#req-model")).to_have_value("gpt-test")
    expect(rows).to_have_count(5)
    shoot(page, "requests-model")

    # Load more: 50 rows a page, then the cursor for the older ones.
    with httpx.Client(timeout=30) as client:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
        for _ in range(50):
            sent = client.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {other}"})
            assert sent.status_code == 200
    logged(url, sent.headers["x-request-id"])
    page.goto(f"{url}/ui#/requests?key={other_id}")
    expect(rows).to_have_count(50)
    expect(rows.nth(0)).to_have_attribute("data-request-id", sent.headers["x-request-id"])
    page.click("#req-more")
    expect(rows).to_have_count(52)  # with the two earlier ones (elsewhere, late_other), oldest last
    expect(rows.nth(51)).to_have_attribute("data-request-id", elsewhere_id)
    expect(page.locator("#req-more")).to_be_hidden()
    expect(page.locator("#req-count")).to_have_text("52 requests loaded")

    # A phone-sized screen: the page is no wider than the screen (the table scrolls inside its card).
    page.set_viewport_size({"width": 390, "height": 844})
    page.click(f"button[data-open='{elsewhere_id}']")
    expect(page.locator("#req-timeline")).to_be_visible()
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    shoot(page, "requests-phone")
