"""Canary analysis: one ``step()`` judges every running canary from the statistics of the
requests the routers served (``control_plane.rollouts.stats``).

Each check compares the canary's window (since its stage began) with the baseline's:
too few canary requests is inconclusive and holds (never promote or roll back on no data);
a failed gate counts toward ``max_failed_checks`` consecutive failures, then rolls back to
0%; a passed check after the stage's duration advances the stage, and passing the last
stage promotes (the logical name now serves the candidate).  Every decision is logged and
kept in the canary's history with the numbers that caused it.

The checks run on the serving event loop, so they stay cheap: the statistics windows are
bounded (``stats``), and the route table is saved only when a check changes the canary's
progress (stage, status, failed-check count), not on every "hold" or "pass"; the store the
service gives the route table writes in its own thread.  A restart resumes from the last
change (the holds since then are only in the log).

The observations a check judges are saved too: each running canary's window (since its
stage began) goes to the route table's store under ``WINDOW_KEY_PREFIX + name`` when it
changed, at most every ``WINDOW_SAVE_INTERVAL_S``, and a new controller (a restart, or a
standby control plane that takes over) restores it, so the next check goes on from the
requests seen before instead of starting over.  A takeover loses at most the outcomes of
the last interval.

Promotion has one source of truth: when the candidate is a registry version of the route's
model, ``on_promote(route, candidate)`` makes it the registry's production version and the
route keeps no alias of its own; otherwise the route gets an alias to the candidate.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from control_plane.rollouts.stats import StatsBook, WindowSummary
from domain.routes import Canary, Route, RouteTable

log = logging.getLogger(__name__)

# Slack added to the relative error gate so a baseline with 0 errors does not turn one
# canary error into a failure.
RELATIVE_ERROR_SLACK = 0.01
WINDOW_KEY_PREFIX = "router.canary_window."  # a key of saved state: never renamed
# A full window is ~1 MB to encode and write; more often would cost the serving loop more
# than the few seconds of outcomes a takeover could lose.
WINDOW_SAVE_INTERVAL_S = 2.0


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


# on_promote(route name, candidate) -> True when the registry now serves the candidate as
# the route's production version (then the route needs no alias).
OnPromote = Callable[[str, str], bool]


def _progress(c: Canary) -> tuple:
    """What a restart must not lose; a check that leaves it as it was writes nothing."""
    return c.status, c.stage_index, c.stage_started_at, c.failed_checks


def window_key(route: str) -> str:
    return WINDOW_KEY_PREFIX + route


class CanaryController:
    def __init__(self, table: RouteTable, stats: StatsBook, clock: Callable[[], float] = time.time,
                 on_promote: OnPromote | None = None):
        self.table = table
        self.stats = stats
        self.clock = clock
        self.on_promote = on_promote
        # route -> (stats revision, stage start, when) of the window last saved for it
        self._saved: dict[str, tuple[int, float, float]] = {}
        self._restore_windows()

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
        self._save_windows(now)

    # ------------------------------------------------------------------ saved windows
    def _restore_windows(self) -> None:
        store = self.table.store
        if store is None:
            return
        for route in self.table.routes.values():
            c = route.canary
            if c is None or c.status != "running":
                continue
            scope = f"canary:{route.name}"
            text = store.get(window_key(route.name))
            if not text:
                continue
            try:
                # Samples from before the current stage (it moved on after the save) stay
                # out of every check: a window starts at the stage's start.
                self.stats.restore(scope, json.loads(text)["variants"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.error("canary %s: its saved statistics window is unreadable (%s); it is "
                          "judged on new requests only", route.name, exc)
                continue
            self._saved[route.name] = (self.stats.revision(scope), c.stage_started_at, self.clock())
            log.info("canary %s: restored its statistics window (%s)", route.name,
                     {v: s["requests"] for v, s in self.stats.scope(scope).items()})

    def _save_windows(self, now: float) -> None:
        """Write each running canary's window when it changed and its last write is older
        than ``WINDOW_SAVE_INTERVAL_S`` (at once when its stage moved on)."""
        store = self.table.store
        if store is None:
            return
        for route in list(self.table.routes.values()):
            c = route.canary
            if c is None or c.status != "running":
                if route.name in self._saved:  # over: its window is of no use to anyone
                    store.put(window_key(route.name), "")
                    del self._saved[route.name]
                continue
            scope = f"canary:{route.name}"
            revision = self.stats.revision(scope)
            last = self._saved.get(route.name)
            if last is None and not self.stats.outcomes(scope):
                continue  # nothing seen yet, nothing saved: nothing to write
            if last is not None and (last[:2] == (revision, c.stage_started_at)
                                     or (last[1] == c.stage_started_at
                                         and now - last[2] < WINDOW_SAVE_INTERVAL_S)):
                continue
            try:
                store.put(window_key(route.name), json.dumps(
                    {"variants": self.stats.saved(scope, c.stage_started_at)}, separators=(",", ":")))
            except Exception:  # the judgement goes on; the next step tries again
                log.exception("saving the statistics window of canary %s failed", route.name)
                continue
            self._saved[route.name] = (revision, c.stage_started_at, now)

    def _decide(self, route: Route, c: Canary, now: float, decision: str, **numbers) -> None:
        entry = {"at": now, "decision": decision, "stage": c.stage_index, "percent": c.percent,
                 **numbers}
        c.history.append(entry)
        del c.history[:-500]  # bounded
        c.last_check_at = now
        log.info("canary %s -> %s: %s %s", route.name, c.candidate, decision, numbers)

    def _check(self, route: Route, c: Canary, now: float) -> None:
        before = _progress(c)
        self._judge(route, c, now)
        if c.status != "promoted" and _progress(c) != before:
            self.table.save()  # promote() has saved already

    def _judge(self, route: Route, c: Canary, now: float) -> None:
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
        promote(self.table, route, now, "promote", numbers, on_promote=self.on_promote)

    def promote_by_hand(self, route: Route, now: float) -> None:
        promote(self.table, route, now, "promote_by_hand", on_promote=self.on_promote)


def promote(table: RouteTable, route: Route, now: float, decision: str, numbers: dict | None = None,
            on_promote: OnPromote | None = None) -> None:
    """Make the candidate what the route serves: through the registry when ``on_promote``
    takes it (no alias, one source of truth), else with an alias.  A failing callback
    falls back to the alias: the verdict stands either way."""
    c = route.canary
    in_registry = False
    if on_promote is not None:
        try:
            in_registry = bool(on_promote(route.name, c.candidate))
        except Exception:
            log.exception("canary %s: promoting %s in the registry failed; aliasing the route "
                          "to it instead", route.name, c.candidate)
    route.target = None if in_registry else c.candidate
    if in_registry and table.target_of(route.name) != c.candidate:
        # The registry took the promotion but the table does not see it (no production
        # lookup wired): the alias keeps the verdict in force.
        log.warning("canary %s: the registry promoted %s but the route still serves %s; "
                    "aliasing the route", route.name, c.candidate, table.target_of(route.name))
        route.target = c.candidate
    c.status = "promoted"
    c.history.append({"at": now, "decision": decision, "stage": c.stage_index, "percent": 100.0,
                      "via": "registry" if route.target is None else "alias", **(numbers or {})})
    c.last_check_at = now
    table.save()
    log.info("canary %s promoted: %s now serves %s (%s)", route.name, route.name, c.candidate,
             "registry production version" if route.target is None else "route alias")


def registry_promoter(registry, who: str = "canary") -> OnPromote:
    """``on_promote`` for a registry: when the candidate is a version of the route's own
    model (``cust017`` -> ``cust017.v4``), make it that model's production version and
    answer True.  Any other candidate (another model, a name the registry does not know)
    answers False and the route aliases it: promoting it in the registry would change
    what *its* model name serves, not this route."""

    def on_promote(route_name: str, candidate: str) -> bool:
        version = registry.by_name(candidate)
        if version is None or version.model != route_name:
            return False
        registry.promote(version.model, version.version, "production", who=who,
                         note=f"canary of {route_name} passed every stage")
        return True

    return on_promote


def abort(table: RouteTable, route: Route, now: float) -> None:
    c = route.canary
    c.status = "aborted"
    c.history.append({"at": now, "decision": "abort", "stage": c.stage_index, "percent": 0.0})
    table.save()
    log.info("canary %s aborted by hand: traffic back to %s", route.name, c.baseline)
