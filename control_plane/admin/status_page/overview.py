"""What the status page shows, in one JSON document (``GET /v1/overview``).

Put together from what the control plane already holds (the manager's records and fleet,
the warm tier's locator, the route table with its experiments, canaries and shadows, the
data-plane hub's workers), its own counters, and the router's Prometheus series for
per-model traffic (``traffic``).  Nothing here changes state.

Cost: one pass over the models per build (2,000 models: ~25 ms), shared by every page
open at the time (``OverviewCache``); models go out as rows of a fixed column list, which
keeps thousands of them to a compact document.  The router's /metrics is read in the
background, never on a page's request: every ``ROUTER_READ_IDLE_S`` (so a page opens on
the last half hour's requests and hit ratio), every ``ROUTER_READ_MIN_S`` while a page is
open, and less often when it is big (``ROUTER_READ_COST_FACTOR`` times what the last read
took: router workers with 1,500 routes take ~1.6 s to export theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field

from control_plane.admin.status_page.history import SAMPLE_EVERY_S, History
from control_plane.admin.status_page.traffic import (
    RouterTraffic,
    Sample,
    parse,
    samples_from_families,
    samples_from_text,
)
from control_plane.metrics import EVICTION_REASONS

log = logging.getLogger(__name__)

ROUTER_READ_MIN_S = 4.0
ROUTER_READ_IDLE_S = 30.0
ROUTER_READ_COST_FACTOR = 10.0  # a read costing X s waits 10 X s for the next
CACHE_S = 1.0  # one build serves every page that polls within this long
CANARY_HISTORY_POINTS = 120
MODEL_COLUMNS = ("model", "tier", "state", "pinned", "server", "last_used", "load_time_s",
                 "memory_bytes", "loads", "requests", "errors", "hit_ratio", "p50_ms", "p99_ms",
                 "failure", "copies")

# Returns the router's samples (``traffic.Sample``); raises when it cannot read them (the
# page says so and shows the rest).
RouterMetrics = Callable[[], Awaitable[Iterable[Sample]]]


@dataclass
class StatusSources:
    """The collaborators the page reads.  ``rollouts``: the in-process Router or the
    data-plane hub (``table``, ``stats``, ``shadow``); ``workers``: the hub when router
    workers report to it; ``router_metrics``: reads the router's series; ``locate``: the
    warm tier's ``name -> {"tier", ...}``."""

    manager: object
    locate: Callable[[str], dict] | None = None
    rollouts: object | None = None
    workers: object | None = None
    router_metrics: RouterMetrics | None = None
    clock: Callable[[], float] = time.time
    started_at: float = field(default_factory=time.time)


def counter_total(counter) -> float:
    """Sum of a prometheus Counter over its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def control_plane_totals(metrics) -> dict[str, float]:
    """Misses, evictions (every unload that made room, ``EVICTION_REASONS``) and loads."""
    loads = evictions = 0.0
    for m in metrics.loads.collect():
        loads += sum(s.value for s in m.samples
                     if s.name.endswith("_total") and s.labels.get("result") == "ok")
    for m in metrics.unloads.collect():
        evictions += sum(s.value for s in m.samples
                         if s.name.endswith("_total") and s.labels.get("reason") in EVICTION_REASONS)
    return {"misses": counter_total(metrics.misses), "evictions": evictions, "loads": loads}


class Overview:
    """Builds the document; keeps the history and the router's traffic between builds."""

    def __init__(self, sources: StatusSources):
        self.sources = sources
        self.history = History()
        self.traffic = RouterTraffic()
        self.router_error: str | None = None
        self._router_read_at = -1e9  # monotonic
        self._router_interval_s = 0.0  # what the last read's cost asks for
        self._reading: asyncio.Task | None = None

    # ------------------------------------------------------------------ sampling
    def sample_control_plane(self) -> None:
        """The background sampler's step: the control plane's own counters (cheap), and
        now and then the router's."""
        self.history.sample(self.sources.clock(),
                            control_plane_totals(self.sources.manager.metrics))
        self.refresh_router_soon(ROUTER_READ_IDLE_S)

    def refresh_router_soon(self, every_s: float = ROUTER_READ_MIN_S) -> None:
        """Start a read of the router's series when one is due and none runs."""
        if self.sources.router_metrics is None or self._reading is not None:
            return
        if time.monotonic() - self._router_read_at < max(every_s, self._router_interval_s):
            return
        self._reading = asyncio.get_running_loop().create_task(self.read_router())
        self._reading.add_done_callback(lambda _t: setattr(self, "_reading", None))

    async def read_router(self) -> None:
        source = self.sources.router_metrics
        if source is None:
            return
        started = time.monotonic()
        try:
            samples = await source()
            now = self.sources.clock()
            self.traffic.observe(await asyncio.to_thread(parse, samples, now))
            self.router_error = None
        except Exception as exc:  # noqa: BLE001 - whatever it was, the rest of the page shows
            self.router_error = f"the router's metrics could not be read: {exc}"
            log.debug("status page: %s", self.router_error)
            return
        finally:
            self._router_read_at = time.monotonic()
            self._router_interval_s = ROUTER_READ_COST_FACTOR * (self._router_read_at - started)
        totals = self.traffic.totals()
        self.history.sample(now, {**control_plane_totals(self.sources.manager.metrics),
                                  "requests": totals.requests, "errors": totals.errors,
                                  "cold_waits": totals.cold_waits})

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading

    # ------------------------------------------------------------------ the document
    async def build(self) -> dict:
        self.refresh_router_soon()
        now = self.sources.clock()
        self.history.sample(now, control_plane_totals(self.sources.manager.metrics))
        manager = self.sources.manager
        models = self._models()
        servers = self._servers(manager.fleet(), models)
        overall = self.traffic.overall()
        series = self.history.series(now)
        tiers: dict[str, int] = {}
        states: dict[str, int] = {}
        for row in models:
            tiers[row[1]] = tiers.get(row[1], 0) + 1
            states[row[2]] = states.get(row[2], 0) + 1
        return {
            "at": now,
            "control_plane": {"role": "leader", "started_at": self.sources.started_at},
            "summary": {
                "models": len(models), "tiers": tiers, "states": states,
                "pinned": sum(1 for row in models if row[3]),
                "misses_per_min": _last(series["misses_per_min"]),
                "evictions_per_min": _last(series["evictions_per_min"]),
                "requests_per_s": _last(series["requests_per_s"]),
                "hit_ratio": overall.hit_ratio if overall else None,
                "p50_ms": overall.p50_ms if overall else None,
                "p99_ms": overall.p99_ms if overall else None,
                "requests": overall.requests if overall else None,
            },
            "servers": servers,
            "history": series,
            "history_sample_s": SAMPLE_EVERY_S,
            "models": {"columns": list(MODEL_COLUMNS), "rows": models},
            "traffic": {"window_s": self.traffic.window_s, "since": self.traffic.since,
                        "configured": self.sources.router_metrics is not None,
                        "available": self.traffic.latest is not None,
                        "read_at": self.traffic.latest.at if self.traffic.latest else None,
                        "error": self.router_error},
            **self._rollouts(),
            "workers": self._workers(now),
        }

    def _models(self) -> list[list]:
        locate = self.sources.locate
        traffic = self.traffic.per_model()
        rows = []
        for m in self.sources.manager.status():
            name = m["model"]
            tier = locate(name)["tier"] if locate is not None else (
                "hot" if m.get("server") else "warm")
            t = traffic.get(name)
            rows.append([name, tier, m["state"], m["pinned"], m["server"], m["last_used"],
                         m["load_time_s"], m["memory_bytes"], m.get("loads", 0),
                         t.requests if t else None, t.errors if t else None,
                         t.hit_ratio if t else None, t.p50_ms if t else None,
                         t.p99_ms if t else None, m["failure"],
                         # The servers of its extra copies (mmctl scale) that are ready.
                         [c["server"] for c in m.get("copies", ())[1:] if c["state"] == "ready"]])
        adapters = getattr(self.sources.manager, "adapters", None)
        for m in adapters.rows() if adapters is not None else ():  # LoRA adapters: BASE:ADAPTER
            t = traffic.get(m["model"])
            rows.append([m["model"], m["tier"], m["state"], m["pinned"], m["server"], m["last_used"],
                         m["load_time_s"], m["memory_bytes"], 0,
                         t.requests if t else None, t.errors if t else None,
                         t.hit_ratio if t else None, t.p50_ms if t else None,
                         t.p99_ms if t else None, m["failure"], []])
        return rows

    @staticmethod
    def _servers(fleet: list[dict], models: list[list]) -> list[dict]:
        by_server: dict[str, dict] = {}
        for row in models:
            name, _, state, pinned, server = row[:5]
            if server is None:
                continue
            s = by_server.setdefault(server, {"pinned": [], "pinned_bytes": 0, "states": {}})
            s["states"][state] = s["states"].get(state, 0) + 1
            if pinned:
                s["pinned"].append(name)
                s["pinned_bytes"] += row[7] or 0
        out = []
        for f in fleet:
            mine = by_server.get(f["server"], {"pinned": [], "pinned_bytes": 0, "states": {}})
            out.append({
                "server": f["server"], "device": f["device"], "up": f["up"], "lost": f["lost"],
                "memory_budget_bytes": f["memory_budget_bytes"], "used_bytes": f["used_bytes"],
                "device_memory_bytes": f.get("device_memory_bytes"),
                "device_used_bytes": f.get("device_used_bytes"),
                "max_loaded": f["max_loaded"], "loaded": f["loaded"],
                "pinned": sorted(mine["pinned"]), "pinned_bytes": mine["pinned_bytes"],
                "states": mine["states"], "headroom": f.get("headroom")})
        return out

    def _rollouts(self) -> dict:
        rollouts = self.sources.rollouts
        if rollouts is None:
            return {"experiments": [], "canaries": [], "shadows": [], "router": False}
        experiments, canaries, shadows = [], [], []
        for route in list(rollouts.table.routes.values()):
            if route.experiment is not None:
                e = route.experiment
                experiments.append({**asdict(e), "route": route.name,
                                    "variants": rollouts.stats.scope(f"exp:{e.id}")})
            if route.canary is not None:
                canaries.append(_canary(route.name, route.canary,
                                        rollouts.stats.scope(f"canary:{route.name}")))
            if route.shadow is not None:
                report = rollouts.shadow.report(route.name)
                shadows.append({"route": route.name, "model": route.shadow.model,
                                "percent": route.shadow.percent, **_jsonable(report)})
        return {"experiments": experiments, "canaries": canaries, "shadows": shadows,
                "router": True}

    def _workers(self, now: float) -> dict | None:
        hub = self.sources.workers
        if hub is None:
            return None
        live, expected = hub.worker_counts()
        return {"live": live, "expected": expected,
                "list": [dict(w.to_dict(now, hub.version, hub.epoch), in_touch=w.in_touch(now))
                         for w in list(hub.workers.values())]}


def _last(values: list) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def _jsonable(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("log", "last")}


def _canary(route: str, c, variants: dict) -> dict:
    """A canary as the page shows it: where it is, the last verdict and why."""
    decisions = [h for h in c.history if h.get("decision") not in (None, "hold", "pass")]
    last = c.history[-1] if c.history else {}
    why = last.get("reason")
    if why is None and last.get("decision") in ("pass", "advance", "promote"):
        why = _gates_passed(last)
    verdict = {"running": last.get("decision", "start"), "promoted": "promoted",
               "rolled_back": "rolled back", "aborted": "aborted"}.get(c.status, c.status)
    if c.status == "rolled_back":  # the rollback's reason, not a later note
        rollback = next((h for h in reversed(c.history) if h.get("decision") == "rollback"), last)
        why = rollback.get("reason", why)
    return {
        "route": route, "baseline": c.baseline, "candidate": c.candidate, "status": c.status,
        "stages": c.stages, "stage_index": c.stage_index, "percent": c.percent,
        "stage_s": c.stage_s, "stage_started_at": c.stage_started_at,
        "failed_checks": c.failed_checks, "max_failed_checks": c.max_failed_checks,
        "max_error_rate": c.max_error_rate, "max_p99_ms": c.max_p99_ms,
        "min_requests": c.min_requests, "verdict": verdict, "why": why,
        "last_check_at": last.get("at"),
        "steps": [{"at": h.get("at"), "percent": h.get("percent"), "decision": h.get("decision")}
                  for h in decisions[-CANARY_HISTORY_POINTS:]],
        "variants": variants,
    }


def _gates_passed(entry: dict) -> str | None:
    cand = entry.get("canary") or {}
    if not cand:
        return None
    p99 = cand.get("p99_ms")
    parts = [f"{cand.get('requests', 0)} canary requests",
             f"error rate {cand.get('error_rate', 0):.3f}"]
    if p99 is not None:
        parts.append(f"p99 {p99:.1f} ms")
    return "gates passed: " + ", ".join(parts)


class OverviewCache:
    """One build at a time, shared by every poll within ``CACHE_S``; the encoded bytes are
    what the handler sends."""

    def __init__(self, overview: Overview, clock: Callable[[], float] = time.monotonic):
        self.overview = overview
        self.clock = clock
        self._body = b""
        self._at = -1e9
        self._lock = asyncio.Lock()

    async def body(self) -> bytes:
        async with self._lock:
            if self.clock() - self._at >= CACHE_S:
                self._body = encode(await self.overview.build())
                self._at = self.clock()
            return self._body


def encode(document: dict) -> bytes:
    """JSON a browser parses: NaN and infinities (not JSON) become null."""
    try:
        text = json.dumps(document, separators=(",", ":"), allow_nan=False, default=str)
    except ValueError:
        text = json.dumps(_finite(document), separators=(",", ":"), allow_nan=False, default=str)
    return text.encode()


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def registry_reader(metrics) -> RouterMetrics:
    """The in-process router's series, from its three metric objects (``RouterMetrics``
    of router.serving.metrics), not its whole registry."""

    async def read() -> list[Sample]:
        families = [*metrics.requests.collect(), *metrics.cold_waits.collect(),
                    *metrics.latency.collect()]
        return list(samples_from_families(families))

    return read


class HttpMetricsReader:
    """The router workers' series from their /metrics (every worker's, summed, whichever
    worker answers: ``router.frontends.http_frontend.metrics_registry``)."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url
        self.timeout_s = timeout_s
        self._session = None

    async def __call__(self) -> list[Sample]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._session.get(self.url) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.url} answered {resp.status}")
            text = await resp.text()
        # Thousands of routes make a long text: read it off the event loop.
        return await asyncio.to_thread(lambda: list(samples_from_text(text)))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def local_url(address: str, path: str) -> str:
    """``host:port`` of a listener -> a URL this machine can call (a wildcard bind is
    reached on loopback)."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "", "[::]", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{port}{path}"
