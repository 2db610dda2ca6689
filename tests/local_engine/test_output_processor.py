"""Incremental detokenization with the bundled model's real byte-level tokenizer: no broken UTF-8 ever leaves,
and stop strings are cut correctly wherever token boundaries fall."""

from __future__ import annotations

from typing import Any

import pytest

from local_engine.output_processor import IncrementalDetokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 🌸🎉👩‍👩‍👧 done",
    "Mixed ünïcödé, 日本語のテキスト and 🚀 rockets",
    "  leading spaces and 123 numbers\n\tindented",
]


def stream(tokenizer: Any, ids: list[int], **options: Any) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], **options)
    deltas = [detokenizer.add_tokens([i]) for i in ids]
    deltas.append(detokenizer.flush())
    return deltas, detokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_valid_and_complete(real_tokenizer: Any, text: str) -> None:
    ids = real_tokenizer.encode(text)
    if not text.isascii():  # the case that matters: characters split across tokens
        assert any("\ufffd" in real_tokenizer.decode([i]) for i in ids)
    deltas, _ = stream(real_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == real_tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello world, how are you", ("world",), "Hello "),
        ("Hello world, how are you", ("o w", "are"), "Hell"),
        ("The answer is 42. Done", (". D",), "The answer is 42"),
        ("你好，世界！再见", ("世界",), "你好，"),
        ("abc🌸def", ("🌸",), "abc"),
        ("nothing matches here", ("zzz", "herex"), "nothing matches here"),
    ],
)
def test_stop_strings_across_token_boundaries(
    real_tokenizer: Any, text: str, stops: tuple[str, ...], expected: str
) -> None:
    ids = real_tokenizer.encode(text)
    deltas, detokenizer = stream(real_tokenizer, ids, stop=stops)
    assert "".join(deltas) == expected
    assert detokenizer.stop_reason == (None if expected == text else next(s for s in stops if s in text))
    # Nothing that later turned out to be part of a stop string was ever emitted.
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)


def test_stop_string_kept_when_asked(real_tokenizer: Any) -> None:
    ids = real_tokenizer.encode("one two three four")
    deltas, _ = stream(real_tokenizer, ids, stop=("three",), include_stop_str_in_output=True)
    assert "".join(deltas) == "one two three"


def test_text_that_could_start_a_stop_string_is_held_then_released(real_tokenizer: Any) -> None:
    ids = real_tokenizer.encode("say STO and STOP")
    deltas, _ = stream(real_tokenizer, ids, stop=("STOP",))
    assert "".join(deltas) == "say STO and "
