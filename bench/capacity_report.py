"""``bench.capacity``'s report: each phase's throughput, latency, deadline misses and copies
against one copy's capacity, the verdicts, a plot, and the table it prints."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

import numpy as np

CPU_FLAG = 0.70


def report_of(rounds: list[dict], args, one_copy_per_s: float, hot_rate: float) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    bg_alone = [r["background_alone"] for r in rounds]
    bg_one = [r["one_copy"]["background"] for r in rounds]
    bg_auto = [r["auto"]["background_steady"] for r in rounds]
    one = med([r["one_copy"]["hot"]["per_s"] for r in rounds])
    auto = med([r["auto"]["hot_steady"]["per_s"] for r in rounds])
    alone_p95 = med([b["p95_ms"] for b in bg_alone])
    report = {
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "servers": args.servers, "router_workers": args.router_workers, "rounds": args.rounds,
            "simulated": f"device time simulated: every model's one instance sleeps {args.service_ms} ms "
                         f"per request ({one_copy_per_s:.0f} requests/s per copy)",
            "hot_offered_per_s": hot_rate, "background_models": args.background,
            "background_offered_per_s": args.background_rate, "timeout_s": args.timeout_s,
            "phase_s": args.phase_s, "auto_s": args.auto_s,
            "refusals": "RESOURCE_EXHAUSTED answers (a request that could not start within its "
                        "deadline) are counted apart from errors"},
        "hot_per_s": {"one_copy": one, "auto_steady": auto,
                      "ratio": round(auto / one, 2) if one and auto else None, "target_ratio": 2.5},
        "ramp_s": med([r["auto"]["ramp_s"] for r in rounds]),
        "final_copies": [r["auto"]["copies"][-1][1] if r["auto"]["copies"] else None for r in rounds],
        "background_p95_ms": {
            "alone": alone_p95, "one_copy": med([b["p95_ms"] for b in bg_one]),
            "auto_steady": med([b["p95_ms"] for b in bg_auto]),
            "samples": {"alone": sum(b["ok"] for b in bg_alone), "one_copy": sum(b["ok"] for b in bg_one),
                        "auto_steady": sum(b["ok"] for b in bg_auto)},
            "target_ratio": 1.3},
        "errors": {
            "hot_steady_timeouts": sum(r["auto"]["hot_steady"]["timeouts"] for r in rounds),
            "hot_ramp_timeouts": sum(r["auto"]["hot_ramp"]["timeouts"] for r in rounds),
            "one_copy_timeouts": sum(r["one_copy"]["hot"]["timeouts"] for r in rounds),
            "wrong_answers": sum(x["wrong"] for r in rounds for x in (
                r["background_alone"], r["one_copy"]["hot"], r["one_copy"]["background"],
                r["auto"]["hot_steady"], r["auto"]["hot_ramp"], r["auto"]["background_steady"])),
            "other": sum(x["error_count"] for r in rounds for x in (
                r["background_alone"], r["one_copy"]["hot"], r["one_copy"]["background"],
                r["auto"]["hot_steady"], r["auto"]["hot_ramp"], r["auto"]["background_steady"])),
            "samples": [e for r in rounds for x in (r["one_copy"]["hot"], r["auto"]["hot_steady"],
                                                     r["auto"]["background_steady"]) for e in x["errors"]][:5]},
        "deadline": {
            "offered_per_s": 2 * one_copy_per_s, "deadline_ms": args.deadline_s * 1000,
            "in_time_per_s": {"told": med([r["deadline"]["told"]["per_s"] for r in rounds]),
                              "untold": med([r["deadline"]["untold"]["per_s"] for r in rounds])},
            "refused": sum(r["deadline"]["told"]["refused"] for r in rounds),
            "refused_p99_ms": med([r["deadline"]["told"]["refused_p99_ms"] for r in rounds]),
            "timeouts": {key: sum(r["deadline"][key]["timeouts"] for r in rounds)
                         for key in ("told", "untold")},
            "target_ratio": 1.5, "target_refusal_ms": 10},
        "refused": {"one_copy": sum(r["one_copy"]["hot"]["refused"] for r in rounds),
                    "auto_ramp": sum(r["auto"]["hot_ramp"]["refused"] for r in rounds),
                    "auto_steady": sum(r["auto"]["hot_steady"]["refused"] for r in rounds)},
        "cpu_busy": [r["cpu_busy"] for r in rounds],
    }
    told, untold = report["deadline"]["in_time_per_s"]["told"], report["deadline"]["in_time_per_s"]["untold"]
    # None when nothing untold was answered in time (every such request waited past it).
    report["deadline"]["ratio"] = round(told / untold, 2) if told and untold else None
    for key in ("one_copy", "auto_steady"):
        value = report["background_p95_ms"][key]
        report["background_p95_ms"][f"{key}_ratio"] = (round(value / alone_p95, 2)
                                                        if value and alone_p95 else None)
    return report


def plot(rounds: list[dict], path: Path, one_copy_per_s: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    twin = ax.twinx()
    for n, r in enumerate(rounds):
        copies = r["auto"]["copies"]
        ax.step([t for t, _ in copies], [c for _, c in copies], where="post",
                label=f"copies, round {n + 1}")
        answered = np.array(r["auto"]["answered_at"])
        if answered.size:
            edges = np.arange(0, answered.max() + 1.0, 1.0)
            counts, _ = np.histogram(answered, bins=edges)
            twin.plot(edges[:-1] + 0.5, counts, alpha=0.4, linestyle="--",
                      label=f"hot answered/s, round {n + 1}")
    twin.axhline(one_copy_per_s, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("seconds after mmctl scale hot --replicas auto")
    ax.set_ylabel("ready copies of the hot model")
    twin.set_ylabel("hot requests answered per second")
    ax.set_title("Copies follow the traffic (device time simulated by sleeping instances)")
    ax.legend(loc="upper left", fontsize=7)
    twin.legend(loc="lower right", fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_report(report: dict) -> None:
    c = report["conditions"]
    print(f"capacity: {c['servers']} Triton servers, {c['router_workers']} router workers, "
          f"{c['rounds']} round(s), {c['cpus']} CPUs; {c['simulated']}")
    h = report["hot_per_s"]
    print(f"hot model offered {c['hot_offered_per_s']:.0f}/s: one copy {h['one_copy']}/s, auto "
          f"(steady) {h['auto_steady']}/s = {h['ratio']}x (target >= {h['target_ratio']}x); "
          f"ramp {report['ramp_s']} s, final copies {report['final_copies']}")
    b = report["background_p95_ms"]
    print(f"background p95: alone {b['alone']} ms, beside one flooded copy {b['one_copy']} ms "
          f"({b['one_copy_ratio']}x), beside auto {b['auto_steady']} ms ({b['auto_steady_ratio']}x, "
          f"target <= {b['target_ratio']}x); samples {b['samples']}")
    d = report["deadline"]
    print(f"deadlines of {d['deadline_ms']:.0f} ms at {d['offered_per_s']:.0f}/s on one copy: answered "
          f"in time {d['in_time_per_s']['told']}/s told to the router, {d['in_time_per_s']['untold']}/s "
          f"not = {d['ratio'] if d['ratio'] is not None else 'unbounded'}"
          f"{'x' if d['ratio'] is not None else ' (none untold was answered in time)'} "
          f"(target >= {d['target_ratio']}x); {d['refused']} refused, p99 "
          f"{d['refused_p99_ms']} ms to the refusal (target <= {d['target_refusal_ms']} ms); timed out: "
          f"{d['timeouts']['told']} told, {d['timeouts']['untold']} not")
    e, r = report["errors"], report["refused"]
    print(f"refused at once (deadline): one copy {r['one_copy']}, auto ramp {r['auto_ramp']}, auto "
          f"steady {r['auto_steady']}")
    print(f"errors: steady {e['hot_steady_timeouts']} timeouts, ramp {e['hot_ramp_timeouts']} "
          f"timeouts, one copy {e['one_copy_timeouts']} timeouts, {e['wrong_answers']} wrong "
          f"answers, {e['other']} other {e['samples']}")
    for n, cpu in enumerate(report["cpu_busy"]):
        flags = [k for k, v in cpu.items() if v > CPU_FLAG]
        print(f"CPU round {n + 1}: " + ", ".join(f"{k} {v:.0%}" for k, v in cpu.items())
              + (f"  (above {CPU_FLAG:.0%} in {', '.join(flags)}: those numbers measure this "
                 "machine's CPU, not the scheduler)" if flags else ""))
