"""Per-variant request statistics: totals plus a time-bounded window for percentiles."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

WINDOW_MAX_SAMPLES = 50_000


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


@dataclass
class WindowSummary:
    requests: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": round(self.error_rate, 6), "p50_ms": self.p50_ms, "p99_ms": self.p99_ms}


@dataclass
class VariantStats:
    requests: int = 0
    errors: int = 0
    random_assignments: int = 0
    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW_MAX_SAMPLES))

    def record(self, now: float, latency_ms: float, ok: bool, randomly_assigned: bool = False) -> None:
        self.requests += 1
        self.errors += 0 if ok else 1
        self.random_assignments += 1 if randomly_assigned else 0
        self.samples.append((now, latency_ms, ok))

    def window(self, since: float) -> WindowSummary:
        picked = [(lat, ok) for t, lat, ok in self.samples if t >= since]
        latencies = sorted(lat for lat, _ in picked)
        errors = sum(1 for _, ok in picked if not ok)
        return WindowSummary(len(picked), errors, percentile(latencies, 0.5), percentile(latencies, 0.99))

    def to_dict(self) -> dict:
        summary = self.window(0.0)
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": round(self.errors / self.requests, 6) if self.requests else 0.0,
                "random_assignments": self.random_assignments,
                "p50_ms": summary.p50_ms, "p99_ms": summary.p99_ms}


class StatsBook:
    """Statistics keyed by (scope, variant), e.g. ("exp:rec-ab", "treatment")."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._stats: dict[tuple[str, str], VariantStats] = {}

    def get(self, scope: str, variant: str) -> VariantStats:
        key = (scope, variant)
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = VariantStats()
        return stats

    def record(self, scope: str, variant: str, latency_ms: float, ok: bool, randomly_assigned=False):
        self.get(scope, variant).record(self.clock(), latency_ms, ok, randomly_assigned)

    def scope(self, scope: str) -> dict[str, dict]:
        return {v: s.to_dict() for (sc, v), s in self._stats.items() if sc == scope}

    def reset(self, scope: str) -> None:
        for key in [k for k in self._stats if k[0] == scope]:
            del self._stats[key]
