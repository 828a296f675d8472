"""Per-adapter Prometheus metrics, from the latest status each LoRA base reported."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class AdapterMetrics:
    """Per-adapter Prometheus metrics from the latest status of each base.

    The values are the model's own counters (they restart at zero when the base is reloaded,
    which Prometheus treats as a counter reset).  The last status of a base that was unloaded
    stays exposed until the base answers again."""

    def __init__(self, registry: CollectorRegistry | None):
        self._status: dict[str, dict] = {}
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
            for a in status.get("adapters", []):
                key = [base, a["name"]]
                requests.add_metric(key, float(a.get("requests") or 0))
                hits.add_metric([*key, "device"], float(a.get("device_hits") or 0))
                hits.add_metric([*key, "host"], float(a.get("host_hits") or 0))
                misses.add_metric(key, float(a.get("misses") or 0))
                cold_loads.add_metric(key, float(a.get("cold_loads") or 0))
                if a.get("load_time_s") is not None:
                    load_s.add_metric(key, float(a["load_time_s"]))
                if a.get("swap_in_s") is not None:
                    swap_s.add_metric(key, float(a["swap_in_s"]))
                if a.get("tier") not in (None, "missing"):  # removed adapters keep their counters
                    resident.add_metric([*key, a["tier"]], 1.0)
        yield from (requests, hits, misses, cold_loads, load_s, swap_s, resident, slots)

