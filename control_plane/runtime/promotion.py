"""Promotion by traffic: auto-pin the busiest models, prefetch into warm the often-missed ones.

``TrafficTracker`` keeps an exponentially decaying request rate per model (half-life
``half_life_s``) from *cumulative* counters sampled now and then: Triton's per-model
``inference_count`` (every request, including those sent straight to Triton) and the
manager's ``mms_cache_misses_total``.  A counter that went backwards (the model was
reloaded, its statistics restarted) counts from zero.

``Promoter.step()`` is one pass, called from the reconcile loop (or on its own interval):

* ``top_k_pin``: the K models with the highest rate are pinned (the seed's "top 12 customers
  send 80% of requests"); a model this class pinned is unpinned once it falls below rank
  ``top_k_pin + unpin_slack`` (hysteresis against churn).  Pins made by an operator are
  never touched: only names in ``auto_pins`` (persisted in the state store) are unpinned.
* ``prefetch_min_miss_rate``: models whose miss rate (misses per second, decayed) is at
  least this, and which are not warm, are staged into the warm tier (at most
  ``max_prefetch_per_step`` per pass), so their next miss skips the cold store.

Each pass re-reads the counters; one failing part (a Triton down, a pin refused for lack
of room) is logged and never stops the pass.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from domain.errors import ControlPlaneError

log = logging.getLogger(__name__)

AUTO_PINS_KEY = "promotion.auto_pins"


class TrafficTracker:
    """Decaying per-model rates (events per second) from cumulative counts."""

    def __init__(self, half_life_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        if half_life_s <= 0:
            raise ValueError(f"half_life_s ({half_life_s}) must be > 0")
        self.half_life_s = half_life_s
        self.clock = clock
        self.rates: dict[str, float] = {}
        self._last_counts: dict[str, int] = {}
        self._last_at: float | None = None

    def observe(self, counts: dict[str, int]) -> None:
        now = self.clock()
        if self._last_at is None:
            self._last_counts = dict(counts)
            self._last_at = now
            return
        dt_s = max(now - self._last_at, 1e-9)
        keep = math.exp(-math.log(2) * dt_s / self.half_life_s)
        for name in set(self.rates) | set(counts):
            total = counts.get(name, self._last_counts.get(name, 0))
            before = self._last_counts.get(name, 0)
            delta = total - before if total >= before else total  # counter restarted
            rate = keep * self.rates.get(name, 0.0) + (1 - keep) * (delta / dt_s)
            if rate < 1e-9 and name not in counts:
                self.rates.pop(name, None)
            else:
                self.rates[name] = rate
        self._last_counts.update(counts)
        self._last_at = now

    def top(self, k: int) -> list[str]:
        ranked = sorted((n for n, r in self.rates.items() if r > 0), key=lambda n: (-self.rates[n], n))
        return ranked[:k]

    def rank(self, name: str) -> int | None:
        ranked = self.top(len(self.rates))
        return ranked.index(name) if name in ranked else None


async def triton_request_counts(manager) -> dict[str, int]:
    """Cumulative inference counts per model from every Triton that answers."""
    counts: dict[str, int] = {}
    for server in manager.servers.values():
        if not server.up:
            continue
        try:
            stats = await server.admin.statistics()
        except ControlPlaneError:
            continue
        for name, s in stats.items():
            counts[name] = counts.get(name, 0) + int(s.get("inference_count", 0) or 0)
    return counts


def counter_by_label(counter, label: str = "model") -> dict[str, int]:
    """Cumulative values of a labelled prometheus Counter (e.g. metrics.misses)."""
    out: dict[str, int] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and label in sample.labels:
                out[sample.labels[label]] = int(sample.value)
    return out


@dataclass
class PromotionReport:
    pinned: list[str] = field(default_factory=list)
    unpinned: list[str] = field(default_factory=list)
    prefetched: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Promoter:
    def __init__(self, manager, warm=None, *, top_k_pin: int | None = None, unpin_slack: int = 2,
                 prefetch_min_miss_rate: float | None = None, max_prefetch_per_step: int = 2,
                 half_life_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 request_counts: Callable[[], Awaitable[dict[str, int]]] | None = None,
                 miss_counts: Callable[[], dict[str, int]] | None = None):
        if top_k_pin is not None and top_k_pin < 0:
            raise ValueError(f"top_k_pin ({top_k_pin}) must be >= 0")
        self.manager = manager
        self.warm = warm
        self.top_k_pin = top_k_pin
        self.unpin_slack = unpin_slack
        self.prefetch_min_miss_rate = prefetch_min_miss_rate
        self.max_prefetch_per_step = max_prefetch_per_step
        self.requests = TrafficTracker(half_life_s, clock)
        self.misses = TrafficTracker(half_life_s, clock)
        self._request_counts = request_counts or (lambda: triton_request_counts(manager))
        self._miss_counts = miss_counts or (lambda: counter_by_label(manager.metrics.misses))
        raw = manager.store.get(AUTO_PINS_KEY)
        self.auto_pins: set[str] = set(json.loads(raw)) if raw else set()

    def _save(self) -> None:
        self.manager.store.put(AUTO_PINS_KEY, json.dumps(sorted(self.auto_pins)))

    async def step(self) -> PromotionReport:
        report = PromotionReport()
        try:
            self.requests.observe(await self._request_counts())
            self.misses.observe(self._miss_counts())
        except Exception as exc:  # counters unavailable this pass: try again next time
            log.exception("promotion: reading request counters failed")
            report.errors.append(repr(exc))
            return report
        if self.top_k_pin is not None:
            await self._pin_top(report)
        if self.prefetch_min_miss_rate is not None and self.warm is not None:
            await self._prefetch(report)
        return report

    async def _pin_top(self, report: PromotionReport) -> None:
        k = self.top_k_pin or 0
        keep = set(self.requests.top(k + self.unpin_slack))
        for name in sorted(self.auto_pins - keep):
            rec = self.manager.records.get(name)
            try:
                if rec is not None and rec.pinned:
                    await self.manager.unpin(name)
                    report.unpinned.append(name)
                self.auto_pins.discard(name)
            except ControlPlaneError as exc:
                report.errors.append(f"unpin {name}: {exc.message}")
        for name in self.requests.top(k):
            rec = self.manager.records.get(name)
            if rec is not None and rec.pinned:
                continue  # pinned already (by us or by an operator)
            try:
                await self.manager.pin(name)
            except ControlPlaneError as exc:
                log.warning("promotion: could not pin %s (rank %s by traffic): %s", name,
                            self.requests.rank(name), exc.message)
                report.errors.append(f"pin {name}: {exc.message}")
                continue
            self.auto_pins.add(name)
            report.pinned.append(name)
            log.info("promotion: pinned %s (%.2f requests/s, top %d)", name,
                     self.requests.rates.get(name, 0.0), k)
        self._save()

    async def _prefetch(self, report: PromotionReport) -> None:
        threshold = self.prefetch_min_miss_rate or 0.0
        hot = sorted(((r, n) for n, r in self.misses.rates.items() if r >= threshold), reverse=True)
        for _rate, name in hot:
            if len(report.prefetched) >= self.max_prefetch_per_step:
                break
            if self.warm.is_warm(name) or name not in self.warm.known():
                continue
            try:
                await self.warm.prefetch(name)
            except ControlPlaneError as exc:
                report.errors.append(f"prefetch {name}: {exc.message}")
                continue
            report.prefetched.append(name)
            log.info("promotion: prefetched %s into warm (%.3f misses/s)", name, _rate)
