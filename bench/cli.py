"""The `bench` (with `bench compare` and `bench report`), `doctor` and `kv-plan` commands, added to the main app by
`register`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["register"]

_Number = TypeVar("_Number", int, float)

_STATUS_STYLE = {"ok": "[green]✓[/]", "warn": "[yellow]![/]", "fail": "[bold red]✗[/]"}
_CONCLUSION_STYLE = {"good": "[bold green]{}[/]", "bad": "[bold red]{}[/]"}


def _console() -> Console:
    """The terminal's width when there is one; wide otherwise, so tables piped to a file or CI log do not wrap."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _split(text: str, kind: type[_Number], option: str) -> list[_Number]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"expected a comma-separated list of numbers, e.g. 1,8,16; got {text!r}", param_hint=option
        ) from None
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter(f"expected positive numbers, got {text!r}", param_hint=option)
    return values


def bench(
    ctx: typer.Context,
    base_url: Annotated[
        str | None, typer.Option(help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8080/v1")
    ] = None,
    api_key: Annotated[str, typer.Option(envvar="UNIGATE_API_KEY", help="API key (or $UNIGATE_API_KEY).")] = "",
    model: Annotated[str | None, typer.Option(help="Model ID to benchmark.")] = None,
    concurrency: Annotated[str, typer.Option(help="Closed-loop concurrency levels, e.g. 1,8,16,32.")] = "1",
    rate: Annotated[
        str | None, typer.Option(help="Open-loop Poisson request rate(s) per second, e.g. 2 or 1,2,4.")
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Measuring seconds per level (default 30 without --requests).")
    ] = None,
    warmup: Annotated[float, typer.Option(help="Warm-up seconds per level, not measured.")] = 5.0,
    requests: Annotated[int | None, typer.Option(help="Measured requests per level.")] = None,
    input_len: Annotated[int | None, typer.Option(help="Fixed prompt length in tokens (default 512).")] = None,
    input_dist: Annotated[
        str | None, typer.Option(help="uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA")
    ] = None,
    output_len: Annotated[int | None, typer.Option(help="max_tokens per request (default 128).")] = None,
    output_dist: Annotated[
        str | None, typer.Option(help="Output length distribution, same forms as --input-dist.")
    ] = None,
    dataset: Annotated[Path | None, typer.Option(help="JSONL of {'prompt'|'messages', optional 'output_len'}.")] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="Local tokenizer (HF folder, cached name or .gguf) for exact input lengths.")
    ] = None,
    slo: Annotated[str | None, typer.Option(help="e.g. ttft_p95=500ms,tpot_p95=50ms")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the run as JSON (the baseline archive).")] = None,
    csv: Annotated[Path | None, typer.Option(help="Write one CSV row per level.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: throughput and p95 latency vs load.")] = None,
    html: Annotated[
        Path | None, typer.Option(help="Write a self-contained HTML report: charts, tables, environment.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for lengths, prompts and arrivals.")] = 0,
    timeout: Annotated[float, typer.Option(help="Per-request timeout, seconds.")] = 600.0,
    max_in_flight: Annotated[int, typer.Option(help="Open loop: most requests in flight before arrivals drop.")] = 1024,
    telemetry: Annotated[bool, typer.Option(help="Scrape /metrics and sample nvidia-smi around each level.")] = True,
) -> None:
    """Measure latency and throughput of any OpenAI-compatible endpoint, level by level."""
    if ctx.invoked_subcommand is not None:
        return
    from bench import loop
    from bench.report import levels_table, write_csv, write_json, write_plot
    from bench.runner import BenchConfig, BenchError, run_bench
    from bench.stats import parse_slo
    from bench.workload import load_jsonl, load_tokenizer, parse_length_dist, synthetic_workload

    if not base_url or not model:
        raise typer.BadParameter("--base-url and --model are required", param_hint="--base-url/--model")
    if input_len is not None and input_dist is not None:
        raise typer.BadParameter("give --input-len or --input-dist, not both", param_hint="--input-len")
    try:
        slo_targets = parse_slo(slo)
        input_spec = parse_length_dist(input_dist or str(input_len or 512))
        output_spec = parse_length_dist(output_dist or str(output_len or 128))
        tok = load_tokenizer(tokenizer) if tokenizer else None
        if dataset is not None:
            workload = load_jsonl(dataset, output_spec, seed=seed, tokenizer=tok)
        else:
            workload = synthetic_workload(input_spec, output_spec, seed=seed, tokenizer=tok)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    config = BenchConfig(
        base_url=base_url,
        api_key=api_key,
        model=model,
        concurrency=_split(concurrency, int, "--concurrency"),
        rate=_split(rate, float, "--rate") if rate else [],
        duration_s=duration if duration is not None or requests is not None else 30.0,
        warmup_s=warmup,
        max_requests=requests,
        timeout_s=timeout,
        max_in_flight=max_in_flight,
        seed=seed,
        workload=workload.description,
        slo=slo,
        tokenizer=tokenizer,
        is_telemetry_enabled=telemetry,
    )
    console = _console()
    try:
        run = loop.run(run_bench(config, workload, slo_targets, console))
    except BenchError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
    console.print(levels_table(run["levels"], title=f"unigate bench: {model} at {base_url}"))
    _print_conclusions(console, run)
    if out is not None:
        write_json(out, run)
    if csv is not None:
        write_csv(csv, run["levels"])
    if plot is not None:
        write_plot(plot, run["levels"], title=f"{model} at {base_url}")
    if html is not None:
        from bench.report_html import render_run, write_html

        write_html(html, render_run(run))


def _print_conclusions(console: Console, run: dict[str, Any]) -> None:
    from bench.report import conclusions

    for found in conclusions(run):
        text = escape(found.text)
        if found.kind == "warning":
            console.print(f"[yellow]warning:[/] {text}")
        elif found.kind == "detail":
            console.print(f"  {text}")
        else:
            console.print(_CONCLUSION_STYLE.get(found.kind, "{}").format(text))


def compare(
    baseline: Annotated[Path, typer.Argument(help="The baseline run (A).")],
    candidate: Annotated[Path, typer.Argument(help="The new run (B).")],
    threshold: Annotated[float, typer.Option(help="Percent worse that counts as a regression.")] = 5.0,
    html: Annotated[
        Path | None, typer.Option(help="Also write a self-contained HTML report: both runs on the same axes.")
    ] = None,
) -> None:
    """Compare two `bench --out` files level by level; exit code 1 on a regression."""
    from bench.compare import changes_table, compare_runs, load_run, num_levels_only_in_one, verdict_lines

    console = _console()
    try:
        a, b = load_run(baseline), load_run(candidate)
        changes = compare_runs(a, b, threshold)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(changes_table(changes, f"A = {baseline.name}   B = {candidate.name}   threshold {threshold:g}%"))
    lines = verdict_lines(changes, num_levels_only_in_one(a, b))
    for line in lines:
        console.print(f"[bold red]{escape(line)}[/]" if line.endswith("REGRESSION") else escape(line))
    if html is not None:
        from bench.report_html import render_compare, write_html

        try:
            page = render_compare(a, b, (baseline.name, candidate.name), threshold)
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            raise typer.BadParameter(f"cannot render the HTML report: {exc!r}") from None
        write_html(html, page)
    if any(change.is_regression for change in changes):
        raise typer.Exit(1)


def report(
    result: Annotated[Path, typer.Argument(help="A `bench --out` file.")],
    html: Annotated[Path, typer.Option(help="Where to write the self-contained HTML report.")],
) -> None:
    """Render an existing run as an HTML report (the same page as `bench --html`)."""
    from bench.compare import load_run
    from bench.report_html import render_run, write_html

    try:
        run = load_run(result)
        page = render_run(run)
    except (ValueError, LookupError, TypeError, AttributeError) as exc:
        raise typer.BadParameter(f"{result} is not a complete `unigate bench --out` file: {exc!r}") from None
    write_html(html, page)
    _console().print(f"wrote {escape(str(html))} ({len(page.encode()) / 1024:.0f} KiB)")


def doctor(
    base_url: Annotated[str, typer.Option(help="The base URL your client uses.")] = "http://127.0.0.1:8080/v1",
    api_key: Annotated[str, typer.Option(envvar="UNIGATE_API_KEY", help="API key (or $UNIGATE_API_KEY).")] = "",
    model: Annotated[str, typer.Option(help="The model ID your client asks for.")] = "smollm2-135m-instruct",
    print_config: Annotated[bool, typer.Option(help="Print ready-to-paste client settings.")] = False,
    show_key: Annotated[bool, typer.Option(help="Put the real key into the printed settings.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer.")] = 20.0,
) -> None:
    """Check base URL, key and model against the server, explaining each failure with its fix."""
    from bench.doctor import client_config, diagnose

    console = _console()
    diagnosis = asyncio.run(diagnose(base_url, api_key, model, timeout_s=timeout))
    console.print(f"unigate doctor: {escape(base_url)}  model {escape(model)}")
    for check in diagnosis.checks:
        console.print(f" {_STATUS_STYLE[check.status.value]} [bold]{escape(check.name)}[/]: {escape(check.detail)}")
        if check.fix and check.status.value != "ok":
            console.print(f"     [cyan]fix:[/] {escape(check.fix)}")
    if diagnosis.is_ok:
        console.print(f"[bold green]All set.[/] Verified base URL: {diagnosis.verified_base_url}")
    else:
        console.print("[bold red]Problems found[/]: fix the ✗ lines above, then run `unigate doctor` again.")
    if print_config:
        config_url = diagnosis.verified_base_url or base_url
        if diagnosis.verified_base_url is None:
            console.print(f"[yellow]Settings below use {escape(config_url)}, which did not pass the checks.[/]")
        console.print()
        console.print(escape(client_config(config_url, model, api_key if show_key else None)), soft_wrap=True)
    if not diagnosis.is_ok:
        raise typer.Exit(1)


def kv_plan(
    model: Annotated[str | None, typer.Argument(help="config.json, a model folder, or a .gguf file.")] = None,
    layers: Annotated[int | None, typer.Option(help="Number of layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="KV heads (GQA); default = heads.")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Head dimension; default = hidden / heads.")] = None,
    params: Annotated[str | None, typer.Option(help="Parameter count for the weights, e.g. 7B.")] = None,
    dtype: Annotated[str, typer.Option(help="fp32 | fp16 | bf16 | fp8 | int8 | int4 (weights and KV).")] = "fp16",
    kv_dtype: Annotated[str | None, typer.Option(help="KV-cache dtype if it differs from --dtype.")] = None,
    weights_dtype: Annotated[
        str | None, typer.Option(help="Weights dtype if it differs; 'file' = size as stored.")
    ] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="GPU memory, e.g. 80GiB or 24GB.")] = None,
    gpu_util: Annotated[float, typer.Option(help="Fraction of GPU memory the engine may use.")] = 0.9,
    context: Annotated[str, typer.Option(help="Context lengths to plan for.")] = "2048,8192,32768",
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Weights memory, KV bytes per token and the maximum concurrency per context length, formula shown."""
    from bench.kv_plan import from_explicit, load_shape, parse_count, parse_size, plan, render

    try:
        if model is not None:
            shape = load_shape(model)
        elif layers is not None and hidden is not None:
            shape = from_explicit(layers, hidden, heads, kv_heads, head_dim, parse_count(params) if params else None)
        else:
            raise ValueError("give a model file (config.json / folder / .gguf) or --layers and --hidden with --heads")
        kv = plan(
            shape,
            dtype=dtype,
            kv_dtype=kv_dtype,
            weights_dtype=weights_dtype,
            gpu_memory_bytes=parse_size(gpu_memory) if gpu_memory else None,
            utilization=gpu_util,
            contexts=_split(context, int, "--context"),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if json_output:
        typer.echo(orjson.dumps(kv.to_dict(), option=orjson.OPT_INDENT_2).decode())
        return
    for line in render(kv):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    """Add `bench` (with `bench compare` and `bench report`), `doctor` and `kv-plan` to the `unigate` app."""
    bench_app = typer.Typer(invoke_without_command=True, help="Measure any OpenAI-compatible endpoint.")
    bench_app.callback()(bench)
    bench_app.command("compare")(compare)
    bench_app.command("report")(report)
    app.add_typer(bench_app, name="bench")
    app.command("doctor")(doctor)
    app.command("kv-plan")(kv_plan)
