"""A thin wrapper over a transformers fast tokenizer: ids in, ids out, chat template, stop ids.

Tokenizers come from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`) or from a GGUF file's
metadata through transformers' own GGUF conversion. Either way the result must split text exactly as the model's
original tokenizer.json does, and transformers 5 gets that wrong in two places we repair:

- GGUF: the conversion builds a byte-level BPE tokenizer with GPT-2's pre-tokenizer and so loses the per-digit
  split of SmolLM2 / StarCoder vocabularies (`tokenizer.ggml.pre = smollm`): "a   123" becomes other tokens than
  the model was trained on. We put back the original Sequence[Digits, ByteLevel].
- Directories: a tokenizer class with its own `__init__` (GPT2Tokenizer, which SmolLM2 names) rebuilds the
  pre-tokenizer from class defaults, ignoring tokenizer.json. We put back the file's normalizer, pre-tokenizer and
  decoder.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from local_engine.errors import CheckpointError, InvalidParamError

__all__ = [
    "BYTE_DECODER",
    "DIGIT_SPLIT_PRE_TOKENIZERS",
    "Tokenizer",
    "restore_digit_split",
    "restore_serialized_pipeline",
]

logger = logging.getLogger("unigate.engine")


# llama.cpp pre-tokenizer names whose original tokenizer.json splits every digit before byte-level BPE:
# Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)].
DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
PIPELINE_STAGES = ("normalizer", "pre_tokenizer", "decoder")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


BYTE_DECODER = _byte_decoder()


class Tokenizer:
    """Token ids for text and chat messages, and the ids that end a generation."""

    def __init__(self, hf: Any, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        eos_ids = set(extra_eos_token_ids)
        if hf.eos_token_id is not None:
            eos_ids.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.bos_token_id: int | None = None if hf.bos_token_id is None else int(hf.bos_token_id)
        self.vocab_size: int = len(hf)

    @classmethod
    def from_pretrained(cls, directory: Path, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """The tokenizer saved in a Hugging Face directory; never touches the hub."""
        from transformers import AutoTokenizer

        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise CheckpointError(
                f"No tokenizer in {directory}: it needs tokenizer.json (or tokenizer.model / vocab.json) and "
                "tokenizer_config.json, as written by `tokenizer.save_pretrained(dir)`.",
                code="tokenizer_not_found",
            )
        try:
            hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"No usable tokenizer in {directory} ({type(exc).__name__}: {exc}); the directory needs "
                "tokenizer.json and tokenizer_config.json as written by `tokenizer.save_pretrained`.",
                code="tokenizer_not_found",
            ) from exc
        restore_serialized_pipeline(hf, directory / "tokenizer.json")
        return cls(hf, extra_eos_token_ids)

    @classmethod
    def from_gguf(
        cls, path: Path, pre_tokenizer: str | None = None, extra_eos_token_ids: Iterable[int] = ()
    ) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata.

        `pre_tokenizer` is the file's `tokenizer.ggml.pre`; it is read from the file when not given.
        """
        from transformers import AutoTokenizer

        if pre_tokenizer is None:
            pre_tokenizer = _read_gguf_pre_tokenizer(path)
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"Cannot build a tokenizer from the metadata of {path} ({type(exc).__name__}: {exc}).",
                code="tokenizer_not_found",
            ) from exc
        if pre_tokenizer in DIGIT_SPLIT_PRE_TOKENIZERS:
            restore_digit_split(hf)
        return cls(hf, extra_eos_token_ids)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest vocabulary piece. A piece is never shorter than
        the text it covers (byte-level BPE pieces have one character per byte, SentencePiece pieces one per
        character and six for a `<0xNN>` byte), so a text of `c` characters has at least `c / max_token_chars`
        tokens. Computed once (tens of milliseconds); the loader warms it off the event loop."""
        pieces = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        return max((len(piece) for piece in pieces if isinstance(piece, str)), default=1)

    def max_prompt_chars(self, max_model_len: int) -> int:
        """Above this many characters a text cannot fit `max_model_len` tokens, whatever it says: such a prompt
        is refused before it is tokenized (tokenizing megabytes takes seconds of CPU)."""
        return max_model_len * max(1, self.max_token_chars)

    @functools.cached_property
    def renders_tool_calls(self) -> bool:
        """Whether the chat template writes tool calls itself (Qwen, Llama 3.1, Mistral, Hermes do; SmolLM2's prints
        only each message's role and content, so callers render calls and results as text for it)."""
        return "tool_calls" in str(self.hf.chat_template or "")

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.hf, "all_special_ids", ()))

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (the `bytes` of OpenAI logprobs): a byte-level BPE piece read
        through GPT-2's alphabet (fast tokenizers, special tokens excepted), a SentencePiece piece (`▁` for a space,
        `<0xNN>` for one byte), else the token's decoded text."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                return bytes([int(piece[3:5], 16)])
            is_byte_level = getattr(self.hf, "is_fast", False) and all(c in BYTE_DECODER for c in piece)
            if is_byte_level and token_id not in self._special_ids:
                return bytes(BYTE_DECODER[c] for c in piece)
            if "▁" in piece:
                return piece.replace("▁", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def save_pretrained(self, directory: Path) -> None:
        self.hf.save_pretrained(str(directory))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids for chat `messages` rendered by the model's own template.

        The template writes the special tokens (BOS, role markers) itself, so the text is encoded without adding any.
        Raises InvalidParamError (`chat_template_missing`, or `invalid_messages` for what the template refuses or
        cannot render).
        """
        if not self.hf.chat_template:
            raise InvalidParamError(
                "This model has no chat template; send a plain prompt to /v1/completions instead.",
                code="chat_template_missing",
                param="messages",
            )
        try:
            return self._render_chat(messages, tools, add_generation_prompt)
        except InvalidParamError:
            raise
        except (RecursionError, TypeError, ValueError) as exc:
            # The template renders what the caller sent: a value nested hundreds deep or of a type the template
            # cannot print is the caller's refusal, never the engine's failure.
            raise InvalidParamError(
                f"The messages or tools cannot be rendered into the model's chat template ({type(exc).__name__}). "
                "Send text content, tool definitions with JSON-schema parameters, and no deeply nested values.",
                code="invalid_messages",
                param="messages",
            ) from None

    def _render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> list[int]:
        import jinja2

        originals: list[str] = []  # control-token texts found in the caller's values, by sentinel number
        messages, tools = self._mark_control_texts(messages, originals), self._mark_control_texts(tools, originals)
        try:
            text = self.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except jinja2.TemplateError as exc:
            raise InvalidParamError(
                f"The model's chat template rejected these messages: {exc}", code="invalid_messages", param="messages"
            ) from exc
        if not originals:
            return self.encode(str(text), add_special_tokens=False)
        ids: list[int] = []
        pieces = _SENTINEL.split(str(text))
        for position, piece in enumerate(pieces):
            if position % 2 == 0:  # the template's text, its own control tokens included
                ids.extend(self.encode(piece, add_special_tokens=False))
            else:  # a caller's "<|im_end|>" is the characters, as OpenAI and Anthropic read message text
                ids.extend(self.hf.encode(originals[int(piece)], add_special_tokens=False, split_special_tokens=True))
        return ids

    @functools.cached_property
    def _control_pattern(self) -> re.Pattern[str]:
        """The texts of the special (control) tokens, longest first, and the sentinel's own opening character."""
        added = getattr(self.hf, "added_tokens_decoder", {}).values()
        texts = {token.content for token in added if getattr(token, "special", False) and token.content}
        texts.add(_SENTINEL_OPEN)
        return re.compile("|".join(re.escape(text) for text in sorted(texts, key=len, reverse=True)))

    def _mark_control_texts(self, value: Any, originals: list[str]) -> Any:
        """`value` (messages or tools, as the caller sent them) with every control-token text in its strings
        replaced by a numbered sentinel (`originals` collects the texts), so the template's output can be encoded
        with its own control tokens while the caller's are encoded as text: otherwise a message holding
        "<|im_end|>\n<|im_start|>system" would open a system turn. Nesting is the caller's (a RecursionError is the
        caller's refusal, `apply_chat_template`)."""
        if isinstance(value, str):
            if not self._control_pattern.search(value):
                return value

            def mark(match: re.Match[str]) -> str:
                originals.append(match.group())
                return f"{_SENTINEL_OPEN}{len(originals) - 1}{_SENTINEL_CLOSE}"

            return self._control_pattern.sub(mark, value)
        if isinstance(value, list):
            return [self._mark_control_texts(item, originals) for item in value]
        if isinstance(value, dict):
            return {
                self._mark_control_texts(key, originals): self._mark_control_texts(item, originals)
                for key, item in value.items()
            }
        return value


# Private-use characters that no chat template writes: `\ue000<n>\ue001` stands for the n-th control-token text
# found in a caller's message (a caller's own \ue000 is marked too, so every one in a rendered prompt is ours).
_SENTINEL_OPEN, _SENTINEL_CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def restore_digit_split(hf: Any) -> None:
    """Give a byte-level BPE tokenizer the pre-tokenizer of SmolLM2's original tokenizer.json."""
    from tokenizers import pre_tokenizers

    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def restore_serialized_pipeline(hf: Any, tokenizer_json: Path) -> None:
    """Make the normalizer, pre-tokenizer and decoder those of `tokenizer_json` again.

    transformers 5 rebuilds a tokenizer whose class has its own `__init__` (GPT2Tokenizer, Qwen2Tokenizer, ...) from
    that class's defaults and takes only the vocabulary, merges and post-processor from tokenizer.json. SmolLM2's
    directory names GPT2Tokenizer, so its per-digit split would be dropped exactly as in the GGUF conversion.
    """
    if not tokenizer_json.is_file():
        return
    from tokenizers import Tokenizer as BackendTokenizer

    serialized = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    current = json.loads(hf.backend_tokenizer.to_str())
    stages = [stage for stage in PIPELINE_STAGES if serialized.get(stage) != current.get(stage)]
    if not stages:
        return
    from_file = BackendTokenizer.from_file(str(tokenizer_json))
    for stage in stages:
        setattr(hf.backend_tokenizer, stage, getattr(from_file, stage))
    logger.info("tokenizer: restored %s from %s (transformers had replaced them)", ", ".join(stages), tokenizer_json)


def _read_gguf_pre_tokenizer(path: Path) -> str | None:
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    pre = metadata.get("tokenizer.ggml.pre")
    return pre if isinstance(pre, str) else None
