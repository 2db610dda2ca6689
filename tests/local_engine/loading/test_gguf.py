"""GGUF loading: names, Q/K un-permutation, dequantization and config, against transformers and original weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from local_engine.errors import CheckpointError as EngineError
from local_engine.loader import Checkpoint, load_checkpoint

from .tiny_checkpoints import tiny_model


def test_bundled_state_dict_matches_transformers_gguf_load(
    bundled_first_load: Checkpoint, transformers_gguf_state_dict: dict[str, torch.Tensor]
) -> None:
    ours = bundled_first_load.state_dict
    reference = transformers_gguf_state_dict
    # SmolLM2 ties lm_head to the embeddings: transformers lists the shared tensor under both names, we once.
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        # Both sides dequantize with the gguf package, so the values agree bit for bit.
        assert torch.equal(tensor, reference[name]), name


def test_bundled_hf_config(bundled_first_load: Checkpoint) -> None:
    config = bundled_first_load.hf_config
    expected = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "rope_scaling": None,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {key: config.get(key) for key in expected} == expected
    assert bundled_first_load.tokenizer.eos_token_ids == frozenset({2})
    assert bundled_first_load.tokenizer.bos_token_id == 1


def test_bundled_load_can_use_bfloat16(
    bundled_path: Path, session_cache_dir: Path, bundled_first_load: Checkpoint
) -> None:
    checkpoint = load_checkpoint(bundled_path, cache_dir=session_cache_dir, dtype=torch.bfloat16)
    assert checkpoint.from_cache
    assert bundled_first_load.blocks and checkpoint.blocks == {}  # bfloat16 never reads the float32 block panels
    for name, tensor in checkpoint.state_dict.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, bundled_first_load.state_dict[name].to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_reads_back_the_original_weights(family: str, gguf_writer: Callable[..., Path]) -> None:
    model = tiny_model(family)
    path = gguf_writer(model, family)
    checkpoint = load_checkpoint(path)
    original = model.state_dict()
    assert set(checkpoint.state_dict) == set(original)
    for name, tensor in checkpoint.state_dict.items():
        # Exact: F32 tensors, and the llama Q/K rows permuted by the writer must come back in HF order.
        assert torch.equal(tensor, original[name]), name
    config = checkpoint.hf_config
    assert config["model_type"] == family
    assert config["head_dim"] == (32 if family == "qwen3" else 16)
    assert config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False
    assert checkpoint.from_cache is False


def test_tiny_gguf_with_tied_embeddings_and_q8_0(gguf_writer: Callable[..., Path]) -> None:
    model = tiny_model("llama", tie_word_embeddings=True)
    checkpoint = load_checkpoint(gguf_writer(model, "llama", quantize_q8=True))
    assert checkpoint.hf_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in checkpoint.state_dict
    original = model.state_dict()
    for name, tensor in checkpoint.state_dict.items():
        # Q8_0 keeps 8 bits per weight with a per-32 scale: close, not equal.
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0.02, msg=name)


def test_the_checkpoint_keeps_the_files_blocks_as_stored(gguf_writer: Callable[..., Path]) -> None:
    """`Checkpoint.blocks`: each Q8_0 tensor's raw blocks, rows in HF order (Q/K un-permuted like the weights), that
    dequantize to exactly the checkpoint's float32 weight (what the decode panels rely on)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    checkpoint = load_checkpoint(gguf_writer(tiny_model("llama"), "llama", quantize_q8=True))
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= set(checkpoint.blocks)
    for name, (kind, raw) in checkpoint.blocks.items():
        assert kind == "Q8_0" and raw.dtype == np.uint8
        weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32))
        assert torch.equal(weights, checkpoint.state_dict[name]), name
    assert load_checkpoint(gguf_writer(tiny_model("llama"), "llama")).blocks == {}  # float32 tensors: no blocks


def test_the_weights_cache_keeps_the_blocks(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    path = gguf_writer(tiny_model("llama"), "llama", quantize_q8=True)
    first = load_checkpoint(path, cache_dir=tmp_path / "cache")
    again = load_checkpoint(path, cache_dir=tmp_path / "cache")
    assert not first.from_cache and again.from_cache and first.blocks
    assert {name: kind for name, (kind, _) in again.blocks.items()} == {n: k for n, (k, _) in first.blocks.items()}
    assert all(np.array_equal(again.blocks[name][1], raw) for name, (_, raw) in first.blocks.items())
    # bfloat16 drops them, converting or from the cache; the cache still keeps them for a later float32 load
    assert load_checkpoint(path, dtype=torch.bfloat16).blocks == {}
    assert load_checkpoint(path, cache_dir=tmp_path / "cache", dtype=torch.bfloat16).blocks == {}
    assert load_checkpoint(path, cache_dir=tmp_path / "cache").blocks.keys() == first.blocks.keys()


def test_mistral_named_llama_file_and_linear_rope_scaling(gguf_writer: Callable[..., Path]) -> None:
    model = tiny_model("llama")
    path = gguf_writer(
        model,
        "llama",
        name="Mistral 7B Tiny",
        **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
    )
    checkpoint = load_checkpoint(path)
    assert checkpoint.hf_config["model_type"] == "mistral"
    assert checkpoint.hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    original = model.state_dict()
    for name, tensor in checkpoint.state_dict.items():
        assert torch.equal(tensor, original[name]), name  # Mistral files are permuted like llama ones


def test_end_of_turn_token_joins_eos(gguf_writer: Callable[..., Path]) -> None:
    path = gguf_writer(tiny_model("llama"), "llama", **{"tokenizer.ggml.eot_token_id": 0})
    checkpoint = load_checkpoint(path)
    assert checkpoint.hf_config["eos_token_id"] == [2, 0]
    assert checkpoint.tokenizer.eos_token_ids == frozenset({0, 2})


def test_llama3_rope_freqs_is_refused_clearly(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "rope.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("rope_freqs.weight", np.ones(2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EngineError, match="rope_freqs") as caught:
        load_checkpoint(path)
    assert caught.value.code == "checkpoint_unsupported"


def test_unsupported_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EngineError, match="architecture 'gpt2' is not supported") as caught:
        load_checkpoint(path)
    assert caught.value.code == "checkpoint_unsupported"


def test_truncated_gguf_is_reported_as_corrupt(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    whole = gguf_writer(tiny_model("llama"), "llama").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(EngineError, match="truncated") as caught:
        load_checkpoint(truncated)
    assert caught.value.code == "checkpoint_corrupt"


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model")
    with pytest.raises(EngineError, match="not a GGUF file") as caught:
        load_checkpoint(path)
    assert caught.value.code == "checkpoint_corrupt"


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="does not exist") as caught:
        load_checkpoint(tmp_path / "nowhere.gguf")
    assert caught.value.code == "checkpoint_not_found"
