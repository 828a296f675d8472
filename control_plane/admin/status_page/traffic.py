"""Per-model traffic for the status page, from the router's own Prometheus series.

The router counts every request (``mmr_requests_total{route,model,variant,code}``), every
request that waited for a load (``mmr_cold_load_waits_total{model}``) and its latency
(``mmr_request_seconds{route,variant}``).  The page shows, per model, requests, errors, hit
ratio (requests that found the model loaded) and p50/p99 over the last ``window_s``:
cumulative values now minus those of a baseline kept from ``window_s`` ago.  Until the
control plane has watched that long the baseline is zero: the numbers are since the
router started, and ``since`` says so.

Pure: it is given samples (name, labels, value) and the time; fetching them is the
caller's business.  A router with thousands of routes exports tens of thousands of lines;
``samples_from_text`` reads only the three series used here, several times faster than
prometheus_client's full parser.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

WINDOW_S = 300.0
BASELINE_EVERY_S = 30.0  # how often a baseline is kept (bounds memory: window / this)
SERIES = ("mmr_requests_total", "mmr_cold_load_waits_total", "mmr_request_seconds_bucket")
_LINE_STARTS = tuple(name + "{" for name in SERIES)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict, float]  # name, labels, value


def samples_from_text(text: str) -> Iterator[Sample]:
    """The samples of ``SERIES`` in Prometheus' text format; every other line is skipped
    unparsed."""
    for line in text.splitlines():
        if not line.startswith(_LINE_STARTS):
            continue
        brace, end = line.index("{"), line.rindex("}")
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\")
                  for k, v in _LABEL.findall(line, brace, end)}
        yield line[:brace], labels, float(line[end + 1:].split()[0])


def samples_from_families(families: Iterable) -> Iterator[Sample]:
    """The samples of ``SERIES`` in prometheus_client Metric objects."""
    for family in families:
        for s in family.samples:
            if s.name in SERIES:
                yield s.name, s.labels, s.value


@dataclass
class Counts:
    """Cumulative counts of one model (or of everything)."""

    requests: float = 0.0
    errors: float = 0.0
    cold_waits: float = 0.0
    buckets: list[float] = field(default_factory=list)  # cumulative, in ``bounds`` order

    def minus(self, base: Counts | None) -> Counts:
        """self - base; a counter that went down was reset (a router restarted): it counts
        from zero again, so its value is the delta."""
        if base is None or self.requests < base.requests:
            return self
        buckets = ([a - b for a, b in zip(self.buckets, base.buckets)]
                   if len(self.buckets) == len(base.buckets) else self.buckets)
        return Counts(self.requests - base.requests, max(self.errors - base.errors, 0.0),
                      max(self.cold_waits - base.cold_waits, 0.0), buckets)


@dataclass
class Snapshot:
    at: float
    models: dict[str, Counts]
    bounds: list[float]  # histogram upper bounds (le), +Inf last


def quantile(q: float, bounds: list[float], cumulative: list[float]) -> float | None:
    """``histogram_quantile`` as Prometheus computes it: linear within the bucket that
    holds the rank; a rank in the +Inf bucket answers the highest finite bound."""
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    lower, below = 0.0, 0.0
    for upper, count in zip(bounds, cumulative):
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def parse(samples: Iterable[Sample], at: float) -> Snapshot:
    """The router's samples as cumulative counts per concrete model.

    Latency is labelled by route and variant, not model: each (route, variant) goes to the
    model that served most of its requests (one, unless a promotion changed it)."""
    models: dict[str, Counts] = {}
    served_by: dict[tuple[str, str], tuple[float, str]] = {}  # (route, variant) -> (n, model)
    histograms: dict[tuple[str, str], dict[float, float]] = {}
    waits: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "mmr_requests_total":
            model = labels.get("model", "")
            c = models.setdefault(model, Counts())
            c.requests += value
            if labels.get("code") != "OK":
                c.errors += value
            key = (labels.get("route", ""), labels.get("variant", ""))
            n, _ = served_by.get(key, (-1.0, ""))
            if value > n:
                served_by[key] = (value, model)
        elif name == "mmr_cold_load_waits_total":
            waits[labels.get("model", "")] = value
        elif name == "mmr_request_seconds_bucket":
            key = (labels.get("route", ""), labels.get("variant", ""))
            histograms.setdefault(key, {})[float(labels["le"])] = value
    bounds = sorted({le for h in histograms.values() for le in h})
    for key, by_bound in histograms.items():
        model = served_by.get(key, (0.0, None))[1]
        if model is None:
            continue
        c = models.setdefault(model, Counts())
        values = [by_bound.get(le, 0.0) for le in bounds]
        c.buckets = [a + b for a, b in zip(c.buckets, values)] if c.buckets else values
    for model, n in waits.items():
        models.setdefault(model, Counts()).cold_waits = n
    models.pop("unknown", None)  # requests for names that turned out unknown
    return Snapshot(at, models, bounds)


@dataclass
class ModelTraffic:
    requests: int
    errors: int
    hit_ratio: float | None  # requests that did not wait for a load / requests
    p50_ms: float | None
    p99_ms: float | None

    def to_dict(self) -> dict:
        return {"requests": self.requests, "errors": self.errors, "hit_ratio": self.hit_ratio,
                "p50_ms": self.p50_ms, "p99_ms": self.p99_ms}


def summarize(delta: Counts, bounds: list[float]) -> ModelTraffic:
    def ms(q: float) -> float | None:
        v = quantile(q, bounds, delta.buckets)
        return None if v is None else round(v * 1000, 3)

    hit_ratio = None
    if delta.requests > 0:
        hit_ratio = round(max(0.0, 1.0 - delta.cold_waits / delta.requests), 4)
    return ModelTraffic(int(delta.requests), int(delta.errors), hit_ratio, ms(0.5), ms(0.99))


class RouterTraffic:
    """The latest snapshot and the baselines the window needs."""

    def __init__(self, window_s: float = WINDOW_S, baseline_every_s: float = BASELINE_EVERY_S):
        self.window_s = window_s
        self.baseline_every_s = baseline_every_s
        self.latest: Snapshot | None = None
        self._baselines: deque[Snapshot] = deque()
        self._observed = 0  # snapshots observed: what per_model's cache is keyed by
        self._summary: tuple[int, dict[str, ModelTraffic]] = (-1, {})

    def observe(self, snapshot: Snapshot) -> None:
        self.latest = snapshot
        self._observed += 1
        if not self._baselines or snapshot.at - self._baselines[-1].at >= self.baseline_every_s:
            self._baselines.append(snapshot)
        # Keep the newest baseline at least a window old; drop the ones before it.
        while len(self._baselines) > 1 and self._baselines[1].at <= snapshot.at - self.window_s:
            self._baselines.popleft()

    def _baseline(self) -> Snapshot | None:
        if self.latest is None or not self._baselines:
            return None
        first = self._baselines[0]
        return first if first.at <= self.latest.at - self.window_s else None

    @property
    def since(self) -> float | None:
        """Start of the window (unix time); None: since the router started."""
        base = self._baseline()
        return None if base is None else base.at

    def per_model(self) -> dict[str, ModelTraffic]:
        """Each model over the window; worked out once per snapshot (pages poll more often
        than the router is read)."""
        if self.latest is None:
            return {}
        base = self._baseline()
        if self._summary[0] != self._observed:
            self._summary = (self._observed, {
                model: summarize(counts.minus(None if base is None else base.models.get(model)),
                                 self.latest.bounds)
                for model, counts in self.latest.models.items()})
        return self._summary[1]

    def totals(self) -> Counts:
        """Cumulative totals over every model (for the history's rates)."""
        total = Counts()
        if self.latest is not None:
            for c in self.latest.models.values():
                total.requests += c.requests
                total.errors += c.errors
                total.cold_waits += c.cold_waits
        return total

    def overall(self) -> ModelTraffic | None:
        """Every model together, over the window."""
        if self.latest is None:
            return None
        base = self._baseline()
        total = Counts(buckets=[0.0] * len(self.latest.bounds))
        for model, counts in self.latest.models.items():
            d = counts.minus(None if base is None else base.models.get(model))
            total.requests += d.requests
            total.errors += d.errors
            total.cold_waits += d.cold_waits
            if len(d.buckets) == len(total.buckets):
                total.buckets = [a + b for a, b in zip(total.buckets, d.buckets)]
        return summarize(total, self.latest.bounds)
