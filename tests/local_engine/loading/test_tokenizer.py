"""The bundled tokenizer equals SmolLM2's original one, digits included; chat template; decoding; errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from local_engine.errors import InvalidParamError as InvalidRequestError
from local_engine.loader import Checkpoint
from local_engine.tokenizer import Tokenizer

from .tiny_checkpoints import SMOLLM2_SPECIAL_TOKENS, save_tiny_tokenizer

# Runs of spaces before digits are where GPT-2's pre-tokenizer and SmolLM2's (digits split first) disagree.
DIGIT_CASES = [
    "a   123",
    "x 2024-11-29  42",
    "def f(x):\n    return 42\n        y = 7\n\t\t3.14159",
    "items:\n  - 1\n  -   22\n    333",
    "total  =  1,000,000  (approx.   12%)",
]
OTHER_CASES = [
    "Hello, world! How are you today?",
    "日本語のテキストと 🤖 emoji 👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "  leading and trailing  ",
    "",
]


@pytest.fixture(scope="session")
def reference_tokenizer(bundled_path: Path) -> Any:
    """SmolLM2's tokenizer.json rebuilt from its definition: the GGUF's vocabulary and merges under the original
    pre-tokenizer Sequence[Digits(individual_digits=True), ByteLevel], ByteLevel decoder, 17 special tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers.integrations.gguf import read_gguf_metadata

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    metadata, _ = read_gguf_metadata(str(bundled_path), keys)
    tokens, merges = metadata[keys[0]], metadata[keys[1]]
    assert tokens[: len(SMOLLM2_SPECIAL_TOKENS)] == SMOLLM2_SPECIAL_TOKENS
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SMOLLM2_SPECIAL_TOKENS])
    return backend


@pytest.fixture(scope="session")
def unrepaired_tokenizer(bundled_path: Path) -> Any:
    """transformers' GGUF conversion as it comes, without our pre-tokenizer repair."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bundled_path.parent), gguf_file=bundled_path.name, local_files_only=True)


@pytest.mark.parametrize("text", DIGIT_CASES + OTHER_CASES)
def test_bundled_tokenizer_equals_original(
    text: str, bundled_first_load: Checkpoint, bundled_cached_load: Checkpoint, reference_tokenizer: Any
) -> None:
    expected = reference_tokenizer.encode(text, add_special_tokens=False).ids
    assert bundled_first_load.tokenizer.encode(text) == expected
    assert bundled_cached_load.tokenizer.encode(text) == expected
    assert bundled_first_load.tokenizer.decode(expected, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", DIGIT_CASES)
def test_transformers_gguf_conversion_alone_gets_digits_wrong(
    text: str, unrepaired_tokenizer: Any, reference_tokenizer: Any
) -> None:
    """The bug the loader repairs is real: without it these strings tokenize differently."""
    expected = reference_tokenizer.encode(text, add_special_tokens=False).ids
    assert unrepaired_tokenizer.encode(text, add_special_tokens=False) != expected


def test_every_digit_is_its_own_token(bundled_first_load: Checkpoint) -> None:
    tokenizer = bundled_first_load.tokenizer
    for text in DIGIT_CASES:
        pieces = [tokenizer.decode([token_id]) for token_id in tokenizer.encode(text)]
        for piece in pieces:
            assert not any(c.isdigit() for c in piece) or len(piece) == 1, (text, pieces)


def test_chat_template(bundled_first_load: Checkpoint) -> None:
    tokenizer = bundled_first_load.tokenizer
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = tokenizer.apply_chat_template(messages)
    expected_text = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected_text
    assert ids == tokenizer.encode(expected_text)
    assert ids[0] == 1  # <|im_start|> as one special token, not cut into pieces
    assert ids.count(2) == 2  # two <|im_end|>
    assert tokenizer.decode(ids).startswith("system\nYou are a helpful AI assistant")

    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    no_prompt = tokenizer.apply_chat_template(with_system, add_generation_prompt=False)
    assert tokenizer.decode(no_prompt, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
    )


def test_missing_chat_template_is_a_client_error(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path, chat_template=None)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(InvalidRequestError, match="/v1/completions") as caught:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert caught.value.code == "chat_template_missing"
    assert caught.value.param == "messages"  # the gateway answers it as a 400 naming the field


def test_chat_template_rejection_is_a_client_error(tmp_path: Path) -> None:
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    save_tiny_tokenizer(tmp_path, chat_template=strict)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(InvalidRequestError, match="first message must be from the user") as caught:
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
    assert caught.value.code == "invalid_messages"


def test_directory_naming_gpt2_tokenizer_keeps_its_digit_split(
    tmp_path: Path, bundled_cached_load: Checkpoint, reference_tokenizer: Any
) -> None:
    """SmolLM2's own HF directory names GPT2Tokenizer, whose transformers 5 constructor drops tokenizer.json's
    pre-tokenizer; the loader must keep the file's."""
    from transformers import AutoTokenizer

    bundled_cached_load.tokenizer.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))

    plain = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    ours = Tokenizer.from_pretrained(tmp_path)

    assert type(ours.hf).__name__ == "GPT2Tokenizer"
    for text in DIGIT_CASES:
        expected = reference_tokenizer.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected
        assert plain.encode(text, add_special_tokens=False) != expected
