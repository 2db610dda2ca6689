"""Every implementation of the six engine operations keeps the `Ops` protocol's signatures: a renamed, reordered or
missing parameter fails here instead of in a model that calls the ops by position or keyword."""

from __future__ import annotations

import inspect
import subprocess
import sys
from types import ModuleType

import pytest

from local_engine.kernels import reference
from local_engine.kernels.cpu import cpu_ops, launch
from local_engine.layers import torch_ops
from local_engine.layers.backend import Ops, select_ops

OPERATIONS = (
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "apply_rotary",
    "silu_and_mul",
)


def _parameters(function: object, *, drop_self: bool = False) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(function).parameters.values())  # type: ignore[arg-type]
    return parameters[1:] if drop_self else parameters


def _mismatches(implementation: object) -> list[str]:
    """How `implementation`'s operations differ from the protocol's: each protocol parameter in the same place, of
    the same kind and with the same default; extra parameters only keyword-only ones with defaults."""
    problems = []
    for name in OPERATIONS:
        function = getattr(implementation, name, None)
        if not callable(function):
            problems.append(f"{name}: missing")
            continue
        expected = _parameters(getattr(Ops, name), drop_self=True)
        got = _parameters(function)
        described = [(p.name, p.kind, p.default) for p in got[: len(expected)]]
        if described != [(p.name, p.kind, p.default) for p in expected]:
            protocol = inspect.signature(getattr(Ops, name))
            problems.append(f"{name}{inspect.signature(function)} differs from the protocol's {protocol}")
        extra = got[len(expected) :]
        if any(p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty for p in extra):
            problems.append(f"{name}: extra parameters a protocol call cannot leave out: {extra}")
    return problems


def test_the_protocol_declares_exactly_the_six_operations() -> None:
    declared = {name for name, value in vars(Ops).items() if inspect.isfunction(value) and not name.startswith("_")}
    assert declared == set(OPERATIONS)


@pytest.mark.parametrize(
    "implementation", [torch_ops, cpu_ops, reference, launch], ids=["torch_ops", "cpu_ops", "reference", "cpu_launch"]
)
def test_each_implementation_keeps_the_protocol_signatures(implementation: ModuleType) -> None:
    assert _mismatches(implementation) == []


def test_the_triton_launchers_keep_the_protocol_signatures() -> None:
    pytest.importorskip("triton")
    import local_engine.kernels as triton_kernels

    assert _mismatches(triton_kernels) == []


def test_a_drifted_signature_is_caught() -> None:
    def rms_norm(x: object, weight: object, epsilon: float, residual: object = None) -> None:  # eps renamed
        del x, weight, epsilon, residual

    def silu_and_mul(x: object, inplace: bool) -> None:  # a parameter no protocol call passes
        del x, inplace

    drifted = ModuleType("drifted")
    for name in OPERATIONS:
        setattr(drifted, name, getattr(torch_ops, name))
    drifted.rms_norm = rms_norm  # type: ignore[attr-defined]
    drifted.silu_and_mul = silu_and_mul  # type: ignore[attr-defined]
    del drifted.store_kv  # type: ignore[attr-defined]
    problems = _mismatches(drifted)
    assert [p.split("(")[0].split(":")[0] for p in problems] == ["store_kv", "rms_norm", "silu_and_mul"]


def test_select_ops_returns_a_protocol_implementation() -> None:
    for native_cpu in (False, True):
        ops = select_ops("torch", native_cpu=native_cpu)
        assert ops in (torch_ops, cpu_ops) and _mismatches(ops) == []
    with pytest.raises(ValueError, match="unknown attention_backend"):
        select_ops("numpy")


def test_the_cpu_path_works_without_triton() -> None:
    """In a fresh interpreter where `import triton` fails (as where it is not installed: torch then leaves it out
    too), the CPU kernels, their ops and the modules that use them import and are selected."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import local_engine.cpu_decode, local_engine.gguf, local_engine.layers.linear\n"
        "import local_engine.kernels.cpu.cpu_ops\n"
        "from local_engine.layers.backend import select_ops\n"
        "assert select_ops('torch', native_cpu=False).__name__ == 'local_engine.layers.torch_ops'\n"
        "assert select_ops('torch', native_cpu=True).__name__.rsplit('.', 1)[-1] in ('cpu_ops', 'torch_ops')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
