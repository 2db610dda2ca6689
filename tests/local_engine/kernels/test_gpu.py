"""The compiled kernels on a CUDA device in bfloat16 vs the float32 torch references (skipped without CUDA).

Tolerances: the kernels read bf16 and compute in float32 (attention rounds p to bf16 before the PV product), so
outputs sit within a couple of bf16 ulps of the float32 result: atol/rtol 2e-2 for attention, 1.6e-2 elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from local_engine import kernels
from local_engine.kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATTENTION_TOL = {"atol": 2e-2, "rtol": 2e-2}
ELEMENTWISE_TOL = {"atol": 1.6e-2, "rtol": 1.6e-2}


def _paged(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, generator: torch.Generator):
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to("cuda", torch.bfloat16)
    v_cache = torch.randn(shape, generator=generator).to("cuda", torch.bfloat16)
    ids = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    return k_cache, v_cache, block_tables.cuda(), torch.tensor(context_lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 32), (32, 8), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_decode_attention_bf16(num_heads, num_kv_heads, head_dim, num_splits):
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables, context_lens = _paged([0, 1, 16, 1000, 2049], 16, num_kv_heads, head_dim, generator)
    q = torch.randn(5, num_heads, head_dim, generator=generator).to("cuda", torch.bfloat16)
    args = (q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5)
    out = kernels.paged_decode_attention(*args, num_splits=num_splits)
    expected = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), *args[3:])
    torch.testing.assert_close(out.float(), expected, **ATTENTION_TOL)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 32), (32, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_attention_bf16(num_heads, num_kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    cases = [(0, 0), (1, 1), (300, 300), (517, 100), (64, 1)]
    k_cache, v_cache, block_tables, context_lens = _paged([c for c, _ in cases], 16, num_kv_heads, head_dim, generator)
    q_lens = [q for _, q in cases]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to("cuda", torch.bfloat16)
    rest = (block_tables, cu, context_lens, max(q_lens), head_dim**-0.5)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, *rest)
    expected = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), *rest)
    torch.testing.assert_close(out.float(), expected, **ATTENTION_TOL)


def test_elementwise_kernels_bf16():
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to("cuda", torch.bfloat16)

    x, residual, weight = randn(33, 4096), randn(33, 4096), randn(4096)
    out, residual_out = kernels.rms_norm(x, weight, 1e-5, residual)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, expected, **ELEMENTWISE_TOL)
    torch.testing.assert_close(residual_out, expected_residual, **ELEMENTWISE_TOL)

    gate_up = randn(33, 2 * 14336)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **ELEMENTWISE_TOL)

    q, k = randn(33, 32, 128), randn(33, 8, 128)
    positions = torch.randint(0, 4096, (33,), generator=generator).cuda()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).cuda()
    q_ref, k_ref = q.clone(), k.clone()
    kernels.apply_rotary(q, k, positions, cos_sin)
    reference.apply_rotary(q_ref, k_ref, positions, cos_sin)
    torch.testing.assert_close(q, q_ref, **ELEMENTWISE_TOL)
    torch.testing.assert_close(k, k_ref, **ELEMENTWISE_TOL)

    k_cache = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache, k_new, v_new = torch.zeros_like(k_cache), randn(20, 8, 128), randn(20, 8, 128)
    slots = torch.randperm(128, generator=generator)[:20].cuda()
    slots[5] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k_new, v_new, k_cache, v_cache, slots)
    reference.store_kv(k_new, v_new, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
