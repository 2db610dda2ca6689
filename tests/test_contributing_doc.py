"""docs/contributing.md names files and Python names as patterns to copy: each of them exists, so the page cannot
drift from the code. Names are resolved by reading the modules with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "contributing.md"
PACKAGES = ("gateway", "auth", "backends", "local_engine", "bench", "tests")

_CODE = re.compile(r"`([^`\s]+)`")
_PATH = re.compile(r"[\w.*-]+(/[\w.*-]+)*/?")


def mentions() -> list[str]:
    return sorted(set(_CODE.findall(PAGE.read_text())))


def paths() -> list[str]:
    """The backticked paths: a `/` and a file under one of our folders (a glob like `auth/lua/*.lua` included)."""
    return [m for m in mentions() if "/" in m and m.split("/")[0] in PACKAGES and _PATH.fullmatch(m)]


def dotted_names() -> list[str]:
    """The backticked `package.module.Name` references (a module alone counts too)."""
    return [m for m in mentions() if "/" not in m and m.split(".")[0] in PACKAGES and m.count(".") >= 1]


def module_file(parts: list[str]) -> Path | None:
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if candidate.exists():
            return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def resolves(dotted: str) -> bool:
    """`a.b.c.Name`: module a/b/c.py defines Name at its top level; or `a.b.c` is a module."""
    parts = dotted.split(".")
    if module_file(parts) is not None:
        return True
    path = module_file(parts[:-1])
    return path is not None and parts[-1] in top_level_names(path)


def test_the_page_names_files_and_names() -> None:
    assert len(paths()) >= 8 and len(dotted_names()) >= 15


@pytest.mark.parametrize("path", paths())
def test_each_named_file_exists(path: str) -> None:
    assert list(ROOT.glob(path.rstrip("/"))), f"docs/contributing.md names {path}, which does not exist"


@pytest.mark.parametrize("dotted", dotted_names())
def test_each_named_python_name_exists(dotted: str) -> None:
    assert resolves(dotted), f"docs/contributing.md names {dotted}, which no module defines"


def test_the_checker_finds_a_missing_name() -> None:
    assert resolves("local_engine.kernels.cpu.library.SIGNATURES")
    assert not resolves("local_engine.kernels.cpu.library.SIGNATURE")
    assert not resolves("gateway.no_such_module.Thing")
