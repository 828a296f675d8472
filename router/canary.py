"""Canary analysis: one ``step()`` judges every running canary from the router's statistics.

Each check compares the canary's window (since its stage began) with the baseline's:
too few canary requests is inconclusive and holds (never promote or roll back on no data);
a failed gate counts toward ``max_failed_checks`` consecutive failures, then rolls back to
0%; a passed check after the stage's duration advances the stage, and passing the last
stage promotes (the logical name now points at the candidate).  Every decision is logged
and persisted with the numbers that caused it, so a restart resumes where it was.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from .routes import Canary, Route, RouteTable
from .stats import StatsBook, WindowSummary

log = logging.getLogger(__name__)

# Slack added to the relative error gate so a baseline with 0 errors does not turn one
# canary error into a failure.
RELATIVE_ERROR_SLACK = 0.01


def gate_failures(c: Canary, cand: WindowSummary, base: WindowSummary) -> list[str]:
    failures = []
    if cand.error_rate > c.max_error_rate:
        failures.append(f"error rate {cand.error_rate:.3f} > {c.max_error_rate:.3f}")
    if c.max_p99_ms is not None and cand.p99_ms is not None and cand.p99_ms > c.max_p99_ms:
        failures.append(f"p99 {cand.p99_ms:.1f} ms > {c.max_p99_ms:.1f} ms")
    if base.requests >= c.min_requests:
        if c.max_error_rate_ratio is not None:
            limit = c.max_error_rate_ratio * base.error_rate + RELATIVE_ERROR_SLACK
            if cand.error_rate > limit:
                failures.append(f"error rate {cand.error_rate:.3f} > {c.max_error_rate_ratio}x "
                                f"baseline {base.error_rate:.3f} (+{RELATIVE_ERROR_SLACK})")
        if (c.max_p99_ratio is not None and cand.p99_ms is not None and base.p99_ms
                and cand.p99_ms > c.max_p99_ratio * base.p99_ms):
            failures.append(f"p99 {cand.p99_ms:.1f} ms > {c.max_p99_ratio}x baseline "
                            f"{base.p99_ms:.1f} ms")
    return failures


class CanaryController:
    def __init__(self, table: RouteTable, stats: StatsBook, clock: Callable[[], float] = time.time):
        self.table = table
        self.stats = stats
        self.clock = clock

    def step(self) -> None:
        now = self.clock()
        for route in list(self.table.routes.values()):
            c = route.canary
            if c is None or c.status != "running" or now - c.last_check_at < c.check_interval_s:
                continue
            try:
                self._check(route, c, now)
            except Exception:  # one broken canary never stops the others
                log.exception("canary check of %s failed", route.name)

    def _decide(self, route: Route, c: Canary, now: float, decision: str, **numbers) -> None:
        entry = {"at": now, "decision": decision, "stage": c.stage_index, "percent": c.percent,
                 **numbers}
        c.history.append(entry)
        del c.history[:-500]  # bounded
        c.last_check_at = now
        self.table.save()
        log.info("canary %s -> %s: %s %s", route.name, c.candidate, decision, numbers)

    def _check(self, route: Route, c: Canary, now: float) -> None:
        scope = f"canary:{route.name}"
        cand = self.stats.get(scope, "canary").window(c.stage_started_at)
        base = self.stats.get(scope, "baseline").window(c.stage_started_at)
        numbers = {"canary": cand.to_dict(), "baseline": base.to_dict()}
        if cand.requests < c.min_requests:
            self._decide(route, c, now, "hold", reason=f"inconclusive: {cand.requests} canary "
                         f"requests < minimum {c.min_requests}", **numbers)
            return
        failures = gate_failures(c, cand, base)
        if failures:
            c.failed_checks += 1
            if c.failed_checks >= c.max_failed_checks:
                c.status = "rolled_back"
                self._decide(route, c, now, "rollback", reason="; ".join(failures),
                             failed_checks=c.failed_checks, **numbers)
            else:
                self._decide(route, c, now, "fail", reason="; ".join(failures),
                             failed_checks=c.failed_checks, **numbers)
            return
        c.failed_checks = 0
        if now - c.stage_started_at < c.stage_s:
            self._decide(route, c, now, "pass", **numbers)
            return
        if c.stage_index + 1 < len(c.stages):
            c.stage_index += 1
            c.stage_started_at = now
            self._decide(route, c, now, "advance", **numbers)
            return
        promote(self.table, route, now, "promote", numbers)


def promote(table: RouteTable, route: Route, now: float, decision: str, numbers: dict | None = None) -> None:
    c = route.canary
    route.target = c.candidate
    c.status = "promoted"
    c.history.append({"at": now, "decision": decision, "stage": c.stage_index, "percent": 100.0,
                      **(numbers or {})})
    c.last_check_at = now
    table.save()
    log.info("canary %s promoted: %s now serves %s", route.name, route.name, c.candidate)


def abort(table: RouteTable, route: Route, now: float) -> None:
    c = route.canary
    c.status = "aborted"
    c.history.append({"at": now, "decision": "abort", "stage": c.stage_index, "percent": 0.0})
    table.save()
    log.info("canary %s aborted by hand: traffic back to %s", route.name, c.baseline)
