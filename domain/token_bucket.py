"""Token buckets for per-model and per-logical-name rate limits (clock injected)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    rate_per_s: float
    burst: float
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    updated_at: float = field(init=False)

    def __post_init__(self):
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError(f"rate ({self.rate_per_s}) must be > 0 and burst ({self.burst}) >= 1")
        self.tokens = float(self.burst)
        self.updated_at = self.clock()

    def try_acquire(self) -> tuple[bool, float]:
        """Take one token; if none, return (False, seconds until one is available)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated_at) * self.rate_per_s)
        self.updated_at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True, 0.0
        return False, (1 - self.tokens) / self.rate_per_s
