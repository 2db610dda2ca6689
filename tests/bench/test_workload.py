"""Seeded length distributions, synthetic prompts (exact lengths with a tokenizer), and JSONL datasets."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest

from bench.workload import LengthDist, load_jsonl, load_tokenizer, parse_length_dist, synthetic_workload


def test_length_specs_parse_and_sample_reproducibly() -> None:
    assert parse_length_dist("128") == LengthDist("fixed", 128.0)
    assert parse_length_dist("uniform:32:600") == LengthDist("uniform", 32.0, 600.0)
    uniform = [parse_length_dist("uniform:32:600").sample(random.Random(7)) for _ in range(3)]
    assert len(set(uniform)) == 1  # same seed, same draw
    rng = random.Random(0)
    draws = [parse_length_dist("uniform:32:600").sample(rng) for _ in range(2000)]
    assert min(draws) >= 32 and max(draws) <= 600
    normal = [parse_length_dist("normal:200:20").sample(rng) for _ in range(2000)]
    assert 190 < statistics.mean(normal) < 210
    lognormal = [parse_length_dist("lognormal:100:1.0").sample(rng) for _ in range(2000)]
    assert 85 < statistics.median(lognormal) < 115 and max(lognormal) > 500  # long tail
    assert min(parse_length_dist("normal:1:50").sample(rng) for _ in range(200)) >= 1


@pytest.mark.parametrize("spec", ["", "zipf:1:2", "uniform:600:32", "uniform:1", "fixed:0", "normal:a:b"])
def test_bad_length_specs_say_what_to_write(spec: str) -> None:
    with pytest.raises(ValueError, match="length spec"):
        parse_length_dist(spec)


def test_synthetic_workload_is_reproducible_and_sized() -> None:
    first = list(
        itertools.islice(synthetic_workload(parse_length_dist("uniform:5:50"), parse_length_dist("7"), seed=3), 20)
    )
    again = list(
        itertools.islice(synthetic_workload(parse_length_dist("uniform:5:50"), parse_length_dist("7"), seed=3), 20)
    )
    assert [r.messages for r in first] == [r.messages for r in again]
    assert all(r.max_tokens == 7 and r.num_prompt_tokens is None for r in first)
    assert all(5 <= len(r.messages[0]["content"].split()) <= 50 for r in first)


@pytest.fixture(scope="module")
def word_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny local word-level tokenizer (no hub access), saved the way transformers expects."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bench.workload import _WORDS

    vocab = {word: i for i, word in enumerate(["[UNK]", *dict.fromkeys(_WORDS)])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_with_a_tokenizer_prompt_lengths_are_exact(word_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(str(word_tokenizer_dir))
    workload = synthetic_workload(parse_length_dist("uniform:3:40"), parse_length_dist("4"), tokenizer=tokenizer)
    first_length = parse_length_dist("uniform:3:40").sample(random.Random(0))  # the workload's first draw
    got = list(itertools.islice(workload, 10))
    assert got[0].num_prompt_tokens == first_length
    for request in got:
        assert request.num_prompt_tokens is not None and 3 <= request.num_prompt_tokens <= 40
        assert request.num_prompt_tokens == len(
            tokenizer.encode(request.messages[0]["content"], add_special_tokens=False)
        )


def test_jsonl_dataset_prompts_messages_and_output_lengths(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "What is paged attention?", "output_len": 40}\n'
        "\n"
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}\n',
        encoding="utf-8",
    )
    workload = load_jsonl(path, parse_length_dist("9"), shuffle=False)
    first, second, third = itertools.islice(workload, 3)
    assert first.messages == [{"role": "user", "content": "What is paged attention?"}] and first.max_tokens == 40
    assert second.messages[0]["role"] == "system" and second.max_tokens == 9
    assert third.messages == first.messages  # cycled
    assert workload.description["num_prompts"] == 2


@pytest.mark.parametrize(
    ("text", "message"), [("not json\n", "not valid JSON"), ('{"x": 1}\n', "expected 'prompt'"), ("\n", "no prompts")]
)
def test_bad_jsonl_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path, parse_length_dist("9"))
