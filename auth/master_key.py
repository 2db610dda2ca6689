"""The master key: from settings (`UNIGATE_MASTER_KEY`), else generated once and kept in `data_dir/master_key`.

The generated file is created with owner-only permissions (0600) and the key is printed on the start that
created it, never again; later starts (and the CLI) read the file.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from auth.keys import generate_key
from gateway.settings import Settings

__all__ = ["master_key_path", "read_master_key", "resolve_master_key"]


def master_key_path(data_dir: Path) -> Path:
    return Path(data_dir) / "master_key"


def read_master_key(settings: Settings) -> str | None:
    """The configured key, else the stored one, else None (nothing is created)."""
    if settings.master_key is not None:
        return settings.master_key.get_secret_value()
    path = master_key_path(settings.data_dir)
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


def _wait_for_stored(settings: Settings, path: Path) -> str:
    # Another worker created the file a moment ago and may not have written it yet.
    for _ in range(50):
        stored = read_master_key(settings)
        if stored is not None:
            return stored
        time.sleep(0.02)
    raise RuntimeError(f"{path} exists but is empty; delete it to generate a new master key")


def resolve_master_key(settings: Settings, *, announce: Callable[[str, Path], None] = _announce) -> str:
    """The master key to use, generating and storing one on first start when none is configured."""
    existing = read_master_key(settings)
    if existing is not None:
        return existing
    path = master_key_path(settings.data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = generate_key()
    try:
        # O_EXCL: when several workers start at once exactly one creates the file; the others read it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _wait_for_stored(settings, path)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(key + "\n")
    announce(key, path)
    return key
