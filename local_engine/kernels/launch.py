"""How a launcher picks the kernel to run for its tensors' device, plus the shared argument checks.

CUDA tensors run the compiled kernel. CPU tensors run the same kernel source in Triton's interpreter, whatever
`TRITON_INTERPRET` said when the kernel modules were imported: `@triton.jit` decides compiled-or-interpreted once,
at decoration time, so a process that imported the kernels before setting the variable would otherwise be stuck
with kernels that cannot take CPU tensors. Choosing per call keeps tests independent of import order.

Kernels must stay self-contained (no calls to other `@triton.jit` helpers): an interpreted kernel resolves names
in its module's globals, where a helper would be a compiled function that only runs inside a compiled kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = [
    "check_kv_cache",
    "check_last_dim_contiguous",
    "check_paged_attention",
    "check_same_device",
    "kernel_for",
    "pow2_at_least",
]

# Where triton keeps its own @jit helpers (tl.zeros, tl.sum, tl.max, tl.cdiv, ...), tensor methods included.
_LANGUAGE_NAMESPACES: tuple[Any, ...] = (tl, tl.core, tl.standard, tl.math, tl.core.tensor)
_interpreted: dict[int, InterpretedFunction[Any]] = {}


def _interpreted_twin(fn: JITFunction[Any]) -> InterpretedFunction[Any]:
    key = id(fn)
    if key not in _interpreted:
        _interpreted[key] = InterpretedFunction(fn.fn)
    return _interpreted[key]


@contextmanager
def _interpreted_language() -> Iterator[None]:
    """Swap triton's own compiled-mode helpers for interpreted twins during one interpreted launch.

    Without `TRITON_INTERPRET=1` at import, `tl.zeros`, `tl.sum`... are compiled-mode functions that refuse to
    run outside a compiled kernel. Not thread-safe, like the interpreter itself (it patches triton.language too).
    """
    # The interpreter imports gluon lazily on its first launch, and gluon asserts that triton's helpers are
    # compiled-mode ones: import it before they are swapped.
    import triton.experimental.gluon  # noqa: F401

    swapped: list[tuple[Any, str, Any]] = []
    for namespace in _LANGUAGE_NAMESPACES:
        for name, value in list(vars(namespace).items()):
            if isinstance(value, JITFunction):
                swapped.append((namespace, name, value))
                setattr(namespace, name, _interpreted_twin(value))
    try:
        yield
    finally:
        for namespace, name, value in reversed(swapped):
            setattr(namespace, name, value)


class _InterpretedLaunch:
    """`kernel[grid](*args)` in the interpreter, with triton's own helpers interpreted for the launch."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel if isinstance(kernel, InterpretedFunction) else _interpreted_twin(kernel)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            with _interpreted_language():
                self.kernel[grid](*args, **kwargs)

        return launch


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """The launchable form of `kernel` (a `@triton.jit` function) for tensors on `device`.

    Compiled on CUDA; interpreted on CPU, and wherever the kernel was decorated under `TRITON_INTERPRET=1`.
    Triton's own helpers are swapped for the launch either way, since they may have been decorated in the other
    mode (e.g. the variable was set after `import triton` but before these kernel modules were imported).
    """
    if device.type == "cuda" and not isinstance(kernel, InterpretedFunction):
        return kernel
    assert device.type in ("cuda", "cpu"), f"Triton kernels run on CUDA, or on CPU in the interpreter; got {device}"
    return _InterpretedLaunch(kernel)


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """The block size that covers `n` lanes: the next power of two, at least `minimum`."""
    return max(int(triton.next_power_of_2(n)), minimum)


def check_same_device(name: str, *tensors: torch.Tensor) -> torch.device:
    device = tensors[0].device
    for t in tensors[1:]:
        assert t.device == device, f"{name}: all tensors must be on one device, got {device} and {t.device}"
    return device


def check_last_dim_contiguous(name: str, arg: str, t: torch.Tensor) -> None:
    assert t.stride(-1) == 1, (
        f"{name}: {arg} must be contiguous in its last dimension (stride 1), got strides {tuple(t.stride())}; "
        "call .contiguous() on it"
    )


def check_kv_cache(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Assert the fixed cache layout; return `(num_blocks, block_size, num_kv_heads, head_dim)`."""
    assert k_cache.dim() == 4, (
        f"{name}: k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
    )
    assert v_cache.shape == k_cache.shape, (
        f"{name}: v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
    )
    assert v_cache.dtype == k_cache.dtype, f"{name}: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), (
        f"{name}: k_cache and v_cache must be contiguous (views of one [2, layers, blocks, block_size, heads, dim] "
        f"tensor), got strides {tuple(k_cache.stride())} and {tuple(v_cache.stride())}"
    )
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_kv_scales(
    name: str, k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """Assert that an int8 cache comes with float32 scales [num_blocks, num_kv_heads] (contiguous) and a float one
    with none; return whether the cache is int8."""
    is_int8 = k_cache.dtype == torch.int8
    if not is_int8:
        assert k_scale is None and v_scale is None, f"{name}: a {k_cache.dtype} KV cache takes no scales"
        return False
    shape = (k_cache.shape[0], k_cache.shape[2])
    for arg, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert t is not None, f"{name}: an int8 KV cache needs {arg}"
        assert t.dtype == torch.float32 and t.shape == shape and t.is_contiguous(), (
            f"{name}: {arg} must be a contiguous float32 {shape}, got {t.dtype} {tuple(t.shape)}"
        )
    return True


def check_paged_attention(
    name: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_seqs: int,
) -> tuple[int, int, int]:
    """Assert the arguments both paged attention launchers share; return `(num_heads, num_kv_heads, block_size)`.
    The cache may hold another float dtype than q (read as q's) or int8 (`check_kv_scales`)."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(name, k_cache, v_cache)
    assert q.dim() == 3 and q.shape[2] == head_dim, (
        f"{name}: q must be [tokens, num_heads, {head_dim}] to match the cache head_dim, got {tuple(q.shape)}"
    )
    num_heads = q.shape[1]
    assert num_heads % num_kv_heads == 0, (
        f"{name}: num_heads ({num_heads}) must be a multiple of the cache's num_kv_heads ({num_kv_heads})"
    )
    floats = (torch.float32, torch.float16, torch.bfloat16)
    assert q.dtype in floats, f"{name}: unsupported dtype {q.dtype}"
    assert k_cache.dtype in (*floats, torch.int8), f"{name}: unsupported KV cache dtype {k_cache.dtype}"
    assert 16 <= head_dim <= 256, f"{name}: head_dim must be in [16, 256], got {head_dim}"
    check_last_dim_contiguous(name, "q", q)
    assert block_tables.dtype == torch.int32, f"{name}: block_tables must be int32, got {block_tables.dtype}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, (
        f"{name}: block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got {tuple(block_tables.shape)}"
    )
    check_last_dim_contiguous(name, "block_tables", block_tables)
    return num_heads, num_kv_heads, block_size
