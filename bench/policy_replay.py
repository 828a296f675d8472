"""Replay request traces through the control plane's eviction code and compare with Belady.

The replay drives ``control_plane.eviction.CachePlanner`` and the policies from
``make_policy`` exactly as the control plane does (touch on every request; on a miss
``plan``, ``remove`` each victim, ``admit`` the newcomer with its load cost), in simulated
time: loads are instantaneous and cost their ``load_cost_s`` in the tally only.

Reported per trace and policy: hit ratio, Belady's hit ratio on the same trace and slots,
their ratio, cost-weighted misses (sum of the load seconds of every miss), loads per
simulated minute and the planner's own cost per request in microseconds.

``lru+pins`` is plain LRU with the trace's ``pin_top`` most popular models (as generated,
i.e. as an operator would know them at deploy time) marked pinned when they are loaded.

    python -m bench.policy_replay                      # the standard set (a few minutes)
    python -m bench.policy_replay --quick              # 100k requests per trace
    python -m bench.policy_replay --traces zipf-1.0 --policies lru,wtinylfu --requests 200000
    python -m bench.policy_replay --quick --headroom 1   # + the cost of keeping headroom

Writes ``bench/results/policy.json`` (a list of rows), ``policy_meta.json`` (machine,
versions, conditions) and, with matplotlib installed, ``policy_hit_ratio.png``.

``--headroom N`` also replays every trace and policy with the control plane's headroom
(``CachePlanner.headroom_victims`` after each miss: N slots kept free, the policy's next
victims leaving in the background) and writes ``policy_headroom.json``: hit ratio with and
without it on the same trace, and the seconds a request waits on misses on average: a miss
that must evict first waits for the victim's unload (``--unload-s``, measured 1.1-1.7 s
with the python backend) and then its load; with headroom a miss only loads, as long as the
background unload finished since the previous miss.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.belady import belady
from bench.traces import STANDARD_TRACES, Trace, TraceSpec
from control_plane.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    CachePlanner,
    Capacity,
    HeadroomSpec,
    Resident,
    make_policy,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PINS_SUFFIX = "+pins"
QUICK_REQUESTS = 100_000
PLOT_TRACE = "zipf-1.0"
PLOT_SLOTS = (10, 25, 50, 100, 200, 400)
PLOT_REQUESTS = 200_000
UNLOAD_S = 1.4  # unload until memory is free, python backend (DESIGN.md: 1.1-1.7 s)


@dataclass
class ReplayResult:
    policy: str
    requests: int
    hits: int
    cost_weighted_miss_s: float
    loads_per_min: float
    replay_s: float
    evicting_misses: int = 0  # misses that had to evict before loading
    headroom_evictions: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def us_per_request(self) -> float:
        return 1e6 * self.replay_s / self.requests if self.requests else 0.0


def parse_policy(spec: str) -> tuple[str, bool, dict[str, Any]]:
    """``name[+pins][:opt=value,...]`` -> (policy name, pinned, constructor options)."""
    head, _, opts = spec.partition(":")
    pinned = head.endswith(PINS_SUFFIX)
    name = head[: -len(PINS_SUFFIX)] if pinned else head
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} in {spec!r}; choose from {sorted(POLICIES)}")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, _, raw = item.partition("=")
        value: Any
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = {"true": True, "false": False}.get(raw.lower(), raw)
        options[key] = value
    return name, pinned, options


def replay(trace: Trace, policy: str, slots: int | None = None, headroom: int = 0) -> ReplayResult:
    """Run ``trace`` through a CachePlanner with ``policy`` (see ``parse_policy``).

    ``headroom``: slots kept free as the control plane keeps them (``headroom_victims``
    after each admission); its evictions cost no load and are counted apart."""
    name, pinned, options = parse_policy(policy)
    slots = trace.slots if slots is None else slots
    pin_keys: set[str] = set()
    if pinned:
        pin_count = min(trace.pin_top, slots - 1)
        pin_keys = {trace.models[i] for i in trace.popularity[:pin_count]}
    planner = CachePlanner(make_policy(name, **options), Capacity(max_slots=slots),
                           headroom=HeadroomSpec(models=headroom))
    restore = planner.headroom_victims if headroom else None
    size_of = dict(zip(trace.models, trace.sizes_bytes))
    cost_of = dict(zip(trace.models, trace.load_costs_s))
    keys = trace.keys()
    times = trace.times_s.tolist()
    residents = planner.residents
    touch, plan, remove, admit = planner.touch, planner.plan, planner.remove, planner.admit
    misses = evicting = headroom_evictions = 0
    miss_cost_s = 0.0
    gc.disable()  # the loop allocates few cycles; a collection mid-run only adds noise
    try:
        start = time.perf_counter()
        for key, now in zip(keys, times):
            touch(key, now)
            if key in residents:
                continue
            misses += 1
            cost_s = cost_of[key]
            miss_cost_s += cost_s
            size = size_of[key]
            victims = plan(key, size).victims
            if victims:
                evicting += 1
            for victim in victims:
                remove(victim)
            admit(Resident(key, size, pinned=key in pin_keys), now, cost_s)
            if restore is not None:
                for victim in restore():
                    headroom_evictions += 1
                    remove(victim)
        elapsed_s = time.perf_counter() - start
    finally:
        gc.enable()
    minutes = trace.duration_s / 60.0
    return ReplayResult(
        policy=policy,
        requests=len(keys),
        hits=len(keys) - misses,
        cost_weighted_miss_s=round(miss_cost_s, 3),
        loads_per_min=round(misses / minutes, 3) if minutes > 0 else 0.0,
        replay_s=elapsed_s,
        evicting_misses=evicting,
        headroom_evictions=headroom_evictions,
    )


def run_trace(trace: Trace, policies: Sequence[str], slots: int | None = None,
              log: Any = None) -> list[dict[str, Any]]:
    """Rows for one trace: every policy plus Belady, all at the same slot count."""
    slots = trace.slots if slots is None else slots
    start = time.perf_counter()
    opt = belady(trace.requests, slots)
    belady_s = time.perf_counter() - start
    minutes = trace.duration_s / 60.0
    base = {"trace": trace.name, "models": trace.n_models, "slots": slots,
            "requests": trace.n_requests}
    rows = []
    for policy in policies:
        result = replay(trace, policy, slots)
        rows.append({
            **base,
            "policy": policy,
            "is_default": policy == DEFAULT_POLICY,
            "hit_ratio": round(result.hit_ratio, 5),
            "belady_hit_ratio": round(opt.hit_ratio, 5),
            "hit_ratio_vs_belady": round(result.hit_ratio / opt.hit_ratio, 4) if opt.hits else 0.0,
            "cost_weighted_miss_s": result.cost_weighted_miss_s,
            "loads_per_min": result.loads_per_min,
            "us_per_request": round(result.us_per_request, 3),
            "replay_s": round(result.replay_s, 3),
        })
        if log:
            log(f"  {trace.name:<9} {trace.n_models:>5} models {policy:<10} "
                f"hit {result.hit_ratio:.4f}  {result.replay_s:6.2f}s")
    rows.append({
        **base,
        "policy": "belady",
        "is_default": False,
        "hit_ratio": round(opt.hit_ratio, 5),
        "belady_hit_ratio": round(opt.hit_ratio, 5),
        "hit_ratio_vs_belady": 1.0,
        "cost_weighted_miss_s": round(opt.cost_weighted_miss_s(trace.load_costs_s), 3),
        "loads_per_min": round(opt.misses / minutes, 3) if minutes > 0 else 0.0,
        "us_per_request": round(1e6 * belady_s / max(1, trace.n_requests), 3),
        "replay_s": round(belady_s, 3),
    })
    lru_cost_s = next((r["cost_weighted_miss_s"] for r in rows if r["policy"] == "lru"), None)
    for row in rows:
        row["cost_vs_lru"] = (round(row["cost_weighted_miss_s"] / lru_cost_s, 4)
                              if lru_cost_s else None)
    return rows


def headroom_rows(trace: Trace, policies: Sequence[str], headroom: int, unload_s: float,
                  log: Any = None) -> list[dict[str, Any]]:
    """Per policy: the same trace without and with ``headroom`` slots kept free."""
    rows = []
    for policy in policies:
        base = replay(trace, policy)
        kept = replay(trace, policy, headroom=headroom)

        def wait_s(r: ReplayResult) -> float:  # per request: loads of misses + unloads waited
            return (r.cost_weighted_miss_s + r.evicting_misses * unload_s) / max(1, r.requests)

        rows.append({
            "trace": trace.name, "models": trace.n_models, "slots": trace.slots,
            "requests": trace.n_requests, "policy": policy, "headroom": headroom,
            "unload_s": unload_s,
            "hit_ratio": round(base.hit_ratio, 5),
            "hit_ratio_with_headroom": round(kept.hit_ratio, 5),
            "hit_ratio_cost": round(base.hit_ratio - kept.hit_ratio, 5),
            "evicting_misses": base.evicting_misses,
            "evicting_misses_with_headroom": kept.evicting_misses,
            "headroom_evictions": kept.headroom_evictions,
            "miss_wait_s_per_request": round(wait_s(base), 5),
            "miss_wait_s_per_request_with_headroom": round(wait_s(kept), 5),
        })
        if log:
            log(f"  {trace.name:<9} {trace.n_models:>5} models {policy:<10} headroom {headroom}: "
                f"hit {base.hit_ratio:.4f} -> {kept.hit_ratio:.4f}")
    return rows


def headroom_table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'trace':<9} {'models':>6} {'slots':>5} {'policy':<10} {'hit':>6} {'hit+hr':>6} "
              f"{'cost':>6} {'wait/req ms':>11} {'+hr ms':>7} {'evicting misses':>15} {'+hr':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['trace']:<9} {r['models']:>6} {r['slots']:>5} {r['policy']:<10} "
            f"{r['hit_ratio']:>6.4f} {r['hit_ratio_with_headroom']:>6.4f} "
            f"{r['hit_ratio_cost']:>6.4f} {r['miss_wait_s_per_request'] * 1000:>11.1f} "
            f"{r['miss_wait_s_per_request_with_headroom'] * 1000:>7.1f} "
            f"{r['evicting_misses']:>15} {r['evicting_misses_with_headroom']:>6}")
    lines.append("hit+hr = with the headroom; cost = hit ratio lost; wait/req = load seconds of misses "
                 "plus --unload-s for each miss that had to evict first, per request")
    return "\n".join(lines)


def conditions(args: argparse.Namespace, started_s: float, started_at: str) -> dict[str, Any]:
    return {
        "benchmark": "policy_replay",
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "seed": args.seed,
        "requests_override": args.requests,
        "quick": args.quick,
        "default_policy": DEFAULT_POLICY,
        "simulated_time": "loads instantaneous; load_cost_s counted, not waited",
        "wall_s": round(time.perf_counter() - started_s, 2),
        "started_at": started_at,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def summary_table(rows: list[dict[str, Any]]) -> str:
    width = max([10, *(len(r["policy"]) + 1 for r in rows)])
    header = (f"{'trace':<9} {'models':>6} {'slots':>5} {'requests':>9} {'policy':<{width}} "
              f"{'hit':>6} {'vs opt':>6} {'miss_cost_s':>12} {'vs lru':>6} {'loads/min':>9} "
              f"{'us/req':>7}")
    lines = [header, "-" * len(header)]
    previous = None
    for r in rows:
        group = (r["trace"], r["models"], r["slots"])
        if previous is not None and group != previous:
            lines.append("")
        previous = group
        mark = "*" if r["is_default"] else " "
        vs_lru = f"{r['cost_vs_lru']:.3f}" if r.get("cost_vs_lru") is not None else "-"
        lines.append(
            f"{r['trace']:<9} {r['models']:>6} {r['slots']:>5} {r['requests']:>9} "
            f"{r['policy'] + mark:<{width}} {r['hit_ratio']:>6.4f} {r['hit_ratio_vs_belady']:>6.3f} "
            f"{r['cost_weighted_miss_s']:>12.1f} {vs_lru:>6} {r['loads_per_min']:>9.2f} "
            f"{r['us_per_request']:>7.2f}")
    lines.append("* = DEFAULT_POLICY; vs opt = hit ratio / Belady's; miss_cost_s = load "
                 "seconds of all misses; vs lru = miss_cost_s / lru's;\nus/req = planner cost "
                 "per request (touch + plan + admit + remove, replay loop included); "
                 "belady row: its own replay")
    return "\n".join(lines)


def plot_hit_ratio(spec: TraceSpec, policies: Sequence[str], n_requests: int, seed: int,
                   path: Path, log: Any = print) -> bool:
    """Hit ratio vs cache size (slots) for one trace; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed (pip install matplotlib): skipping the plot")
        return False
    trace = spec.build(n_requests, seed)
    slots_list = [s for s in PLOT_SLOTS if s < trace.n_models]
    series: dict[str, list[float]] = {p: [] for p in [*policies, "belady"]}
    for slots in slots_list:
        for row in run_trace(trace, policies, slots):
            series[row["policy"]].append(row["hit_ratio"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, values in series.items():
        style = "k--" if policy == "belady" else "-o"
        label = policy + (" (default)" if policy == DEFAULT_POLICY else "")
        ax.plot(slots_list, values, style, label=label, markersize=4)
    ax.set_xscale("log")
    ax.set_xticks(slots_list, [str(s) for s in slots_list])
    ax.set_xlabel("cache size (GPU model slots)")
    ax.set_ylabel("hit ratio")
    ax.set_title(f"{trace.name}, {trace.n_models} models, {trace.n_requests:,} requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = sorted({s.name for s in STANDARD_TRACES})
    parser.add_argument("--traces", default=",".join(names),
                        help=f"comma-separated subset of: {', '.join(names)} (default: all)")
    parser.add_argument("--policies", default=f"lru,lru{PINS_SUFFIX},wtinylfu,gdsf",
                        help="comma-separated; NAME[+pins][:option=value,...]")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per trace (default: per trace, 200k-1M)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REQUESTS:,} requests per trace and a smaller plot")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--models", type=int, default=None,
                        help="only the variants of the traces with this many models")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--headroom", type=int, default=0,
                        help="also replay with this many slots kept free (the control plane's "
                             "headroom) and write policy_headroom.json")
    parser.add_argument("--unload-s", type=float, default=UNLOAD_S,
                        help="seconds a miss waits for its victim's unload without headroom")
    args = parser.parse_args(argv)
    if args.headroom < 0:
        parser.error(f"--headroom ({args.headroom}) must be >= 0")
    started_s = time.perf_counter()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    wanted = [t.strip() for t in args.traces.split(",") if t.strip()]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        parser.error(f"unknown trace(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        for p in policies:
            parse_policy(p)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    specs = [s for s in STANDARD_TRACES if s.name in wanted
             and (args.models is None or s.models == args.models)]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    kept_rows: list[dict[str, Any]] = []
    for spec in specs:
        n = args.requests or (QUICK_REQUESTS if args.quick else spec.default_requests)
        trace = spec.build(n, args.seed)
        rows.extend(run_trace(trace, policies, log=log))
        if args.headroom:
            kept_rows.extend(headroom_rows(trace, policies, args.headroom, args.unload_s, log=log))

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy.json").write_text(json.dumps(rows, indent=1) + "\n")
    plotted = False
    if not args.no_plot:
        plot_spec = next((s for s in STANDARD_TRACES if s.name == PLOT_TRACE and s.models == 1000),
                         None)
        if plot_spec is not None:
            plot_n = args.requests or (QUICK_REQUESTS if args.quick else PLOT_REQUESTS)
            plotted = plot_hit_ratio(plot_spec, policies, plot_n, args.seed,
                                     args.out / "policy_hit_ratio.png", log=log)
    meta = conditions(args, started_s, started_at)
    meta["plot"] = "policy_hit_ratio.png" if plotted else None
    meta["traces"] = sorted({(r["trace"], r["models"], r["slots"], r["requests"]) for r in rows},
                            key=lambda t: (t[1], t[0]))
    meta["traces"] = [dict(zip(("trace", "models", "slots", "requests"), t))
                      for t in meta["traces"]]
    meta["policies"] = policies
    (args.out / "policy_meta.json").write_text(json.dumps(meta, indent=1) + "\n")

    print(f"policy replay: {meta['processor']} x{meta['cpu_count']}, Python {meta['python']}, "
          f"numpy {meta['numpy']}, seed {args.seed}, wall {meta['wall_s']}s")
    print(summary_table(rows))
    if kept_rows:
        (args.out / "policy_headroom.json").write_text(json.dumps(kept_rows, indent=1) + "\n")
        print(f"\nheadroom of {args.headroom} slot(s), unload {args.unload_s:g}s:")
        print(headroom_table(kept_rows))
        print(f"wrote {args.out / 'policy_headroom.json'}")
    print(f"wrote {args.out / 'policy.json'}" + (", policy_hit_ratio.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
