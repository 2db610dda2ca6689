"""`--html`: one self-contained HTML page for a bench run (`render_run`) or for two runs compared (`render_compare`).

Text and tables are rendered here, every string from the results escaped. The charts are drawn in the browser by
`bench/static/charts.js` (the chart code the web console shares) from chart specs embedded as JSON next to the
run's own JSON. Nothing is fetched: scripts and style are inline, and the page's Content-Security-Policy allows
exactly those (by hash) and no connection, so the file opens from disk, offline, and a hostile string in a results
file stays text.
"""

from __future__ import annotations

import base64
import hashlib
import html
from importlib import resources
from pathlib import Path
from typing import Any

import orjson

from bench.compare import Change, compare_runs, format_change, level_key, num_levels_only_in_one, verdict_lines
from bench.report import conclusions
from bench.stats import STATS

__all__ = ["PALETTE", "render_compare", "render_run", "script_json", "write_html"]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")  # = charts.js
SLO_MET_COLOR, SATURATION_COLOR = "#2e7d32", "#6a1b9a"
LATENCY_CHARTS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
SHOWN_STATS = ("p50", "p90", "p99")


def _asset(name: str) -> str:
    text = (resources.files("bench") / "static" / name).read_text(encoding="utf-8")
    assert "</script" not in text.lower() and "<!--" not in text, f"{name} cannot be inlined in <script>"
    return text


def script_json(value: Any) -> str:
    """JSON that is safe as the text of a `<script>` element: no `</script>`, `<!--` or line separators that a
    JavaScript parser reads as line ends (all escaped as `\\uXXXX`, which JSON.parse reads back unchanged)."""
    text = orjson.dumps(value).decode()
    for raw, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(raw, escaped)
    return text


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _e(value: Any) -> str:
    """Escaped text; None as a dash and booleans as JSON writes them."""
    if isinstance(value, bool):
        value = str(value).lower()
    return html.escape("—" if value is None else str(value), quote=True)


def _num(value: Any, digits: int = 1) -> str:
    return "—" if not isinstance(value, int | float) else f"{value:,.{digits}f}"


def _page(title: str, body: str, data: dict[str, Any], charts: list[dict[str, Any]]) -> str:
    style, scripts = _asset("report.css"), [_asset("charts.js"), _asset("report.js")]
    csp = (
        f"default-src 'none'; script-src {' '.join(_hash(s) for s in scripts)}; style-src {_hash(style)}; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{_e(csp)}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{_e(title)}</title>",
            f"<style>{style}</style>",
            "</head><body>",
            body,
            f'<script type="application/json" id="unigate-data">{script_json(data)}</script>',
            f'<script type="application/json" id="unigate-charts">{script_json(charts)}</script>',
            *(f"<script>{script}</script>" for script in scripts),
            "</body></html>",
        ]
    )


def write_html(path: Path, page: str) -> None:
    path.write_text(page, encoding="utf-8")


# ---- chart specs (the options of UnigateCharts.line) ----


def _x_axis(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    xs = sorted({lv[key] for run in runs for lv in run["levels"]})
    is_log = key == "concurrency" and len(xs) > 1 and xs[-1] / max(xs[0], 1) >= 8
    return {"label": "concurrency" if key == "concurrency" else "offered rate (req/s)", "log": is_log, "ticks": xs}


def _markers(run: dict[str, Any], key: str, prefix: str = "") -> list[dict[str, Any]]:
    """The highest level meeting the SLO and the saturation point, as vertical lines."""
    vlines = []
    best = _slo(run).get(f"max_{key}_meeting_slo")
    if best is not None:
        vlines.append({"x": best, "label": f"{prefix}SLO met up to {best:g}", "color": SLO_MET_COLOR})
    saturation = run.get("saturation")
    if saturation is not None:
        vlines.append(
            {"x": saturation[key], "label": f"{prefix}saturation {saturation[key]:g}", "color": SATURATION_COLOR}
        )
    return vlines


def _slo(run: dict[str, Any]) -> dict[str, Any]:
    return run.get("slo_result") or {}


def _slo_lines(runs: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    lines: dict[tuple[str, float], dict[str, Any]] = {}
    for run in runs:
        for name, ms in (_slo(run).get("slo") or {}).items():
            if name.partition("_")[0] == metric:
                lines[(name, ms)] = {"y": ms, "label": f"SLO {name} ≤ {ms:g} ms"}
    return list(lines.values())


def _stats_for(runs: list[dict[str, Any]], metric: str) -> list[str]:
    """p50, p90, p99, plus any statistic an SLO is set on (e.g. p95), in STATS order."""
    wanted = set(SHOWN_STATS)
    for run in runs:
        targets = [name.partition("_") for name in _slo(run).get("slo") or {}]
        wanted |= {stat for name, _, stat in targets if name == metric}
    return [stat for stat in STATS if stat in wanted]


def _points(run: dict[str, Any], key: str, path: tuple[str, ...]) -> list[list[Any]]:
    points = []
    for level in run["levels"]:
        value: Any = level
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        points.append([level[key], value if isinstance(value, int | float) else None])
    return points


def _chart_specs(runs: list[tuple[str, dict[str, Any]]], key: str) -> list[dict[str, Any]]:
    """Throughput, goodput and latency percentiles vs load; with two runs, B is drawn dashed in A's colours."""
    docs = [run for _, run in runs]
    x_axis, vlines = _x_axis(docs, key), []
    for name, run in runs:
        vlines += _markers(run, key, f"{name}: " if len(runs) > 1 else "")

    def series(figures: list[tuple[str, tuple[str, ...]]]) -> list[dict[str, Any]]:
        out = []
        for index, (label, path) in enumerate(figures):
            for run_index, (name, run) in enumerate(runs):
                points = _points(run, key, path)
                if any(y is not None for _, y in points):
                    full = f"{name} {label}" if len(runs) > 1 else label
                    color = PALETTE[index % len(PALETTE)]
                    out.append({"name": full, "points": points, "color": color, "dash": run_index > 0})
        return out

    specs = [
        {
            "title": "Requests per second",
            "series": series([("requests/s", ("request_throughput",)), ("goodput", ("goodput",))]),
            "y": {"label": "requests/s", "min": 0},
        },
        {
            "title": "Tokens per second",
            "series": series([("output tok/s", ("output_throughput",)), ("total tok/s", ("total_throughput",))]),
            "y": {"label": "tokens/s", "min": 0},
        },
    ]
    for metric, label in LATENCY_CHARTS:
        stats = _stats_for(docs, metric)
        specs.append(
            {
                "title": f"{label} percentiles",
                "series": series([(f"{label} {stat}", (f"{metric}_ms", stat)) for stat in stats]),
                "y": {"label": "ms", "min": 0},
                "hlines": _slo_lines(docs, metric),
            }
        )
    charts = []
    for index, spec in enumerate(specs):
        options = {"x": x_axis, "vlines": vlines, "hlines": [], "height": 260, **spec}
        charts.append({"id": f"chart-{index}", "kind": "line", "title": spec["title"], "options": options})
    return charts


# ---- page sections ----


def _charts_html(charts: list[dict[str, Any]]) -> str:
    figures = "".join(
        f'<figure class="chart"><figcaption>{_e(c["title"])}</figcaption><div class="plot" id="{_e(c["id"])}">'
        "</div></figure>"
        for c in charts
    )
    return f'<section class="charts">{figures}</section>'


def _table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{_e(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _levels_html(run: dict[str, Any], key: str) -> str:
    headers = [key, "ok/total", "errors", "req/s", "out tok/s", "goodput"]
    headers += [f"{m.upper()} p50 / p90 / p99 ms" for m, _ in LATENCY_CHARTS]
    rows = []
    for level in run["levels"]:
        errors = ", ".join(f"{code}: {n}" for code, n in level.get("errors", {}).items()) or "—"
        row = [_e(f"{level[key]:g}"), _e(f"{level['successful']}/{level['requests']}"), _e(errors)]
        row += [
            _num(level.get("request_throughput"), 2),
            _num(level.get("output_throughput")),
            _num(level.get("goodput"), 2),
        ]
        for metric, _ in LATENCY_CHARTS:
            figures = level.get(f"{metric}_ms") or {}
            row.append(" / ".join(_num(figures.get(stat)) for stat in SHOWN_STATS))
        rows.append(row)
    return f"<section><h2>Levels</h2>{_table(headers, rows, 'levels')}</section>"


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        items: list[tuple[str, Any]] = []
        for name, inner in value.items():
            items += _flatten(inner, f"{prefix}.{name}" if prefix else str(name))
        return items
    if isinstance(value, list | dict):
        return [(prefix, orjson.dumps(value).decode())]
    return [(prefix, value)]


def _pairs_html(pairs: list[tuple[str, Any]]) -> str:
    rows = "".join(f"<tr><th>{_e(name)}</th><td>{_e(value)}</td></tr>" for name, value in pairs)
    return f'<table class="pairs"><tbody>{rows}</tbody></table>'


def _telemetry(level: dict[str, Any], part: str) -> Any:
    return (level.get("telemetry") or {}).get(part)


def _g(value: Any) -> str:
    return _e(f"{value:g}" if isinstance(value, int | float) else value)


def _speculative_html(run: dict[str, Any]) -> str:
    speculative = run.get("environment", {}).get("speculative")
    if not speculative:
        return ""
    rate = speculative.get("acceptance_rate")
    text = f"{speculative.get('accepted')} of {speculative.get('proposed')} proposed tokens accepted"
    share = f"{100 * rate:.1f}%" if isinstance(rate, int | float) else None
    return f'<p class="speculative">Speculative decoding: {_e(text)} ({_e(share)})</p>'


def _metrics_html(levels: list[dict[str, Any]], key: str) -> str:
    """One row per /metrics series: its value after each level, and its change over the level."""
    per_level = [m if isinstance(m := _telemetry(level, "metrics"), dict) else {} for level in levels]
    names = sorted({name for metrics in per_level for name in metrics})
    if not names:
        notes = {m for level in levels if isinstance(m := _telemetry(level, "metrics"), str)}
        return "".join(f"<p>/metrics: {_e(note)}</p>" for note in sorted(notes))
    rows = []
    for name in names:
        cells = [f"<code>{_e(name)}</code>"]
        for metrics in per_level:
            sample = metrics.get(name) or {}
            delta = sample.get("delta")
            change = f' <span class="delta">({delta:+g})</span>' if isinstance(delta, int | float) and delta else ""
            cells.append(_g(sample.get("after")) + change)
        rows.append(cells)
    headers = ["series: value after the level (change)", *(f"{key} {lv[key]:g}" for lv in levels)]
    return _table(headers, rows, "engine")


def _gpu_html(levels: list[dict[str, Any]], key: str) -> str:
    rows: list[list[str]] = []
    columns: list[str] = []
    for level in levels:
        gpus = _telemetry(level, "gpu")
        for gpu, figures in gpus.items() if isinstance(gpus, dict) else ():
            columns = columns or list(figures)
            rows.append([_g(level[key]), _e(gpu), *(_g(figures.get(column)) for column in columns)])
    return _table([key, "GPU", *columns], rows, "gpu") if rows else ""


def _engine_html(run: dict[str, Any], key: str) -> str:
    """The server's side: speculative acceptance, /metrics series per level, GPU samples."""
    levels = run["levels"]
    parts = _speculative_html(run) + _metrics_html(levels, key) + _gpu_html(levels, key)
    return f'<section class="engine"><h2>Engine stats</h2>{parts}</section>'


def _conclusions_html(run: dict[str, Any], key: str) -> str:
    items = "".join(f'<li class="{_e(c.kind)}">{_e(c.text)}</li>' for c in conclusions(run))
    if not run["slo_result"].get("slo"):
        items = '<li class="info">No SLO given (--slo): goodput and the SLO search are off.</li>' + items
    best = run["slo_result"].get(f"max_{key}_meeting_slo")
    saturation = (run.get("saturation") or {}).get(key)
    return (
        f'<section class="summary" data-slo-max="{_e(best)}" data-saturation="{_e(saturation)}">'
        f"<ul>{items}</ul></section>"
    )


def _environment_html(run: dict[str, Any]) -> str:
    config = {name: value for name, value in run.get("config", {}).items() if name != "api_key"}
    return (
        '<section class="environment"><h2>Environment</h2>'
        f"{_pairs_html(_flatten(run.get('environment', {})))}<h2>Configuration</h2>{_pairs_html(_flatten(config))}"
        "</section>"
    )


def render_run(run: dict[str, Any]) -> str:
    """The report of one `unigate bench --out` document."""
    key = level_key(run)
    environment = run.get("environment", {})
    model, target = environment.get("model") or run["config"].get("model"), environment.get("target")
    title = f"unigate bench: {model}"
    charts = _chart_specs([("", run)], key)
    body = "".join(
        [
            f"<header><h1>{_e(title)}</h1>",
            f'<p class="sub">{_e(target)} · {_e(environment.get("started_at"))} · {_e(key)} sweep</p></header>',
            _conclusions_html(run, key),
            _charts_html(charts),
            _levels_html(run, key),
            _engine_html(run, key),
            _environment_html(run),
        ]
    )
    return _page(title, body, run, charts)


def _changes_html(changes: list[Change]) -> str:
    rows = [
        [
            _e(change.where),
            _e(change.label),
            _num(change.before, 2),
            _num(change.after, 2),
            f'<span class="{"worse" if change.is_regression else "same"}">{_e(format_change(change))}</span>',
            '<strong class="regression">REGRESSION</strong>' if change.is_regression else "ok",
        ]
        for change in changes
    ]
    headers = ["level", "figure", "A", "B", "change", "verdict"]
    return f"<section><h2>Changes</h2>{_table(headers, rows, 'changes')}</section>"


def _environment_diff_html(a: dict[str, Any], b: dict[str, Any]) -> str:
    flat_a, flat_b = dict(_flatten(a.get("environment", {}))), dict(_flatten(b.get("environment", {})))
    rows = [
        [f"<code>{_e(name)}</code>", _e(flat_a.get(name)), _e(flat_b.get(name))]
        for name in sorted(flat_a.keys() | flat_b.keys())
        if not name.startswith("server.headers")
    ]
    rows.sort(key=lambda row: row[1] == row[2])  # what differs first
    return f'<section class="environment"><h2>Environment</h2>{_table(["field", "A", "B"], rows, "env-diff")}</section>'


def render_compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], threshold_pct: float = 5.0) -> str:
    """Both runs on the same axes (B dashed), every compared figure's change and the verdict of `bench compare`.

    Raises ValueError as `compare_runs` does (runs of different modes)."""
    changes = compare_runs(a, b, threshold_pct)
    lines = verdict_lines(changes, num_levels_only_in_one(a, b))
    key = level_key(a)
    title = f"unigate bench compare: {names[0]} → {names[1]}"
    charts = _chart_specs([("A", a), ("B", b)], key)
    num_regressions = sum(change.is_regression for change in changes)
    headline = (
        f'<li class="bad">{num_regressions} figure(s) worse than the {threshold_pct:g}% threshold</li>'
        if num_regressions
        else ""
    )
    verdict = headline + "".join(
        f'<li class="{"bad" if line.endswith("REGRESSION") else "info"}">{_e(line)}</li>' for line in lines
    )
    body = "".join(
        [
            f"<header><h1>{_e(title)}</h1>",
            f'<p class="sub">A = {_e(names[0])} ({_e(a.get("environment", {}).get("model"))}) · '
            f"B = {_e(names[1])} ({_e(b.get('environment', {}).get('model'))}) · threshold {threshold_pct:g}% · "
            "B is dashed</p></header>",
            f'<section class="summary verdict" data-regression="{str(num_regressions > 0).lower()}">',
            f"<ul>{verdict}</ul></section>",
            _charts_html(charts),
            _changes_html(changes),
            _environment_diff_html(a, b),
        ]
    )
    data = {"a": a, "b": b, "names": list(names), "threshold_pct": threshold_pct, "verdict": lines}
    return _page(title, body, data, charts)
