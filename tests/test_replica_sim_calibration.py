"""The replica simulator's presets: the bundled engine's, calibrated by benchmarks/calibrate_replica_sim.py and
checked in, loads with values that fit together; the script itself runs end to end on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.replica_sim import CALIBRATION_PATH, SimParams
from fakes.scripts import run_script


def test_the_defaults_are_the_vllm_h100_preset() -> None:
    assert SimParams.vllm_h100(time_scale=0.5) == SimParams(time_scale=0.5)


def test_the_bundled_engine_preset_loads_with_consistent_values() -> None:
    document = orjson.loads(CALIBRATION_PATH.read_bytes())
    params = SimParams.bundled_engine(time_scale=0.25)
    assert params.time_scale == 0.25
    for name, value in document["params"].items():
        assert getattr(params, name) == value, name
        assert value > 0, name
    assert params.block_tokens & (params.block_tokens - 1) == 0  # the engine's block sizes are powers of two
    assert params.num_cache_blocks * params.block_tokens == document["measured"]["kv_cache_tokens"]
    # the fitted line goes through the measured points' neighbourhood: a measured 1,024-token prefill and a decode
    # step of 16 sequences are within a factor of 3 of what the simulator charges for them
    prefill = document["measured"]["prefill_s_by_prompt_tokens"]
    longest = max(prefill, key=int)
    charged = params.decode_step_s + params.decode_s_per_seq + params.prefill_s_per_token * int(longest)
    assert 1 / 3 < charged / prefill[longest] < 3
    decode = document["measured"]["decode_step_s_by_batch"]
    largest = max(decode, key=int)
    assert 1 / 3 < (params.decode_step_s + params.decode_s_per_seq * int(largest)) / decode[largest] < 3
    # a prefill token costs more than nothing and less than a whole decode step of one sequence
    assert params.prefill_s_per_token < params.decode_step_s + params.decode_s_per_seq
    assert 2 <= params.chars_per_token <= 8  # English through a BPE vocabulary
    assert document["validation"]["ttft_p50_ratio"] > 0 and document["validation"]["total_ratio"] > 0


@pytest.mark.timeout(300)
def test_the_calibration_script_runs_on_a_tiny_model(tmp_path: Path) -> None:
    model = tiny_llama_checkpoint(tmp_path / "tiny", max_position_embeddings=2048)
    out = tmp_path / "calibration.json"
    args = ["--model", str(model), "--cache-dir", str(tmp_path / "cache"), "--kv-cache-memory", str(8 << 20)]
    args += ["--prompt-lens", "16,48", "--batch-sizes", "1,2", "--decode-steps", "3", "--decode-context", "32"]
    args += ["--repeats", "1", "--turns", "2", "--max-tokens", "3", "--threads", "1", "--out", str(out)]
    out_text = run_script("benchmarks/calibrate_replica_sim.py", *args, timeout=280)
    assert "simulated / measured: TTFT p50" in out_text
    document = orjson.loads(out.read_bytes())
    params = SimParams.bundled_engine(path=out)
    assert params.block_tokens == 16 and params.max_batch == 64  # the engine's defaults
    assert params.num_cache_blocks * 16 == document["measured"]["kv_cache_tokens"]
    assert all(value > 0 for value in document["params"].values())
    assert document["measured"]["prefill_s_by_prompt_tokens"].keys() == {"16", "48"}
    assert document["validation"]["workload"].startswith("2 sessions x 2 turns")
