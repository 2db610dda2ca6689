"""Run the examples of README.md and docs/*.md against a real gateway, so the docs cannot drift from the code.

A fenced block is an example the suite runs when its info string says `run` after the language:

    ```sh run         bash (`set -euo pipefail`) in a scratch directory; every command must exit 0, and every
                      curl must get a status below 400 unless the block expects that status (below)
    ```python run     Python, in a fresh namespace, in the scratch directory; it must not raise
    ```yaml run       a routing file; it must validate (`gateway.routing_config.parse_routing`)

Renderers highlight by the first word only, so the marker is invisible to readers. Blocks without it (servers
that run for ever, tools that need Claude Code, Codex or a GPU, syntax summaries) are not run.

Before a block runs, the addresses and secrets a reader would have are put in: `http://127.0.0.1:8080` becomes
the test gateway's URL, `sk-ug-...` its master key, `key_0123456789abcdef` the id of a key made (and used once)
for that block. The scratch directory holds `.unigate/master_key` (written by the gateway itself on its first start,
as with `make run`) and a `.venv` link to the project's, so quick-start lines such as `KEY=$(cat .unigate/master_key)`
and `.venv/bin/unigate keys ...` run unchanged; `unigate` is on the PATH and `UNIGATE_BASE_URL`,
`UNIGATE_MASTER_KEY`, `UNIGATE_API_KEY` and `KEY` hold the gateway's URL and key.

Expected output: in a `sh run` block, a comment `# → {"object": "list", "data": [...], "has_more"}` after a command
shows its answer; each quoted name (`"has_more"`, `"list"`) must appear, quoted, in the block's output. A comment
that starts with a status (`# → 404 {"error": ...}`) expects that status from a curl of the block.

The gateway is production wiring (`gateway.server.build_app`: Redis-backed keys, limits and admin API) with a
fake OpenAI-compatible upstream behind every model id the docs use (`local`, `fast`, `my-model`, `openai/*`, ...),
so only an example that loads a model itself (the loader's API) costs a model load. Blocks are found with
Sybil's Markdown lexer (https://sybil.readthedocs.io).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream
from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
DOC_PATHS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

GATEWAY_IN_DOCS = "http://127.0.0.1:8080"
KEY_IN_DOCS = "sk-ug-..."
KEY_ID_IN_DOCS = "key_0123456789abcdef"
LANGUAGES = ("sh", "bash", "python", "yaml")
BLOCK_TIMEOUT_S = 60.0

# The model ids the docs' examples send, all served by the fake upstream.
DOC_MODELS: tuple[dict[str, Any], ...] = (
    {"id": "smollm2-135m-instruct", "aliases": ["local"]},
    {"id": "gpt-4o-mini", "aliases": ["fast"]},
    {"id": "my-model", "aliases": []},
    {"id": "openai/*", "aliases": []},
)
# `env:NAME` upstream keys in the docs' routing files.
ROUTING_ENV = {"UPSTREAM_KEY": "sk-up", "OPENAI_API_KEY": "sk-up", "OTHER_KEY": "sk-up"}

_INFO = re.compile(rf"(?P<language>{'|'.join(LANGUAGES)})[ \t]+run[ \t]*$\n", re.MULTILINE)
# `# → [status] shape`, the shape going on over comment lines indented by two or more spaces.
_EXPECTED = re.compile(r"#\s*→\s*(?P<status>[1-5]\d\d\b)?(?P<shape>.*(?:\n[ \t]*#[ \t]{2,}[^→\n]*)*)")
_STATUS = re.compile(r"<<http (\d{3})>>")
_FIELD = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"')
_PRELUDE = """set -euo pipefail
curl() { command curl --silent --show-error "$@" --write-out '\n<<http %{http_code}>>\n'; }
"""

__all__ = ["DOC_PATHS", "DocsGateway", "collect_examples", "start_docs_gateway"]


@dataclass
class DocsGateway:
    """A running gateway for the examples, and the scratch directory they run in."""

    server: ThreadedServer
    upstream: FakeUpstream
    workdir: Path
    master_key: str

    @property
    def url(self) -> str:
        return self.server.url

    def new_key_id(self) -> str:
        """A fresh key that has served one request, so its usage rows are not empty."""
        created = httpx.post(
            f"{self.url}/admin/keys",
            json={"name": "docs-example"},
            headers={"authorization": f"Bearer {self.master_key}"},
        )
        created.raise_for_status()
        chat = {"model": "local", "messages": [{"role": "user", "content": "Hi"}]}
        used = httpx.post(
            f"{self.url}/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {created.json()['key']}"}
        )
        used.raise_for_status()
        return str(created.json()["id"])

    def substitute(self, source: str) -> str:
        source = source.replace(GATEWAY_IN_DOCS, self.url).replace(KEY_IN_DOCS, self.master_key)
        if KEY_ID_IN_DOCS in source:
            source = source.replace(KEY_ID_IN_DOCS, self.new_key_id())
        return source

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("UNIGATE_") and k != "REDIS_URL"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(UNIGATE_BASE_URL=self.url, UNIGATE_MASTER_KEY=self.master_key, UNIGATE_API_KEY=self.master_key)
        env["KEY"] = self.master_key
        return env

    def stop(self) -> None:
        self.server.stop()
        self.upstream.stop()


def start_docs_gateway(redis_url: str, workdir: Path) -> DocsGateway:
    """The production app (`build_app`) on a free port, with every doc model id routed to one fake upstream."""
    from gateway.server import build_app
    from gateway.settings import Settings

    upstream = FakeUpstream().start()
    deployment = {"type": "openai", "base_url": upstream.base_url, "api_key": "sk-up"}
    models = [{**model, "deployments": [deployment]} for model in DOC_MODELS]
    routing = workdir / "routing.yaml"
    routing.write_text(yaml.safe_dump({"models": models}))
    (workdir / ".venv").symlink_to(Path(sys.executable).parent.parent)
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        redis_url=redis_url,
        data_dir=workdir / ".unigate",  # the master key is generated there, as on a first `make run`
        engine={"enabled": False},  # type: ignore[arg-type]
        health_probe_interval_s=0,
    )
    server = ThreadedServer(build_app(settings)).start()
    master_key = (workdir / ".unigate" / "master_key").read_text().strip()
    return DocsGateway(server=server, upstream=upstream, workdir=workdir, master_key=master_key)


# -- finding the examples -------------------------------------------------------------------------------------------


def _parse_runnable(document: Document) -> Iterable[Region]:
    lexer = RawFencedCodeBlockLexer(info_pattern=_INFO)
    for region in lexer(document):
        language = str(region.lexemes["language"])
        region.parsed = str(region.lexemes["source"])
        region.evaluator = _EVALUATORS["sh" if language == "bash" else language]
        yield region


def collect_examples(paths: Iterable[Path] = DOC_PATHS) -> Iterator[Example]:
    for path in paths:
        yield from Document.parse(str(path), _parse_runnable)


def example_id(example: Example) -> str:
    path = Path(example.path).resolve()
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{example.line}"


# -- running them -----------------------------------------------------------------------------------------------------


def _gateway(example: Example) -> DocsGateway:
    gateway = example.namespace.get("docs_gateway")
    assert isinstance(gateway, DocsGateway), "set example.namespace['docs_gateway'] before evaluating"
    return gateway


def evaluate_shell(example: Example) -> str | None:
    gateway = _gateway(example)
    script = gateway.substitute(example.parsed)
    result = subprocess.run(
        ["bash", "-c", _PRELUDE + script],
        cwd=gateway.workdir,
        env=gateway.environment(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        return f"exit status {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    return check_output(example.parsed, result.stdout)


def check_output(source: str, output: str) -> str | None:
    """Compare a block's output with its `# →` comments: documented fields present, error statuses expected."""
    expected_statuses = {match.group("status") for match in _EXPECTED.finditer(source) if match.group("status")}
    statuses = _STATUS.findall(output)
    unexpected = [status for status in statuses if int(status) >= 400 and status not in expected_statuses]
    if unexpected or not expected_statuses <= set(statuses):
        return f"HTTP statuses {statuses}, expected {sorted(expected_statuses)} (and < 400 otherwise)\n{output}"
    fields = [name for match in _EXPECTED.finditer(source) for name in _FIELD.findall(match.group("shape"))]
    missing = [name for name in fields if f'"{name}"' not in output]
    if missing:
        return f"the output lacks the documented fields {missing}\n--- stdout\n{output}"
    return None


def evaluate_python(example: Example) -> str | None:
    gateway = _gateway(example)
    code = compile(gateway.substitute(example.parsed), f"{example.path}:{example.line}", "exec")
    with contextlib.chdir(gateway.workdir):
        exec(code, {"__name__": "__docs_example__"})
    return None


def evaluate_yaml(example: Example) -> str | None:
    from gateway.routing_config import parse_routing

    saved = {name: os.environ.get(name) for name in ROUTING_ENV}
    os.environ.update(ROUTING_ENV)
    try:
        parse_routing(yaml.safe_load(example.parsed), source=example_id(example))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return None


_EVALUATORS = {"sh": evaluate_shell, "python": evaluate_python, "yaml": evaluate_yaml}
