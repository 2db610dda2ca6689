"""The engine on the Triton kernels (Triton's interpreter on CPU) produces the torch backend's greedy tokens, also
with speculative decoding verifying proposals on them.

Runs in a subprocess so TRITON_INTERPRET=1 is set before triton is imported, whatever else the session imported.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys, torch
sys.path.insert(0, {tests_dir!r})
from conftest import tiny_model
from local_engine.sampling_params import SamplingParams
from local_engine.cuda_graphs import DecodeGraphs

params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
generator = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (5, 20, 17)]
for name in ("llama3", "qwen2", "qwen3"):
    model = tiny_model(name)
    expected = [c[0].token_ids for c in model.engine(attention_backend="torch").generate(prompts, params)]
    engine = model.engine(attention_backend="triton", max_num_batched_tokens=16)  # chunked prefill + decode mix
    assert engine.runner.attention_backend == "triton"
    got = [c[0].token_ids for c in engine.generate(prompts, params)]
    assert got == expected, (name, got, expected)
    # Decode steps as a CUDA graph would run them (static buffers, padded to 4 rows), eagerly in the interpreter.
    runner = engine.runner
    runner.graphs = DecodeGraphs(
        runner.model, sizes=[4], max_blocks_per_seq=-(-runner.max_model_len // 16), device=runner.device, capture=False
    )
    got = [c[0].token_ids for c in engine.generate(prompts, params)]
    assert got == expected, (name, "padded", got, expected)
# Speculative verification (1 + k decode rows per sequence, context lengths growing by one) on the Triton kernels.
model = tiny_model("llama3")
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
repeats = [[7, 8, 9, 10] * 6, [11, 12, 13] * 7, prompts[1]]
expected = [c[0].token_ids for c in model.engine(attention_backend="torch").generate(repeats, params)]
engine = model.engine(attention_backend="triton", speculative={{"method": "ngram", "ngram_min": 1, "max_num_seqs": 64}})
got = [c[0].token_ids for c in engine.generate(repeats, params)]
assert got == expected, ("speculative", got, expected)
assert engine.stats()["spec_proposed_tokens_total"] > 0
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_backend_matches_torch_backend() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join((str(root), str(root / "tests")))}
    script = SCRIPT.format(tests_dir=str(Path(__file__).parent))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=170
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
