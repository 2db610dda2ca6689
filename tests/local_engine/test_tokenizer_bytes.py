"""`Tokenizer.token_bytes`: the exact bytes each token stands for (OpenAI logprobs' `bytes`), for byte-level BPE
(GPT-2's alphabet, the bundled model) and SentencePiece (`▁`, `<0xNN>`) vocabularies."""

from __future__ import annotations

from typing import Any, ClassVar

from local_engine.tokenizer import BYTE_DECODER, Tokenizer


def test_the_byte_alphabet_covers_every_byte_once() -> None:
    assert sorted(BYTE_DECODER.values()) == list(range(256))
    assert BYTE_DECODER["Ġ"] == ord(" ") and BYTE_DECODER["A"] == ord("A")


def test_byte_level_tokens_join_to_the_texts_utf8(real_tokenizer: Any) -> None:
    text = "Say something about 春天 🌸, naïve café"
    ids = real_tokenizer.encode(text)
    pieces = [real_tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(len(piece) == 1 and piece[0] >= 0x80 for piece in pieces)  # part of a character: a raw byte


def test_a_special_token_is_its_text(real_tokenizer: Any) -> None:
    [eos] = real_tokenizer.eos_token_ids
    assert real_tokenizer.token_bytes(eos) == real_tokenizer.decode([eos], skip_special_tokens=False).encode()


class SentencePieceVocab:
    """The parts of a slow SentencePiece tokenizer `Tokenizer` reads."""

    eos_token_id = 2
    bos_token_id = 1
    is_fast = False
    all_special_ids = (1, 2)
    pieces: ClassVar[dict[int, str]] = {3: "▁Hello", 4: "<0xE6>", 5: "world", 6: ""}

    def __len__(self) -> int:
        return 7

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces.get(token_id, "")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i].replace("▁", " ") or "<empty>" for i in ids)


def test_sentencepiece_pieces() -> None:
    tokenizer = Tokenizer(SentencePieceVocab())
    assert tokenizer.token_bytes(3) == b" Hello"
    assert tokenizer.token_bytes(4) == b"\xe6"
    assert tokenizer.token_bytes(5) == b"world"  # not a fast tokenizer: its decoded text, not GPT-2's alphabet
    assert tokenizer.token_bytes(6) == b"<empty>"  # no piece: the decoded text
