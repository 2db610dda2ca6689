"""Every example marked `run` in README.md and docs/*.md runs against a real gateway (see docs_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from docs_harness import DOC_PATHS, DocsGateway, collect_examples, example_id, start_docs_gateway
from sybil import Example
from sybil.example import SybilFailure

EXAMPLES = list(collect_examples())


def _param(example: Example) -> object:
    # The model-loading API example loads the real bundled model (~20 s): the one example of this module that does.
    marks = [pytest.mark.slow] if "bundled_model_path" in str(example.parsed) else []
    return pytest.param(example, marks=marks, id=example_id(example))


@pytest.fixture(scope="module")
def docs_gateway(redis_server_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsGateway]:
    import redis

    client = redis.Redis.from_url(redis_server_url)
    client.flushall()
    client.close()
    gateway = start_docs_gateway(redis_server_url, tmp_path_factory.mktemp("docs"))
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.mark.parametrize("example", [_param(example) for example in EXAMPLES])
def test_documented_example_runs(example: Example, docs_gateway: DocsGateway) -> None:
    example.namespace["docs_gateway"] = docs_gateway
    example.evaluate()


def test_the_docs_have_runnable_examples_for_every_client_surface() -> None:
    """A marker typo must not silently turn the examples off: the README's clients and the docs' tools run."""
    sources = "\n".join(str(example.parsed) for example in EXAMPLES)
    for needle in ("curl ", "/v1/messages", "from openai import", "from anthropic import", "unigate keys", "doctor"):
        assert needle in sources, f"no runnable example uses {needle!r}"
    assert DOC_PATHS[0] in {Path(example.path) for example in EXAMPLES}  # README.md


class ReadersShell(DocsGateway):
    """The shell a reader has beside `make run`: the gateway's files (`.unigate/master_key`), no key exported."""

    def environment(self) -> dict[str, str]:
        env = super().environment()
        for name in ("UNIGATE_API_KEY", "UNIGATE_MASTER_KEY", "KEY"):
            del env[name]
        return env


CLIENT_TOOL_EXAMPLES = [e for e in EXAMPLES if "unigate bench" in str(e.parsed) or "unigate doctor" in str(e.parsed)]


@pytest.mark.parametrize("example", [_param(example) for example in CLIENT_TOOL_EXAMPLES])
def test_client_tool_examples_need_no_exported_key(example: Example, docs_gateway: DocsGateway) -> None:
    """`unigate bench` and `doctor` examples pass their key: without one they get 401 unless the reader happened to
    export `UNIGATE_API_KEY`."""
    example.namespace["docs_gateway"] = ReadersShell(
        **{f.name: getattr(docs_gateway, f.name) for f in fields(docs_gateway)}
    )
    example.evaluate()


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ("curl http://127.0.0.1:8080/v1/chat/complete -H 'content-type: application/json' -d '{}'", "HTTP statuses"),
        ('curl http://127.0.0.1:8080/health/live\n# → {"status", "uptime_s"}', "documented fields ['uptime_s']"),
        ('curl http://127.0.0.1:8080/health/live\n# → 404 {"status"}', "HTTP statuses"),
        ("unigate keys show --no-such-flag", "exit status 2"),
    ],
)
def test_the_harness_fails_a_wrong_example(block: str, reason: str, docs_gateway: DocsGateway, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"```sh run\n{block}\n```\n")
    [example] = collect_examples([page])
    example.namespace["docs_gateway"] = docs_gateway
    with pytest.raises(SybilFailure, match=reason.replace("[", r"\[").replace("]", r"\]")):
        example.evaluate()
