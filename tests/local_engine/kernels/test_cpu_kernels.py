"""The native CPU kernels (decode attention, rotary, few-row projections, RMSNorm, silu-and-mul, the KV cache
write) against the torch ops, their fallbacks, and the engine."""

from __future__ import annotations

import logging
import mmap
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from local_engine.kernels import cpu as cpu_kernels
from local_engine.kernels.cpu import cpu_ops
from local_engine.layers import torch_ops
from local_engine.layers.backend import select_ops
from local_engine.sampling_params import SamplingParams


def _has_avx2() -> bool:
    try:
        return " avx2 " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


CAN_BUILD = platform.machine() in ("x86_64", "AMD64") and shutil.which("cc") is not None and _has_avx2()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and a C compiler")


def paged_case(
    generator: torch.Generator,
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """q as a strided view of a fused qkv output, a shuffled paged cache, int32 tables and lengths."""
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    ids = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lens), max(blocks, default=0) + 2, dtype=torch.int32)
    start = 0
    for seq, n in enumerate(blocks):
        tables[seq, :n] = ids[start : start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, : num_heads * head_dim].reshape(len(lens), num_heads, head_dim)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@needs_kernel
def test_the_kernels_build_on_this_machine() -> None:
    assert cpu_kernels.is_available()
    assert select_ops("torch", native_cpu=True) is cpu_ops
    assert select_ops("torch", native_cpu=False) is torch_ops


@needs_kernel
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (8, 8, 64, 32),
        (16, 4, 128, 16),
        (32, 4, 128, 32),
        (16, 2, 64, 16),
        (8, 1, 128, 16),
        (10, 2, 80, 16),  # 64 + 16 lanes: a head's values in a full and a partial pass; groups of 5 heads
        (14, 2, 96, 16),  # groups of 7: two passes of up to four heads (AVX-512)
    ],
)
@pytest.mark.parametrize(
    "lens",
    [[0, 1, 15, 16, 17, 100, 333, 64, 5], [1], [257], [40, 0], [511, 512, 513, 1100]],  # past one 512-key chunk
)
def test_decode_attention_matches_the_torch_path(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, lens: list[int]
) -> None:
    generator = torch.Generator().manual_seed(sum(lens) + num_heads * head_dim + block_size)
    q, k_cache, v_cache, tables, context = paged_case(generator, lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, context, scale)
    assert got is not None and got.shape == q.shape and not got.isnan().any()
    expected = torch_ops.paged_decode_attention(q, k_cache, v_cache, tables, context, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    assert not got[torch.tensor(lens) == 0].any()  # an empty context attends to nothing: zeros, not NaN


@needs_kernel
def test_decode_attention_takes_head_dims_of_whole_vectors_only() -> None:
    generator = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, context = paged_case(generator, [20, 7], 8, 2, 24, 16)  # 24: 1.5 AVX-512 vectors
    kernel = cpu_kernels.load()
    assert kernel is not None
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.2)
    if 24 % kernel.lanes:
        assert got is None
    else:
        torch.testing.assert_close(got, torch_ops.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.2))
    torch.testing.assert_close(  # the ops module falls back to the torch path
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.2),
        torch_ops.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.2),
    )


def prefill_case(
    generator: torch.Generator,
    contexts: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    dim: int,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """A paged cache holding each sequence's whole context, q for its last q_len tokens as a strided view of a fused
    qkv output, and cu_seqlens_q."""
    _, k_cache, v_cache, tables, context = paged_case(generator, contexts, num_heads, num_kv_heads, dim, block_size)
    total = sum(q_lens)
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * dim, generator=generator)
    q = qkv[:, : num_heads * dim].reshape(total, num_heads, dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, cu, context


@needs_kernel
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 64, 32), (16, 4, 128, 16), (16, 2, 64, 16), (8, 1, 128, 16), (4, 2, 16, 16)],
)
@pytest.mark.parametrize(
    ("contexts", "q_lens"),
    [
        ([1, 17, 130, 64], [1, 17, 130, 64]),  # whole prompts (one token, partial blocks, several 64-token tasks)
        ([300, 40, 7], [45, 1, 7]),  # chunked prefill / cached prefixes: the last q_len tokens of each context
        ([600], [600]),
        ([5, 0, 70], [5, 0, 3]),  # a sequence with no new tokens
    ],
)
def test_prefill_attention_matches_the_torch_path(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, contexts: list[int], q_lens: list[int]
) -> None:
    generator = torch.Generator().manual_seed(sum(contexts) + num_heads * head_dim + block_size)
    q, k_cache, v_cache, tables, cu, context = prefill_case(
        generator, contexts, q_lens, num_heads, num_kv_heads, head_dim, block_size
    )
    args = (q, k_cache, v_cache, tables, cu, context, max(q_lens), head_dim**-0.5)
    got = cpu_kernels.paged_prefill_attention(*args)
    assert got is not None and got.shape == q.shape and not got.isnan().any()
    expected = torch_ops.paged_prefill_attention(*args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_ops.paged_prefill_attention(*args), got)


@needs_kernel
def test_prefill_attention_inputs_it_does_not_handle_fall_back_to_the_torch_path() -> None:
    generator = torch.Generator().manual_seed(2)
    q, k_cache, v_cache, tables, cu, context = prefill_case(generator, [30, 9], [30, 4], 8, 2, 24, 16)
    args = (q, k_cache, v_cache, tables, cu, context, 30, 0.2)  # head dim 24: not a multiple of 16 (or of 8 lanes x 2)
    kernel = cpu_kernels.load()
    assert kernel is not None
    if 24 % kernel.lanes:
        assert cpu_kernels.paged_prefill_attention(*args) is None
    assert cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, tables, cu.long(), context, 30, 0.2) is None
    bf16 = (q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, cu, context, 30, 0.2)
    assert cpu_kernels.paged_prefill_attention(*bf16) is None
    assert torch.equal(cpu_ops.paged_prefill_attention(*bf16), torch_ops.paged_prefill_attention(*bf16))


@needs_kernel
def test_attention_inputs_it_does_not_handle_fall_back_to_the_torch_path() -> None:
    generator = torch.Generator().manual_seed(1)
    cases = {
        "bfloat16": paged_case(generator, [20, 3], 8, 2, 64, 16, torch.bfloat16),
        "head_dim not a multiple of 8": paged_case(generator, [20, 3], 8, 2, 20, 16),
        "block size over 64": paged_case(generator, [200, 3], 8, 2, 64, 128),
    }
    for name, (q, k_cache, v_cache, tables, context) in cases.items():
        assert cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.125) is None, name
        got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.125)
        expected = torch_ops.paged_decode_attention(q, k_cache, v_cache, tables, context, 0.125)
        assert torch.equal(got, expected), name


@needs_kernel
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (4, 4, 16)])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rotary_matches_the_torch_path(num_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int) -> None:
    generator = torch.Generator().manual_seed(num_tokens * head_dim + num_heads)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(1024, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    expected = qkv.clone()
    views = []
    for x in (qkv, expected):  # q and k as the model has them: strided views into the fused projection
        q = x[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        k = x[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
        views.append((q, k))
    positions = torch.randint(0, 1024, (num_tokens,), generator=generator)
    assert cpu_kernels.apply_rotary(*views[0], positions, cos_sin)
    torch_ops.apply_rotary(*views[1], positions, cos_sin)
    torch.testing.assert_close(qkv, expected, rtol=1e-6, atol=1e-6)  # v (the last third) untouched by either


@needs_kernel
def test_rotary_inputs_it_does_not_handle_fall_back_to_the_torch_path() -> None:
    cos_sin = torch.randn(64, 16)
    q, k = torch.randn(3, 4, 16, dtype=torch.bfloat16), torch.randn(3, 2, 16, dtype=torch.bfloat16)
    positions = torch.tensor([0, 5, 63])
    assert not cpu_kernels.apply_rotary(q, k, positions, cos_sin)
    expected_q, expected_k = q.clone(), k.clone()
    torch_ops.apply_rotary(expected_q, expected_k, positions, cos_sin)
    cpu_ops.apply_rotary(q, k, positions, cos_sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@needs_kernel
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 24, 97])
@pytest.mark.parametrize(("num_out", "num_in"), [(1, 8), (2, 7), (3, 9), (47, 96), (49, 100), (160, 96), (96, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(num_rows: int, num_out: int, num_in: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(num_rows * 1000 + num_out * 10 + num_in)
    weight = torch.randn(num_out, num_in, generator=generator)
    b = torch.randn(num_out, generator=generator) if bias else None
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed is not None and packed.shape[1] == num_in and packed.shape[0] * packed.shape[2] >= num_out
    fused = torch.randn(num_rows, 3 * num_in, generator=generator)
    for x in (fused[:, :num_in].contiguous(), fused[:, num_in : 2 * num_in]):  # also rows apart, as in the model
        got = cpu_kernels.linear(x, packed, num_out, b)
        assert got is not None and got.shape == (num_rows, num_out) and got.is_contiguous()
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        # float32 sums of num_in terms of size ~1: rounding grows like sqrt(num_in), as F.linear's does
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6 * num_in**0.5 * 8)


@needs_kernel
def test_linear_inputs_it_does_not_handle_return_none() -> None:
    weight, x = torch.randn(16, 32), torch.randn(4, 32)
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed is not None and cpu_kernels.linear(x, packed, 16, None) is not None
    assert cpu_kernels.pack_linear_weight(weight.bfloat16()) is None
    assert cpu_kernels.pack_linear_weight(weight[0]) is None
    assert cpu_kernels.linear(x.bfloat16(), packed, 16, None) is None
    assert cpu_kernels.linear(torch.randn(32, 4).t(), packed, 16, None) is None  # columns apart
    assert cpu_kernels.linear(x, weight, 16, None) is None  # not packed
    assert cpu_kernels.linear(x, packed, packed.shape[0] * packed.shape[2] + 1, None) is None  # more than it holds
    assert cpu_kernels.linear(x, packed, 16, torch.randn(15)) is None  # a bias of another size
    assert cpu_kernels.linear(torch.randn(4, 31), packed, 16, None) is None
    assert cpu_kernels.linear(x.view(2, 2, 32), packed, 16, None) is None
    assert cpu_kernels.linear(torch.empty(0, 32), packed, 16, None).shape == (0, 16)  # type: ignore[union-attr]


@needs_kernel
@pytest.mark.parametrize("num_rows", [1, 5, 300])
@pytest.mark.parametrize("dim", [20, 64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_path(num_rows: int, dim: int, with_residual: bool) -> None:
    generator = torch.Generator().manual_seed(num_rows * dim)
    wide = torch.randn(num_rows, dim + 8, generator=generator) * 3
    weight = torch.randn(dim, generator=generator)
    residual = torch.randn(num_rows, dim, generator=generator) if with_residual else None
    for x in (wide[:, :dim].contiguous(), wide[:, 8:]):  # also rows apart (a qk-norm head view)
        expected, expected_residual = torch_ops.rms_norm(
            x.clone(), weight, 1e-6, None if residual is None else residual.clone()
        )
        got = cpu_kernels.rms_norm(x.clone(), weight, 1e-6, None if residual is None else residual.clone())
        assert got is not None
        torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
        if residual is None:
            assert got[1] is None
        else:
            assert got[1] is not None
            torch.testing.assert_close(got[1], expected_residual, rtol=0, atol=0)  # the same float32 sums


@needs_kernel
@pytest.mark.parametrize(("num_rows", "inter"), [(1, 8), (3, 13), (64, 1536)])
def test_silu_and_mul_matches_the_torch_path(num_rows: int, inter: int) -> None:
    generator = torch.Generator().manual_seed(num_rows + inter)
    x = torch.randn(num_rows, 2 * inter, generator=generator) * 8
    x[0, :4] = torch.tensor([-150.0, -88.5, 87.5, 150.0])[: min(4, inter)]  # where exp over/underflows
    expected = torch_ops.silu_and_mul(x.clone())
    gate = x.clone()
    got = cpu_kernels.silu_and_mul(gate)
    assert got is not None and got.data_ptr() == gate.data_ptr()  # in place in the gate half
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@needs_kernel
def test_store_kv_matches_the_torch_path() -> None:
    generator = torch.Generator().manual_seed(5)
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 6, 2, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)  # views into qkv, as stored
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([3, 17, -1, 0, 40, 41, 63])  # -1: skipped
    caches = [torch.randn(4, 16, num_kv_heads, head_dim, generator=generator) for _ in range(2)]
    expected = [c.clone() for c in caches]
    assert cpu_kernels.store_kv(k, v, *caches, slots)
    torch_ops.store_kv(k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@needs_kernel
def test_small_op_inputs_they_do_not_handle_fall_back_to_the_torch_path() -> None:
    x, weight = torch.randn(3, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    assert cpu_kernels.rms_norm(x, weight, 1e-6) is None
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6)[0], torch_ops.rms_norm(x, weight, 1e-6)[0])
    assert cpu_kernels.silu_and_mul(x) is None
    assert cpu_kernels.silu_and_mul(torch.randn(3, 31)) is None  # no even split into gate and up
    assert cpu_kernels.rms_norm(torch.randn(3, 32), torch.ones(16), 1e-6) is None
    k = torch.randn(2, 1, 8, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    assert not cpu_kernels.store_kv(k, k, cache, cache.clone(), torch.tensor([0, 5]))
    expected = cache.clone()
    cpu_ops.store_kv(k, k, cache, cache.clone(), torch.tensor([0, 5]))
    torch_ops.store_kv(k, k, expected, expected.clone(), torch.tensor([0, 5]))
    assert torch.equal(cache, expected)


@pytest.fixture
def fresh_kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield tmp_path
    cpu_kernels.load.cache_clear()  # later tests load the library built under the real cache directory


def test_a_missing_compiler_means_the_torch_path(
    fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(fresh_kernel_cache / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="unigate.engine"):
        assert cpu_kernels.load() is None
    assert select_ops("torch", native_cpu=True) is torch_ops
    if platform.machine() in ("x86_64", "AMD64"):
        assert "native CPU kernels unavailable" in caplog.text


@needs_kernel
def test_builds_once_into_the_cache_directory(fresh_kernel_cache: Path) -> None:
    assert cpu_kernels.load() is not None
    built = list((fresh_kernel_cache / "unigate" / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1
    cpu_kernels.load.cache_clear()
    mtime = built[0].stat().st_mtime_ns
    assert cpu_kernels.load() is not None and built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


@needs_kernel
def test_engine_greedy_tokens_are_the_same_with_and_without_the_kernels(family: Any) -> None:
    model = family
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 37, 16, 90)]
    native = model.engine()
    plain = model.engine(cpu_kernels=False)
    assert native.stats()["ops"] == "cpu_ops" and plain.stats()["ops"] == "torch_ops"
    assert native.generate(prompts, params) == plain.generate(prompts, params)


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.skipif(_thp_mode() == "unavailable", reason="no transparent huge pages in this kernel")
def test_the_cpu_kv_cache_asks_for_huge_pages() -> None:
    """The advice itself is checked (the `hg` flag on the mapping): whether the kernel then finds free 2 MiB pages
    depends on the machine's memory at that moment."""
    from local_engine.model_runner import advise_huge_pages

    assert not advise_huge_pages(torch.empty(1024))  # no 2 MiB-aligned page inside: nothing to advise
    # A fresh mapping of its own: memory from the allocator may have been advised for an earlier test's cache.
    region = mmap.mmap(-1, 64 << 20)
    cache = torch.frombuffer(region, dtype=torch.uint8)
    start, end = cache.data_ptr(), cache.data_ptr() + cache.numel()

    def advised_mappings() -> list[bool]:
        flags: list[bool] = []
        overlaps = False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                low, high = (int(x, 16) for x in head.split("-"))
                overlaps = low < end and high > start
            elif overlaps and line.startswith("VmFlags:"):
                flags.append("hg" in line.split()[1:])
        return flags

    assert advised_mappings() and not any(advised_mappings())
    assert advise_huge_pages(cache)
    assert any(advised_mappings())
