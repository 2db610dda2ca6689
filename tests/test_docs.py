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

from gateway import validate
from gateway.errors import InvalidRequestError
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


# -- request-field ranges -------------------------------------------------------------------------------------------

API_LIMITS = ROOT / "docs" / "api-limits.md"
_FAMILY_CHECKS = {
    "chat": (validate.check_chat, {"logprobs": True}),  # `top_logprobs` above 0 needs `logprobs: true`
    "completions": (validate.check_completions, {}),
    "messages": (validate.check_messages, {}),
    "responses": (validate.check_responses, {}),
}
# A number as the range tables write it: `1024`, `0.5`, `−2^63`, `2^31 − 1` (U+2212 minus; `–` joins a range);
# `above 0` excludes its 0.
_RANGE_END = re.compile(
    r"(?<![\w.^])(?P<above>above )?(?P<minus>−)?(?P<base>\d+(?:\.\d+)?)(?:\^(?P<power>\d+)(?:\s*−\s*(?P<less>\d+))?)?"
)


def range_ends(cell: str) -> list[tuple[int | float, bool]]:
    """(value, is it allowed) for each number of an Allowed cell."""
    ends: list[tuple[int | float, bool]] = []
    for match in _RANGE_END.finditer(without_code(cell)):
        base = float(match["base"]) if "." in match["base"] else int(match["base"])
        value = base ** int(match["power"] or 1) - int(match["less"] or 0)
        ends.append((-value if match["minus"] else value, match["above"] is None))
    return ends


def field_rows() -> Iterator[tuple[list[str], list[str], str]]:
    """(field names, families, Allowed cell) for each row of docs/api-limits.md's field table."""
    text = API_LIMITS.read_text().split("\n## Fields\n", 1)[1].split("\n## ", 1)[0]
    for header, cells in table_rows(text):
        row = dict(zip(header, cells, strict=True))
        families = re.findall(r"\b(chat|completions|messages|responses)\b", row["Families"])
        if row["Families"].startswith("all"):
            families = list(_FAMILY_CHECKS)
        yield re.findall(r"`([a-z_]+)`", row["Field"]), families, row["Allowed"]


def refusal(family: str, field: str, value: Any) -> str | None:
    """None when the gateway's validator for `family` accepts `{field: value}`, else the error's code."""
    check, base = _FAMILY_CHECKS[family]
    try:
        check({**base, field: value})
    except InvalidRequestError as exc:
        return exc.code
    return None


def range_cases(allowed: str) -> list[tuple[int | float, bool]]:
    """The values an integer or number range cell decides: its ends, one step past each side (refused) and, for
    integers, each allowed end written as a float (`2.0`: refused); [] for any other cell."""
    kind = allowed.split()[0].rstrip(",:")
    if kind not in ("integer", "number"):
        return []
    ends = range_ends(allowed)
    low, high = min(value for value, _ in ends), max(value for value, _ in ends)
    step = 1 if kind == "integer" else 0.5
    cases = [*ends, (low - step, False), (high + step, False)]
    if kind == "integer":
        cases += [(float(value), False) for value, is_allowed in ends if is_allowed]
    return cases


def test_the_field_table_is_what_the_gateway_enforces() -> None:
    """Each range of docs/api-limits.md's table, against gateway/validate.py for each family the row names; each
    constant a row names has the value the row states."""
    wrong = []
    num_checked = 0
    for fields, families, allowed in field_rows():
        for name in re.findall(r"`(MAX_[A-Z_]+)`", allowed):
            if getattr(validate, name, None) not in [value for value, _ in range_ends(allowed)]:
                wrong.append(f"validate.{name} is {getattr(validate, name, None)}; the table says {allowed!r}")
        for field in fields:
            for family in families:
                for value, is_allowed in range_cases(allowed):
                    num_checked += 1
                    if (refusal(family, field, value) is None) != is_allowed:
                        wrong.append(f"{family} `{field}: {value!r}` is {'refused' if is_allowed else 'allowed'}")
    assert num_checked >= 100, "the table's ranges were not found"
    assert wrong == []


def test_the_ranges_are_in_one_table() -> None:
    """docs/api-limits.md holds the request-field ranges as the gateway enforces them; other pages link to it."""
    tables = {
        page.name
        for page in PAGES
        for header, _ in table_rows(page.read_text())
        if header[:1] == ["Field"] and "Allowed" in header
    }
    assert tables == {"api-limits.md"}
    engine_links = [target for target, _, _ in relative_links(ROOT / "docs" / "engine.md")]
    assert "api-limits.md#fields" in engine_links


def test_the_range_check_reads_the_cells() -> None:
    assert range_ends("integer, −2^63 to 2^63 − 1") == [(-(2**63), True), (2**63 - 1, True)]
    assert range_ends("number above 0, at most 10") == [(0, False), (10, True)]
    assert range_cases("integer 1–128 (`MAX_N`)") == [
        (1, True),
        (128, True),
        (0, False),
        (129, False),
        (1.0, False),
        (128.0, False),
    ]
    assert range_cases("number 0–1") == [(0, True), (1, True), (-0.5, False), (1.5, False)]
    assert range_cases("a string") == []


# -- headline figures -----------------------------------------------------------------------------------------------

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
_FIGURE = re.compile(r"(?<![\w.,^])\d+(?:,\d{3})*(?:\.\d+)?")  # `1,134.1`, `0.81`; not the 4 of `int4` or `Q4_1`


def figures(text: str) -> set[str]:
    return {match.group().replace(",", "") for match in _FIGURE.finditer(text)}


def sections(path: Path) -> dict[str, str]:
    """Each heading's anchor → the text under it, up to the next heading (code blocks included: a run's table may be
    a tool's output)."""
    text = path.read_text()
    fences = [match.span() for match in _FENCE.finditer(text)]
    headings = [m for m in _HEADING.finditer(text) if not any(a <= m.start() < b for a, b in fences)]
    found: dict[str, str] = {}
    counts: dict[str, int] = {}
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        base = slug(heading.group(1))
        number = counts.get(base, 0)
        counts[base] = number + 1
        found[base if number == 0 else f"{base}-{number}"] = text[
            heading.end() : following.start() if following else None
        ]
    return found


def headline_rows() -> Iterator[tuple[str, str, list[str]]]:
    """(what, figures, RESULTS.md links) for each row of the README's headline table."""
    text = README.read_text().split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    for header, cells in table_rows(text):
        row = dict(zip(header, cells, strict=True))
        links = [match.group(1) for match in _LINK.finditer(" ".join(cells))]
        yield row["what"], row["figure"], [link for link in links if link.startswith("benchmarks/RESULTS.md")]


def test_every_headline_figure_is_in_the_run_its_row_links() -> None:
    """Each row of the README's headline table links one dated run in RESULTS.md, and quotes only figures that run
    holds, written as it writes them (`252.4 MiB`, not a rounded `252 MiB`)."""
    runs = sections(RESULTS)
    rows = list(headline_rows())
    wrong = []
    for what, figure, links in rows:
        anchors = [link.partition("#")[2] for link in links]
        if len(anchors) != 1 or anchors[0] not in runs:
            wrong.append(f"{what}: links {links}, not one heading of RESULTS.md")
        elif missing := sorted(figures(figure) - figures(runs[anchors[0]])):
            wrong.append(f"{what}: {missing} are not in the run it links")
    assert len(rows) >= 5
    assert wrong == []


def test_the_figure_check_reads_numbers_and_runs() -> None:
    assert figures("int4 (head int8) 214.4 MiB, 1,134.1 MiB, 0.81–1.76× on Q4_1, 2^20") == {
        "214.4",
        "1134.1",
        "0.81",
        "1.76",
        "2",
    }
    runs = sections(RESULTS)
    assert "2026-11-29-gateway-overhead-2-core-vm" in runs
    assert "19169" in figures(runs["2026-11-29-gateway-overhead-2-core-vm"])  # inside the run's code block


def test_every_headline_row_links_the_latest_run_of_its_kind() -> None:
    """A run is superseded by a later one of the same kind: a heading opening with the same two words after its date
    (`2026-12-03: gateway overhead after ...` supersedes `2026-11-29: gateway overhead (2-core VM)`)."""
    runs = [re.match(r"(\d{4}-\d{2}-\d{2}): (\S+ \S+)", heading) for heading in _HEADING.findall(RESULTS.read_text())]
    dated = [(slug(m.string), m.group(1), m.group(2).lower()) for m in runs if m is not None]
    stale = []
    for what, _, links in headline_rows():
        for anchor in [link.partition("#")[2] for link in links]:
            for _, date, kind in [run for run in dated if run[0] == anchor]:
                later = [name for name, other, same in dated if same == kind and other > date]
                if later:
                    stale.append(f"{what}: {anchor} is superseded by {later}")
    assert stale == []


def test_the_quantization_table_quotes_the_run_it_links() -> None:
    """docs/local-engine.md's table of weight formats (resident MiB, speed, agreement): every figure is in the run
    linked right after it, so the `int4` row cannot keep a size from before its head went to int8."""
    text = (ROOT / "docs" / "local-engine.md").read_text()
    table = re.search(r"^\| weights \| resident weights \|.*?\n(?!\|)", text, re.MULTILINE | re.DOTALL)
    assert table is not None
    link = re.search(r"\]\(\.\./benchmarks/RESULTS\.md#([^)]+)\)", text[table.end() :])
    assert link is not None and link.start() < 200, "no run linked right after the table"
    assert sorted(figures(table.group()) - figures(sections(RESULTS)[link.group(1)])) == []
