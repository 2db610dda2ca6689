"""KV write (slot-mapping scatter) in Triton's interpreter vs the torch reference: exact in any dtype."""

from __future__ import annotations

import pytest
import torch

from local_engine.kernels import reference, store_kv


def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, generator: torch.Generator):
    kv = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    return kv[0, 1], kv[1, 1]  # layer 1 of the engine's [2, layers, ...] tensor


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(generator, head_dim, num_kv_heads, block_size):
    num_blocks, num_tokens = 5, 23
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, generator)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens: skipped
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)

    store_kv(k, v, k_cache, v_cache, slots)

    reference.store_kv(k, v, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize(
    ("input_dtype", "cache_dtype"),
    # float32 -> bfloat16 is left out: the interpreter truncates that cast where the GPU rounds to nearest.
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16), (torch.float16, torch.float32)],
)
def test_strided_views_and_cast_to_cache_dtype(generator, input_dtype, cache_dtype):
    """k and v sliced out of a fused qkv output, cast to the cache dtype as torch would."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    k_cache = torch.zeros(3, 16, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(6, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(input_dtype)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(6, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(6, num_kv_heads, head_dim)
    slots = torch.tensor([0, 17, 18, 47, 5, 30])

    store_kv(k, v, k_cache, v_cache, slots)

    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], k.to(cache_dtype))
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[slots], v.to(cache_dtype))


def test_no_tokens_is_a_no_op(generator):
    k_cache, v_cache = _caches(2, 16, 2, 64, generator)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 64)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slot_mapping": lambda t: t.to(torch.int32)}, "slot_mapping must be int64"),
        ({"k": lambda t: t[:, :1]}, "k must be"),
        ({"v": lambda t: t[:2]}, "v shape"),
        ({"k": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)}, "last dimension"),
        ({"v_cache": lambda t: t.double()}, "v_cache is torch.float64"),
    ],
)
def test_rejects_bad_arguments(generator, change, message):
    k_cache, v_cache = _caches(2, 16, 2, 64, generator)
    args = {
        "k": torch.randn(3, 2, 64),
        "v": torch.randn(3, 2, 64),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "slot_mapping": torch.tensor([0, 1, 2]),
    }
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(AssertionError, match=message):
        store_kv(**args)
