"""Per-adapter Prometheus metrics, from the latest status each LoRA base reported."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from domain.series import OTHER_LABEL, BoundedLabel

COUNTS = ("requests", "device_hits", "host_hits", "misses", "cold_loads")


class AdapterMetrics:
    """Per-adapter Prometheus metrics from the latest status of each base.

    The values are the model's own counters (they restart at zero when the base is reloaded,
    which Prometheus treats as a counter reset).  The last status of a base that was unloaded
    stays exposed until the base answers again.

    Series stay bounded with thousands of adapters: the first ``MODEL_SERIES_CAP`` adapters
    seen keep series of their own, the others are summed per base under adapter
    ``_other`` (counters and resident counts; their last load and swap-in times are left
    out), so a sum over adapters is still the exact total."""

    def __init__(self, registry: CollectorRegistry | None, label: BoundedLabel | None = None):
        self._status: dict[str, dict] = {}
        # base -> adapters the control plane evicted from its slots for others (AdapterSlots)
        self.evictions: dict[str, int] = {}
        self._label = label or BoundedLabel()
        if registry is not None:
            registry.register(self)

    def update(self, base: str, status: dict) -> None:
        self._status[base] = status

    def describe(self):
        return []

    def collect(self):
        labels = ["base", "adapter"]
        requests = CounterMetricFamily("mms_adapter_requests", "Requests that named the adapter", labels=labels)
        hits = CounterMetricFamily("mms_adapter_cache_hits",
                                   "Requests that found the adapter in a device slot or host memory",
                                   labels=[*labels, "tier"])
        misses = CounterMetricFamily("mms_adapter_cache_misses",
                                     "Requests that had to load the adapter from its directory", labels=labels)
        cold_loads = CounterMetricFamily("mms_adapter_cold_loads", "Adapter loads from the directory",
                                         labels=labels)
        load_s = GaugeMetricFamily("mms_adapter_load_seconds", "Duration of the adapter's last load from "
                                   "its directory", labels=labels)
        swap_s = GaugeMetricFamily("mms_adapter_swap_in_seconds", "Duration of the adapter's last swap-in "
                                   "from host memory into a device slot", labels=labels)
        resident = GaugeMetricFamily("mms_adapter_resident", "1 for the tier the adapter is in now",
                                     labels=[*labels, "tier"])
        slots = GaugeMetricFamily("mms_adapter_device_slots_used", "Device slots in use per base", labels=["base"])
        for base, status in sorted(self._status.items()):
            slots.add_metric([base], float(status.get("device_slots_used") or 0))
            others: dict[str, float] = defaultdict(float)  # the adapters past the cap, summed
            for a in status.get("adapters", []):
                if self._label(f"{base}/{a['name']}") == OTHER_LABEL:
                    for count in COUNTS:
                        others[count] += float(a.get(count) or 0)
                    if a.get("tier") not in (None, "missing"):
                        others["tier:" + a["tier"]] += 1.0
                    continue
                key = [base, a["name"]]
                if a.get("load_time_s") is not None:
                    load_s.add_metric(key, float(a["load_time_s"]))
                if a.get("swap_in_s") is not None:
                    swap_s.add_metric(key, float(a["swap_in_s"]))
                counts = {count: float(a.get(count) or 0) for count in COUNTS}
                if a.get("tier") not in (None, "missing"):  # removed adapters keep their counters
                    counts["tier:" + a["tier"]] = 1.0
                self._add_counts(key, counts, requests, hits, misses, cold_loads, resident)
            if others:
                self._add_counts([base, OTHER_LABEL], others, requests, hits, misses, cold_loads, resident)
        evictions = CounterMetricFamily("mms_adapter_evictions", "Adapters the control plane "
                                        "evicted from the base's device slots for others",
                                        labels=["base"])
        for base, count in sorted(self.evictions.items()):
            evictions.add_metric([base], count)
        yield from (requests, hits, misses, cold_loads, load_s, swap_s, resident, slots, evictions)

    @staticmethod
    def _add_counts(key, counts, requests, hits, misses, cold_loads, resident) -> None:
        requests.add_metric(key, counts["requests"])
        hits.add_metric([*key, "device"], counts["device_hits"])
        hits.add_metric([*key, "host"], counts["host_hits"])
        misses.add_metric(key, counts["misses"])
        cold_loads.add_metric(key, counts["cold_loads"])
        for name, value in counts.items():
            if name.startswith("tier:"):
                resident.add_metric([*key, name.removeprefix("tier:")], value)

