"""Tiny checkpoints written on the spot for the loader tests.

Tiny GGUF files are written with the `gguf` package the way llama.cpp's converter writes them (Q/K rows permuted for
llama), from a randomly initialised transformers model, so a test can compare what we read back with the original
weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# The 17 special tokens of SmolLM2's original tokenizer.json (ids 0..16).
SMOLLM2_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows of llama models (written from its description)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: 3 control tokens, the 256 byte symbols, and merges for runs of spaces."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ Ġ", "ĠĠ Ġ", "h i", "Ġ hi"]
    merged = ["ĠĠ", "ĠĠĠ", "hi", "Ġhi"]
    tokens = specials + symbols + merged
    token_types = [3] * len(specials) + [1] * (len(symbols) + len(merged))
    return tokens, token_types, merges


_GGUF_TENSOR_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_tensor_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{_GGUF_TENSOR_NAMES[module]}.{suffix}"
    return f"{_GGUF_TENSOR_NAMES[stem]}.{suffix}"


def write_gguf(path: Path, model: Any, arch: str, quantize_q8: bool = False, **metadata: Any) -> Path:
    """Write `model` (a transformers causal LM) as llama.cpp would: metadata, vocabulary and renamed tensors."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(metadata.pop("name", "tiny"))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    tokens, token_types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(metadata.pop("pre", "smollm"))
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    tied = config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        weights = tensor.detach().float().numpy().copy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            is_query = ".q_proj." in hf_name
            weights = llama_cpp_permute(weights, config.num_attention_heads if is_query else config.num_key_value_heads)
        if quantize_q8 and weights.ndim == 2:
            packed = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_tensor_name(hf_name), packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_tensor_name(hf_name), weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_model(family: str, tie_word_embeddings: bool = False, **overrides: Any) -> Any:
    """A randomly initialised tiny causal LM of `family` ("llama", "qwen2", "qwen3") with GQA."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[family]
    options: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 263,  # len(tiny_vocab()[0])
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": tie_word_embeddings,
    }
    if family == "qwen3":
        options["head_dim"] = 32  # differs from hidden / heads, as in real Qwen3
    options.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**options))
    with torch.no_grad():
        # Norm weights start at exactly 1; make them distinct so a wrong name mapping cannot pass.
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def save_tiny_tokenizer(directory: Path, chat_template: str | None = TINY_CHAT_TEMPLATE) -> None:
    """A byte-level BPE tokenizer over `tiny_vocab()` saved as a Hugging Face directory would hold it."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens, token_types, merges = tiny_vocab()
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[tuple(merge.split(" ")) for merge in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [token for token, kind in zip(tokens, token_types, strict=True) if kind == 3]
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(directory))
