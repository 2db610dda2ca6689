"""The engine's boundary raises only its own error tree (`local_engine.errors`): every refusal and failure that the
entry points the gateway calls (the loader, `LLMEngine`, `AsyncEngine`, `Tokenizer`, `perplexity`) raise on the
bad inputs tested elsewhere is a `LocalEngineError`, under the builtin base it always had, so `engine_errors`
can translate by type and callers that caught `ValueError` / `RuntimeError` keep working."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes.checkpoints import tiny_llama_checkpoint

from local_engine.async_engine import AsyncEngine
from local_engine.config import EngineConfig, ModelConfig
from local_engine.engine import LLMEngine
from local_engine.errors import (
    CheckpointError,
    DuplicateRequestError,
    EngineBusyError,
    EngineDeadError,
    InvalidParamError,
    LocalEngineError,
    ModelLoadError,
    PromptTooLongError,
    RequestFailedError,
)
from local_engine.loader import Checkpoint, load_checkpoint
from local_engine.perplexity import perplexity
from local_engine.sampling_params import SamplingParams

ENGINE = EngineConfig(device="cpu", kv_cache_memory=4 * 2**20, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
MESSAGES = [{"role": "user", "content": "hi"}]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}  # a rope scaling the engine does not implement


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoint(directory: Path) -> Checkpoint:
    return load_checkpoint(directory)


@pytest.fixture(scope="module")
def engine(checkpoint: Checkpoint) -> LLMEngine:
    return LLMEngine.from_checkpoint(checkpoint, ENGINE)


def raises(kind: type[LocalEngineError], call: Callable[[], object]) -> LocalEngineError:
    """The engine error `call` raises: of class `kind`, under the engine's root (and nothing else gets through)."""
    with pytest.raises(LocalEngineError) as info:
        call()
    assert type(info.value) is kind, repr(info.value)
    return info.value


# -- loading ----------------------------------------------------------------------------------------------------------


def with_config(checkpoint: Checkpoint, **changes: Any) -> Checkpoint:
    return Checkpoint(
        {**checkpoint.hf_config, **changes}, checkpoint.state_dict, checkpoint.tokenizer, "tiny", 0, False
    )


def test_loading_raises_engine_errors(tmp_path: Path, directory: Path, checkpoint: Checkpoint) -> None:
    raises(CheckpointError, lambda: load_checkpoint(tmp_path / "missing"))
    raises(ModelLoadError, lambda: load_checkpoint(directory, quantization="int3"))
    for unsupported in ({"rope_parameters": YARN}, {"hidden_act": "gelu"}, {"model_type": "gpt2"}):
        raises(ModelLoadError, lambda u=unsupported: LLMEngine.from_checkpoint(with_config(checkpoint, **u), ENGINE))
    extra = {**checkpoint.state_dict, "model.extra.weight": torch.zeros(1)}
    bad = Checkpoint(checkpoint.hf_config, extra, checkpoint.tokenizer, "tiny", 0, False)
    raises(ModelLoadError, lambda: LLMEngine.from_checkpoint(bad, ENGINE))
    tiny_budget = ENGINE.model_copy(update={"kv_cache_memory": 16})
    raises(ModelLoadError, lambda: LLMEngine.from_checkpoint(checkpoint, tiny_budget))
    if not torch.cuda.is_available():
        triton = ENGINE.model_copy(update={"attention_backend": "triton"})
        raises(ModelLoadError, lambda: LLMEngine.from_checkpoint(checkpoint, triton))


def test_a_model_the_engine_does_not_implement_is_a_value_error(checkpoint: Checkpoint) -> None:
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelConfig.from_hf_config({**checkpoint.hf_config, "rope_parameters": YARN})


# -- requests ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "kind"),
    [
        ([], GREEDY, InvalidParamError),
        ([10**6], GREEDY, InvalidParamError),
        ([-1], GREEDY, InvalidParamError),
        (["a"], GREEDY, InvalidParamError),
        ([5] * 64, GREEDY, PromptTooLongError),
        ([5] * 60, SamplingParams(max_tokens=10), PromptTooLongError),
        ([5], SamplingParams(stop_token_ids=(10**6,)), InvalidParamError),
        ([5], SamplingParams(logit_bias=((10**6, 1.0),)), InvalidParamError),
        ([5], {"max_tokens": 4}, InvalidParamError),
    ],
    ids=["empty", "past-vocab", "negative", "not-int", "too-long", "too-long-output", "stop-id", "bias", "params"],
)
def test_a_refused_request_is_an_invalid_param_error(engine: LLMEngine, prompt: Any, params: Any, kind: type) -> None:
    raises(kind, lambda: engine.validate(prompt, params))
    raises(kind, lambda: engine.add_request("refused", prompt, params))
    assert "refused" not in engine.requests


def test_a_request_id_already_running_is_a_duplicate(engine: LLMEngine) -> None:
    engine.add_request("twice", [5, 6], GREEDY)
    try:
        error = raises(DuplicateRequestError, lambda: engine.add_request("twice", [5, 6], GREEDY))
        assert isinstance(error, ValueError)
    finally:
        engine.abort_request("twice")


async def test_the_async_engine_raises_engine_errors(checkpoint: Checkpoint) -> None:
    async_engine = AsyncEngine(LLMEngine.from_checkpoint(checkpoint, ENGINE))
    try:
        with pytest.raises(InvalidParamError):
            await anext(async_engine.generate([], GREEDY))
        first = async_engine.generate([5, 6], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), "x")
        await anext(first)
        with pytest.raises(DuplicateRequestError):
            await anext(async_engine.generate([5, 6], GREEDY, "x"))
        await first.aclose()
    finally:
        await async_engine.shutdown()
    with pytest.raises(EngineDeadError):
        await anext(async_engine.generate([5, 6], GREEDY))


# -- the tokenizer ----------------------------------------------------------------------------------------------------


TOO_DEEP = functools.reduce(lambda value, _: [value], range(5000), "x")  # past the recursion limit to render


@pytest.mark.parametrize(
    ("template", "messages", "code"),
    [
        (None, MESSAGES, "chat_template_missing"),
        ("{{ raise_exception('no') }}", MESSAGES, "invalid_messages"),
        ("{{ messages[0]['content'] + 1 }}", MESSAGES, "invalid_messages"),  # a TypeError inside the template
        ("keep", [{"role": "user", "content": "hi", "name": TOO_DEEP}], "invalid_messages"),  # RecursionError
    ],
    ids=["no-template", "template-refuses", "type-error", "too-deep"],
)
def test_the_tokenizer_refuses_with_invalid_param_errors(
    directory: Path, template: str | None, messages: Any, code: str
) -> None:
    tokenizer = load_checkpoint(directory).tokenizer
    if template != "keep":
        tokenizer.hf.chat_template = template
    error = raises(InvalidParamError, lambda: tokenizer.apply_chat_template(messages))
    assert (error.code, error.param) == (code, "messages")  # type: ignore[attr-defined]


# -- perplexity -------------------------------------------------------------------------------------------------------


def test_perplexity_raises_engine_errors(checkpoint: Checkpoint) -> None:
    llm = LLMEngine.from_checkpoint(checkpoint, ENGINE)
    raises(InvalidParamError, lambda: perplexity(llm, [5]))
    raises(InvalidParamError, lambda: perplexity(llm, [5, 6, 7], window=3, stride=4))
    llm.add_request("busy", [5, 6], GREEDY)
    error = raises(EngineBusyError, lambda: perplexity(llm, [5, 6, 7]))
    assert isinstance(error, RuntimeError)


def test_every_engine_error_keeps_its_builtin_base() -> None:
    value_errors = (ModelLoadError, InvalidParamError, PromptTooLongError, DuplicateRequestError)
    runtime_errors = (EngineBusyError, RequestFailedError, EngineDeadError)
    assert all(issubclass(kind, ValueError) for kind in value_errors)
    assert all(issubclass(kind, RuntimeError) for kind in runtime_errors)
