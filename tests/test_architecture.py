"""Dependencies point one way (shared/ARCHITECTURE.md): `gateway/` composes `auth/`, `backends/`, `local_engine/`
and `bench/`; those never import `gateway/` (except its ground floor) nor each other, except the local backend,
which adapts the engine. The import graph is read with `ast` (every `import` and `from ... import`, including
imports inside functions and under TYPE_CHECKING), so an arrow that points up or sideways fails here. The engine
host's room has rules of its own: none of its modules but `http.py` (`unigate engine serve`) reaches a web app,
it meets its client only in the protocol module, and that module needs nothing of the gateway but the error tree.
And no class in `gateway/` grows past ~200 lines (a second job: give it an object of its own).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "auth", "backends", "local_engine", "bench")

# The ground floor (no web app, no I/O), which every package may import: the error tree, and the SSE decoder (the
# wire format that backends read from upstreams and bench reads from the gateway).
GROUND_FLOOR = frozenset({"gateway.errors", "backends.sse"})

# package -> the packages it may import (besides itself and the ground floor)
ALLOWED = {
    "gateway": frozenset({"auth", "backends", "local_engine", "bench"}),  # the composition root
    "auth": frozenset(),
    "backends": frozenset({"local_engine"}),  # backends/local.py adapts the engine
    "local_engine": frozenset(),
    "bench": frozenset(),  # bench and doctor talk HTTP
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def wrong_arrows(root: Path = ROOT) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for name in imports_of(path):
                target = name.split(".")[0]
                if target not in PACKAGES or target == package or name in GROUND_FLOOR:
                    continue
                if target not in ALLOWED[package]:
                    found.add((path.relative_to(root).as_posix(), name))
    return found


def test_no_new_arrow_points_up_or_sideways() -> None:
    new = wrong_arrows()
    assert not new, "imports against the dependency direction (see shared/ARCHITECTURE.md):\n" + "\n".join(
        f"  {module} imports {name}" for module, name in sorted(new)
    )


def test_the_walk_finds_upward_and_sideways_arrows(tmp_path: Path) -> None:
    """The checker itself: a lazy import inside a function and one under TYPE_CHECKING are arrows too."""
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "x.py").write_text("def f():\n    from gateway.settings import Settings\n")
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import auth.store\nfrom gateway.errors import E\n"
    )
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "z.py").write_text("from backends.sse import SSEDecoder\nfrom bench import w\n")
    assert wrong_arrows(tmp_path) == {("auth/x.py", "gateway.settings"), ("backends/y.py", "auth.store")}


def test_the_ground_floor_imports_nothing_of_ours() -> None:
    for module in GROUND_FLOOR:
        path = ROOT / (module.replace(".", "/") + ".py")
        ours = {name for name in imports_of(path) if name.split(".")[0] in PACKAGES and name not in GROUND_FLOOR}
        assert not ours, f"{module} is the ground floor but imports {sorted(ours)}"


def test_the_engine_core_never_imports_torch() -> None:
    """sequence, block manager and scheduler are pure Python (tested fast and exhaustively on their own)."""
    for name in ("sequence", "block_manager", "scheduler", "errors"):
        imported = imports_of(ROOT / "local_engine" / f"{name}.py")
        assert not {i for i in imported if i.split(".")[0] in ("torch", "triton", "numpy")}, name


# -- the engine host (gateway/engine_host/, shared/ARCHITECTURE.md) ---------------------------------------------------

WEB_APP = ("gateway.app", "gateway.routes", "gateway.middleware", "starlette", "uvicorn")


def import_closure(module: str, root: Path = ROOT) -> set[str]:
    """Every module `module` may import, directly or through others of ours (lazy imports included), with the
    packages each of them sits in."""
    found: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        path = root / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = root / name.replace(".", "/") / "__init__.py"
        if name.split(".")[0] not in PACKAGES or not path.exists():
            continue
        for imported in imports_of(path):
            parts = imported.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found


def test_the_engine_process_imports_no_web_app() -> None:
    """The engine process (`python -m gateway.engine_host.main`) serves the engine protocol, not the gateway app:
    nothing it may import reaches the app, its routes or middleware, or a web framework."""
    closure = import_closure("gateway.engine_host.main")
    assert "backends.local" in closure  # (the walk does reach what the process serves)
    web = sorted(name for name in closure if name.startswith(WEB_APP))
    assert not web, f"the engine process may import {web}"


def test_the_engine_host_and_its_client_share_only_the_protocol() -> None:
    """The workers' client and the host meet in `backends.engine_protocol`, which needs only the ground floor and
    the backend protocol's types."""
    for path in sorted((ROOT / "gateway" / "engine_host").glob("*.py")):
        assert "backends.engine_client" not in imports_of(path), path.name
    ours = {name for name in imports_of(ROOT / "backends" / "engine_protocol.py") if name.split(".")[0] in PACKAGES}
    assert ours <= GROUND_FLOOR | {"backends.base"}, ours


def test_the_closure_walk_follows_lazy_imports(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "a.py").write_text("def f():\n    from gateway.b import x\n")
    (tmp_path / "gateway" / "b.py").write_text("import starlette.routing\n")
    assert {"gateway.b", "starlette.routing", "starlette"} <= import_closure("gateway.a", tmp_path)


# Every module of the engine host but `http.py`, which is `unigate engine serve`: the gateway app on purpose.
ENGINE_HOST_HTTP = "gateway.engine_host.http"


def engine_host_modules() -> list[str]:
    names = [f"gateway.engine_host.{path.stem}" for path in sorted((ROOT / "gateway" / "engine_host").glob("*.py"))]
    return [name.removesuffix(".__init__") for name in names if name != ENGINE_HOST_HTTP]


def test_no_engine_host_module_reaches_the_web_app() -> None:
    """The parent's side (`process`), the host and the package itself stay out of the app too, not only `main`."""
    assert "gateway.engine_host.process" in engine_host_modules()
    for module in engine_host_modules():
        web = sorted(name for name in import_closure(module) if name.startswith(WEB_APP))
        assert not web, f"{module} may import {web}"


def test_the_engine_protocol_needs_nothing_of_the_gateway_but_its_error_tree() -> None:
    """Both ends import the protocol: it may not pull in settings, the app or any stage of the gateway."""
    ours = {name for name in import_closure("backends.engine_protocol") if name.startswith("gateway")}
    assert ours <= {"gateway", "gateway.errors"}, sorted(ours)


# -- sizes (shared/STYLE.md): a class in gateway/ over ~200 lines holds a second job ----------------------------------

MAX_CLASS_LINES = 220


def class_sizes(package: str, root: Path = ROOT) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                sizes[f"{path.relative_to(root).as_posix()}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def test_no_class_in_the_gateway_is_over_about_200_lines() -> None:
    large = {name: size for name, size in class_sizes("gateway").items() if size > MAX_CLASS_LINES}
    assert not large, f"split these by job (a stage, a helper object of their own): {large}"


def test_class_sizes_count_the_whole_body(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "a.py").write_text("class A:\n    x = 1\n\n    def f(self):\n        return 2\n")
    assert class_sizes("gateway", tmp_path) == {"gateway/a.py:A": 5}
