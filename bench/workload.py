"""What the bench sends: seeded synthetic prompts of controlled length, or a JSONL file of real prompts.

Length specs (`--input-dist`, `--output-dist`):
    fixed:N                 every request N tokens
    uniform:LO:HI           integers drawn uniformly in [LO, HI]
    normal:MEAN:STD         rounded, clamped to >= 1
    lognormal:MEDIAN:SIGMA  median * exp(SIGMA * z): long-tailed, like production prompts

Input lengths are exact when a tokenizer is given (transformers, by local name or path); otherwise a prompt of N
common one-token English words is sent and the server's reported `usage.prompt_tokens` is what gets recorded.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

__all__ = [
    "BenchRequest",
    "LengthDist",
    "Tokenizer",
    "Workload",
    "load_jsonl",
    "load_tokenizer",
    "parse_length_dist",
    "synthetic_workload",
]

# Short, frequent words: each is a single token (with its leading space) in GPT-2/Llama/SmolLM-style BPE vocabularies.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but be have which one "
    "you were all she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three"
).split()


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str  # fixed | uniform | normal | lognormal
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = self.a * math.exp(self.b * rng.gauss(0.0, 1.0))
        return max(1, round(value))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_length_dist(spec: str) -> LengthDist:
    """`512`, `fixed:512`, `uniform:32:600`, `normal:256:64`, `lognormal:200:0.8`."""
    parts = spec.strip().split(":")
    try:
        if len(parts) == 1:
            return _checked(LengthDist("fixed", float(int(parts[0]))))
        kind, *nums = parts
        values = [float(n) for n in nums]
    except ValueError:
        raise ValueError(f"cannot read length spec {spec!r}: numbers expected, e.g. uniform:32:600") from None
    if kind == "fixed" and len(values) == 1:
        return _checked(LengthDist("fixed", values[0]))
    if kind in ("uniform", "normal", "lognormal") and len(values) == 2:
        return _checked(LengthDist(kind, values[0], values[1]))
    raise ValueError(
        f"unknown length spec {spec!r}: use N, fixed:N, uniform:LO:HI, normal:MEAN:STD or lognormal:MEDIAN:SIGMA"
    )


def _checked(dist: LengthDist) -> LengthDist:
    if dist.a < 1 or dist.b < 0 or (dist.kind == "uniform" and dist.b < dist.a):
        raise ValueError(f"length spec {dist.describe()} is out of range: lengths are >= 1 and LO <= HI")
    return dist


@dataclass(slots=True)
class BenchRequest:
    messages: list[dict[str, Any]]
    max_tokens: int
    num_prompt_tokens: int | None = None  # known only when a tokenizer counted it


@dataclass(slots=True)
class Workload:
    """An endless, reproducible stream of requests: synthetic ones are drawn lazily, a dataset is cycled."""

    source: Callable[[], Iterator[BenchRequest]]
    description: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[BenchRequest]:
        return self.source()


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A transformers tokenizer from a local directory, a local GGUF file, or a name already in the HF cache."""
    from transformers import AutoTokenizer

    path = Path(name_or_path)
    if path.suffix == ".gguf" and path.is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    # transformers types `decode` as returning `str | list[str]`; a flat list of ids always decodes to one str
    return tokenizer  # type: ignore[return-value]


def _prompt_text(rng: random.Random, num_tokens: int, tokenizer: Tokenizer | None) -> tuple[str, int | None]:
    words = " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
    if tokenizer is None:
        return words, None
    ids = tokenizer.encode(words, add_special_tokens=False)
    while len(ids) < num_tokens:  # a tokenizer that merges words: pad with more text, then cut exactly
        ids += tokenizer.encode(" " + " ".join(rng.choice(_WORDS) for _ in range(num_tokens)), add_special_tokens=False)
    text = tokenizer.decode(ids[:num_tokens], skip_special_tokens=True)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def synthetic_workload(
    input_dist: LengthDist,
    output_dist: LengthDist,
    *,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> Workload:

    def draw() -> Iterator[BenchRequest]:
        rng = random.Random(seed)
        while True:
            text, num_tokens = _prompt_text(rng, input_dist.sample(rng), tokenizer)
            yield BenchRequest([{"role": "user", "content": text}], output_dist.sample(rng), num_tokens)

    description = {"kind": "synthetic", "input": input_dist.describe(), "output": output_dist.describe(), "seed": seed}
    return Workload(draw, description)


def load_jsonl(
    path: Path, output_dist: LengthDist, *, seed: int = 0, tokenizer: Tokenizer | None = None, shuffle: bool = True
) -> Workload:
    """One JSON object a line: `{"prompt": "..."}` or `{"messages": [...]}`, optionally `"output_len"` (or
    `"max_tokens"`) to replay the length the real answer had; otherwise `output_dist` decides."""
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise ValueError(f"{path}:{line_no}: not valid JSON") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object with 'prompt' or 'messages'")
        messages = _row_messages(row, f"{path}:{line_no}")
        max_tokens = row.get("output_len", row.get("max_tokens"))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            max_tokens = output_dist.sample(rng)
        num_tokens = None
        if tokenizer is not None:
            num_tokens = sum(len(tokenizer.encode(str(m.get("content", "")))) for m in messages)
        requests.append(BenchRequest(messages, max_tokens, num_tokens))
    if not requests:
        raise ValueError(f"{path}: no prompts found")
    if shuffle:
        rng.shuffle(requests)
    return Workload(
        lambda: itertools.cycle(requests),
        {"kind": "dataset", "path": str(path), "num_prompts": len(requests), "seed": seed},
    )


def _row_messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    if isinstance(row.get("messages"), list) and row["messages"]:
        return list(row["messages"])
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    raise ValueError(f"{where}: expected 'prompt' (string) or 'messages' (list)")
