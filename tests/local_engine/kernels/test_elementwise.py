"""RMSNorm (+residual), rotary embedding and SiLU-and-mul in Triton's interpreter vs the torch references.

Float32 here; on GPU in bfloat16 the tolerance is one bf16 ulp (atol/rtol 2e-2, see test_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from local_engine.kernels import apply_rotary, reference, rms_norm, silu_and_mul

ATOL = RTOL = 1e-5


def _cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [max_position, rotary_dim]


@pytest.mark.parametrize("hidden_size", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(generator, hidden_size, with_residual):
    rows = torch.randn(7, hidden_size + 3, generator=generator)
    x = rows[:, :hidden_size]  # strided rows
    weight = torch.randn(hidden_size, generator=generator)
    residual = torch.randn(7, hidden_size, generator=generator) if with_residual else None
    x_before = x.clone()

    out, residual_out = rms_norm(x, weight, 1e-6, residual)

    expected, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    if with_residual:
        torch.testing.assert_close(residual_out, expected_residual, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(residual_out, x_before + residual, atol=0, rtol=0)
    else:
        assert residual_out is None
    assert torch.equal(x, x_before), "inputs must not be modified"


def test_rms_norm_reference_matches_torch(generator):
    x = torch.randn(5, 64, generator=generator)
    weight = torch.randn(64, generator=generator)
    expected = torch.nn.functional.rms_norm(x, (64,), weight, eps=1e-5)
    torch.testing.assert_close(reference.rms_norm(x, weight, 1e-5)[0], expected, atol=1e-6, rtol=1e-6)


def test_rms_norm_empty_and_bad_arguments():
    out, residual_out = rms_norm(torch.empty(0, 64), torch.ones(64), 1e-6, torch.empty(0, 64))
    assert out.shape == (0, 64) and residual_out is not None and residual_out.shape == (0, 64)
    with pytest.raises(AssertionError, match="weight must be"):
        rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(AssertionError, match="residual"):
        rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6, torch.randn(2, 32))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)])
def test_rotary_matches_reference_and_transformers(generator, head_dim, num_heads, num_kv_heads):
    num_tokens = 9
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided views, rotated in place
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 100, (num_tokens,), generator=generator)
    cache = _cos_sin_cache(100, head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    q_hf, k_hf = q.clone(), k.clone()

    apply_rotary(q, k, positions, cache)

    reference.apply_rotary(q_ref, k_ref, positions, cache)
    torch.testing.assert_close(q, q_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(k, k_ref, atol=ATOL, rtol=RTOL)
    # The reference itself, against transformers' Llama rotary ([batch, heads, seq, dim] layout, full cos/sin).
    cos = cache[positions, : head_dim // 2].repeat(1, 2)[None]
    sin = cache[positions, head_dim // 2 :].repeat(1, 2)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q_hf.transpose(0, 1)[None], k_hf.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1), atol=ATOL, rtol=RTOL)


def test_partial_rotary_leaves_the_tail(generator):
    q = torch.randn(4, 2, 64, generator=generator)
    k = torch.randn(4, 1, 64, generator=generator)
    positions = torch.tensor([0, 3, 7, 1])
    cache = _cos_sin_cache(8, 32)
    q_ref, k_ref = q.clone(), k.clone()

    apply_rotary(q, k, positions, cache)

    reference.apply_rotary(q_ref, k_ref, positions, cache)
    torch.testing.assert_close(q, q_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(k, k_ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(q[..., 32:], q_ref[..., 32:])
    assert torch.equal(q[0], q_ref[0])  # position 0 is the identity rotation


def test_rotary_bad_arguments():
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    with pytest.raises(AssertionError, match="positions must be int64"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.int32), _cos_sin_cache(4, 64))
    with pytest.raises(AssertionError, match="columns"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.int64), _cos_sin_cache(4, 128))


@pytest.mark.parametrize("intermediate_size", [64, 1500])  # 1500: two column blocks, the second partial
def test_silu_and_mul_matches_reference(generator, intermediate_size):
    x = torch.randn(5, 2 * intermediate_size, generator=generator) * 4
    x[0, :4] = torch.tensor([-1000.0, 1000.0, -88.0, 90.0])  # exp never overflows, whatever the sign
    out = silu_and_mul(x)
    assert out.shape == (5, intermediate_size) and torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.silu_and_mul(x), atol=ATOL, rtol=RTOL)


def test_silu_and_mul_bad_arguments():
    with pytest.raises(AssertionError, match="2\\*intermediate"):
        silu_and_mul(torch.randn(2, 7))
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
