"""What the engine hands back each step (`RequestOutput` deltas), and the incremental detokenizer that turns
new tokens into safe text deltas.

Text is emitted only when it is final: a decode that ends in U+FFFD (an incomplete UTF-8 sequence split across
tokens, typical of emoji and CJK in byte-level BPE) is held back until the next token completes it, and the
tail that could still grow into a stop string is held back until it cannot. A matched stop string is cut from
the output (unless `include_stop_str_in_output`) and ends the sequence with finish_reason "stop".

How much to hold back is tracked incrementally (a Knuth-Morris-Pratt state per stop string: the longest prefix
of the stop that the text ends with), so it costs a few steps per new character, whatever the stops' lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

__all__ = [
    "CompletionOutput",
    "Detokenizer",
    "EngineStages",
    "IncrementalDetokenizer",
    "RequestOutput",
    "TokenLogprob",
    "accumulate",
]

# Prompt tokens decoded with the first output tokens, so tokenizers that drop a leading space when decoding a
# lone token (SentencePiece) still produce the right text.
NUM_CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Detokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self._stop_tables = [_prefix_function(s) for s in stop]
        self._stop_states = [0] * len(stop)  # per stop: the length of its longest prefix that `text` ends with
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all decoded output text (after a stop match: cut at the match)
        self.num_emitted = 0  # characters of `text` already handed out
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that became final. After a stop string matched (`stop_reason`
        set) nothing more is produced."""
        if self.stop_reason is not None:
            return ""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._append_text(full[len(prefix) :])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
                if self.stop_reason is not None:
                    break
        return self._take(final=self.stop_reason is not None)

    def flush(self) -> str:
        """The sequence ended for another reason: everything held back is final now (an incomplete UTF-8 tail
        comes out as U+FFFD, as the model produced it)."""
        if self.stop_reason is None:
            full = self._decode(self.token_ids[self.prefix_offset :])
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            if len(full) > len(prefix):
                self._append_text(full[len(prefix) :])
        return self._take(final=True)

    def _append_text(self, delta: str) -> None:
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return
        self._advance_stop_states(delta)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            index, stop = best
            self.text = self.text[: index + len(stop) if self.include_stop_str_in_output else index]
            self.stop_reason = stop

    def _advance_stop_states(self, delta: str) -> None:
        for index, (stop, table) in enumerate(zip(self.stop, self._stop_tables, strict=True)):
            state = self._stop_states[index]
            for char in delta:
                while state and stop[state] != char:
                    state = table[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):  # a whole match (cut by the caller); keep only proper prefixes
                    state = table[state - 1]
            self._stop_states[index] = state

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        return max(self._stop_states, default=0)

    def _take(self, *, final: bool) -> str:
        end = len(self.text) if final or not self.stop else len(self.text) - self._held_back()
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta


@functools.lru_cache(maxsize=256)
def _prefix_function(stop: str) -> tuple[int, ...]:
    """KMP failure table: entry i is the length of the longest proper prefix of stop[: i + 1] that is also its
    suffix. Cached: the `n` choices of a request (and repeated requests) share their stops' tables."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives (token id, logprob), best first


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request. In a step's output, `text`, `token_ids` and `logprobs` are what is new since
    the previous output for this choice; `accumulate` merges deltas into the whole completion."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any
    num_output_tokens: int = 0  # cumulative


class EngineStages(NamedTuple):
    """When a request reached each stage in the engine: wall clock (`time.time_ns()`, so another process of the host
    can place them on its own timeline), 0 for a stage not reached. Queued: it arrived in the engine; scheduled: it
    was first admitted to the running batch (its prefill starts); first token: its first token was sampled;
    finished: it ended (done, aborted or failed)."""

    queued_ns: int
    scheduled_ns: int
    first_token_ns: int
    finished_ns: int


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]  # the choices that changed this step
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = False  # every choice has finished
    error: Exception | None = None  # set on a request's final output when the engine failed it (outputs empty)
    # On the final output: speculative decoding's proposed and accepted tokens over all choices (0: it never ran)
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    # On the request's first output (`finished_ns` 0 unless it is also the final one) and on its final output: what
    # a stream cut in between still knows
    stages: EngineStages | None = None


def accumulate(deltas: list[RequestOutput], n: int) -> list[CompletionOutput]:
    """Merge a request's stream of deltas into `n` complete choices, in index order."""
    choices = [CompletionOutput(index=i) for i in range(n)]
    for delta in deltas:
        for out in delta.outputs:
            choice = choices[out.index]
            choice.text += out.text
            choice.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + out.logprobs
            choice.finish_reason = out.finish_reason or choice.finish_reason
            choice.stop_reason = out.stop_reason if out.stop_reason is not None else choice.stop_reason
            choice.num_output_tokens = out.num_output_tokens
    return choices
