"""Per-variant request statistics: totals plus a time-bounded window for percentiles.

Feeds A/B experiments and canary verdicts, so what it counts is what judges a model:

* latency counts from when the model was ready to serve the request, not from arrival: a
  candidate that starts cold is judged on its inference latency, not on its load time;
* what the client or the product caused is not the model's error: client mistakes (bad
  input, a name or adapter the model does not have) and cancellations, a deadline shorter
  than the model could meet, and a refusal before the model was reached (a rate limit, the
  miss budget, a deadline refused at once, no room) are counted apart, each by its kind,
  and left out of the window (``classify``).  So an anonymous client can neither roll a
  healthy canary back nor make its baseline look worse with tiny deadlines or refusals.

Samples live in fixed-size numpy ring buffers, so recording is a few array stores and a
window summary is a vectorized mask plus a percentile over a bounded sample: it never sorts
tens of thousands of Python tuples on the serving event loop.

A window can be saved and restored (``VariantStats.saved`` / ``restored``), so another
process judges the same observations: a standby control plane that takes over a canary.
"""

from __future__ import annotations

import base64
import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

WINDOW_MAX_SAMPLES = 50_000
# Percentiles are computed over at most this many of the window's samples (evenly spaced
# in time): p99 of 8192 samples has ~80 samples above it, plenty for a gate, and the
# partition costs ~0.1 ms instead of a full sort of 50k values.
PERCENTILE_MAX_SAMPLES = 8192

# Status codes (grpc.StatusCode names) that say the client, not the model, was at fault.
CLIENT_ERROR_CODES = frozenset({
    "INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED",
    "UNAUTHENTICATED", "ALREADY_EXISTS",
})


# A deadline the model had the request for at least this long, and at least twice the p99 of
# its own answers in time, was one it could meet: passing it is the model's error.  A
# shorter one is the client's (a 1 us deadline would otherwise be an error made to order).
JUDGED_DEADLINE_MIN_MS = 100.0
JUDGED_DEADLINE_P99_FACTOR = 2.0


class Outcome(enum.Enum):
    OK = "ok"
    ERROR = "error"  # the model's (or its load's) fault: counts against it
    CLIENT = "client"  # a client mistake or cancellation: counted apart, never judged
    SHORT_DEADLINE = "short_deadline"  # a deadline the model could not meet: apart
    REFUSED = "refused"  # refused before the model was reached (limits, room): apart


# VariantStats' counter of each outcome counted apart.
APART = {Outcome.CLIENT: "client_errors", Outcome.SHORT_DEADLINE: "short_deadlines",
         Outcome.REFUSED: "refused"}


def classify(code: str, reached_model: bool, served_ms: float | None = None,
             meetable_ms: float = JUDGED_DEADLINE_MIN_MS) -> Outcome:
    """Whose fault a request's outcome is.

    ``reached_model``: the model was ready and the request went to it.  Before that point
    NOT_FOUND or INVALID_ARGUMENT come from the model itself (a candidate that is not in
    the repository, a load that was refused) and count as its errors; after it they answer
    the request's content (bad shape, unknown adapter).  A cancellation is the client
    giving up (it went away), also while waiting for a cold load.  RESOURCE_EXHAUSTED is a
    limit's refusal (a rate limit, the miss budget, a fair share, no room), never the
    model's.  DEADLINE_EXCEEDED is the model's only when it had the request for at least
    ``meetable_ms`` (``served_ms``: how long it had it); refused before the model was
    reached, or sooner, it is a deadline shorter than the model could meet."""
    if code == "OK":
        return Outcome.OK
    if code == "CANCELLED":
        return Outcome.CLIENT
    if code == "RESOURCE_EXHAUSTED":
        return Outcome.REFUSED
    if code == "DEADLINE_EXCEEDED":
        if not reached_model or served_ms is None or served_ms < meetable_ms:
            return Outcome.SHORT_DEADLINE
        return Outcome.ERROR
    if reached_model and code in CLIENT_ERROR_CODES:
        return Outcome.CLIENT
    return Outcome.ERROR


def percentiles(values: np.ndarray, qs: tuple[float, ...]) -> list[float | None]:
    """Nearest-rank percentiles (0..1) of ``values`` (not sorted); None for no values."""
    if values.size == 0:
        return [None] * len(qs)
    if values.size > PERCENTILE_MAX_SAMPLES:
        values = values[:: math.ceil(values.size / PERCENTILE_MAX_SAMPLES)]
    return [float(v) for v in np.percentile(values, [q * 100 for q in qs], method="nearest")]


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


class VariantStats:
    """Totals since start plus the last ``max_samples`` judged requests (time, latency, ok).

    Requests the client is to blame for are only counted (``client_errors``).  A request
    that never reached a ready model has no latency (NaN): it counts in the window's
    requests and errors but not in its percentiles."""

    def __init__(self, max_samples: int = WINDOW_MAX_SAMPLES):
        self.requests = 0
        self.errors = 0
        self.client_errors = 0
        self.short_deadlines = 0
        self.refused = 0
        self.random_assignments = 0
        self._meetable: tuple[float, float] | None = None  # (computed at, ms): ``meetable_ms``
        self.max_samples = max_samples
        self._at = np.empty(max_samples, np.float64)
        self._latency_ms = np.empty(max_samples, np.float64)
        self._ok = np.empty(max_samples, np.bool_)
        self._next = 0  # ring index of the next sample
        self._count = 0  # samples held, <= max_samples

    def record(self, now: float, latency_ms: float | None, ok: bool,
               randomly_assigned: bool = False) -> None:
        self.requests += 1
        self.errors += 0 if ok else 1
        self.random_assignments += 1 if randomly_assigned else 0
        i = self._next
        self._at[i] = now
        self._latency_ms[i] = math.nan if latency_ms is None else latency_ms
        self._ok[i] = ok
        self._next = (i + 1) % self.max_samples
        if self._count < self.max_samples:
            self._count += 1

    def record_client_error(self, randomly_assigned: bool = False,
                            counter: str = "client_errors") -> None:
        """One outcome counted apart: ``counter`` is its kind's (``APART``)."""
        setattr(self, counter, getattr(self, counter) + 1)
        self.random_assignments += 1 if randomly_assigned else 0

    def meetable_ms(self, now: float) -> float:
        """The shortest deadline this model could meet: ``JUDGED_DEADLINE_MIN_MS``, or twice
        the p99 of its answers in time, whichever is longer (worked out at most once a
        second: a flood of deadlines costs no percentile each)."""
        if self._meetable is not None and now - self._meetable[0] < 1.0:
            return self._meetable[1]
        n = self._count
        ok = self._ok[:n]
        latencies = self._latency_ms[:n][ok]
        latencies = latencies[~np.isnan(latencies)]
        (p99,) = percentiles(latencies, (0.99,))
        meetable = max(JUDGED_DEADLINE_MIN_MS, JUDGED_DEADLINE_P99_FACTOR * (p99 or 0.0))
        self._meetable = (now, meetable)
        return meetable

    def _in_time_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The held samples, oldest first (a full ring starts at ``_next``)."""
        n = self._count
        order = np.arange(n) if n < self.max_samples else np.roll(np.arange(n), -self._next)
        return self._at[order], self._latency_ms[order], self._ok[order]

    def saved(self, since: float) -> dict:
        """The totals and the samples at or after ``since``, JSON-ready (arrays as base64 of
        their little-endian bytes: a full window is ~1 MB, not tens of MB of JSON numbers)."""
        at, latency_ms, ok = self._in_time_order()
        picked = at >= since
        return {"requests": self.requests, "errors": self.errors,
                "client_errors": self.client_errors, "short_deadlines": self.short_deadlines,
                "refused": self.refused, "random_assignments": self.random_assignments,
                "at": _packed(at[picked], "<f8"), "latency_ms": _packed(latency_ms[picked], "<f8"),
                "ok": _packed(ok[picked], "u1")}

    @classmethod
    def restored(cls, saved: dict, max_samples: int = WINDOW_MAX_SAMPLES) -> VariantStats:
        """Stats from ``saved()``.  Raises ValueError (or KeyError, TypeError) when it is not
        what ``saved()`` writes."""
        at = _unpacked(saved["at"], "<f8")
        latency_ms = _unpacked(saved["latency_ms"], "<f8")
        ok = _unpacked(saved["ok"], "u1")
        if not len(at) == len(latency_ms) == len(ok):
            raise ValueError(f"saved window arrays differ in length ({len(at)}, {len(latency_ms)}, "
                             f"{len(ok)})")
        stats = cls(max_samples)
        keep = slice(max(0, len(at) - max_samples), None)  # the newest, as the ring would
        n = len(at[keep])
        stats._at[:n], stats._latency_ms[:n], stats._ok[:n] = at[keep], latency_ms[keep], ok[keep]
        stats._count, stats._next = n, n % max_samples
        stats.requests = int(saved["requests"])
        stats.errors = int(saved["errors"])
        stats.client_errors = int(saved["client_errors"])
        # Saved by an earlier version: none counted apart of these kinds.
        stats.short_deadlines = int(saved.get("short_deadlines", 0))
        stats.refused = int(saved.get("refused", 0))
        stats.random_assignments = int(saved["random_assignments"])
        return stats

    def window(self, since: float) -> WindowSummary:
        """Requests at or after ``since`` among the last ``max_samples``."""
        n = self._count
        picked = self._at[:n] >= since
        requests = int(np.count_nonzero(picked))
        if requests == 0:
            return WindowSummary(0, 0, None, None)
        errors = requests - int(np.count_nonzero(self._ok[:n][picked]))
        # Ring order, not time order: a stride over it still picks every k-th request.
        latencies = self._latency_ms[:n][picked]
        latencies = latencies[~np.isnan(latencies)]
        p50, p99 = percentiles(latencies, (0.5, 0.99))
        return WindowSummary(requests, errors, p50, p99)

    def to_dict(self) -> dict:
        summary = self.window(-math.inf)
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": round(self.errors / self.requests, 6) if self.requests else 0.0,
                "client_errors": self.client_errors,
                "short_deadlines": self.short_deadlines, "refused": self.refused,
                "random_assignments": self.random_assignments,
                "p50_ms": summary.p50_ms, "p99_ms": summary.p99_ms}


def _packed(values: np.ndarray, dtype: str) -> str:
    return base64.b64encode(values.astype(dtype).tobytes()).decode("ascii")


def _unpacked(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype)


class StatsBook:
    """Statistics keyed by (scope, variant), e.g. ("exp:rec-ab", "treatment")."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_samples: int = WINDOW_MAX_SAMPLES):
        self.clock = clock
        self.max_samples = max_samples
        self._stats: dict[tuple[str, str], VariantStats] = {}
        # Per scope, bumped by every outcome and reset: whether a saved copy is out of date.
        self._revisions: dict[str, int] = {}

    def get(self, scope: str, variant: str) -> VariantStats:
        key = (scope, variant)
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = VariantStats(self.max_samples)
        return stats

    def record(self, scope: str, variant: str, latency_ms: float | None, ok: bool,
               randomly_assigned=False):
        self.get(scope, variant).record(self.clock(), latency_ms, ok, randomly_assigned)
        self._revisions[scope] = self._revisions.get(scope, 0) + 1

    def record_outcome(self, scope: str, variant: str, code: str, served_ms: float | None,
                       randomly_assigned: bool = False) -> Outcome:
        """Record one request by its status code.  ``served_ms``: latency from when the
        model was ready (None if it never was); see ``classify``."""
        stats = self.get(scope, variant)
        meetable = stats.meetable_ms(self.clock()) if code == "DEADLINE_EXCEEDED" else JUDGED_DEADLINE_MIN_MS
        outcome = classify(code, served_ms is not None, served_ms, meetable)
        if outcome in APART:
            stats.record_client_error(randomly_assigned, APART[outcome])
            self._revisions[scope] = self._revisions.get(scope, 0) + 1
        else:
            self.record(scope, variant, served_ms, outcome is Outcome.OK, randomly_assigned)
        return outcome

    def scope(self, scope: str) -> dict[str, dict]:
        return {v: s.to_dict() for (sc, v), s in self._stats.items() if sc == scope}

    def reset(self, scope: str) -> None:
        for key in [k for k in self._stats if k[0] == scope]:
            del self._stats[key]
        self._revisions[scope] = self._revisions.get(scope, 0) + 1

    def outcomes(self, scope: str) -> int:
        """Outcomes ``scope`` holds, those counted apart included."""
        return sum(s.requests + s.client_errors + s.short_deadlines + s.refused
                   for (sc, _), s in self._stats.items() if sc == scope)

    def revision(self, scope: str) -> int:
        """Changes whenever ``scope`` records an outcome or is reset."""
        return self._revisions.get(scope, 0)

    def saved(self, scope: str, since: float) -> dict[str, dict]:
        """Each variant of ``scope`` as ``VariantStats.saved(since)``."""
        return {v: s.saved(since) for (sc, v), s in self._stats.items() if sc == scope}

    def restore(self, scope: str, saved: dict[str, dict]) -> None:
        """Put ``saved()``'s variants back in place of what ``scope`` holds.  Raises as
        ``VariantStats.restored`` does, before anything is replaced."""
        restored = {v: VariantStats.restored(d, self.max_samples) for v, d in saved.items()}
        self.reset(scope)
        for variant, stats in restored.items():
            self._stats[(scope, variant)] = stats
