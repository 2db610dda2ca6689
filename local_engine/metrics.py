"""Engine throughput counters: totals plus tokens/s over a sliding window, updated once per step."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["ThroughputMeter"]


class ThroughputMeter:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0

    def record(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        now = time.monotonic()
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.num_steps += 1
        self._steps.append((now, num_prompt_tokens, num_generation_tokens))
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()

    def rates(self) -> tuple[float, float]:
        """(prompt tokens/s, generation tokens/s) over the window."""
        steps = list(self._steps)
        if not steps:
            return 0.0, 0.0
        span = max(time.monotonic() - steps[0][0], 1e-3)
        return sum(s[1] for s in steps) / span, sum(s[2] for s in steps) / span
