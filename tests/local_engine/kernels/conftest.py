"""Fixtures for the kernel tests: a paged KV cache laid out like the engine's, filled so that stray reads show.

The kernels run in Triton's interpreter here because the tensors are on CPU: the launchers pick the interpreted
form per call (`local_engine.kernels.launch.kernel_for`), so these tests need no `TRITON_INTERPRET` and do not
change the process environment for the rest of the suite.

Every cache slot that no sequence owns holds NaN, and the padding entries of the block tables point at a block
that is NaN throughout, so a kernel that reads one token past a context (or one table entry too far) returns NaN
and fails the comparison instead of passing by luck.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


def _unshadow_local_engine() -> None:
    """Make `local_engine.kernels` the real package, not this folder.

    pytest's default (prepend) import mode puts tests/ on sys.path, so tests/local_engine is a namespace portion of
    `local_engine` and this folder one of `local_engine.kernels`; the editable install's finder runs only after
    sys.path, so the namespace wins. A no-op once pyproject sets `pythonpath = ["."]` for pytest (the real fix:
    it also covers runs that never load this conftest).
    """
    root = Path(__file__).resolve().parents[3]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    package = sys.modules.get("local_engine")
    if package is not None and getattr(package, "__file__", None) is None:
        # Imported as a namespace by a conftest above this one: a regular package found on its search path wins
        # over the namespace portion tests/local_engine/kernels.
        package.__path__.append(str(root / "local_engine"))
    kernels = sys.modules.get("local_engine.kernels")
    if kernels is not None and getattr(kernels, "__file__", None) is None:
        raise RuntimeError('local_engine.kernels resolved to tests/; set pythonpath = ["."] for pytest in pyproject')


_unshadow_local_engine()

NUM_LAYERS = 2  # the cache under test is layer 1 of a [2, layers, ...] tensor, as the engine allocates it
NAN_BLOCK = 0  # never handed to a sequence; padding entries point here


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, shuffled block ids
    context_lens: torch.Tensor  # [num_seqs] int32


MakePagedKV = Callable[..., PagedKV]


def make_paged_kv(
    context_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    generator: torch.Generator,
    extra_table_entries: int = 1,
    dtype: torch.dtype = torch.float32,
) -> PagedKV:
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    max_blocks = max([*blocks_per_seq, 0]) + extra_table_entries
    num_blocks = sum(blocks_per_seq) + 3  # + the NaN block + two spare ones
    kv = torch.full((2, NUM_LAYERS, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    k_cache, v_cache = kv[0, 1], kv[1, 1]
    free_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # shuffled, never NAN_BLOCK
    block_tables = torch.full((len(context_lens), max_blocks), NAN_BLOCK, dtype=torch.int32)
    for seq, (context_len, num_seq_blocks) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        ids = [free_ids.pop() for _ in range(num_seq_blocks)]
        block_tables[seq, :num_seq_blocks] = torch.tensor(ids, dtype=torch.int32)
        positions = torch.arange(context_len)
        slots = torch.tensor(ids, dtype=torch.int64)[positions // block_size] * block_size + positions % block_size
        shape = (context_len, num_kv_heads, head_dim)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(shape, generator=generator).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(shape, generator=generator).to(dtype)
    return PagedKV(k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32))


@pytest.fixture
def paged_kv() -> MakePagedKV:
    return make_paged_kv


@pytest.fixture
def generator(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id, so each parametrized case draws different but repeatable data."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**31)
    return torch.Generator().manual_seed(seed)
