"""How launchers run on CPU: the interpreter chosen per call, in either import mode, with nothing left patched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from local_engine.kernels import is_triton_available, rms_norm

ROOT = Path(__file__).resolve().parents[3]


def test_triton_helpers_are_restored_after_an_interpreted_launch():
    rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6)
    assert isinstance(tl.zeros, JITFunction) and isinstance(tl.standard.sum, JITFunction)
    assert isinstance(tl.core.tensor.__dict__["sum"], JITFunction)


def test_is_triton_available(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert is_triton_available() == torch.cuda.is_available()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert is_triton_available()


@pytest.mark.parametrize(
    "preamble",
    [
        # TRITON_INTERPRET=1 before any import: every @triton.jit, triton's own helpers too, is interpreted.
        "import os; os.environ['TRITON_INTERPRET'] = '1'",
        # Set after triton was imported (e.g. by a test's monkeypatch.setenv): our kernels are decorated
        # interpreted, triton's helpers compiled-mode.
        "import os, triton.language; os.environ['TRITON_INTERPRET'] = '1'",
    ],
    ids=["before-triton-import", "after-triton-import"],
)
def test_kernels_run_whatever_the_interpreter_setting_at_import(preamble: str):
    script = preamble + textwrap.dedent(
        """
        import torch
        from local_engine.kernels import paged_decode_attention, reference, rms_norm

        torch.manual_seed(0)
        x, w = torch.randn(3, 64), torch.randn(64)
        torch.testing.assert_close(rms_norm(x, w, 1e-6)[0], reference.rms_norm(x, w, 1e-6)[0])
        k_cache, v_cache = torch.randn(4, 16, 1, 64), torch.randn(4, 16, 1, 64)
        q = torch.randn(2, 4, 64)
        args = (q, k_cache, v_cache, torch.tensor([[2, 0], [3, 1]], dtype=torch.int32),
                torch.tensor([20, 3], dtype=torch.int32), 0.125)
        out = paged_decode_attention(*args, num_splits=2)
        torch.testing.assert_close(out, reference.paged_decode_attention(*args), atol=2e-5, rtol=2e-5)
        print("ok")
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
