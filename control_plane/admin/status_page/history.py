"""The status page's plots over time: counter totals sampled now and then, turned into
rates over a trailing minute (misses and evictions per minute, requests per second, hit
ratio).

Pure: ``sample(now, totals)`` records, ``series(now)`` answers; the caller samples from a
background loop (control-plane counters, every ``SAMPLE_EVERY_S``) and on each page poll
(with the router's totals when it could read them).  A counter that is missing from a
sample (the router was not read) leaves a gap rather than a made-up value.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SPAN_S = 1800.0  # what the page plots: the last half hour
RATE_OVER_S = 60.0  # each point: the rate over the minute before it
SAMPLE_EVERY_S = 5.0  # one sample per this many seconds: later ones in the same slot merge

# counter name -> (series name, scale): per minute or per second
RATES = {"misses": ("misses_per_min", 60.0), "evictions": ("evictions_per_min", 60.0),
         "loads": ("loads_per_min", 60.0), "requests": ("requests_per_s", 1.0),
         "errors": ("errors_per_s", 1.0)}


@dataclass
class Sample:
    at: float
    totals: dict[str, float]


class History:
    def __init__(self, span_s: float = SPAN_S, rate_over_s: float = RATE_OVER_S,
                 slot_s: float = SAMPLE_EVERY_S):
        self.span_s = span_s
        self.rate_over_s = rate_over_s
        self.slot_s = slot_s
        self.samples: deque[Sample] = deque()

    def sample(self, now: float, totals: dict[str, float]) -> None:
        """Record counter totals; at most one sample per ``slot_s`` (bounded memory and
        cost, however many pages poll): a later one in the same slot updates it, keeping
        the counters only the earlier one had (the router's, read by a page poll)."""
        last = self.samples[-1] if self.samples else None
        if last is not None and now // self.slot_s == last.at // self.slot_s:
            last.totals = {**last.totals, **totals}
            last.at = now
        else:
            self.samples.append(Sample(now, dict(totals)))
        while self.samples and self.samples[0].at < now - self.span_s - self.rate_over_s:
            self.samples.popleft()

    def _before(self, i: int, name: str) -> Sample | None:
        """The sample ``rate_over_s`` before sample ``i`` that has ``name`` (the oldest one
        that has it when history is shorter than that)."""
        at = self.samples[i].at - self.rate_over_s
        found = None
        for j in range(i - 1, -1, -1):
            s = self.samples[j]
            if name in s.totals:
                found = s
                if s.at <= at:
                    break
        return found

    def series(self, now: float) -> dict[str, list]:
        out: dict[str, list] = {"t": []}
        for series, _ in RATES.values():
            out[series] = []
        out["hit_ratio"] = []
        start = now - self.span_s
        for i, s in enumerate(self.samples):
            if s.at < start:
                continue
            out["t"].append(round(s.at, 3))
            for name, (series, scale) in RATES.items():
                out[series].append(self._rate(i, name, scale))
            out["hit_ratio"].append(self._hit_ratio(i))
        return out

    def _rate(self, i: int, name: str, scale: float) -> float | None:
        s = self.samples[i]
        if name not in s.totals:
            return None
        base = self._before(i, name)
        if base is None or s.at <= base.at:
            return None
        delta = s.totals[name] - base.totals[name]
        if delta < 0:  # a reset (a restarted router worker): no rate across it
            return None
        return round(delta / (s.at - base.at) * scale, 4)

    def _hit_ratio(self, i: int) -> float | None:
        s = self.samples[i]
        if "requests" not in s.totals or "cold_waits" not in s.totals:
            return None
        base = self._before(i, "requests")
        if base is None or "cold_waits" not in base.totals:
            return None
        requests = s.totals["requests"] - base.totals["requests"]
        waits = s.totals["cold_waits"] - base.totals["cold_waits"]
        if requests <= 0 or waits < 0:
            return None
        return round(max(0.0, 1.0 - waits / requests), 4)
