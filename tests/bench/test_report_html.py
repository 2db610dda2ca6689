"""HTML reports (`bench --html`, `bench report`, `bench compare --html`) from a real bench run against the fake server,
and bench/static/charts.js itself: under node with a small DOM stub, and in headless Chromium when installed."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import typer
from bench_fakes import FakeConfig, FakeServer
from typer.testing import CliRunner

from bench.compare import compare_runs, format_change, num_levels_only_in_one, verdict_lines
from bench.report import conclusions
from bench.report_html import PALETTE, render_compare, render_run, script_json

HOSTILE = "</script><img src=x onerror=alert(1)><!--\u2028\u2029&amp;"
CHARTS_JS = Path(__file__).parents[2] / "bench" / "static" / "charts.js"
CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)
METRICS_TEXT = """\
# TYPE unigate_engine_kv_cache_usage_ratio gauge
unigate_engine_kv_cache_usage_ratio 0.25
# TYPE unigate_engine_num_preemptions_total counter
unigate_engine_num_preemptions_total 3
"""


class Page(HTMLParser):
    """Every start tag with its attributes, and each <script>'s text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self._in_script: dict[str, str | None] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in_script = dict(attrs)
            self.scripts.append((self._in_script, ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = None

    def handle_data(self, data: str) -> None:
        if self._in_script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def json_script(self, element_id: str) -> Any:
        (text,) = [text for attrs, text in self.scripts if attrs.get("id") == element_id]
        return json.loads(text)


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    from bench.cli import register

    app = typer.Typer()
    register(app)
    return app


@pytest.fixture(scope="module")
def bench_run(app: typer.Typer, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real sweep (concurrency 1, 2, 4; one server slot, so latency grows and throughput does not) with --html."""
    folder = tmp_path_factory.mktemp("report")
    out, page = folder / "run.json", folder / "run.html"
    config = FakeConfig(ttft_s=0.03, itl_s=0.01, max_concurrent=1, metrics_text=METRICS_TEXT)
    with FakeServer(config) as server:
        result = CliRunner().invoke(
            app,
            [
                *("bench", "--base-url", server.base_url, "--model", "fake-model", "--warmup", "0"),
                *("--input-len", "8", "--concurrency", "1,2,4", "--requests", "3", "--output-len", "4"),
                *("--slo", "ttft_p95=100ms", "--out", str(out), "--html", str(page)),
            ],
        )
    assert result.exit_code == 0, result.output
    return out, page


def _assert_self_contained(page: Page) -> None:
    for tag, attrs in page.tags:
        for name in ("src", "href", "action", "srcset", "xlink:href"):
            assert not (attrs.get(name) or "").strip(), f"<{tag} {name}=...> would load something"
        assert tag not in ("link", "iframe", "object", "embed", "img", "base")
    (csp,) = [a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp is not None and csp.startswith("default-src 'none';") and "connect-src" not in csp
    code = [text for attrs, text in page.scripts if "type" not in attrs]
    assert len(code) == 2  # charts.js and report.js, both inline
    for text in code:  # the CSP admits exactly these scripts: the browser would refuse any other
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp


def _charts(page: Page) -> dict[str, dict[str, Any]]:
    return {chart["title"]: chart["options"] for chart in page.json_script("unigate-charts")}


def test_bench_html_is_self_contained_and_shows_the_run(bench_run: tuple[Path, Path]) -> None:
    out, html_path = bench_run
    run, text = json.loads(out.read_text()), html_path.read_text()
    page = Page(text)
    _assert_self_contained(page)
    assert page.json_script("unigate-data") == run  # the run's JSON, whole
    charts = _charts(page)
    assert set(charts) == {
        "Requests per second",
        "Tokens per second",
        "TTFT percentiles",
        "TPOT percentiles",
        "ITL percentiles",
        "E2E percentiles",
    }
    ttft = charts["TTFT percentiles"]
    assert [s["name"] for s in ttft["series"]] == ["TTFT p50", "TTFT p90", "TTFT p95", "TTFT p99"]  # + the SLO's p95
    assert ttft["series"][2]["points"] == [[lv["concurrency"], lv["ttft_ms"]["p95"]] for lv in run["levels"]]
    assert ttft["hlines"] == [{"y": 100.0, "label": "SLO ttft_p95 ≤ 100 ms"}]
    assert [s["name"] for s in charts["Requests per second"]["series"]] == ["requests/s", "goodput"]
    assert charts["Tokens per second"]["x"]["ticks"] == [1, 2, 4]
    best, saturation = run["slo_result"]["max_concurrency_meeting_slo"], run["saturation"]
    expected = [f"SLO met up to {best:g}"] if best is not None else []
    expected += [f"saturation {saturation['concurrency']:g}"] if saturation else []
    assert [v["label"] for v in ttft["vlines"]] == expected
    for found in conclusions(run):
        assert html_escaped(found.text) in text  # the same words as the terminal
    assert "unigate_engine_kv_cache_usage_ratio" in text and "Engine stats" in text
    assert f"<td>{run['environment']['platform']}</td>" in text


def _hostile(run: dict[str, Any]) -> dict[str, Any]:
    run = copy.deepcopy(run)
    run["environment"]["model"] = run["config"]["model"] = HOSTILE
    run["environment"]["server"] = {"headers": {HOSTILE: HOSTILE}}
    run["environment"]["speculative"] = {"proposed": 200, "accepted": 150, "acceptance_rate": 0.75}
    run["warnings"] = [HOSTILE]
    run["levels"][0]["errors"] = {HOSTILE: 1}
    run["levels"][0]["telemetry"]["metrics"] = {HOSTILE: {"before": 1.0, "after": 2.0, "delta": 1.0}}
    run["slo_result"] |= {"max_concurrency_meeting_slo": 2, "first_failing": 4}
    run["saturation"] = {"concurrency": 1, "output_throughput": 10.0}
    return run


def test_bench_report_renders_a_saved_run_and_keeps_hostile_strings_text(
    app: typer.Typer, bench_run: tuple[Path, Path], tmp_path: Path
) -> None:
    run = _hostile(json.loads(bench_run[0].read_text()))
    source, target = tmp_path / "hostile.json", tmp_path / "hostile.html"
    source.write_text(json.dumps(run))
    result = CliRunner().invoke(app, ["bench", "report", str(source), "--html", str(target)])
    assert result.exit_code == 0, result.output
    text = target.read_text()
    page = Page(text)
    _assert_self_contained(page)  # no <img>: the hostile markup stayed text
    assert [tag for tag, _ in page.tags].count("script") == 4
    assert text.lower().count("</script") == 4 and text.count("<!--") == 0
    for attrs, script in page.scripts:  # raw, U+2028/9 end a line inside a JavaScript string
        assert "\u2028" not in script and "\u2029" not in script
        assert attrs.get("type") != "application/json" or "<" not in script
    assert HOSTILE not in text and html_escaped(HOSTILE) in text  # in the tables
    assert page.json_script("unigate-data") == run  # and the embedded JSON reads back exactly
    summary = next(attrs for tag, attrs in page.tags if tag == "section" and "summary" in (attrs.get("class") or ""))
    assert summary["data-slo-max"] == "2" and summary["data-saturation"] == "1"
    assert [v["label"] for v in _charts(page)["TTFT percentiles"]["vlines"]] == ["SLO met up to 2", "saturation 1"]
    assert "150 of 200 proposed tokens accepted (75.0%)" in text


def html_escaped(value: str) -> str:
    import html

    return html.escape(value, quote=True)


def test_script_json_cannot_close_its_script_element() -> None:
    text = script_json({"label": HOSTILE})
    assert "<" not in text and ">" not in text and "\u2028" not in text and "\u2029" not in text
    assert json.loads(text) == {"label": HOSTILE}


def test_bench_report_refuses_a_file_that_is_not_a_run(app: typer.Typer, tmp_path: Path) -> None:
    source = tmp_path / "other.json"
    source.write_text('{"levels": [{"concurrency": 1}]}')
    result = CliRunner().invoke(app, ["bench", "report", str(source), "--html", str(tmp_path / "x.html")])
    assert result.exit_code == 2 and "not a complete" in result.output
    assert not (tmp_path / "x.html").exists()


def test_compare_html_shows_each_change_and_the_same_verdict(
    app: typer.Typer, bench_run: tuple[Path, Path], tmp_path: Path
) -> None:
    baseline = bench_run[0]
    a = json.loads(baseline.read_text())
    b = copy.deepcopy(a)
    b["levels"][1]["tpot_ms"]["p95"] *= 1.103
    b["levels"] = [*b["levels"][:2], dict(b["levels"][2], concurrency=8)]  # one level only in A, one only in B
    candidate, page_path = tmp_path / "b.json", tmp_path / "diff.html"
    candidate.write_text(json.dumps(b))
    result = CliRunner().invoke(app, ["bench", "compare", str(baseline), str(candidate), "--html", str(page_path)])
    assert result.exit_code == 1, result.output  # the exit code is unchanged by --html
    text = page_path.read_text()
    page = Page(text)
    _assert_self_contained(page)
    changes = compare_runs(a, b, 5.0)
    expected = verdict_lines(changes, num_levels_only_in_one(a, b))
    assert "TPOT p95 +10.3% at concurrency 2: REGRESSION" in expected
    assert page.json_script("unigate-data")["verdict"] == expected
    for line in expected:
        assert f">{html_escaped(line)}</li>" in text
    rows = re.findall(r"<tr><td>(concurrency [^<]+)</td><td>([^<]+)</td>.*?</tr>", text)
    assert len(rows) == len(changes)
    for change in changes:
        assert f"<td>{change.where}</td><td>{html_escaped(change.label)}</td>" in text
        assert f">{format_change(change)}</span>" in text
    assert text.count('class="regression">REGRESSION') == sum(c.is_regression for c in changes)
    ttft = _charts(page)["TTFT percentiles"]
    assert [(s["name"], s["dash"]) for s in ttft["series"][:2]] == [("A TTFT p50", False), ("B TTFT p50", True)]
    assert ttft["series"][0]["color"] == ttft["series"][1]["color"]  # same figure, same colour
    assert ttft["x"]["ticks"] == [1, 2, 4, 8]


def test_rate_runs_and_hand_made_runs_render(bench_run: tuple[Path, Path]) -> None:
    run = json.loads(bench_run[0].read_text())
    run["config"]["mode"] = "rate"
    for index, level in enumerate(run["levels"]):
        level["rate"] = float(level.pop("concurrency") * 2)
        level["requests"] = index + 1  # nothing else in the page depends on it
    run["slo_result"] |= {"max_concurrency_meeting_slo": None, "max_rate_meeting_slo": 4.0, "first_failing": 8.0}
    run["saturation"] = None
    page = Page(render_run(run))
    ttft = _charts(page)["TTFT percentiles"]
    assert ttft["x"] == {"label": "offered rate (req/s)", "log": False, "ticks": [2.0, 4.0, 8.0]}
    assert [v["label"] for v in ttft["vlines"]] == ["SLO met up to 4"]
    minimal = {"levels": [{"concurrency": 1, "requests": 10, "errors": {}, "ttft_ms": {"p50": 5.0}}]}
    slower = copy.deepcopy(minimal)
    slower["levels"][0]["ttft_ms"]["p50"] = 6.0
    text = render_compare(minimal, slower, ("a.json", "b.json"))  # no environment, SLO or saturation at all
    assert "TTFT p50 +20.0% at concurrency 1: REGRESSION" in text
    assert Page(text).json_script("unigate-charts")[2]["options"]["series"][0]["points"] == [[1, 5.0]]


NODE_CHECK = r"""
class Node_ {
  constructor(name) { this.name = name; this.attrs = {}; this.children = []; this.clientWidth = 0; }
  setAttribute(k, v) {
    if (k.toLowerCase() === 'style' || k.toLowerCase().startsWith('on')) throw new Error('attribute ' + k);
    this.attrs[k] = v;
  }
  appendChild(c) { this.children.push(c); return c; }
  removeChild(c) { this.children = this.children.filter((x) => x !== c); }
  get firstChild() { return this.children[0] || null; }
  all(name) { return [this].concat(...this.children.map((c) => c.all(name))).filter((n) => n.name === name); }
  get text() { return this.data !== undefined ? this.data : this.children.map((c) => c.text).join(''); }
}
globalThis.document = {
  createElementNS: (ns, name) => {
    if (ns !== 'http://www.w3.org/2000/svg') throw new Error(ns);
    return new Node_(name);
  },
  createTextNode: (data) => { const n = new Node_('#text'); n.data = data; return n; },
  createElement: () => { throw new Error('HTML elements: markup parsing is not allowed'); },
};
const C = require(process.argv[2]);
const box = new Node_('div');
const out = {};
const hostile = process.argv[3];
let svg = C.line(box, {series: [{name: hostile, points: [[1, 10], [2, 20], [4, null], [8, 35]]},
                                {name: 'b', points: [[1, 5], [8, 50]], dash: true}],
                       x: {label: 'concurrency', log: true}, y: {label: 'ms'},
                       hlines: [{y: 40, label: 'SLO'}], vlines: [{x: 4, label: 'saturation'}], height: 240});
out.line = {returned: svg === box.children[0], children: box.children.length,
            circles: svg.all('circle').length, titles: svg.all('title').map((t) => t.text),
            paths: svg.all('path').map((p) => p.attrs.d),
            hline: svg.all('g').filter((g) => g.attrs.class === 'uc-hline').length,
            vline: svg.all('g').filter((g) => g.attrs.class === 'uc-vline').length,
            legend: svg.all('text').map((t) => t.text),
            height: svg.attrs.height};
svg = C.bars(box, {categories: ['d1', 'd2'], series: [{name: 'x', values: [1, 2]}, {name: 'y', values: [3, null]}],
                   stacked: true, y: {label: 'tokens'}});
out.bars = {children: box.children.length, rects: svg.all('rect').map((r) => [r.attrs.y, r.attrs.height])};
svg = C.sparkline(box, [1, 3, 2], {width: 120, height: 24});
out.spark = {width: svg.attrs.width, height: svg.attrs.height, path: svg.all('path')[0].attrs.d};
out.empty = [C.line(box, {series: []}), C.bars(box, {categories: [], series: []}), C.sparkline(box, [])]
  .map((s) => s.text);
svg = C.line(box, {series: [{name: 'z', points: [[0, 1], [1, 2], [2, 3]]}], x: {log: true}});
out.logZero = {circles: svg.all('circle').length, nan: JSON.stringify(svg).includes('NaN')};
out.palette = C.palette;
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_charts_js_draws_svg_with_text_nodes_only(tmp_path: Path) -> None:
    script = tmp_path / "check.js"
    script.write_text(NODE_CHECK)
    done = subprocess.run(
        ["node", str(script), str(CHARTS_JS), HOSTILE], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    line = out["line"]
    assert line["returned"] and line["children"] == 1 and line["height"] == "240"
    assert line["circles"] == 5  # the null point is a gap, not a dot
    assert f"{HOSTILE}: concurrency 8, ms 35" in line["titles"]  # the tooltip, as a text node
    assert HOSTILE in line["legend"] and "SLO" in line["legend"] and "saturation" in line["legend"]
    first = line["paths"][0]
    assert first.count("M") == 2 and first.count("L") == 1  # broken at the gap: M 1 L 2, M 8
    assert line["hline"] == 1 and line["vline"] == 1
    assert out["bars"]["children"] == 1 and len(out["bars"]["rects"]) == 3
    assert out["spark"] == {"width": "120", "height": "24", "path": "M1.0 22.0 L60.0 2.0 L119.0 12.0"}
    assert out["empty"] == ["no data", "no data", "no data"]
    assert out["logZero"] == {"circles": 2, "nan": False}  # x = 0 has no place on a log axis: left out
    assert tuple(out["palette"]) == PALETTE


def test_charts_js_has_no_eval_network_or_markup_parsing() -> None:
    source = CHARTS_JS.read_text()
    markup = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write")
    network = ("fetch(", "XMLHttpRequest", "import(", "WebSocket", "EventSource")
    for banned in ("eval(", "Function(", *markup, *network, "'style'", '"style"', ".style."):
        assert banned not in source, banned


def _dump_dom(path: Path) -> str:
    assert CHROMIUM is not None
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--window-size=1280,2000",
            "--virtual-time-budget=2000",
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`)")
def test_the_report_draws_its_charts_in_chromium(
    app: typer.Typer, bench_run: tuple[Path, Path], tmp_path: Path
) -> None:
    run = _hostile(json.loads(bench_run[0].read_text()))
    source, target = tmp_path / "hostile.json", tmp_path / "hostile.html"
    source.write_text(json.dumps(run))
    assert CliRunner().invoke(app, ["bench", "report", str(source), "--html", str(target)]).exit_code == 0
    dom = Page(_dump_dom(target))
    svgs = [attrs for tag, attrs in dom.tags if tag == "svg"]
    assert len(svgs) == 6 and all("uc-line" in (a.get("class") or "") for a in svgs)  # the CSP let the scripts run
    assert sum(1 for tag, a in dom.tags if tag == "circle" and a.get("class") == "uc-point") >= 6 * 3
    assert sum(1 for tag, a in dom.tags if tag == "g" and a.get("class") == "uc-vline") == 6 * 2  # SLO, saturation
    assert sum(1 for tag, a in dom.tags if tag == "g" and a.get("class") == "uc-hline") == 1  # ttft_p95
    assert not any(tag == "img" for tag, _ in dom.tags)  # the hostile label did not become an element


CHARTS_PAGE = """<!doctype html><html><head><meta charset="utf-8"></head><body>
<div id="line"></div><div id="bars"></div><div id="spark"></div><div id="empty"></div>
<script>CHARTS_JS</script>
<script>
const hostile = HOSTILE_JSON;
UnigateCharts.line(document.getElementById('line'), {series: [{name: hostile, points: [[1, 3], [2, null], [4, 9]]}],
  x: {label: 'concurrency', log: true}, y: {label: 'ms'}, hlines: [{y: 5, label: hostile}],
  vlines: [{x: 2, label: 'v'}]});
UnigateCharts.bars(document.getElementById('bars'), {categories: ['a', 'b', 'c'],
  series: [{name: 'x', values: [1, 2, 3]}, {name: 'y', values: [2, 1, null]}], y: {label: 'tokens'}});
UnigateCharts.sparkline(document.getElementById('spark'), [3, 1, 4, 1, 5]);
UnigateCharts.line(document.getElementById('empty'), {series: []});
</script></body></html>"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`)")
def test_charts_js_in_chromium_draws_every_kind(tmp_path: Path) -> None:
    page = tmp_path / "charts.html"
    source = CHARTS_PAGE.replace("CHARTS_JS", CHARTS_JS.read_text()).replace("HOSTILE_JSON", script_json(HOSTILE))
    page.write_text(source)
    dumped = _dump_dom(page)
    dom = Page(dumped)
    classes = [a.get("class") for tag, a in dom.tags if tag == "svg"]
    assert classes == ["uc-chart uc-line", "uc-chart uc-bars", "uc-chart uc-sparkline", "uc-chart uc-line"]
    assert sum(1 for tag, a in dom.tags if tag == "circle" and a.get("class") == "uc-point") == 2
    assert sum(1 for tag, a in dom.tags if tag == "rect" and "uc-bar" in (a.get("class") or "")) == 5
    assert not any(tag == "img" for tag, _ in dom.tags)
    assert ">no data</text>" in dumped and "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in dumped
