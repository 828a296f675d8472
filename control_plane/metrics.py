"""Prometheus metrics of the control plane (one registry, served at /metrics).

``ControlPlaneMetrics`` holds the series the manager updates as things happen;
``StateCollector`` adds gauges read from the control plane's state at each scrape (pins per
server, slot limits, canaries, router workers), so no code path has to keep them in step.
Labels stay bounded: servers, routes with a canary, fixed states; never request data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from domain.periodic import loop_failures_counter
from domain.series import BoundedLabel

LOAD_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
PROPAGATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.loop_failures = loop_failures_counter("mms", r)
        # Per-model series (hits, misses) for at most MODEL_SERIES_CAP models; the rest
        # share one series labelled "_other" (domain.series).
        self.model_label = BoundedLabel()
        self.illegal_transitions = Counter(
            "mms_illegal_transitions_total", "Model state changes that the state machine does not "
            "list (made anyway, logged)", ["from_state", "to_state"], registry=r)
        self.loads = Counter("mms_loads_total", "Triton loads started by the control plane",
                             ["server", "result"], registry=r)
        self.evictions = Counter("mms_evictions_total", "Models unloaded to make room",
                                 ["server"], registry=r)
        self.unloads = Counter("mms_unloads_total", "Models unloaded (any reason)",
                               ["server", "reason"], registry=r)
        self.hits = Counter("mms_cache_hits_total", "ensure() found the model loaded",
                            ["model"], registry=r)
        self.misses = Counter("mms_cache_misses_total", "ensure() had to load the model",
                              ["model"], registry=r)
        self.load_seconds = Histogram("mms_load_seconds", "Triton load + warm-up time",
                                      ["server"], buckets=LOAD_BUCKETS_S, registry=r)
        self.unload_free_seconds = Histogram(
            "mms_unload_free_seconds", "Unload request until Triton shows the model UNAVAILABLE",
            ["server"], buckets=LOAD_BUCKETS_S, registry=r)
        self.loaded_bytes = Gauge("mms_loaded_bytes", "Bytes counted as used on a server",
                                  ["server"], registry=r)
        self.loaded_models = Gauge("mms_loaded_models", "Models resident on a server",
                                   ["server"], registry=r)
        self.capacity_bytes = Gauge("mms_capacity_bytes", "Memory budget of a server",
                                    ["server"], registry=r)
        self.server_up = Gauge("mms_triton_up", "1 if the Triton server answers", ["server"],
                               registry=r)
        self.warmup_failures = Counter(
            "mms_warmup_failures_total",
            "Loads whose synthetic warm-up the model refused (it is served; mmctl health says why)",
            ["server"], registry=r)
        self.dataplane_propagation = Histogram(
            "mms_dataplane_propagation_seconds",
            "From a change's publication to a router worker's acknowledgement of it (each "
            "worker, each version it applies)", buckets=PROPAGATION_BUCKETS_S, registry=r)
        self.model_copies = Gauge(
            "mms_model_copies", "Servers a model with a copy target (mmctl scale) is READY on: "
            "its own copy and its extra copies", ["model"], registry=r)
        self.capacity_errors = Counter("mms_capacity_errors_total",
                                       "Loads refused because nothing was evictable", registry=r)
        # The same name as a standby's (control_plane.runtime.leadership): sum() over the
        # control planes scraped is the number of leaders.  A control plane without
        # leader election leads alone.
        self.leader = Gauge("control_plane_leader", "1 on the leading control plane, 0 on a "
                            "standby", registry=r)
        self.leader.set(1)

    def declare_servers(self, servers: Iterable[str]) -> None:
        """Each server's counters at 0 from the start: a dashboard's rate() and an alert see
        a series before the first eviction or load instead of no data."""
        for server in servers:
            self.evictions.labels(server)
            self.loads.labels(server, "ok")
            self.loads.labels(server, "failed")
            for reason in EVICTION_REASONS:
                self.unloads.labels(server, reason)


CANARY_STATES = ("running", "promoted", "rolled_back", "aborted")
# mms_unloads_total reasons that make room: on a miss (evicted), ahead of the next one
# (headroom) or back under a shrunken budget (over_budget).  mms_evictions_total counts the
# first only; a dashboard's "evictions" are all three.
EVICTION_REASONS = ("evicted", "headroom", "over_budget")


class StateCollector(Collector):
    """Gauges computed from the control plane's state when Prometheus scrapes.

    ``manager``: the ModelManager (``servers``, ``records``).  ``rollouts``: what holds the
    route table (``table.routes``; the in-process Router or the data-plane hub), or None
    without a router.  ``workers``: the data-plane hub (``worker_counts()``), or None when
    no router worker reports here.  Every read is of in-memory state: a scrape does no I/O.
    """

    def __init__(self, manager, rollouts=None, workers=None,
                 clock: Callable[[], float] = time.time):
        self.manager = manager
        self.rollouts = rollouts
        self.workers = workers
        self.clock = clock

    def describe(self) -> Iterator:
        return iter(())  # computed at each scrape; nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._servers()
        if self.rollouts is not None:
            yield from self._canaries()
        if self.workers is not None:
            yield from self._workers()

    def _servers(self) -> Iterator[GaugeMetricFamily]:
        pinned = GaugeMetricFamily("mms_pinned_models", "Pinned models resident on a server",
                                   labels=["server"])
        pinned_bytes = GaugeMetricFamily("mms_pinned_bytes", "Bytes of the pinned models "
                                         "resident on a server", labels=["server"])
        slots = GaugeMetricFamily(
            "mms_max_loaded_models", "Models a server may hold at once (--max-loaded or its "
            "slots; +Inf without a limit)", labels=["server"])
        counts: dict[str, list[int]] = {name: [0, 0] for name in self.manager.servers}
        for rec in list(self.manager.records.values()):
            if rec.pinned and rec.server in counts:
                counts[rec.server][0] += 1
                counts[rec.server][1] += rec.memory_bytes
        for name, server in list(self.manager.servers.items()):
            pinned.add_metric([name], counts[name][0])
            pinned_bytes.add_metric([name], counts[name][1])
            limit = server.spec.max_loaded
            slots.add_metric([name], math.inf if limit is None else limit)
        yield from (pinned, pinned_bytes, slots)

    def _canaries(self) -> Iterator[GaugeMetricFamily]:
        states = GaugeMetricFamily("mms_canaries", "Canaries by state", labels=["state"])
        percent = GaugeMetricFamily("mms_canary_percent", "Share of a route's traffic its "
                                    "canary's candidate gets now (0 once it is over)",
                                    labels=["route"])
        rolled_back = GaugeMetricFamily(
            "mms_canary_rollback_time_seconds", "When a route's canary was rolled back (unix "
            "time; only for a canary whose verdict is rolled_back)", labels=["route"])
        by_state = dict.fromkeys(CANARY_STATES, 0)
        for route in list(self.rollouts.table.routes.values()):
            canary = route.canary
            if canary is None:
                continue
            by_state[canary.status] = by_state.get(canary.status, 0) + 1
            percent.add_metric([route.name], canary.percent)
            if canary.status == "rolled_back":
                at = next((h.get("at") for h in reversed(canary.history)
                           if h.get("decision") == "rollback"), None)
                rolled_back.add_metric([route.name], at if at is not None else self.clock())
        for state, count in by_state.items():
            states.add_metric([state], count)
        yield from (states, percent, rolled_back)

    def _workers(self) -> Iterator[GaugeMetricFamily]:
        live, expected = self.workers.worker_counts()
        yield GaugeMetricFamily("mms_router_workers_live", "Router workers in touch with this "
                                "control plane (watching its snapshot or reporting)", value=live)
        yield GaugeMetricFamily("mms_router_workers_expected", "Router workers this control "
                                "plane was started to serve (0: routers come and go on their "
                                "own, e.g. an autoscaled Deployment)", value=expected)
