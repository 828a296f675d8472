"""What the router counts: its Prometheus series, and the recording of one request's outcome
in them and in the experiment and canary windows (``Recording``)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from domain.periodic import loop_failures_counter
from domain.routes import Decision
from domain.series import BoundedLabel
from router.serving.outcomes import OutcomeSink

LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1, 2.5, 5, 10, 30)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("mmr_requests_total", "Inference requests by route and variant",
                                ["route", "model", "variant", "code"], registry=r)
        self.latency = Histogram("mmr_request_seconds", "End-to-end router latency",
                                 ["route", "variant"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.cold_waits = Counter("mmr_cold_load_waits_total",
                                  "Requests that waited for a model to load", ["model"], registry=r)
        self.cold_wait_seconds = Histogram("mmr_cold_load_wait_seconds", "Time waiting for a load",
                                           ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.rate_limited = Counter("mmr_rate_limited_total", "Requests rejected by a rate limit",
                                    ["limit"], registry=r)
        self.shadow_dropped = Counter("mmr_shadow_dropped_total", "Mirrors dropped (queue full)",
                                      ["route"], registry=r)
        self.shadow_results = Counter("mmr_shadow_results_total",
                                      "Shadow outcomes: match, diverged, error, timeout",
                                      ["route", "result"], registry=r)
        self.miss_budget_refused = Counter(
            "mmr_miss_budget_refused_total",
            "Requests refused because their client caused more misses than its budget", registry=r)
        self.deadline_refused = Counter(
            "mmr_deadline_refused_total",
            "Requests refused at once because they could not start within their deadline: "
            "their model's load (reason load) or the requests queued before them (reason "
            "queue) would outlast it", ["reason"], registry=r)
        self.share_wait = Histogram(
            "mmr_share_wait_seconds", "Time requests waited for their model's fair share of a "
            "saturated server (servers with a concurrency)", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.share_refused = Counter(
            "mmr_share_refused_total", "Requests refused because as many of their model's "
            "requests already waited for its share of a saturated server as a worker holds",
            ["model"], registry=r)
        self.refused = Counter("mmr_refused_total", "Model-control calls refused on the public port",
                               ["api"], registry=r)
        self.inflight = Gauge("mmr_inflight_requests", "Requests in flight", registry=r,
                              multiprocess_mode="livesum")  # summed over live router workers
        self.past_deadline = Gauge(
            "mmr_requests_past_deadline",
            "Requests whose client's deadline passed while Triton still had them (their sends "
            "stay open until Triton answers: a copy that fell behind)",
            registry=r, multiprocess_mode="livesum")
        self.loop_failures = loop_failures_counter("mmr", r)
        self.writes = RequestWrites(self.inflight)  # each request's writes, made after it
        # Route and model labels for at most MODEL_SERIES_CAP names each; the rest share one
        # series labelled "_other" (domain.series): sums stay exact.
        self.model_label = BoundedLabel()
        self.route_label = BoundedLabel()


# How long a request's Prometheus writes may wait to be made with those of the requests
# around it.  A scrape of this process's /metrics makes them at once; another process's
# (the control plane's, over every worker's files) sees them this much later at most.
FLUSH_INTERVAL_S = 0.005


class RequestWrites:
    """The Prometheus writes of each request (``mmr_inflight_requests`` up when it starts
    and down when it ends, ``mmr_requests_total`` and ``mmr_request_seconds``), made together
    every ``FLUSH_INTERVAL_S`` instead of inside each request: the in-flight changes of that
    time are netted into one write, the counts of each series into one increment, and only
    the latency observations stay one per request.  Without a running loop (a synchronous
    caller) they are made at once.

    In a router worker (multiprocess mode) each write takes a lock, looks up the process id
    and packs a value into a memory-mapped file: measured in a worker on the identity model,
    the five writes of a hit were a quarter of the router's own Python per request."""

    __slots__ = ("_answered", "_inflight_due", "_loop", "inflight")

    def __init__(self, inflight: Gauge):
        self.inflight = inflight
        self._inflight_due = 0  # net change of the in-flight gauge not written yet
        self._answered: list[tuple] = []  # (requests child, latency child, seconds) not written yet
        self._loop: asyncio.AbstractEventLoop | None = None  # where a flush is due

    def started(self) -> None:
        self._inflight_due += 1
        self._due()

    def ended(self) -> None:
        self._inflight_due -= 1
        self._due()

    def answered(self, requests, latency, latency_s: float) -> None:
        """One request counted in the ``requests`` child and observed in the ``latency`` one."""
        self._answered.append((requests, latency, latency_s))
        self._due()

    def _due(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: nothing to defer to
            self.flush()
            return
        if self._loop is not loop:  # none due yet on this loop (or on one that is gone)
            self._loop = loop
            loop.call_later(FLUSH_INTERVAL_S, self.flush)

    def flush(self) -> None:
        """Make every write that is due now."""
        self._loop = None
        due, self._inflight_due = self._inflight_due, 0
        if due:
            self.inflight.inc(due)
        answered, self._answered = self._answered, []
        counted: dict = {}  # one write per series for the requests since the last flush
        for requests, latency, latency_s in answered:
            counted[requests] = counted.get(requests, 0) + 1
            latency.observe(latency_s)
        for requests, n in counted.items():
            requests.inc(n)


class Recording:
    """Counts each request's outcome in ``metrics`` and hands the outcomes of experiment and
    canary requests to ``outcomes``: the control plane's statistics in this process
    (``control_plane.rollouts.stats.StatsBook``), or a router worker's report to the control
    plane (``router.serving.state_client.RemoteState``).  None: those outcomes are judged
    nowhere (a router without experiments and canaries, unit tests)."""

    def __init__(self, metrics: RouterMetrics, outcomes: OutcomeSink | None = None):
        self.metrics = metrics
        self.outcomes = outcomes
        self._children: dict[tuple, tuple] = {}  # labels -> (requests, latency) children

    def record(self, decision: Decision, latency_s: float, code: str, known: bool = True,
               served_s: float | None = None) -> None:
        """``served_s``: latency from when the model was ready (None: it never was)."""
        # Adapters share their base's series: adapter names are chosen by clients.
        metrics = self.metrics
        # Keyed by the series' own (bounded) labels: names past the cap share "_other", so a
        # client sending made-up names grows nothing here.
        series_route = metrics.route_label(decision.logical.split(":", 1)[0] if known else "unknown")
        series_model = metrics.model_label(decision.model if known else "unknown")
        key = (series_route, series_model, decision.variant, code)
        children = self._children.get(key)
        if children is None:  # labels() lookups cost more than the increments themselves
            children = self._children[key] = (
                metrics.requests.labels(*key),
                metrics.latency.labels(series_route, decision.variant))
        metrics.writes.answered(children[0], children[1], latency_s)
        if self.outcomes is None or not decision.scope.startswith(("exp:", "canary:")):
            return  # per-variant windows feed experiments and canaries only
        # Judge the model, not its load or the client: latency from ready, client errors apart.
        self.outcomes.record_outcome(decision.scope, decision.variant, code,
                                     None if served_s is None else served_s * 1000,
                                     decision.randomly_assigned)
