"""mypy checks the Triton kernel modules with two checks off (pyproject.toml: a `@triton.jit` function's parameters
stay unannotated, since Triton reads annotations itself). Every other function there must still be fully annotated,
so the relaxation covers the kernels and nothing else."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def relaxed_modules() -> list[str]:
    """The modules of the one mypy override that turns checks off (rather than ignoring a whole package)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    [override] = [o for o in config["tool"]["mypy"]["overrides"] if "disable_error_code" in o]
    assert sorted(override["disable_error_code"]) == ["no-untyped-def", "untyped-decorator"]
    return list(override["module"])


def is_kernel(function: ast.FunctionDef) -> bool:
    return any(ast.unparse(decorator) == "triton.jit" for decorator in function.decorator_list)


def is_annotated(function: ast.FunctionDef) -> bool:
    args = function.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]
    unannotated = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
    return function.returns is not None and not unannotated


def test_the_relaxed_modules_are_the_modules_that_define_kernels() -> None:
    defining = set()
    for path in (ROOT / "local_engine").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.FunctionDef) and is_kernel(node) for node in ast.walk(tree)):
            defining.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert sorted(defining) == sorted(relaxed_modules())


def test_every_function_but_the_kernels_is_annotated() -> None:
    unannotated = []
    for module in relaxed_modules():
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and not is_kernel(node) and not is_annotated(node):
                unannotated.append(f"{module}.{node.name}")
    assert unannotated == []
