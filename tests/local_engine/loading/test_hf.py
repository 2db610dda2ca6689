"""Hugging Face directories: single and sharded safetensors, config normalisation, tokenizer, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from local_engine.errors import CheckpointError as EngineError
from local_engine.loader import BUNDLED_FILE, load_checkpoint, model_sampling_defaults

from .tiny_checkpoints import save_tiny_tokenizer, tiny_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def save_model_dir(directory: Path, model: Any, max_shard_size: str | None = None, with_tokenizer: bool = True) -> Path:
    if max_shard_size is None:
        model.save_pretrained(str(directory))
    else:
        model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    if with_tokenizer:
        save_tiny_tokenizer(directory)
    return directory


@pytest.mark.parametrize(
    ("family", "tied", "overrides"),
    [
        ("llama", False, {"rope_scaling": LLAMA3_ROPE}),
        ("qwen2", True, {}),
        ("qwen3", False, {}),
    ],
)
def test_sharded_directory_round_trip(tmp_path: Path, family: str, tied: bool, overrides: dict[str, Any]) -> None:
    model = tiny_model(family, tie_word_embeddings=tied, **overrides)
    save_model_dir(tmp_path, model, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    checkpoint = load_checkpoint(tmp_path)

    expected = {name: t for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}
    assert set(checkpoint.state_dict) == set(expected)
    for name, tensor in checkpoint.state_dict.items():
        assert torch.equal(tensor, expected[name]), name
    config = checkpoint.hf_config
    assert config["model_type"] == family
    assert config["tie_word_embeddings"] is tied
    assert config["head_dim"] == (32 if family == "qwen3" else 16)
    assert config["num_key_value_heads"] == 2
    # transformers 5 writes rope settings under rope_parameters; the engine reads them at top level.
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    if family == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert config["rope_scaling"]["factor"] == 8.0
        assert config["rope_scaling"]["original_max_position_embeddings"] == 64
    else:
        assert config["rope_scaling"] is None
    assert checkpoint.from_cache is False
    assert checkpoint.source == str(tmp_path)


def test_single_file_directory_in_bfloat16_with_generation_eos(tmp_path: Path) -> None:
    model = tiny_model("llama")
    save_model_dir(tmp_path, model)
    # Llama 3 style: the generation config ends on more ids than config.json's eos_token_id.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    checkpoint = load_checkpoint(tmp_path, dtype=torch.bfloat16)

    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    for name, tensor in checkpoint.state_dict.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, model.state_dict()[name].to(torch.bfloat16)), name
    assert checkpoint.tokenizer.eos_token_ids == frozenset({0, 2})
    assert checkpoint.tokenizer.bos_token_id == 1
    assert checkpoint.num_weight_bytes == sum(t.numel() * 2 for t in checkpoint.state_dict.values())


def test_the_generation_configs_sampling_fields_become_the_models_sampling_defaults(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_model_dir(tmp_path, tiny_model("llama"))
    generation = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({**generation, "max_new_tokens": 64, "eos_token_id": 2})
    )
    assert load_checkpoint(tmp_path).sampling_defaults == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    # The model's file, not the operator's: a value its field cannot take is left out, with a warning.
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.8, "top_k": "x"}))
    assert model_sampling_defaults(tmp_path) == {"top_p": 0.8}
    assert "temperature must be a finite number >= 0; left out of the sampling defaults" in caplog.text
    (tmp_path / "generation_config.json").write_text("[1]")
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").unlink()
    assert model_sampling_defaults(tmp_path) == {}


def test_the_bundled_model_has_its_own_sampling_defaults_and_another_gguf_none(tmp_path: Path) -> None:
    bundled = tmp_path / BUNDLED_FILE
    bundled.write_bytes(b"GGUF")
    assert model_sampling_defaults(bundled) == {"temperature": 0.2}
    other = tmp_path / "other.Q4_1.gguf"
    other.write_bytes(b"GGUF")
    assert model_sampling_defaults(other) == {}


def test_legacy_config_keys_are_kept(tmp_path: Path) -> None:
    """Checkpoints written before transformers 5 carry rope_theta / rope_scaling ("type") at top level."""
    save_model_dir(tmp_path, tiny_model("llama"))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    del config["head_dim"]
    config.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = load_checkpoint(tmp_path).hf_config

    assert loaded["rope_theta"] == 500000.0
    assert loaded["rope_scaling"] == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert loaded["head_dim"] == 16


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"has no config\.json") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "checkpoint_not_found"


def test_missing_weights(tmp_path: Path) -> None:
    save_model_dir(tmp_path, tiny_model("llama"))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(EngineError, match=r"no \*.safetensors weights") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "checkpoint_not_found"


def test_missing_shard(tmp_path: Path) -> None:
    save_model_dir(tmp_path, tiny_model("llama"), max_shard_size="100KB")
    sorted(tmp_path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(EngineError, match="is missing") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "checkpoint_corrupt"


def test_truncated_safetensors(tmp_path: Path) -> None:
    save_model_dir(tmp_path, tiny_model("llama"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(EngineError, match="truncated") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "checkpoint_corrupt"


def test_invalid_config_json(tmp_path: Path) -> None:
    save_model_dir(tmp_path, tiny_model("llama"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngineError, match="not valid JSON") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "checkpoint_corrupt"


def test_unsupported_model_type(tmp_path: Path) -> None:
    save_model_dir(tmp_path, tiny_model("llama"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(EngineError, match="'gpt_neox' is not supported") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "checkpoint_unsupported"


def test_untied_config_without_lm_head(tmp_path: Path) -> None:
    save_model_dir(tmp_path, tiny_model("llama", tie_word_embeddings=True))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(EngineError, match=r"no lm_head\.weight") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "checkpoint_corrupt"


def test_missing_tokenizer(tmp_path: Path) -> None:
    save_model_dir(tmp_path, tiny_model("llama"), with_tokenizer=False)
    with pytest.raises(EngineError, match="No tokenizer") as caught:
        load_checkpoint(tmp_path)
    assert caught.value.code == "tokenizer_not_found"
