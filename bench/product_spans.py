"""The product's own spans, read back from its file exporter (``--trace-exporter
file:PATH``): grouped by request, and what a miss waited for before its inference went."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np


def read_spans(path: Path) -> list[dict]:
    spans = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                span = json.loads(line)
                for key in ("start_time", "end_time"):
                    span[key] = datetime.fromisoformat(span[key]).timestamp()
                spans.append(span)
    return spans


def by_trace(spans: list[dict]) -> list[list[dict]]:
    """The spans of each trace (one request through the product), trace by trace."""
    traces: dict[str, list[dict]] = {}
    for span in spans:
        traces.setdefault(span["context"]["trace_id"], []).append(span)
    return list(traces.values())


def miss_traces(spans: list[dict]) -> dict:
    """Per miss (a router request whose trace holds a load): the calls to another process that
    ended before the answered inference was sent (the round trips the client waited for; a
    send to a variant no longer in its slot is one of them), and the median duration of each
    span of a miss.  Counted from the product's own spans."""
    round_trips, durations, family_loads = [], {}, 0
    for trace in by_trace(spans):
        names = {s["name"] for s in trace}
        if "infer" not in names or "load" not in names or "triton.infer" not in names:
            continue
        if "triton.load" in names:  # the family model's own load (its first variant): not a copy
            family_loads += 1
            continue
        sent = max(s["start_time"] for s in trace if s["name"] == "triton.infer")
        before = sorted((s for s in trace if s["kind"] == "SpanKind.CLIENT" and s["end_time"] <= sent),
                        key=lambda s: s["start_time"])
        round_trips.append([s["name"] for s in before])
        for s in trace:
            side = s["resource"]["attributes"].get("service.name", "?").removeprefix("mms-")
            durations.setdefault(f"{s['name']} ({side})", []).append(s["end_time"] - s["start_time"])
    counts = [len(r) for r in round_trips]
    return {"misses": len(round_trips), "family_model_loads_left_out": family_loads,
            "round_trips_before_inference": {"max": max(counts, default=0),
                                             "median": float(np.median(counts)) if counts else 0,
                                             "calls": sorted({" + ".join(r) for r in round_trips})},
            "span_p50_ms": {name: round(float(np.median(d)) * 1000, 3)
                            for name, d in sorted(durations.items())}}
