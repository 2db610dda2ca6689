"""Paged prefill/extend attention in Triton's interpreter vs the torch reference (float32).

GPU tolerance for the same comparison in bfloat16: atol/rtol 2e-2 (see test_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from local_engine.kernels import paged_decode_attention, paged_prefill_attention, reference

ATOL = RTOL = 2e-5


def _packed_batch(
    q_lens: list[int], num_heads: int, head_dim: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator)
    return q, cu_seqlens_q


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 1), (8, 1)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(paged_kv, generator, head_dim, num_heads, num_kv_heads, block_size):
    # (context_len, q_len): empty; one token; a whole prompt that fills its blocks exactly; a chunk after a
    # cached prefix; a prompt longer than one row block (64); a random chunk of a random context.
    random_ctx = int(torch.randint(2, 3 * block_size, (1,), generator=generator))
    random_q = int(torch.randint(1, random_ctx + 1, (1,), generator=generator))
    cases = [(0, 0), (1, 1), (2 * block_size, 2 * block_size), (block_size + 7, 5), (70, 70), (random_ctx, random_q)]
    context_lens = [ctx for ctx, _ in cases]
    q_lens = [q_len for _, q_len in cases]
    kv = paged_kv(
        context_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator
    )
    q, cu_seqlens_q = _packed_batch(q_lens, num_heads, head_dim, generator)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens_q, kv.context_lens, max(q_lens), head_dim**-0.5)

    out = paged_prefill_attention(*args)

    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, reference.paged_prefill_attention(*args), atol=ATOL, rtol=RTOL)


def test_one_token_chunks_equal_decode(paged_kv, generator):
    """A batch of one-token chunks is a decode step: both kernels must agree."""
    context_lens = [1, 17, 64, 99]
    kv = paged_kv(context_lens, block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    q, cu_seqlens_q = _packed_batch([1] * 4, 8, 64, generator)

    prefill = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens_q, kv.context_lens, 1, 0.125
    )
    decode = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)

    torch.testing.assert_close(prefill, decode, atol=ATOL, rtol=RTOL)


def test_first_row_sees_only_the_prefix_and_itself(paged_kv, generator):
    """Causality: changing a later key must not change an earlier query row's output."""
    kv = paged_kv([40], block_size=16, num_kv_heads=1, head_dim=64, generator=generator)
    q, cu_seqlens_q = _packed_batch([8], 2, 64, generator)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens_q, kv.context_lens, 8, 0.125)
    before = paged_prefill_attention(*args)

    last_block = int(kv.block_tables[0, 2])  # holds positions 32..39: the 8 new tokens
    kv.k_cache[last_block, 39 - 32] += 5.0  # the last new token's key

    after = paged_prefill_attention(*args)
    torch.testing.assert_close(after[:7], before[:7], atol=0, rtol=0)
    assert not torch.allclose(after[7], before[7])


def test_strided_q_and_larger_max_seqlen(paged_kv, generator):
    """q as a view of a fused projection; max_seqlen_q is only an upper bound."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    kv = paged_kv([30, 12], block_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator)
    qkv = torch.randn(42, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q = qkv[:, : num_heads * head_dim].view(42, num_heads, head_dim)
    cu_seqlens_q = torch.tensor([0, 30, 42], dtype=torch.int32)
    rest = (kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens_q, kv.context_lens)

    out = paged_prefill_attention(q, *rest, 100, 0.125)

    torch.testing.assert_close(
        out, reference.paged_prefill_attention(q.contiguous(), *rest, 30, 0.125), atol=ATOL, rtol=RTOL
    )


def test_reference_matches_sdpa(paged_kv, generator):
    """The reference itself, against torch's causal attention on a whole prompt."""
    kv = paged_kv([21], block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    q, cu_seqlens_q = _packed_batch([21], 4, 64, generator)
    out = reference.paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens_q, kv.context_lens, 21, 0.125
    )
    k = reference.gather_kv(kv.k_cache, kv.block_tables[0], 21).transpose(0, 1)
    v = reference.gather_kv(kv.v_cache, kv.block_tables[0], 21).transpose(0, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, is_causal=True, scale=0.125, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cu_seqlens_q": lambda t: t.to(torch.int64)}, "cu_seqlens_q must be int32"),
        ({"cu_seqlens_q": lambda t: t[:-1]}, r"num_seqs\+1"),
        ({"context_lens": lambda t: t.float()}, "context_lens must be int32"),
        ({"block_tables": lambda t: t[:1]}, "block_tables must be"),
        ({"q": lambda t: t.reshape(t.shape[0], -1)}, "q must be"),
    ],
)
def test_rejects_bad_arguments(paged_kv, generator, change, message):
    kv = paged_kv([5, 6], block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    q, cu_seqlens_q = _packed_batch([5, 6], 4, 64, generator)
    args = {
        "q": q,
        "k_cache": kv.k_cache,
        "v_cache": kv.v_cache,
        "block_tables": kv.block_tables,
        "cu_seqlens_q": cu_seqlens_q,
        "context_lens": kv.context_lens,
    }
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(AssertionError, match=message):
        paged_prefill_attention(**args, max_seqlen_q=6, scale=0.125)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(paged_kv, seed):
    """Random batch sizes, contexts, chunk lengths and head layouts (head_dim 96 exercises the padded lanes)."""
    generator = torch.Generator().manual_seed(2000 + seed)

    def pick(options: list[int]) -> int:
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    head_dim, group, num_kv_heads, block_size = pick([64, 96, 128]), pick([1, 4, 8]), pick([1, 2]), pick([16, 32])
    num_seqs = int(torch.randint(1, 5, (1,), generator=generator))
    context_lens = torch.randint(0, 100, (num_seqs,), generator=generator).tolist()
    q_lens = [int(torch.randint(0, n + 1, (1,), generator=generator)) for n in context_lens]
    kv = paged_kv(
        context_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator
    )
    q, cu_seqlens_q = _packed_batch(q_lens, group * num_kv_heads, head_dim, generator)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens_q, kv.context_lens, max(q_lens), head_dim**-0.5)

    out = paged_prefill_attention(*args)

    torch.testing.assert_close(out, reference.paged_prefill_attention(*args), atol=ATOL, rtol=RTOL)
