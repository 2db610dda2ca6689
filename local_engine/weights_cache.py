"""A disk cache of converted checkpoints, so a GGUF is dequantized once rather than at every start.

    <cache_dir>/<key>/config.json
                     /model.safetensors           float32, HF parameter names
                     /gguf_blocks.safetensors     the file's Q4_1 / Q8_0 tensors as stored (uint8, HF names;
                                                  the metadata names each one's type): the decode panels' source
                     /tokenizer.json, tokenizer_config.json, chat_template.jinja
                     /unigate-cache.json          written last: what the entry was converted from

`key` hashes the source's resolved path, size and mtime plus the conversion's format version, so an edited or
replaced file, or a loader that converts differently, gets a fresh entry. An entry is written into a temporary
directory beside it and renamed into place: a reader sees a complete entry or none, also when two processes
convert the same file at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from local_engine.tokenizer import Tokenizer

__all__ = ["CACHE_FORMAT_VERSION", "MARKER_FILE", "WeightsCache", "cache_key"]

logger = logging.getLogger("unigate.engine")

# Bump when the conversion's output changes (names, permutation, config keys, tokenizer repair): old entries are
# then ignored instead of served.
CACHE_FORMAT_VERSION = 2  # 2: with gguf_blocks.safetensors
MARKER_FILE = "unigate-cache.json"
WEIGHTS_FILE = "model.safetensors"
BLOCKS_FILE = "gguf_blocks.safetensors"


def cache_key(source: Path) -> str:
    """A stable name for `source` as it is now: resolved path, size, mtime and the format version."""
    resolved = source.resolve()
    stat = resolved.stat()
    identity = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0v{CACHE_FORMAT_VERSION}"
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


class WeightsCache:
    """Converted checkpoints under one directory, one entry per source file version."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir

    def entry_dir(self, source: Path) -> Path:
        return self.cache_dir / cache_key(source)

    def lookup(self, source: Path) -> Path | None:
        """The complete entry for `source` as it is now, or None."""
        entry = self.entry_dir(source)
        return entry if (entry / MARKER_FILE).is_file() else None

    def store(
        self,
        source: Path,
        hf_config: dict[str, Any],
        state_dict: dict[str, torch.Tensor],
        tokenizer: Tokenizer,
        blocks: dict[str, tuple[str, np.ndarray]] | None = None,
    ) -> Path:
        """Write an entry for `source` atomically and return its directory."""
        from safetensors.numpy import save_file as save_arrays
        from safetensors.torch import save_file

        entry = self.entry_dir(source)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=self.cache_dir))
        try:
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
            save_file({name: t.contiguous() for name, t in state_dict.items()}, staging / WEIGHTS_FILE)
            if blocks:
                arrays = {name: np.ascontiguousarray(raw) for name, (_, raw) in blocks.items()}
                save_arrays(arrays, staging / BLOCKS_FILE, metadata={name: kind for name, (kind, _) in blocks.items()})
            tokenizer.save_pretrained(staging)
            marker = {"source": str(source.resolve()), "format_version": CACHE_FORMAT_VERSION}
            (staging / MARKER_FILE).write_text(json.dumps(marker))
            _fsync_tree(staging)
            staging.chmod(0o755)  # mkdtemp makes it private; the entry should read like any other directory
            if entry.exists() and self.lookup(source) is None:
                # Not ours and not complete (no marker): nothing can be reading it as an entry.
                shutil.rmtree(entry, ignore_errors=True)
            os.rename(staging, entry)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if self.lookup(source) is None:
                raise
            # Another process finished the same entry first; theirs is as good as ours.
            return entry
        self._remove_stale_entries(source, keep=entry)
        return entry

    @staticmethod
    def load_blocks(entry: Path) -> dict[str, tuple[str, np.ndarray]]:
        """The entry's GGUF blocks by HF name: (type, raw uint8 [rows, bytes]); {} when the file had none."""
        from safetensors import safe_open

        path = entry / BLOCKS_FILE
        if not path.is_file():
            return {}
        with safe_open(str(path), framework="np") as file:
            kinds = file.metadata() or {}
            return {name: (kinds[name], file.get_tensor(name)) for name in file.keys()}

    def discard(self, entry: Path) -> None:
        """Remove an entry that failed to load, so the next start converts again."""
        logger.warning("removing unreadable weights cache entry %s", entry)
        shutil.rmtree(entry, ignore_errors=True)

    def _remove_stale_entries(self, source: Path, keep: Path) -> None:
        """Entries of earlier versions of the same source file only take disk space."""
        resolved = str(source.resolve())
        for marker in self.cache_dir.glob(f"*/{MARKER_FILE}"):
            if marker.parent == keep:
                continue
            try:
                converted_from = json.loads(marker.read_text()).get("source")
            except (OSError, ValueError):
                continue
            if converted_from == resolved:
                logger.info("removing stale weights cache entry %s", marker.parent)
                shutil.rmtree(marker.parent, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    """Flush the entry's files before the rename publishes it, so a crash cannot leave a named but empty entry."""
    for path in directory.iterdir():
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())
