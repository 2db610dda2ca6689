"""Paged decode attention in Triton's interpreter vs the torch reference (float32).

GPU tolerance for the same comparison in bfloat16: atol/rtol 2e-2 (see test_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from local_engine.kernels import paged_decode_attention, reference
from local_engine.kernels.decode_attention import choose_num_splits

ATOL = RTOL = 2e-5


def _random_context_lens(generator: torch.Generator, block_size: int) -> list[int]:
    """Empty, single-token, an exact multiple of the block size, and two random lengths (usually not multiples)."""
    randoms = torch.randint(2, 4 * block_size, (2,), generator=generator).tolist()
    return [0, 1, 2 * block_size, *randoms]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_reference(paged_kv, generator, head_dim, num_heads, num_kv_heads, block_size, num_splits):
    context_lens = _random_context_lens(generator, block_size)
    kv = paged_kv(
        context_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator
    )
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)

    out = paged_decode_attention(*args, num_splits=num_splits)

    expected = reference.paged_decode_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(out[0], torch.zeros_like(out[0])), "an empty context must give zeros"


def test_more_splits_than_tiles_and_all_empty(paged_kv, generator):
    """Splits with no keys (short contexts, empty contexts) must merge to the right answer, never NaN."""
    kv = paged_kv([0, 0, 5], block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    q = torch.randn(3, 4, 64, generator=generator)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)

    out = paged_decode_attention(*args, num_splits=8)

    torch.testing.assert_close(out, reference.paged_decode_attention(*args), atol=ATOL, rtol=RTOL)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))


def test_automatic_split_choice_on_a_long_table(paged_kv, generator):
    """The default split count comes from the block table's width; a wide table takes the split path."""
    kv = paged_kv([300, 7], block_size=32, num_kv_heads=1, head_dim=64, generator=generator, extra_table_entries=10)
    assert choose_num_splits(2, 1, kv.block_tables.shape[1] * 32, num_sms=4) > 1
    q = torch.randn(2, 4, 64, generator=generator)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)

    torch.testing.assert_close(
        paged_decode_attention(*args), reference.paged_decode_attention(*args), atol=ATOL, rtol=RTOL
    )


def test_strided_q_from_fused_projection(paged_kv, generator):
    """q may be a view into a fused qkv output: rows strided, last dim contiguous."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    kv = paged_kv([9, 40], block_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator)
    qkv = torch.randn(2, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q = qkv[:, : num_heads * head_dim].view(2, num_heads, head_dim)
    assert not q.is_contiguous()
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)

    torch.testing.assert_close(
        paged_decode_attention(*args), reference.paged_decode_attention(q.contiguous(), *args[1:]), atol=ATOL, rtol=RTOL
    )


def test_reference_matches_sdpa(paged_kv, generator):
    """The reference itself, against torch's attention on the gathered (unpaged) keys."""
    kv = paged_kv([23], block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    q = torch.randn(1, 8, 64, generator=generator)
    out = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)
    k = reference.gather_kv(kv.k_cache, kv.block_tables[0], 23).transpose(0, 1)  # [KVH, 23, D]
    v = reference.gather_kv(kv.v_cache, kv.block_tables[0], 23).transpose(0, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, scale=0.125, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_choose_num_splits():
    assert choose_num_splits(4, 8, max_context_len=256, num_sms=132) == 1  # short: one pass, no merge
    assert choose_num_splits(1, 8, max_context_len=32768, num_sms=132) == 32  # few programs, long: many splits
    assert choose_num_splits(64, 8, max_context_len=4096, num_sms=132) == math.ceil(4 * 132 / 512)
    assert choose_num_splits(512, 8, max_context_len=4096, num_sms=132) == 1  # the batch fills the GPU already
    assert choose_num_splits(1, 1, max_context_len=600, num_sms=132) == 2  # no split under ~256 tokens


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_tables": lambda t: t.to(torch.int64)}, "block_tables must be int32"),
        ({"context_lens": lambda t: t.to(torch.int64)}, "context_lens must be int32"),
        ({"q": lambda t: t[:, :3]}, "multiple of the cache's num_kv_heads"),
        ({"q": lambda t: t.double()}, "unsupported dtype torch.float64"),
        ({"k_cache": lambda t: t.to(torch.int8), "v_cache": lambda t: t.to(torch.int8)}, "needs k_scale"),
        (
            {"k_cache": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)},
            "k_cache and v_cache must be contiguous",
        ),
        ({"q": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)[..., :32]}, "head_dim"),
    ],
)
def test_rejects_bad_arguments(paged_kv, generator, change, message):
    kv = paged_kv([5, 6], block_size=16, num_kv_heads=2, head_dim=64, generator=generator)
    args = {
        "q": torch.randn(2, 4, 64, generator=generator),
        "k_cache": kv.k_cache,
        "v_cache": kv.v_cache,
        "block_tables": kv.block_tables,
        "context_lens": kv.context_lens,
    }
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(AssertionError, match=message):
        paged_decode_attention(**args, scale=0.125)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(paged_kv, seed):
    """Random batch sizes, lengths, head layouts (head_dim 96 exercises the padded lanes) and split counts."""
    generator = torch.Generator().manual_seed(1000 + seed)

    def pick(options: list[int]) -> int:
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    head_dim, group, num_kv_heads, block_size = pick([64, 96, 128]), pick([1, 4, 8]), pick([1, 2]), pick([16, 32])
    num_seqs = int(torch.randint(1, 6, (1,), generator=generator))
    context_lens = torch.randint(0, 150, (num_seqs,), generator=generator).tolist()
    kv = paged_kv(
        context_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator
    )
    q = torch.randn(num_seqs, group * num_kv_heads, head_dim, generator=generator)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, head_dim**-0.5)

    out = paged_decode_attention(*args, num_splits=pick([1, 2, 5]))

    torch.testing.assert_close(out, reference.paged_decode_attention(*args), atol=ATOL, rtol=RTOL)
