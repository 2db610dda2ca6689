"""A disk cache of converted checkpoints, so a GGUF is dequantized, and a checkpoint quantized, once rather than at
every start.

    <cache_dir>/<key>/config.json
                     /model.safetensors           float32, HF parameter names; a quantized variant holds each
                                                  projection as `X.qweight` / `X.scales` / `X.mins` instead
                                                  (`local_engine/quantization.py`)
                     /gguf_blocks.safetensors     the file's Q4_1 / Q8_0 tensors as stored (uint8, HF names;
                                                  the metadata names each one's type): the decode panels' source
                     /tokenizer.json, tokenizer_config.json, chat_template.jinja
                     /unigate-cache.json          written last: what the entry was converted from, and the variant

`key` hashes the source's resolved path, size and mtime (a directory: those of its config and weight files), the
conversion's format version and the variant (`""` for the plain conversion of a GGUF, `int8` or `int4-g32` for a
quantized checkpoint, GGUF or HF directory), so an edited or replaced file, a loader that converts differently or
another quantization gets a fresh entry. An entry is written into a temporary directory beside it and renamed into
place: a reader sees a complete entry or none, also when two processes convert the same file at once.
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
CACHE_FORMAT_VERSION = 3  # 2: with gguf_blocks.safetensors; 3: int4 entries keep the output head in int8
MARKER_FILE = "unigate-cache.json"
WEIGHTS_FILE = "model.safetensors"
BLOCKS_FILE = "gguf_blocks.safetensors"


def cache_key(source: Path, variant: str = "") -> str:
    """A stable name for `source` as it is now (and `variant`): resolved path, size, mtime, the format version."""
    resolved = source.resolve()
    identity = f"{resolved}\0{_stat_identity(resolved)}\0v{CACHE_FORMAT_VERSION}"
    if variant:
        identity += f"\0{variant}"
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def _stat_identity(path: Path) -> str:
    """Size and mtime of a file; of a directory, those of its config and weight files (what a load reads)."""
    if not path.is_dir():
        stat = path.stat()
        return f"{stat.st_size}\0{stat.st_mtime_ns}"
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
    return "\0".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


class WeightsCache:
    """Converted checkpoints under one directory, one entry per source file version."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir

    def entry_dir(self, source: Path, variant: str = "") -> Path:
        return self.cache_dir / cache_key(source, variant)

    def lookup(self, source: Path, variant: str = "") -> Path | None:
        """The complete entry for `source` as it is now (and `variant`), or None."""
        entry = self.entry_dir(source, variant)
        return entry if (entry / MARKER_FILE).is_file() else None

    def store(
        self,
        source: Path,
        hf_config: dict[str, Any],
        state_dict: dict[str, torch.Tensor],
        tokenizer: Tokenizer,
        blocks: dict[str, tuple[str, np.ndarray]] | None = None,
        variant: str = "",
    ) -> Path:
        """Write an entry for `source` (and `variant`) atomically and return its directory."""
        from safetensors.numpy import save_file as save_arrays
        from safetensors.torch import save_file

        entry = self.entry_dir(source, variant)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=self.cache_dir))
        try:
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
            save_file({name: t.contiguous() for name, t in state_dict.items()}, staging / WEIGHTS_FILE)
            if blocks:
                arrays = {name: np.ascontiguousarray(raw) for name, (_, raw) in blocks.items()}
                save_arrays(arrays, staging / BLOCKS_FILE, metadata={name: kind for name, (kind, _) in blocks.items()})
            tokenizer.save_pretrained(staging)
            marker = {"source": str(source.resolve()), "format_version": CACHE_FORMAT_VERSION, "variant": variant}
            (staging / MARKER_FILE).write_text(json.dumps(marker))
            _fsync_tree(staging)
            staging.chmod(0o755)  # mkdtemp makes it private; the entry should read like any other directory
            if entry.exists() and self.lookup(source, variant) is None:
                # Not ours and not complete (no marker): nothing can be reading it as an entry.
                shutil.rmtree(entry, ignore_errors=True)
            os.rename(staging, entry)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if self.lookup(source, variant) is None:
                raise
            # Another process finished the same entry first; theirs is as good as ours.
            return entry
        self._remove_stale_entries(source, variant, keep=entry)
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

    def _remove_stale_entries(self, source: Path, variant: str, keep: Path) -> None:
        """Entries of earlier versions of the same source file (and variant) only take disk space."""
        resolved = str(source.resolve())
        for marker in self.cache_dir.glob(f"*/{MARKER_FILE}"):
            if marker.parent == keep:
                continue
            try:
                written = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue
            if written.get("source") == resolved and written.get("variant", "") == variant:
                logger.info("removing stale weights cache entry %s", marker.parent)
                shutil.rmtree(marker.parent, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    """Flush the entry's files before the rename publishes it, so a crash cannot leave a named but empty entry."""
    for path in directory.iterdir():
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())
