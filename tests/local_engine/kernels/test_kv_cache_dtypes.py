"""KV caches in another dtype than the model's: int8 with per-(block, KV head) scales, and bfloat16/float16 under a
float32 model, on every backend (torch ops, native CPU kernels, Triton in its interpreter).

The int8 write rule (`reference.store_kv`) is checked on its own terms (error bounds, scales that only grow, a
block restarted at offset 0), then every backend's write against it byte for byte, and every backend's decode
and prefill attention over an int8 cache against the reference on the same cache (float32 rounding only) and
against float attention over the unquantized K/V (the quantization error: within `INT8_ATTENTION_ATOL`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from local_engine.kernels import cpu as cpu_kernels
from local_engine.kernels import reference
from local_engine.kernels.cpu import launch
from local_engine.layers import torch_ops

MakePagedKV = Any  # the kernel tests' conftest fixture `paged_kv`, and the PagedKV it returns
PagedKV = Any

needs_kernel = pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")

# Attention over an int8 cache of randn K/V vs over the float K/V: each element is off by at most half a step,
# max|x| / 254 over its (block, head) (~0.016 for randn blocks of 16 x 64), and the output, a convex combination of
# values under slightly moved softmax weights, stays within this (measured: ~0.01).
INT8_ATTENTION_ATOL = 0.04


def _triton() -> ModuleType:
    pytest.importorskip("triton")
    import local_engine.kernels as kernels

    return kernels


def _cpu_launch() -> ModuleType:
    if not cpu_kernels.is_available():
        pytest.skip("the native CPU kernels do not build here")
    return launch


BACKENDS: dict[str, Callable[[], ModuleType]] = {
    "torch_ops": lambda: torch_ops,
    "cpu_kernels": _cpu_launch,
    "triton": _triton,
}


def _int8_copy(paged: PagedKV) -> tuple[torch.Tensor, ...]:
    """The float cache's sequences written into an int8 cache, one store per sequence as a prefill would. Unowned
    blocks get NaN scales, so a kernel that reads one (a table entry too far) returns NaN."""
    k_cache = torch.zeros(paged.k_cache.shape, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.full((k_cache.shape[0], k_cache.shape[2]), float("nan"))
    v_scale = k_scale.clone()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    for table, context_len in zip(paged.block_tables, paged.context_lens.tolist(), strict=True):
        positions = torch.arange(context_len)
        slots = table.long()[positions // block_size] * block_size + positions % block_size
        k = paged.k_cache.view(-1, num_kv_heads, head_dim)[slots]
        v = paged.v_cache.view(-1, num_kv_heads, head_dim)[slots]
        reference.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    return k_cache, v_cache, k_scale, v_scale


def _prefill_args(context_lens: list[int], q_lens: list[int], num_heads: int, head_dim: int, generator: Any) -> Any:
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, cu


# -- the write rule ------------------------------------------------------------------------------------------------


def _dequantized(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    block_size = cache.shape[1]
    flat = cache.view(-1, *cache.shape[2:]).float()[slots]
    return flat * scales[slots // block_size][:, :, None]


def test_a_run_is_quantized_within_half_a_step_of_its_block_scale() -> None:
    generator = torch.Generator().manual_seed(0)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.int8)
    scales = torch.zeros(4, 2)
    x = torch.randn(20, 2, 64, generator=generator)
    slots = torch.cat((torch.arange(32, 48), torch.arange(16, 20)))  # block 2 whole, then block 1's first four
    reference.store_kv(x, x, cache, cache.clone(), slots, scales, scales.clone())
    assert torch.equal(scales[2], x[:16].abs().amax(dim=(0, 2)) / 127)  # one scale per (block, head): its max
    assert (cache[2].abs().amax(dim=(0, 2)) == 127).all()  # each head's largest element lands on +-127
    error = (_dequantized(cache, scales, slots) - x).abs()
    assert (error <= scales[slots // 16][:, :, None] / 2 + 1e-7).all()


def test_a_larger_token_grows_the_scale_and_requantizes_the_earlier_entries_only() -> None:
    generator = torch.Generator().manual_seed(1)
    cache, scales = torch.zeros(2, 16, 1, 64, dtype=torch.int8), torch.zeros(2, 1)
    spare, spare_scales = cache.clone(), scales.clone()
    first = torch.randn(5, 1, 64, generator=generator)
    reference.store_kv(first, first, cache, spare, torch.arange(16, 21), scales, spare_scales)
    old_scale = scales[1].clone()
    big = 3 * first[:1]  # three times the range: the scale must grow
    reference.store_kv(big, big, cache, spare, torch.tensor([21]), scales, spare_scales)
    assert scales[1] > old_scale and torch.equal(scales[1], big.abs().amax() / 127 * torch.ones(1))
    slots = torch.arange(16, 22)
    error = (_dequantized(cache, scales, slots) - torch.cat((first, big))).abs()
    assert (error <= scales[1] + 1e-7).all()  # requantized entries: within one step of the new scale
    small = first[:1] / 4  # within the range: the scale stays and nothing is requantized
    before = cache.clone()
    reference.store_kv(small, small, cache, spare, torch.tensor([22]), scales, spare_scales)
    assert torch.equal(cache[1, :6], before[1, :6]) and torch.equal(scales[1], big.abs().amax() / 127 * torch.ones(1))


def test_writing_offset_0_restarts_the_block_whatever_its_old_scale() -> None:
    """A freed block handed to another sequence: its first write starts at offset 0 and must not inherit the old
    (larger) scale."""
    cache, scales = torch.zeros(1, 16, 1, 64, dtype=torch.int8), torch.full((1, 1), 50.0)
    x = torch.full((1, 1, 64), 0.5)
    reference.store_kv(x, x, cache, cache.clone(), torch.tensor([0]), scales, scales.clone())
    assert scales.item() == pytest.approx(0.5 / 127) and (cache[0, 0] == 127).all()


def _write_scenario(store: Callable[..., None], generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Prefill chunks over several blocks, decode tokens that grow a block's scale, a padding slot, a reused block
    restarted at offset 0: the int8 cache and scales `store` leaves."""
    num_blocks, block_size, num_kv_heads, head_dim = 6, 8, 2, 64
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(num_blocks, num_kv_heads) for _ in range(2)]
    steps = [
        torch.cat((torch.arange(24, 32), torch.arange(8, 11), torch.arange(40, 43))),  # three sequences' prefill
        torch.tensor([11, -1, 43]),  # a decode step with a padding row
        torch.tensor([12, 13, 14, 44]),  # a verification (three rows of one sequence) and a decode
        torch.tensor([32, 33, 15]),  # block 4 fresh
        torch.tensor([40, 41, 16]),  # block 5 reused from offset 0 (its earlier content dropped)
    ]
    for i, slots in enumerate(steps):
        k = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator) * (1 + i)  # ranges that grow
        v = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator) * (1 + i)
        store(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    return (*caches, *scales)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_each_backend_writes_the_reference_bytes(backend: str) -> None:
    ops = BACKENDS[backend]()

    def store(*args: Any) -> None:
        done = ops.store_kv(*args)
        assert done is None or done is True  # the native launcher returns False where it does not apply

    got = _write_scenario(store, torch.Generator().manual_seed(7))
    expected = _write_scenario(reference.store_kv, torch.Generator().manual_seed(7))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize("backend", ["torch_ops", "cpu_kernels"])
def test_one_block_in_two_runs_of_a_call_follows_the_rule(backend: str) -> None:
    """Not a batch the engine builds (one block's tokens are always consecutive), but the torch and C writes keep
    the rule for it too (the Triton write documents it as unsupported)."""
    ops = BACKENDS[backend]()
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(4, 2, 64, generator=generator)
    slots = torch.tensor([16, 32, 17, 33])
    results = []
    for store in (ops.store_kv, reference.store_kv):
        cache, scales = torch.zeros(3, 16, 2, 64, dtype=torch.int8), torch.zeros(3, 2)
        store(k, k * 2, cache, cache.clone(), slots, scales, scales.clone())
        results.append((cache, scales))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# -- attention over an int8 or a lower-precision float cache ------------------------------------------------------


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_decode_attention_over_int8(backend: str, paged_kv: MakePagedKV, generator: torch.Generator) -> None:
    ops = BACKENDS[backend]()
    paged = paged_kv([1, 37, 200, 64], block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    k8, v8, k_scale, v_scale = _int8_copy(paged)
    q = torch.randn(4, 8, 64, generator=generator)
    args = (paged.block_tables, paged.context_lens, 0.125)

    got = ops.paged_decode_attention(q, k8, v8, *args, k_scale, v_scale)

    expected = reference.paged_decode_attention(q, k8, v8, *args, k_scale, v_scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    unquantized = reference.paged_decode_attention(q, paged.k_cache, paged.v_cache, *args)
    assert (got - unquantized).abs().max() <= INT8_ATTENTION_ATOL


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_attention_over_int8(backend: str, paged_kv: MakePagedKV, generator: torch.Generator) -> None:
    """Chunked prefill and a cached prefix: the new rows attend to int8 keys written in earlier steps too."""
    ops = BACKENDS[backend]()
    context_lens, q_lens = [70, 16, 130], [70, 5, 33]
    paged = paged_kv(context_lens, block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    k8, v8, k_scale, v_scale = _int8_copy(paged)
    q, cu = _prefill_args(context_lens, q_lens, 8, 64, generator)
    args = (paged.block_tables, cu, paged.context_lens, max(q_lens), 0.125)

    got = ops.paged_prefill_attention(q, k8, v8, *args, k_scale, v_scale)

    expected = reference.paged_prefill_attention(q, k8, v8, *args, k_scale, v_scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    unquantized = reference.paged_prefill_attention(q, paged.k_cache, paged.v_cache, *args)
    assert (got - unquantized).abs().max() <= INT8_ATTENTION_ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_float32_model_reads_a_half_precision_cache(
    backend: str, dtype: torch.dtype, paged_kv: MakePagedKV, generator: torch.Generator
) -> None:
    """The cache's values are exact in float32, so only float32 rounding separates the backends (the native
    kernels hand such a cache to the torch ops)."""
    ops = BACKENDS[backend]()
    context_lens, q_lens = [40, 97], [1, 30]
    paged = paged_kv(context_lens, block_size=16, num_kv_heads=2, head_dim=64, generator=generator, dtype=dtype)
    q = torch.randn(2, 4, 64, generator=generator)
    decode_args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.125)
    decode = cpu_or_torch(ops, "paged_decode_attention", *decode_args)
    assert decode.dtype == torch.float32
    torch.testing.assert_close(decode, reference.paged_decode_attention(*decode_args), atol=2e-5, rtol=1e-4)
    qp, cu = _prefill_args(context_lens, q_lens, 4, 64, generator)
    prefill_args = (qp, paged.k_cache, paged.v_cache, paged.block_tables, cu, paged.context_lens, 30, 0.125)
    prefill = cpu_or_torch(ops, "paged_prefill_attention", *prefill_args)
    torch.testing.assert_close(prefill, reference.paged_prefill_attention(*prefill_args), atol=2e-5, rtol=1e-4)


def cpu_or_torch(ops: ModuleType, name: str, *args: Any) -> torch.Tensor:
    """The op, through the torch ops where the native launcher declines (as `cpu_ops` does)."""
    out = getattr(ops, name)(*args)
    if out is None:
        assert ops is launch
        out = getattr(torch_ops, name)(*args)
    return out


@needs_kernel
def test_the_native_kernels_decline_a_half_precision_cache_and_take_int8_with_scales_only() -> None:
    q = torch.randn(1, 4, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    half = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    assert launch.paged_decode_attention(q, half, half, tables, lens, 0.125) is None
    int8, scales = torch.zeros(1, 16, 2, 64, dtype=torch.int8), torch.ones(1, 2)
    assert launch.paged_decode_attention(q, int8, int8, tables, lens, 0.125) is None  # no scales
    assert launch.paged_decode_attention(q, int8, int8, tables, lens, 0.125, scales, scales) is not None
    k = torch.randn(1, 2, 64)
    assert launch.store_kv(k, k, half, half, torch.zeros(1, dtype=torch.int64)) is False
