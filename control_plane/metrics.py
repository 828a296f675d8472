"""Prometheus metrics of the control plane (one registry, served at /metrics)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from control_plane.domain.periodic import loop_failures_counter
from control_plane.domain.series import BoundedLabel

LOAD_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
PROPAGATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.loop_failures = loop_failures_counter("mms", r)
        # Per-model series (hits, misses) for at most MODEL_SERIES_CAP models; the rest
        # share one series labelled "_other" (control_plane.domain.series).
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
        self.capacity_errors = Counter("mms_capacity_errors_total",
                                       "Loads refused because nothing was evictable", registry=r)
