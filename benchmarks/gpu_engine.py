"""GPU benchmark of the local engine: kernel checks, decode-attention bandwidth, engine throughput.

    python benchmarks/gpu_engine.py                # on a CUDA machine (H100/H200 class): under 5 minutes
    python benchmarks/gpu_engine.py --cpu-smoke    # tiny sizes on CPU, kernels in Triton's interpreter

1. Kernel checks: every Triton kernel against its torch reference (`local_engine.kernels.reference`) in bfloat16
   (float32 in the smoke run: the interpreter's bfloat16 is not faithful), printing the max error and the tolerance.
2. Decode attention: `triton.testing.do_bench` at batch 64 x 4k context (Llama-3-8B heads: 32 q / 8 kv, dim 128),
   achieved bandwidth (KV + q + out bytes / time) against the measured device copy bandwidth, per split count.
3. Engine throughput: random-initialised Llama-3-8B- and 1B-shaped models in bfloat16, `ignore_eos`, 256 requests
   of 512 prompt / 256 output tokens: output tokens/s, TTFT and TPOT p50/p95, the decode floor (weight + KV bytes
   per step / copy bandwidth), and the same workload through transformers `generate` for comparison.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B and Llama-3.2-1B shapes; weights are random, only the shapes matter for speed.
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "tie_word_embeddings": False,
    },
}
LLAMA3_ROPE = {
    "rope_theta": 500000.0,
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Plan:
    """Sizes for one run: the full GPU benchmark or the CPU smoke run."""

    device: str
    dtype_name: str
    decode_batch: int
    decode_context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    models: tuple[str, ...]
    num_requests: int
    input_len: int
    output_len: int
    max_num_seqs: int
    hf_batch: int
    enforce_eager: bool = False


def make_plan(args: argparse.Namespace) -> Plan:
    if args.cpu_smoke:
        return Plan("cpu", "float32", 2, 80, 4, 2, 64, 16, ("tiny",), 4, 16, 8, 4, 4, args.enforce_eager)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return Plan(
        "cuda",
        "bfloat16",
        64,
        4096,
        32,
        8,
        128,
        16,
        models,
        args.num_requests,
        512,
        256,
        args.max_num_seqs,
        args.hf_batch,
        args.enforce_eager,
    )


def bench_ms(fn: Callable[[], object], device: Any) -> float:
    """Milliseconds per call: do_bench (CUDA events, L2 flushed) on GPU, a wall clock on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    fn()
    started = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - started) / 3 * 1000


# -- 1. kernel checks ----------------------------------------------------------------------------------------------


def paged_inputs(plan: Plan, context_lens: list[int]) -> tuple[Any, Any, Any, Any]:
    """A random paged KV cache (made on the device: GBs at full size) with shuffled block tables."""
    import torch

    dtype = getattr(torch, plan.dtype_name)
    blocks_per_seq = [-(-n // plan.block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, plan.block_size, plan.num_kv_heads, plan.head_dim)
    k_cache = torch.randn(shape, device=plan.device, dtype=dtype)
    v_cache = torch.randn(shape, device=plan.device, dtype=dtype)
    ids = torch.randperm(num_blocks)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = ids[start : start + n]
        start += n
    context = torch.tensor(context_lens, dtype=torch.int32, device=plan.device)
    return k_cache, v_cache, block_tables.to(plan.device), context


def check_kernels(plan: Plan) -> bool:
    import torch

    from local_engine import kernels
    from local_engine.kernels import reference

    dtype = getattr(torch, plan.dtype_name)
    is_bf16 = dtype == torch.bfloat16
    attention_tol, elementwise_tol = (2e-2, 1.6e-2) if is_bf16 else (2e-5, 1e-5)
    device, heads, kv_heads, dim = plan.device, plan.num_heads, plan.num_kv_heads, plan.head_dim

    def randn(*shape: int) -> Any:
        return torch.randn(shape, device=device, dtype=dtype)

    def error(a: Any, b: Any) -> float:
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

    results: list[tuple[str, float, float]] = []
    small = plan.device == "cpu"
    context_lens = [0, 1, 37, 80] if small else [0, 1, 16, 1000, 4097]
    k_cache, v_cache, tables, context = paged_inputs(plan, context_lens)
    scale = dim**-0.5
    q = randn(len(context_lens), heads, dim)
    reference_kv = (k_cache.float(), v_cache.float())
    expected = reference.paged_decode_attention(q.float(), *reference_kv, tables, context, scale)
    for num_splits in (1, 4):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, context, scale, num_splits=num_splits)
        results.append((f"paged_decode_attention (splits={num_splits})", error(out, expected), attention_tol))

    q_lens = [0, 1, 20, 3] if small else [0, 1, 16, 300, 1000]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = randn(sum(q_lens), heads, dim)
    rest: tuple[Any, ...] = (tables, cu, context, max(q_lens), scale)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, *rest)
    expected = reference.paged_prefill_attention(q.float(), *reference_kv, *rest)
    results.append(("paged_prefill_attention", error(out, expected), attention_tol))

    num_tokens, hidden = (5, 96) if small else (33, 4096)
    x, residual, weight = randn(num_tokens, hidden), randn(num_tokens, hidden), randn(hidden)
    out, residual_out = kernels.rms_norm(x, weight, 1e-5, residual)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    results.append(
        ("rms_norm (+residual)", max(error(out, expected), error(residual_out, expected_residual)), elementwise_tol)
    )

    gate_up = randn(num_tokens, 2 * (300 if small else 14336))
    results.append(
        ("silu_and_mul", error(kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)), elementwise_tol)
    )

    q, k = randn(num_tokens, heads, dim), randn(num_tokens, kv_heads, dim)
    positions = torch.randint(0, 512, (num_tokens,), device=device)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
    q_ref, k_ref = q.clone(), k.clone()
    kernels.apply_rotary(q, k, positions, cos_sin)
    reference.apply_rotary(q_ref, k_ref, positions, cos_sin)
    results.append(("apply_rotary", max(error(q, q_ref), error(k, k_ref)), elementwise_tol))

    cache_k, cache_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    new_k, new_v = randn(num_tokens, kv_heads, dim), randn(num_tokens, kv_heads, dim)
    slots = torch.randperm(cache_k.shape[0] * plan.block_size)[:num_tokens].to(device)
    slots[0] = -1
    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    kernels.store_kv(new_k, new_v, cache_k, cache_v, slots)
    reference.store_kv(new_k, new_v, expected_k, expected_v, slots)
    results.append(("store_kv", max(error(cache_k, expected_k), error(cache_v, expected_v)), 0.0))

    print(f"\n## Kernel checks ({plan.dtype_name} on {device}, vs float32 torch references)\n")
    print(f"| {'kernel':<36} | {'max abs error':>13} | {'tolerance':>9} | ok   |")
    print(f"|{'-' * 38}|{'-' * 15}|{'-' * 11}|------|")
    all_ok = True
    for name, err, tol in results:
        ok = err <= tol
        all_ok &= ok
        print(f"| {name:<36} | {err:>13.3e} | {tol:>9.1e} | {'yes' if ok else 'NO':<4} |")
    return all_ok


# -- 2. decode attention bandwidth ---------------------------------------------------------------------------------


def copy_bandwidth(plan: Plan) -> float:
    """Bytes/s of a device-to-device copy (read + write), the practical memory bandwidth ceiling."""
    import torch

    num_bytes = (1 << 30) if plan.device == "cuda" else (64 << 20)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), src.device)
    return 2 * num_bytes / (ms / 1000)


def bench_decode_attention(plan: Plan, copy_bw: float) -> None:
    import torch

    from local_engine.kernels import paged_decode_attention
    from local_engine.kernels.decode_attention import choose_num_splits

    batch, context = plan.decode_batch, plan.decode_context
    k_cache, v_cache, tables, context_lens = paged_inputs(plan, [context] * batch)
    q = torch.randn(batch, plan.num_heads, plan.head_dim, device=plan.device, dtype=getattr(torch, plan.dtype_name))
    element = q.element_size()
    kv_bytes = 2 * batch * context * plan.num_kv_heads * plan.head_dim * element
    num_bytes = kv_bytes + 2 * q.numel() * element  # + q read and out written
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if plan.device == "cuda" else 4
    default_splits = choose_num_splits(batch, plan.num_kv_heads, tables.shape[1] * plan.block_size, num_sms)
    print(
        f"\n## Decode attention: batch {batch} x context {context}, {plan.num_heads} q / {plan.num_kv_heads} kv "
        f"heads, dim {plan.head_dim}, {plan.dtype_name}, block {plan.block_size}\n"
    )
    print(f"copy bandwidth (measured): {copy_bw / 1e9:,.0f} GB/s; KV read per call: {kv_bytes / 2**20:,.1f} MiB\n")
    print("| splits        | time (us) | GB/s     | % of copy bw |")
    print("|---------------|-----------|----------|--------------|")
    candidates = sorted({1, 2, 4, 8, 16, default_splits} if plan.device == "cuda" else {1, 2, default_splits})
    for num_splits in candidates:
        attend = functools.partial(
            paged_decode_attention,
            q,
            k_cache,
            v_cache,
            tables,
            context_lens,
            plan.head_dim**-0.5,
            num_splits=num_splits,
        )
        ms = bench_ms(attend, q.device)
        bandwidth = num_bytes / (ms / 1000)
        label = f"{num_splits}{' (default)' if num_splits == default_splits else ''}"
        print(f"| {label:<13} | {ms * 1000:>9.1f} | {bandwidth / 1e9:>8,.0f} | {100 * bandwidth / copy_bw:>11.1f}% |")


# -- 3. engine throughput ------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    seconds: float
    num_output_tokens: int
    ttft_ms: list[float]
    tpot_ms: list[float]
    decode_seconds: float = 0.0  # steps that computed no prompt token (pure decode); engine runs only
    num_decode_tokens: int = 0
    full_decode_steps_ms: list[float] = field(default_factory=list)  # pure-decode steps of max_num_seqs rows

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.num_decode_tokens / self.decode_seconds if self.decode_seconds > 0 else None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hf_config(shape_name: str, plan: Plan) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **MODEL_SHAPES[shape_name],
        "max_position_embeddings": 8192 if plan.device == "cuda" else 256,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": plan.dtype_name,
    }
    if plan.device == "cuda":
        config["rope_scaling"] = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
        config["rope_theta"] = LLAMA3_ROPE["rope_theta"]
    return config


def random_model(config: dict[str, Any], plan: Plan) -> Any:
    """A transformers Llama with random weights, built directly on the device in the benchmark dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, plan.dtype_name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(plan.device):
            model: Any = LlamaForCausalLM(LlamaConfig(**config))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def run_engine(engine: Any, prompts: list[list[int]], output_len: int, plan: Plan) -> RunResult:
    """Offline run: every request queued at t0, steps until all finish; TTFT and TPOT per request."""
    import torch

    from local_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    num_tokens: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)

    def has_unfinished() -> bool:
        pending = engine.has_unfinished_requests  # a property today; tolerate a method
        return bool(pending() if callable(pending) else pending)

    decode_seconds = 0.0
    num_decode_tokens = 0
    full_steps_ms: list[float] = []
    while has_unfinished():
        step_started = time.perf_counter()
        prompt_tokens_before = engine.meter.num_prompt_tokens
        outputs = engine.step()
        now = time.perf_counter()
        step_tokens = 0
        for out in outputs:
            new_tokens = sum(len(choice.token_ids) for choice in out.outputs)
            step_tokens += new_tokens
            num_tokens[out.request_id] = num_tokens.get(out.request_id, 0) + new_tokens
            first.setdefault(out.request_id, now)
            if out.finished:
                finished[out.request_id] = now
        if engine.meter.num_prompt_tokens == prompt_tokens_before:  # the sampled-token read synced the device
            decode_seconds += now - step_started
            num_decode_tokens += step_tokens
            if step_tokens == plan.max_num_seqs:
                full_steps_ms.append((now - step_started) * 1000)
    if plan.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    ttft = [(first[r] - started) * 1000 for r in first]
    tpot = [(finished[r] - first[r]) * 1000 / (num_tokens[r] - 1) for r in finished if num_tokens[r] > 1]
    return RunResult(seconds, sum(num_tokens.values()), ttft, tpot, decode_seconds, num_decode_tokens, full_steps_ms)


def decode_step_breakdown(engine: Any, result: RunResult, plan: Plan) -> str | None:
    """Where a full decode step's wall time goes: the captured forward's GPU time (graph replay), the logits and
    argmax, and the rest (host work: scheduling, inputs, sampling bookkeeping, outputs)."""
    import torch

    graphs = engine.runner.graphs
    if graphs is None or not result.full_decode_steps_ms or plan.max_num_seqs not in graphs.graphs:
        return None
    size = plan.max_num_seqs
    # The static buffers still hold the run's last full batch: replaying rewrites those finished requests' KV.
    forward_ms = bench_ms(graphs.graphs[size].replay, torch.device(plan.device))
    hidden = graphs.outputs[size]

    @torch.inference_mode()
    def logits_and_argmax() -> Any:
        return engine.runner.model.compute_logits(hidden).float().argmax(-1)

    logits_ms = bench_ms(logits_and_argmax, hidden.device)
    wall_ms = percentile(result.full_decode_steps_ms, 0.5)
    host_ms = wall_ms - forward_ms - logits_ms
    return (
        f"decode step at batch {size}: wall {wall_ms:.2f} ms (median of {len(result.full_decode_steps_ms)}) = "
        f"forward graph {forward_ms:.2f} ms + logits/argmax {logits_ms:.2f} ms + host and launches {host_ms:.2f} ms"
    )


def run_hf_generate(model: Any, prompts: list[list[int]], output_len: int, plan: Plan) -> RunResult:
    """The same prompts through transformers `generate`, `hf_batch` at a time (static batches, greedy)."""
    import torch

    started = time.perf_counter()
    num_tokens = 0
    ttft: list[float] = []
    tpot: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(prompts), plan.hf_batch):
            chunk = prompts[start : start + plan.hf_batch]
            input_ids = torch.tensor(chunk, device=plan.device)
            batch_started = time.perf_counter()
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            if plan.device == "cuda":
                torch.cuda.synchronize()
            batch_seconds = time.perf_counter() - batch_started
            generated = out.shape[1] - input_ids.shape[1]
            num_tokens += generated * len(chunk)
            # generate() returns all tokens at once: a request's first token arrives with its batch's last one.
            ttft.extend([(time.perf_counter() - started) * 1000] * len(chunk))
            tpot.extend([batch_seconds * 1000 / max(generated, 1)] * len(chunk))
    return RunResult(time.perf_counter() - started, num_tokens, ttft, tpot)


def decode_floor_tokens_per_s(config: dict[str, Any], plan: Plan, num_weight_bytes: int, copy_bw: float) -> float:
    """Output tokens/s if each decode step only streamed the weights and the batch's KV at copy bandwidth."""
    batch = plan.max_num_seqs
    mean_context = plan.input_len + plan.output_len / 2
    element = 2 if plan.dtype_name == "bfloat16" else 4
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * element
    step_seconds = (num_weight_bytes + batch * mean_context * kv_per_token) / copy_bw
    return float(batch / step_seconds)


def bench_engine(plan: Plan, copy_bw: float, skip_hf: bool, profile_host: bool = False) -> None:
    try:
        import torch

        from local_engine.config import EngineConfig, ModelConfig
        from local_engine.engine import LLMEngine
    except Exception as exc:  # the engine is optional here: report, do not fail the kernel sections
        print(f"\nengine section skipped: {type(exc).__name__}: {exc}")
        return

    print(
        f"\n## Engine throughput: {plan.num_requests} requests x {plan.input_len} prompt / {plan.output_len} output "
        f"tokens, ignore_eos, greedy, {plan.dtype_name}, max_num_seqs {plan.max_num_seqs}\n"
    )
    memory_lines: list[str] = []
    print(
        "| model | runner      | output tok/s | TTFT p50/p95 (ms) | TPOT p50/p95 (ms) | decode tok/s | "
        "decode / floor | seconds |"
    )
    print(
        "|-------|-------------|--------------|-------------------|-------------------|--------------|"
        "----------------|---------|"
    )
    for shape_name in plan.models:
        config = hf_config(shape_name, plan)
        try:
            model = random_model(config, plan)
            state_dict = {name: tensor.detach() for name, tensor in model.state_dict().items()}
            num_weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            engine_config = EngineConfig(
                block_size=plan.block_size,
                max_num_seqs=plan.max_num_seqs,
                max_num_batched_tokens=max(2048, plan.max_num_seqs),
                dtype=plan.dtype_name,  # type: ignore[arg-type]
                device=plan.device,  # type: ignore[arg-type]
                attention_backend="triton",
                kv_cache_memory=None if plan.device == "cuda" else 64 << 20,
                enable_prefix_caching=False,  # random prompts share nothing; keep the comparison plain
                enforce_eager=plan.enforce_eager,
            )
            engine = LLMEngine(ModelConfig.from_hf_config(config), engine_config, state_dict)
        except Exception as exc:
            print(f"\nengine section skipped for {shape_name}: {type(exc).__name__}: {exc}")
            continue
        del state_dict
        runner = engine.runner
        peak = runner.activations_peak_bytes
        memory_lines.append(
            f"{shape_name}: weights {runner.weights_bytes / 2**30:.2f} GiB, activations peak "
            + ("not profiled" if peak is None else f"{peak / 2**30:.2f} GiB")
            + f", KV cache {engine.capacity.num_bytes / 2**30:.2f} GiB ({engine.capacity.num_tokens:,} tokens), "
            + ("eager" if runner.graphs is None else f"decode CUDA graphs for batch sizes {runner.graphs.sizes}")
        )
        generator = torch.Generator().manual_seed(1)
        vocab = config["vocab_size"]
        prompts = torch.randint(3, vocab, (plan.num_requests, plan.input_len), generator=generator).tolist()
        floor = decode_floor_tokens_per_s(config, plan, num_weight_bytes, copy_bw)

        warmup = prompts[: min(4, len(prompts))]
        run_engine(engine, warmup, 4, plan)  # compiles the kernels, warms the allocator
        if profile_host:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            result = profiler.runcall(run_engine, engine, prompts, plan.output_len, plan)
            print_row(shape_name, "unigate", result, floor)
            print(f"\nhost profile of the {shape_name} run (cProfile inflates host time; read it for shares):")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(15)
        else:
            result = run_engine(engine, prompts, plan.output_len, plan)
            print_row(shape_name, "unigate", result, floor)
        try:
            breakdown = decode_step_breakdown(engine, result, plan)
        except Exception as exc:  # a diagnostic only: never lose the rest of the run to it
            breakdown = f"decode step breakdown failed: {type(exc).__name__}: {exc}"
        if breakdown:
            memory_lines.append(f"{shape_name}: {breakdown}")
        del engine, runner  # both hold the KV cache: transformers needs that memory back
        if plan.device == "cuda":
            torch.cuda.empty_cache()
        if not skip_hf:
            run_hf_generate(model, warmup, 4, plan)
            print_row(shape_name, "hf generate", run_hf_generate(model, prompts, plan.output_len, plan), floor)
        del model
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    print(
        "\ndecode tok/s: tokens of the steps that computed no prompt token over those steps' time; decode / floor:"
        "\nthat rate as a fraction of the decode floor at max_num_seqs (weight + mean KV bytes / copy bandwidth)."
    )
    for line in memory_lines:
        print(line)


def print_row(shape_name: str, runner: str, result: RunResult, floor: float) -> None:
    ttft = f"{percentile(result.ttft_ms, 0.5):,.0f} / {percentile(result.ttft_ms, 0.95):,.0f}"
    tpot = f"{percentile(result.tpot_ms, 0.5):,.1f} / {percentile(result.tpot_ms, 0.95):,.1f}"
    decode = result.decode_tokens_per_s
    decode_cells = ("-", "-") if decode is None else (f"{decode:,.0f}", f"{decode / floor:.2f}")
    print(
        f"| {shape_name:<5} | {runner:<11} | {result.tokens_per_s:>12,.0f} | {ttft:>17} | {tpot:>17} | "
        f"{decode_cells[0]:>12} | {decode_cells[1]:>14} | {result.seconds:>7.1f} |",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU, kernels in the interpreter")
    parser.add_argument("--models", default="8b,1b", help="model shapes for the engine section (8b, 1b)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers generate static batch size")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true", help="skip the kernel checks and attention timing")
    parser.add_argument("--enforce-eager", action="store_true", help="no decode CUDA graphs (to measure their gain)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers generate comparison")
    parser.add_argument("--profile-host", action="store_true", help="cProfile the engine runs' host (Python) work")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        # Before triton is imported: every kernel is interpreted, and the engine's "triton" backend is allowed.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU smoke run", file=sys.stderr)
        return 2
    plan = make_plan(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("unigate.engine").setLevel(logging.INFO)  # start-up time, memory plan, graph capture
    torch.manual_seed(0)
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(0) if plan.device == "cuda" else "CPU (Triton interpreter)"
    print(f"# unigate GPU engine benchmark: {device_name}, torch {torch.__version__}")
    ok = True if args.skip_kernels else check_kernels(plan)
    copy_bw = copy_bandwidth(plan)
    if not args.skip_kernels:
        bench_decode_attention(plan, copy_bw)
    if not args.skip_engine:
        bench_engine(plan, copy_bw, args.skip_hf, args.profile_host)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; kernel checks {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
