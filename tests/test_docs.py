"""The docs say what the code does: links resolve, the settings tables match `Settings`, the error table matches
`KNOWN_ERROR_CODES`, and the README stays a front door. The examples themselves run in test_docs_examples.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.metrics import KNOWN_ERROR_CODES
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
LINKED_PAGES = [*PAGES, ROOT / "benchmarks" / "RESULTS.md"]
MAX_README_LINES = 300

# `UNIGATE_*` names the docs mention that are not settings: the keys CLI's and `unigate bench`'s defaults, the
# engine server's key, docker-compose's published port, the test suite's Redis topology switch and screenshot folder.
NOT_SETTINGS = {
    "UNIGATE_BASE_URL",
    "UNIGATE_API_KEY",
    "UNIGATE_ENGINE_API_KEY",
    "UNIGATE_PUBLISH_PORT",
    "UNIGATE_TEST_REDIS_TOPOLOGY",
    "UNIGATE_SCREENSHOT_DIR",  # where the console's browser test writes its screenshots
}

_FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_SETTING = re.compile(r"\bUNIGATE_[A-Z0-9_]*[A-Z0-9]\b")
_DIARY = re.compile(
    r"\b(this|that|a|an|later|earlier|next|previous|first|second|third|fourth|fifth|sixth|seventh) sessions?\b",
    re.IGNORECASE,
)


def without_code(text: str) -> str:
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for match in _HEADING.finditer(_FENCE.sub("", path.read_text())):
        base = slug(match.group(1))
        number = counts.get(base, 0)
        counts[base] = number + 1
        found.add(base if number == 0 else f"{base}-{number}")
    return found


def relative_links(path: Path) -> Iterator[tuple[str, Path, str]]:
    for match in _LINK.finditer(without_code(path.read_text())):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        yield target, (path.parent / file_part).resolve() if file_part else path, anchor


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target, file, anchor in relative_links(page):
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


def test_slugs_follow_github() -> None:
    assert slug("Admin API (master key only)") == "admin-api-master-key-only"
    assert slug("Stored responses (`/v1/responses` with `native_responses`)") == (
        "stored-responses-v1responses-with-native_responses"
    )
    assert slug("2026-11-29: gateway overhead (2-core VM)") == "2026-11-29-gateway-overhead-2-core-vm"


# -- settings -------------------------------------------------------------------------------------------------------


def setting_defaults(model: type[BaseModel] = Settings, prefix: str = "UNIGATE_") -> dict[str, Any]:
    """Every environment variable of `Settings` (nested groups joined by `__`) and its default."""
    defaults: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        env = f"{prefix}{name.upper()}"
        if isinstance(default, BaseModel):
            defaults.update(setting_defaults(type(default), f"{env}__"))
        else:
            defaults[env] = default
    return defaults


def table_rows(text: str) -> Iterator[tuple[list[str], list[str]]]:
    """(header cells, row cells) for every row of every Markdown table outside code blocks."""
    header: list[str] | None = None
    previous = ""
    for line in _FENCE.sub("", text).splitlines():
        if not line.startswith("|"):
            header, previous = None, line
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if re.fullmatch(r"\|?\s*:?-{3,}.*", line) and previous.startswith("|"):
            header = [cell.strip() for cell in previous.strip().strip("|").split("|")]
        elif header is not None:
            yield header, cells
        previous = line


def documented_settings() -> Iterator[tuple[Path, str, str]]:
    """(page, variable, default cell) for each row of a table with a `Default` column naming one variable."""
    for page in PAGES:
        for header, cells in table_rows(page.read_text()):
            names = _SETTING.findall(cells[0])
            if "Default" in header and len(names) == 1 and len(cells) == len(header):
                yield page, names[0], cells[header.index("Default")]


def parse_default(cell: str) -> str | None:
    """A default cell opens with the value in backticks; any other opening ("none: ...") means no value."""
    match = re.match(r"`([^`]*)`", cell)
    return match.group(1) if match else None


def same_default(documented: str | None, actual: Any) -> bool:
    if actual is None or actual == []:
        return documented is None
    if documented is None:
        return False
    if isinstance(actual, bool):
        return documented == str(actual).lower()
    if isinstance(actual, int | float):
        try:
            return float(documented) == float(actual)
        except ValueError:
            return False
    if isinstance(actual, list):
        return bool(json.loads(documented) == actual)
    return documented == str(actual)


def test_every_documented_setting_exists_with_its_default() -> None:
    defaults = setting_defaults()
    wrong = []
    for page, name, cell in documented_settings():
        if name not in defaults:
            wrong.append(f"{page.name}: {name} is not a setting")
        elif not same_default(parse_default(cell), defaults[name]):
            wrong.append(f"{page.name}: {name} documented as {cell!r}, Settings says {defaults[name]!r}")
    assert wrong == []


def test_every_setting_is_in_a_configuration_table() -> None:
    documented = {name for _, name, _ in documented_settings()}
    assert sorted(set(setting_defaults()) - documented) == []


def test_every_unigate_name_in_the_docs_is_a_setting() -> None:
    defaults = setting_defaults()
    unknown = sorted(
        {f"{page.name}: {name}" for page in PAGES for name in _SETTING.findall(page.read_text())}
        - {f"{page.name}: {name}" for page in PAGES for name in [*defaults, *NOT_SETTINGS]}
    )
    assert unknown == []


def test_the_settings_check_reads_the_tables() -> None:
    assert parse_default("`16777216` (16 MiB)") == "16777216"
    assert parse_default("none: an embedded Redis") is None
    assert same_default("0.90", 0.9) and same_default('["local"]', ["local"]) and same_default(None, [])
    assert not same_default("2", 1.0) and not same_default(None, 8080) and not same_default("`x`", None)
    assert len(list(documented_settings())) >= len(setting_defaults())


# -- error codes ----------------------------------------------------------------------------------------------------


def code_column(text: str, heading: str | None = None) -> set[str]:
    """The backticked codes in the `code` column of the tables (under `heading`, when given)."""
    if heading is not None:
        text = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    codes: set[str] = set()
    for header, cells in table_rows(text):
        columns = [i for i, name in enumerate(header) if name.strip("`").lower() == "code"]
        for i in columns:
            codes.update(re.findall(r"`([a-z_]+)`", cells[i]))
    return codes


def test_the_error_table_lists_every_code_the_gateway_sends_and_no_other() -> None:
    documented = code_column((ROOT / "docs" / "gateway.md").read_text(), heading="Errors")
    assert sorted(KNOWN_ERROR_CODES - documented) == [], "codes the gateway sends that the table lacks"
    assert sorted(documented - KNOWN_ERROR_CODES) == [], "codes in the table that the gateway never sends"


def test_every_error_code_in_any_docs_table_is_a_gateway_code() -> None:
    unknown = {f"{page.name}: {code}" for page in PAGES for code in code_column(page.read_text()) - KNOWN_ERROR_CODES}
    assert sorted(unknown) == []


# -- the front door -------------------------------------------------------------------------------------------------


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert "```\nmake run\nmake test\n```" in text  # the two-command quick start


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_diary_in_the_docs(page: Path) -> None:
    assert _DIARY.findall(page.read_text()) == []
