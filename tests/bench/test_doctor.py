"""`unigate doctor` against fake servers that fail in each way a client config can fail."""

from __future__ import annotations

import pytest
import typer
from bench_fakes import FakeConfig, FakeServer
from fakes.app import MASTER, build_app, single_model
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream
from typer.testing import CliRunner

from bench.cli import register
from bench.doctor import CheckStatus, Diagnosis, client_config, diagnose

GOOD_KEY = "sk-ug-good0123456789"
KEYS = {GOOD_KEY: "ok", "sk-ug-revoked": "revoked", "sk-ug-expired": "expired"}


def _failures(diagnosis: Diagnosis) -> dict[str, str]:
    return {c.name: f"{c.detail} | fix: {c.fix}" for c in diagnosis.checks if c.status is CheckStatus.FAIL}


def _status(diagnosis: Diagnosis, name: str) -> CheckStatus:
    return next(c.status for c in diagnosis.checks if c.name == name)


async def test_a_healthy_server_passes_every_check() -> None:
    with FakeServer(FakeConfig(keys=KEYS)) as server:
        diagnosis = await diagnose(server.base_url, GOOD_KEY, "fake-model")
    assert diagnosis.is_ok, _failures(diagnosis)
    assert diagnosis.verified_base_url == server.base_url
    for name in ("connect", "API key", "model", "chat completion", "streaming"):
        assert _status(diagnosis, name) is CheckStatus.OK
    assert _status(diagnosis, "Anthropic Messages (Claude Code)") is CheckStatus.WARN  # the fake has none


async def test_connection_refused() -> None:
    diagnosis = await diagnose(FakeServer().base_url, GOOD_KEY, "fake-model")  # nothing listens there
    assert "connection refused" in _failures(diagnosis)["connect"]


async def test_dns_failure() -> None:
    diagnosis = await diagnose("http://no-such-host.invalid/v1", GOOD_KEY, "fake-model")
    assert "does not resolve" in _failures(diagnosis)["connect"]


async def test_https_against_a_plain_http_server() -> None:
    with FakeServer() as server:
        diagnosis = await diagnose(server.base_url.replace("http://", "https://"), GOOD_KEY, "fake-model")
    failure = _failures(diagnosis)["connect"]
    assert "TLS" in failure and "use http://" in failure


@pytest.mark.parametrize(("suffix", "what"), [("", "lacks `/v1`"), ("/v1/v1", "appears twice")])
async def test_v1_missing_or_doubled(suffix: str, what: str) -> None:
    with FakeServer(FakeConfig(keys=KEYS)) as server:
        diagnosis = await diagnose(server.url + suffix, GOOD_KEY, "fake-model")
    failure = _failures(diagnosis)["base URL"]
    assert what in failure and f"use {server.url}/v1 as the base URL" in failure
    assert _status(diagnosis, "chat completion") is CheckStatus.OK  # carried on with the corrected URL
    assert diagnosis.verified_base_url == f"{server.url}/v1"


async def test_a_path_the_gateway_had_to_repair_is_a_warning() -> None:
    with FakeServer(FakeConfig(keys=KEYS, is_path_normalized=True)) as server:
        diagnosis = await diagnose(server.url, GOOD_KEY, "fake-model")
    assert diagnosis.is_ok and diagnosis.verified_base_url == f"{server.url}/v1"
    warning = next(c for c in diagnosis.checks if c.name == "base URL")
    assert warning.status is CheckStatus.WARN and warning.fix is not None and f"{server.url}/v1" in warning.fix


async def test_an_endpoint_pasted_as_the_base_url() -> None:
    with FakeServer() as server:
        diagnosis = await diagnose(f"{server.base_url}/chat/completions", "", "fake-model")
    assert "ends with the endpoint" in _failures(diagnosis)["base URL"]
    assert _status(diagnosis, "chat completion") is CheckStatus.OK


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("", "no API key reached the server"),
        ("sk-proj-abcdefghijklmnop", "unigate keys start with `sk-ug-`"),
        ("sk-ant-api03-abcdefghijkl", "looks like an Anthropic key"),
        ("sk-ug-typo0123456789", "check the key for a copy-paste error"),
        ("sk-ug-revoked", "revoked"),
        ("sk-ug-expired", "expired"),
        (f"{GOOD_KEY} {GOOD_KEY}", "must be exactly `Authorization: Bearer <key>`"),
    ],
)
async def test_401_variants(key: str, expected: str) -> None:
    with FakeServer(FakeConfig(keys=KEYS)) as server:
        diagnosis = await diagnose(server.base_url, key, "fake-model")
    assert expected in _failures(diagnosis)["API key"]
    assert "chat completion" not in {c.name for c in diagnosis.checks}  # nothing after a rejected key


async def test_a_key_pasted_with_its_bearer_prefix() -> None:
    with FakeServer(FakeConfig(keys=KEYS)) as server:
        diagnosis = await diagnose(server.base_url, f"Bearer {GOOD_KEY}", "fake-model")
    assert "`Bearer ` prefix" in _failures(diagnosis)["API key"]
    assert _status(diagnosis, "chat completion") is CheckStatus.OK


async def test_403_model_not_allowed() -> None:
    with FakeServer(FakeConfig(keys=KEYS, allowed_models={GOOD_KEY: ["other"]})) as server:
        diagnosis = await diagnose(server.base_url, GOOD_KEY, "fake-model")
    assert "may not use the model `fake-model`" in _failures(diagnosis)["chat completion"]


async def test_404_model_not_found_lists_models() -> None:
    with FakeServer(FakeConfig(models=["fake-model", "local"])) as server:
        diagnosis = await diagnose(server.base_url, "", "fake-modle")
    failure = _failures(diagnosis)["chat completion"]
    assert "Available models: fake-model, local" in failure and "did you mean `fake-model`" in failure
    assert _status(diagnosis, "model") is CheckStatus.WARN


async def test_an_alias_of_a_gateway_model_is_not_reported_missing(fake_upstream: FakeUpstream) -> None:
    # The real gateway lists `gpt-test` with `"aliases": ["fast"]`; `fast` is served, so doctor must say so.
    with ThreadedServer(build_app(single_model(fake_upstream))) as gateway:
        diagnosis = await diagnose(f"{gateway.url}/v1", MASTER, "fast")
    model = next(c for c in diagnosis.checks if c.name == "model")
    assert model.status is CheckStatus.OK and "alias of `gpt-test`" in model.detail, model.detail
    assert _status(diagnosis, "chat completion") is CheckStatus.OK


async def test_429_rate_limited_says_when_to_retry() -> None:
    with FakeServer(FakeConfig(failure="rate_limited")) as server:
        diagnosis = await diagnose(server.base_url, "", "fake-model")
    failure = _failures(diagnosis)["chat completion"]
    assert "requests per minute" in failure and "retry after 7 s" in failure


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("malformed", "no usable `choices` (missing)"),
        ("empty_choices", "no usable `choices` ([])"),
        ("non_json", "not JSON"),
    ],
)
async def test_malformed_answers_explain_reading_choices(failure: str, expected: str) -> None:
    with FakeServer(FakeConfig(failure=failure)) as server:
        diagnosis = await diagnose(server.base_url, "", "fake-model")
    found = _failures(diagnosis)["chat completion"]
    assert expected in found and "reading 'choices'" in found


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("broken_stream", "broke mid-stream"),
        ("no_done", "without `data: [DONE]`"),
        ("stream_error", "carried an error (upstream_error)"),
        ("no_choices_stream", "has `choices`"),
        ("not_streaming", "not text/event-stream"),
    ],
)
async def test_broken_streams(failure: str, expected: str) -> None:
    with FakeServer(FakeConfig(failure=failure)) as server:
        diagnosis = await diagnose(server.base_url, "", "fake-model", is_surfaces_checked=False)
    if failure != "not_streaming":
        assert _status(diagnosis, "chat completion") is CheckStatus.OK
    assert expected in _failures(diagnosis)["streaming"]


async def test_not_an_api_at_all() -> None:
    with FakeServer(FakeConfig(prefix="/api")) as server:
        diagnosis = await diagnose(server.url + "/v1", "", "fake-model")
    assert "no OpenAI-compatible API" in _failures(diagnosis)["API"]


def test_cli_exit_codes_and_printed_config() -> None:
    app = typer.Typer()
    register(app)
    with FakeServer(FakeConfig(keys=KEYS)) as server:
        ok = CliRunner().invoke(
            app, ["doctor", "--base-url", server.url, "--api-key", GOOD_KEY, "--model", "fake-model", "--print-config"]
        )
        bad = CliRunner().invoke(
            app, ["doctor", "--base-url", server.base_url, "--api-key", "sk-ug-revoked", "--model", "fake-model"]
        )
    assert ok.exit_code == 1  # the base URL lacked /v1: a failure even though doctor found the right one
    assert f"OPENAI_BASE_URL={server.url}/v1" in ok.output and GOOD_KEY not in ok.output
    assert bad.exit_code == 1 and "revoked" in bad.output


def test_printed_config_snippets() -> None:
    text = client_config("http://gw.example:8080/v1/v1", "smollm2", "sk-ug-k")
    for needle in (
        'OpenAI(base_url="http://gw.example:8080/v1"',
        'Anthropic(base_url="http://gw.example:8080"',
        "curl http://gw.example:8080/v1/chat/completions",
        "Authorization: Bearer $UNIGATE_API_KEY",
        "export ANTHROPIC_BASE_URL=http://gw.example:8080\n",
        "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_API_KEY",
        "export ANTHROPIC_MODEL=smollm2",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
        "[model_providers.unigate]",
        'base_url = "http://gw.example:8080/v1"',
        'env_key = "UNIGATE_API_KEY"',
        'wire_api = "responses"',
        'model_provider = "unigate"',
        "OpenAI Compatible",
        "export UNIGATE_API_KEY=sk-ug-k",
    ):
        assert needle in text, needle


def test_the_printed_openai_snippet_works() -> None:
    from openai import OpenAI

    with FakeServer(FakeConfig(keys=KEYS)) as server:
        text = client_config(server.base_url, "fake-model")
        base_url = text.split('OpenAI(base_url="')[1].split('"')[0]
        client = OpenAI(base_url=base_url, api_key=GOOD_KEY, max_retries=0)
        reply = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
        client.close()
    assert reply.choices[0].message.content


def _claude_code_exports(text: str) -> dict[str, str]:
    """`NAME -> value` of every `export ANTHROPIC_*` / `CLAUDE_CODE_*` line (comments dropped)."""
    exports: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("export ANTHROPIC_") or line.startswith("export CLAUDE_CODE_"):
            name, _, value = line.removeprefix("export ").partition("=")
            exports[name] = value.split("#", 1)[0].strip()
    return exports


def test_printed_claude_code_variables_are_those_docs_clients_recommends() -> None:
    """docs/clients.md's Claude Code block and `doctor --print-config` set the same variables (the doc's values are
    placeholders; the printed ones are this gateway's)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "clients.md").read_text()
    block = doc.split("## Claude Code", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    documented = _claude_code_exports(block)
    printed = _claude_code_exports(client_config("http://gw.example:8080", "smollm2", "sk-ug-k"))
    assert "ANTHROPIC_DEFAULT_HAIKU_MODEL" in documented
    assert sorted(printed) == sorted(documented)
    assert printed["ANTHROPIC_MODEL"] == printed["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "smollm2"
    assert printed["ANTHROPIC_BASE_URL"] == "http://gw.example:8080"
