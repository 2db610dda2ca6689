"""The master key: from settings (`UNIGATE_MASTER_KEY`), else generated once and kept in `data_dir/master_key`.

The generated file is created with owner-only permissions (0600), in a directory created owner-only (0700), and
the key is printed on the start that created it, never again; later starts (and the CLI) read the file. A start
that finds the file readable by others makes it 0600.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from auth.keys import generate_key

__all__ = ["master_key_path", "read_master_key", "resolve_master_key"]


def master_key_path(data_dir: Path) -> Path:
    return Path(data_dir) / "master_key"


def read_master_key(configured: str | None, data_dir: Path) -> str | None:
    """The configured key (`UNIGATE_MASTER_KEY`), else the one stored in `data_dir`, else None (nothing is
    created)."""
    if configured is not None:
        return configured
    path = master_key_path(data_dir)
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def _announce(key: str, path: Path) -> None:
    print(
        f"unigate: generated a master key (stored in {path}, mode 0600; shown only this once):\n  {key}",
        file=sys.stderr,
        flush=True,
    )


def _wait_for_stored(data_dir: Path, path: Path) -> str:
    # Another worker created the file a moment ago and may not have written it yet.
    for _ in range(50):
        stored = read_master_key(None, data_dir)
        if stored is not None:
            return stored
        time.sleep(0.02)
    raise RuntimeError(f"{path} exists but is empty; delete it to generate a new master key")


def resolve_master_key(
    configured: str | None, data_dir: Path, *, announce: Callable[[str, Path], None] = _announce
) -> str:
    """The master key to use, generating and storing one in `data_dir` on first start when none is configured."""
    existing = read_master_key(configured, data_dir)
    path = master_key_path(data_dir)
    if existing is not None:
        if configured is None and path.stat().st_mode & 0o077:
            path.chmod(0o600)  # written by hand, or by a copy that kept no modes
        return existing
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = generate_key()
    try:
        # O_EXCL: when several workers start at once exactly one creates the file; the others read it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _wait_for_stored(data_dir, path)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(key + "\n")
    announce(key, path)
    return key
