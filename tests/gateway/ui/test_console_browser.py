"""The console in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright for Python) against the
production gateway on loopback with real Redis, a fake OpenAI-compatible upstream, one that fails (so it cools
down), and the local engine serving a tiny random model.

One flow, as an operator would go: log in, create a key and see its secret once, use it from the playground, see its
usage, revoke it and see the playground's next call fail with the 401 message, see the failing upstream cooling down
on Models, watch the Engine page change while requests run, log out. Screenshots of each page go to
`$UNIGATE_SCREENSHOT_DIR` (else a temp dir); the page load time (first byte → load event, Navigation Timing) and the
bundle size are printed (`pytest -s`), never asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes.app import MASTER
from fakes.server import ThreadedServer
from fakes.upstream import Behavior, FakeUpstream

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
UPSTREAM_KEY = "sk-upstream-SECRET-123"
WAIT_MS = 30_000  # a loaded CI machine: every wait below ends as soon as its condition holds

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)
pytestmark = pytest.mark.skipif(
    shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing (apt-get install chromium): browser tests skipped"
)
expect = playwright_api.expect
expect.set_options(timeout=WAIT_MS)


def tiny_model_dir(directory: Path) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer and a chat template, written without loading anything."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["the console streams tokens while the operator watches"], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    vocab, hidden, inner, num_layers, num_heads, num_kv_heads = len(fast), 64, 96, 2, 4, 2
    head_dim = hidden // num_heads
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.3

    state = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(num_layers):
        layer = f"model.layers.{i}."
        state |= {
            layer + "self_attn.q_proj.weight": weight(num_heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": weight(num_kv_heads * head_dim, hidden),
            layer + "self_attn.v_proj.weight": weight(num_kv_heads * head_dim, hidden),
            layer + "self_attn.o_proj.weight": weight(hidden, num_heads * head_dim),
            layer + "mlp.gate_proj.weight": weight(inner, hidden),
            layer + "mlp.up_proj.weight": weight(inner, hidden),
            layer + "mlp.down_proj.weight": weight(hidden, inner),
            layer + "input_layernorm.weight": torch.ones(hidden),
            layer + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    fast.save_pretrained(directory)
    return directory


@pytest.fixture
def gateway(
    redis_url: str, tmp_path: Path, fake_upstream_factory: Any
) -> Iterator[tuple[ThreadedServer, FakeUpstream]]:
    good: FakeUpstream = fake_upstream_factory()
    failing: FakeUpstream = fake_upstream_factory().behave(mode="status", status=500)
    models = [
        {"id": "gpt-test", "aliases": ["fast"], "deployments": [_deployment(good, "gpt-test#0")]},
        {"id": "flaky", "deployments": [_deployment(failing, "flaky#0")]},
        {"id": "tiny", "deployments": [{"type": "local", "model_path": str(tiny_model_dir(tmp_path / "tiny"))}]},
    ]
    routing = tmp_path / "unigate.yaml"
    routing.write_text(yaml.safe_dump({"models": models, "router": {"retry_backoff_s": 0.001}}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
        engine={"device": "cpu", "kv_cache_memory": 4 * 2**20, "max_num_seqs": 8, "max_num_batched_tokens": 128},  # type: ignore[arg-type]
    )
    with ThreadedServer(build_app(settings)) as server:
        yield server, failing


def _deployment(upstream: FakeUpstream, name: str) -> dict[str, Any]:
    return {"type": "openai", "name": name, "base_url": upstream.base_url, "api_key": UPSTREAM_KEY, "max_in_flight": 8}


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    configured = os.environ.get("UNIGATE_SCREENSHOT_DIR")
    directory = Path(configured) if configured else tmp_path / "screenshots"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture
def page(screenshots: Path) -> Iterator[Any]:
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        context.set_default_timeout(WAIT_MS)
        context.grant_permissions(["clipboard-read", "clipboard-write"])
        tab = context.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda error: errors.append(str(error)))
        tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        yield tab
        browser.close()
        # Expected failures (the wrong login, the revoked key's 401, the failing upstream) log "Failed to load
        # resource"; anything else, such as a CSP violation or a script error, fails the test.
        assert [e for e in errors if "Failed to load resource" not in e] == []


def test_operator_flow_in_a_real_browser(
    gateway: tuple[ThreadedServer, FakeUpstream], page: Any, screenshots: Path
) -> None:
    server, _ = gateway
    shots: list[str] = []

    def shoot(name: str) -> None:
        page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)
        shots.append(f"{name}.png")

    # Log in (a wrong key first), and measure the page load: first byte → load event.
    page.goto(server.url + "/ui", wait_until="load")
    timing = page.evaluate(
        "() => { const n = performance.getEntriesByType('navigation')[0];"
        " return {first_byte_to_load_ms: n.loadEventStart - n.responseStart, total_ms: n.loadEventStart}; }"
    )
    expect(page.locator("#login")).to_be_visible()
    shoot("login")
    page.fill("#login-key", "sk-ug-wrong")
    page.click("#login-form button")
    expect(page.locator("#login-error")).to_have_text("Wrong master key.")
    page.fill("#login-key", MASTER)
    page.click("#login-form button")
    expect(page.locator("#keys-table")).to_be_visible()
    assert page.evaluate("() => localStorage.length + sessionStorage.length") == 0

    # Keys: create one with limits; its secret is shown once, with the warning, and nowhere after "Done".
    page.click("#new-key")
    form = page.locator(".key-form").first
    form.locator("input[name=name]").fill("team-a")
    form.locator("input[name=rpm]").fill("100")
    form.locator("input[name=token_budget]").fill("100000")
    form.locator("button[type=submit]").click()
    expect(page.locator("#secret-panel")).to_contain_text("you will not see it again")
    secret = page.input_value("#new-secret")
    assert secret.startswith("sk-ug-")
    page.click("#copy-secret")
    assert page.evaluate("() => navigator.clipboard.readText()") == secret
    row = page.locator("#keys-table tr", has_text="team-a")
    expect(row).to_contain_text("100 rpm")
    key_id = row.get_attribute("data-key-id")
    shoot("keys-secret-once")
    page.click("#secret-panel >> text=Done")
    expect(page.locator("#secret-panel")).to_have_count(0)

    # Rotate (confirmed): a new secret, shown once; edit: only the changed limits, an emptied one removed.
    row.locator("text=Rotate").click()
    page.click("#confirm-yes")
    expect(page.locator("#secret-panel")).to_contain_text("Key rotated")
    rotated = page.input_value("#new-secret")
    assert rotated.startswith("sk-ug-") and rotated != secret
    page.click("#secret-panel >> text=Done")
    row.locator("text=Edit").click()
    edit = page.locator("#edit-panel")
    expect(edit.locator("input[name=rpm]")).to_have_value("100")
    edit.locator("input[name=rpm]").fill("")
    edit.locator("input[name=tpm]").fill("5000")
    edit.locator("button[type=submit]").click()
    expect(row).to_contain_text("5000 tpm, 100,000 tok/total")
    expect(row).not_to_contain_text("rpm")
    secret = rotated
    page.reload(wait_until="load")  # the session survives a reload (cookie); the secret does not
    expect(page.locator("#keys-table")).to_contain_text("team-a")
    assert secret not in page.content()
    shoot("keys")
    # Search asks the server (every key, not only the page shown): a name that matches nothing empties the table.
    page.fill("#key-search", "no-such-key")
    expect(page.locator("#keys-table")).to_contain_text("No keys.")
    page.fill("#key-search", "TEAM-A")
    expect(page.locator("#keys-table tr", has_text="team-a")).to_have_count(1)
    page.fill("#key-search", "")
    expect(page.locator("#keys-table")).to_contain_text("team-a")

    # Playground: stream through the gateway with the new key (pasted, kept in memory only).
    page.goto(server.url + "/ui#/playground")
    expect(page.locator("#pg-model option[value=gpt-test]")).to_have_count(1)
    page.select_option("#pg-model", "gpt-test")
    page.fill("#pg-key", secret)
    page.click("#pg-send")
    expect(page.locator("#pg-output")).to_have_text("t0 t1 t2 ")
    expect(page.locator("[data-stat=request_id] .value")).not_to_have_text("—")
    expect(page.locator("[data-stat=tokens] .value")).to_have_text("3")
    page.click("[data-tab=openai]")
    expect(page.locator("#pg-code")).to_contain_text(f'base_url="{server.url}/v1"')
    page.click("[data-tab=anthropic]")
    expect(page.locator("#pg-code")).to_contain_text(f'base_url="{server.url}"')
    assert secret not in page.locator("#pg-code").inner_text()
    assert page.evaluate("() => localStorage.length + sessionStorage.length") == 0
    shoot("playground")

    # Usage: the request shows up under the key (settled just after the response: apply until it is counted).
    page.goto(server.url + "/ui#/usage")
    page.select_option("#usage-by", "key")
    for _ in range(50):
        page.click("text=Apply")
        if "team-a" in page.locator("#usage-table").inner_text():
            break
    expect(page.locator("#usage-table tr", has_text="team-a")).to_contain_text("10")  # 7 prompt + 3 completion
    with page.expect_download() as download:
        page.click("#usage-csv")
    csv = Path(download.value.path()).read_text()
    assert csv.startswith("date,key_id,key_name,model,requests,") and f",{key_id},team-a,gpt-test,1,7,3,10," in csv
    shoot("usage")
    hostile = page.evaluate(
        "() => UG.usageCsv([{date: '2026-01-01', key_id: 'k', key_name: '=HYPERLINK(1)', model: 'm,\"x',"
        " team_name: '@SUM(1)'}])"
    )
    assert hostile.splitlines()[1] == '2026-01-01,k,\'=HYPERLINK(1),"m,""x",,,,,,,,\'@SUM(1)'

    # Revoke (with confirmation); the playground's next call gets the 401 message.
    page.goto(server.url + "/ui#/keys")
    page.locator(f"tr[data-key-id={key_id}] [data-action=revoke]").click()
    expect(page.locator("#modal")).to_contain_text("cannot be undone")
    page.click("#confirm-yes")
    expect(page.locator(f"tr[data-key-id={key_id}] .badge")).to_have_text("revoked")
    page.goto(server.url + "/ui#/playground")
    expect(page.locator("#pg-key")).to_have_value(secret)  # still in memory after moving between pages
    page.select_option("#pg-model", "gpt-test")
    for _ in range(50):  # other instances' caches drop the key within a second; this one at once
        page.click("#pg-send")
        expect(page.locator("#pg-send")).to_be_enabled()
        if page.locator("#pg-error").inner_text():
            break
    expect(page.locator("#pg-error")).to_contain_text("401 key_revoked")
    shoot("playground-revoked")

    # Models: the failing upstream cools down after one request's attempts.
    failed = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "flaky", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {MASTER}"},
        timeout=30,
    )
    assert failed.status_code == 502
    page.goto(server.url + "/ui#/models")
    flaky = page.locator("tr[data-deployment='flaky#0']")
    expect(flaky.locator("[data-state=cooling_down]")).to_be_visible()
    expect(flaky).to_contain_text("until")
    expect(flaky).to_contain_text("of 3")  # 3 attempts (1 + 2 retries), all failed: 100.0 % of 3
    expect(page.locator("tr[data-deployment='gpt-test#0']")).to_contain_text("127.0.0.1:")
    assert UPSTREAM_KEY not in page.content()
    shoot("models")

    # Engine: once the tiny model is loaded, the page follows requests as they run.
    page.goto(server.url + "/ui#/engine")
    generated = page.locator("[data-stat=gen_total] .value")
    expect(generated).to_be_visible(timeout=120_000)
    before = generated.inner_text()
    threads = [threading.Thread(target=_generate, args=(server.url,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        expect(generated).not_to_have_text(before)
        shoot("engine")
    finally:
        for thread in threads:
            thread.join(120)

    # A phone-sized screen, then log out: the cookie no longer opens anything.
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(server.url + "/ui#/keys")
    expect(page.locator("#keys-table")).to_be_visible()
    shoot("keys-phone")
    page.click("#logout")
    expect(page.locator("#login")).to_be_visible()
    assert page.request.get(server.url + "/admin/keys").status == 401

    bundle = _bundle_bytes(server.url)
    print(f"\nconsole page load (first byte → load event): {timing['first_byte_to_load_ms']:.0f} ms", end=" ")
    print(f"(navigation start → load: {timing['total_ms']:.0f} ms); bundle: {bundle} bytes uncompressed")
    print(f"screenshots in {screenshots}: {', '.join(shots)}")


def _generate(url: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "stream"}], "max_tokens": 32, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {MASTER}"}, timeout=120
    ) as response:
        for _ in response.iter_lines():
            pass


def _bundle_bytes(url: str) -> int:
    """Bytes of the page and every file it loads (no compression)."""
    html = httpx.get(url + "/ui").text
    names = [part.split('"')[0] for part in html.split("/ui/static/")[1:]]
    return len(html.encode()) + sum(len(httpx.get(f"{url}/ui/static/{name}").content) for name in names)


@pytest.fixture
def troubled_gateway(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[ThreadedServer]:
    """A local deployment whose model_path does not exist, and a wildcard route over a fake upstream."""
    models = [
        {"id": "local", "deployments": [{"type": "local", "model_path": str(tmp_path / "no-such-model")}]},
        {"id": "openai/*", "deployments": [_deployment(fake_upstream, "openai/*#0")]},
    ]
    routing = tmp_path / "unigate.yaml"
    routing.write_text(yaml.safe_dump({"models": models, "router": {"retry_backoff_s": 0.001}}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
        engine={"device": "cpu"},  # type: ignore[arg-type]
    )
    with ThreadedServer(build_app(settings)) as server:
        yield server


def test_models_page_shows_a_failed_load_and_a_wildcards_cooling_models(
    troubled_gateway: ThreadedServer, fake_upstream: FakeUpstream, page: Any, screenshots: Path
) -> None:
    server = troubled_gateway
    fake_upstream.queue(*[Behavior(mode="status", status=500)] * 3)  # one request's 3 attempts: openai/gpt-x cools
    failed = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "openai/gpt-x", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {MASTER}"},
        timeout=30,
    )
    assert failed.status_code == 502
    page.goto(server.url + "/ui", wait_until="load")
    page.fill("#login-key", MASTER)
    page.click("#login-form button")
    expect(page.locator("#keys-table")).to_be_visible()
    page.goto(server.url + "/ui#/models")
    local = page.locator("tr[data-deployment='local#0']")
    expect(local.locator("[data-state=load_failed]")).to_have_text("load failed")
    expect(local.locator("[data-reason]")).to_contain_text("checkpoint_not_found")
    wildcard = page.locator("tr[data-deployment='openai/*#0']")
    expect(wildcard.locator("[data-state=up]")).to_be_visible()
    expect(wildcard.locator("[data-cooling-models]")).to_contain_text("1 model cooling: openai/gpt-x")
    page.screenshot(path=str(screenshots / "models-troubled.png"), full_page=True)


@pytest.fixture
def priced_gateway(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[ThreadedServer]:
    """One priced model over a fake upstream ($1,000 per million tokens either way: 7 + 3 tokens cost $0.01)."""
    model = {
        "id": "gpt-test",
        "pricing": {"input_per_mtok": 1000, "output_per_mtok": 1000},
        "deployments": [_deployment(fake_upstream, "gpt-test#0")],
    }
    routing = tmp_path / "unigate.yaml"
    routing.write_text(yaml.safe_dump({"models": [model]}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
        engine={"enabled": False},  # type: ignore[arg-type]
    )
    with ThreadedServer(build_app(settings)) as server:
        yield server


def test_teams_page_in_a_real_browser(priced_gateway: ThreadedServer, page: Any, screenshots: Path) -> None:
    """Create a team with budgets, move a key in from the members panel, see its request's spend against the team's
    budget, edit a limit, see usage grouped by team, move the key out, and delete a team that still has a key."""
    server = priced_gateway
    admin = {"authorization": f"Bearer {MASTER}"}
    ana = httpx.post(server.url + "/admin/keys", json={"name": "ana"}, headers=admin, timeout=30).json()
    bob = httpx.post(server.url + "/admin/keys", json={"name": "bob"}, headers=admin, timeout=30).json()
    page.goto(server.url + "/ui", wait_until="load")
    page.fill("#login-key", MASTER)
    page.click("#login-form button")
    expect(page.locator("#keys-table")).to_be_visible()

    page.click("#nav a[data-page=teams]")
    expect(page.locator("#teams-table")).to_contain_text("No teams yet")
    page.click("#new-team")
    form = page.locator(".team-form").first
    form.locator("input[name=name]").fill("search <b>team</b>")  # shown as text, never as markup
    form.locator("input[name=token_budget]").fill("100000")
    form.locator("input[name=budget_usd]").fill("5")
    form.locator("select[name=budget_period]").select_option("month")
    form.locator("select[name=priority]").select_option("high")
    form.locator("button[type=submit]").click()
    row = page.locator("#teams-table tbody tr", has_text="search <b>team</b>")
    expect(row).to_contain_text("$0 of $5 this month")
    expect(row).to_contain_text("0 of 100,000 tokens this month")
    expect(row).to_contain_text("weight 1, high")
    assert page.locator("#teams-table b").count() == 0
    team_id = row.get_attribute("data-team-id")
    assert team_id is not None and team_id.startswith("team_")

    # Members: ana joins from the picker; the team counts her.
    row.locator("text=Members").click()
    expect(page.locator("#members-table")).to_contain_text("No keys in this team.")
    page.select_option("#member-add", ana["id"])
    page.click("#member-add-button")
    expect(page.locator(f"#members-table tr[data-key-id={ana['id']}]")).to_contain_text("ana")
    expect(row.locator("[data-num-keys]")).to_have_text("1")

    # A request with ana's key counts against the team's budgets (settled just after the response: reload until).
    chat = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    sent = httpx.post(
        server.url + "/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {ana['key']}"}, timeout=30
    )
    assert sent.status_code == 200, sent.text
    for _ in range(50):
        page.goto(server.url + "/ui#/keys")
        page.goto(server.url + "/ui#/teams")
        expect(row).to_be_visible()
        if "$0.01 of $5" in row.inner_text():
            break
    expect(row).to_contain_text("$0.01 of $5 this month")
    expect(row).to_contain_text("10 of 100,000 tokens this month")
    page.screenshot(path=str(screenshots / "teams.png"), full_page=True)

    # Edit a limit: only what changed is sent.
    row.locator("text=Edit").click()
    edit = page.locator("#team-edit-panel")
    expect(edit.locator("input[name=budget_usd]")).to_have_value("5")
    edit.locator("input[name=rpm]").fill("50")
    edit.locator("button[type=submit]").click()
    expect(row).to_contain_text("50 rpm")

    # Usage grouped by team; the Keys page names ana's team.
    page.goto(server.url + "/ui#/usage")
    page.select_option("#usage-by", "team")
    team_row = page.locator("#usage-table tr", has_text=f"search <b>team</b> ({team_id})")
    expect(team_row).to_contain_text("10")
    page.screenshot(path=str(screenshots / "usage-by-team.png"), full_page=True)
    page.goto(server.url + "/ui#/keys")
    expect(page.locator(f"tr[data-key-id={ana['id']}] [data-team]")).to_have_text("team: search <b>team</b>")

    # Out and in: ana leaves from the members panel, bob joins through his key's edit form; then delete the team
    # with bob still in it (confirmed): bob is out of it, and keeps working.
    page.goto(server.url + "/ui#/teams")
    row.locator("text=Members").click()
    page.locator(f"#members-table tr[data-key-id={ana['id']}] [data-action=leave]").click()
    expect(page.locator("#members-table")).to_contain_text("No keys in this team.")
    page.goto(server.url + "/ui#/keys")
    page.locator(f"tr[data-key-id={bob['id']}] >> text=Edit").click()
    team_select = page.locator("#edit-panel select[name=team_id]")
    expect(team_select.locator(f"option[value={team_id}]")).to_have_count(1)
    team_select.select_option(team_id)
    page.locator("#edit-panel button[type=submit]").click()
    expect(page.locator(f"tr[data-key-id={bob['id']}] [data-team]")).to_contain_text("team: search")
    page.goto(server.url + "/ui#/teams")
    expect(row.locator("[data-num-keys]")).to_have_text("1")
    row.locator("[data-action=delete]").click()
    expect(page.locator("#modal")).to_contain_text("leave the team")
    page.click("#confirm-yes")
    expect(page.locator("#teams-table")).to_contain_text("No teams yet")
    assert httpx.get(server.url + f"/admin/keys/{bob['id']}", headers=admin, timeout=30).json()["team_id"] is None
