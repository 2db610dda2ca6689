"""One generated sequence: its tokens, how many of them have KV in the cache, and its block table.

A request with `n` > 1 becomes `n` sequences; the first is the parent of the others, which wait until the
parent's prompt is in the cache and then reuse its full blocks through the prefix cache.
"""

from __future__ import annotations

import itertools
import time
from enum import Enum

from local_engine.fair_share import DEFAULT_TENANCY, Tenancy
from local_engine.sampling_params import SamplingParams

__all__ = ["FinishReason", "Sequence", "SequenceStatus"]

_seq_counter = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"  # client gone or cancelled


class Sequence:
    """Token state of one sequence. `seq_id` grows with arrival, so it orders sequences by arrival time."""

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "block_table",
        "eos_token_ids",
        "finish_reason",
        "index",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_spec_accepted",
        "num_spec_misses",
        "num_spec_paused_steps",
        "num_spec_proposed",
        "num_spec_tokens",
        "params",
        "parent",
        "request_id",
        "scheduled_ns",
        "seq_id",
        "spec_token_ids",
        "status",
        "stop_reason",
        "tenancy",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        index: int = 0,
        parent: Sequence | None = None,
        tenancy: Tenancy = DEFAULT_TENANCY,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache on the last admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained content hashes of full blocks, filled by the block manager
        self.status = SequenceStatus.WAITING
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.parent = parent
        self.tenancy = tenancy  # whose share of the engine serves it (local_engine/fair_share.py)
        self.arrival_time = time.monotonic()
        self.scheduled_ns = 0  # wall clock of its first admission to the running batch (`time.time_ns()`)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Speculative decoding (local_engine/speculative.py): this step's proposed tokens, which follow
        # `token_ids` and are verified by the step; the totals over the sequence; the adaptive proposal length.
        self.spec_token_ids: list[int] = []
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        self.num_spec_tokens = -1  # the next proposal's length; -1: not started (the setting's k)
        self.num_spec_misses = 0  # verifications in a row that accepted nothing
        self.num_spec_paused_steps = 0  # steps left without proposals after a streak of misses

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_waiting_for_parent(self) -> bool:
        """A sibling of an `n` > 1 request waits until its parent's prompt KV is computed, then shares it."""
        parent = self.parent
        return parent is not None and not parent.is_finished and parent.num_computed_tokens < parent.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """After appending a token: set the finish reason if a token-level stop condition holds."""
        token = self.token_ids[-1]
        num_output = self.num_output_tokens
        params = self.params
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, None
                return True
            if token in params.stop_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, token
                return True
        if num_output >= self.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
