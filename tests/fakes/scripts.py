"""A repository script (a benchmark) run to its end in a subprocess, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_script"]

ROOT = Path(__file__).resolve().parents[2]


def run_script(*args: str, timeout: float = 540) -> str:
    """`python <args>`'s standard output; it must exit 0 (else its output's tails are the failure message). The
    timeout bounds a hang, it is not a timing assertion."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout
