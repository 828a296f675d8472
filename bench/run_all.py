"""`make bench`: every CPU benchmark in a few minutes, one summary table, JSON + PNG plots.

Each benchmark is its own module and can run alone with its own options:

    python -m bench.load_unload      load + warm-up and unload-until-free times on real Triton
    python -m bench.load_profile     where a load goes: stub, imports, weights, warm-up, ours
    python -m bench.cold_bandwidth   verified download MB/s: local store vs S3 (moto)
    python -m bench.policy_replay    eviction policies vs Belady on request traces
    python -m bench.router_latency   what the router adds (vs direct Triton, a plain proxy, nginx)
    python -m bench.seed_scenario    50 customers, top 12 pinned, on the real stack
    python -m bench.shadow_overhead  the primary's latency with and without a shadow, same run
    python -m bench.canary_overhead  request latency and serving-loop CPU while a canary runs
    python bench/lora_bench.py       LoRA: 1 vs 100 adapters per batch, swap-in, memory
    python -m bench.family_swap      model families vs separate models: miss vs memcpy, hits
    python -m bench.mixed_traffic    hits and misses at once: req/s, p50 and p99 (--baseline REV)
    python -m bench.mixed_fleet      a family, separate models and a LoRA base in one server's cache
    python -m bench.adapter_traffic  LoRA adapter hits and misses through the router (--baseline REV)
    python -m bench.thrash           failed requests and latency under thrash (models, family)
    python -m bench.scale            50, 1,000 and 10,000 models: idle CPU, bytes per change, status, hits
    python -m bench.abuse            CPU and memory of one hostile HTTP body vs a normal one, same size
    python -m bench.soak             minutes of Zipf traffic, every answer checked, memory sampled
    python -m bench.slot_fill        one family slot's swap-in: reading threads, device copies
    python -m bench.http_parse_offloop  how long a large JSON body holds up the router's loop
    python -m bench.capacity         a hot model at 3x one copy: one copy vs --replicas auto, deadlines
    python -m bench.fair_share       a flood beside 20 customers on one family: Triton's queue vs fair shares

This runner uses shorter settings (`--full` uses each benchmark's defaults), writes
bench/results/summary.json (machine, versions, conditions, headline numbers) and the plots
bench/results/*.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

QUICK = {
    "load_unload": ["-m", "bench.load_unload", "--cycles", "6"],
    "load_profile": ["-m", "bench.load_profile", "--cycles", "3"],
    "cold_bandwidth": ["-m", "bench.cold_bandwidth", "--size-mb", "64", "--repeats", "2"],
    "policy_replay": ["-m", "bench.policy_replay", "--quick", "--headroom", "1"],
    "router_latency": ["-m", "bench.router_latency", "--requests", "2000", "--seconds", "5"],
    "seed_scenario": ["-m", "bench.seed_scenario", "--rate", "3", "--seconds", "40",
                      "--hot-seconds", "10"],
    "shadow_overhead": ["-m", "bench.shadow_overhead", "--rounds", "8"],
    "canary_overhead": ["-m", "bench.canary_overhead", "--seconds", "10", "--fill", "20000"],
    "lora": ["bench/lora_bench.py", "--quick", "--no-wide"],
    "family_swap": ["-m", "bench.family_swap", "--variants", "8", "--size-mb", "20", "--slots", "3",
                    "--hits", "50", "--rounds", "1", "--cycles", "100"],
    "thrash": ["-m", "bench.thrash", "--clients", "16", "--requests", "4", "--models", "12",
               "--workers", "1"],
    "scale": ["-m", "bench.scale", "--sizes", "50,1000", "--idle-s", "5", "--changes", "10",
              "--hits", "200", "--replay", "500"],
    "abuse": ["-m", "bench.abuse", "--quick"],
    "soak": ["-m", "bench.soak", "--variants", "20", "--room", "4", "--clients", "4",
             "--duration", "30"],
    "slot_fill": ["-m", "bench.slot_fill", "--size-mb", "50", "--repeats", "5"],
    "mixed_traffic": ["-m", "bench.mixed_traffic", "--size-mb", "20", "--duration", "20"],
    "mixed_fleet": ["-m", "bench.mixed_fleet", "--duration", "20"],
    "adapter_traffic": ["-m", "bench.adapter_traffic", "--requests", "100"],
    "http_parse_offloop": ["-m", "bench.http_parse_offloop", "--mib", "4", "1", "--bodies", "3"],
    "capacity": ["-m", "bench.capacity", "--rounds", "1", "--phase-s", "10", "--auto-s", "30"],
    "fair_share": ["-m", "bench.fair_share", "--rounds", "1", "--phase-s", "10"],
}
FULL = {
    "load_unload": ["-m", "bench.load_unload"],
    "load_profile": ["-m", "bench.load_profile"],
    "cold_bandwidth": ["-m", "bench.cold_bandwidth"],
    "policy_replay": ["-m", "bench.policy_replay", "--headroom", "1"],
    "router_latency": ["-m", "bench.router_latency"],
    "seed_scenario": ["-m", "bench.seed_scenario"],
    "shadow_overhead": ["-m", "bench.shadow_overhead"],
    "canary_overhead": ["-m", "bench.canary_overhead"],
    "lora": ["bench/lora_bench.py"],
    "family_swap": ["-m", "bench.family_swap"],
    "thrash": ["-m", "bench.thrash"],
    "scale": ["-m", "bench.scale"],
    "abuse": ["-m", "bench.abuse"],
    "soak": ["-m", "bench.soak"],
    "slot_fill": ["-m", "bench.slot_fill"],
    "mixed_traffic": ["-m", "bench.mixed_traffic"],
    "mixed_fleet": ["-m", "bench.mixed_fleet"],
    "adapter_traffic": ["-m", "bench.adapter_traffic"],
    "http_parse_offloop": ["-m", "bench.http_parse_offloop"],
    "capacity": ["-m", "bench.capacity"],
    "fair_share": ["-m", "bench.fair_share"],
}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "tritonclient", "nvidia-pytriton", "grpcio", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def load(name: str) -> dict | list | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _cdf_plot(plt, np, series: dict[str, list[float]], xlabel: str, title: str,
              filename: str) -> str:
    """One latency CDF per series (log x axis), saved under bench/results/."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, samples in series.items():
        if samples:
            xs = np.sort(np.array(samples))
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)
    ax.set(xlabel=xlabel, ylabel="CDF", title=title)
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / filename, dpi=120)
    plt.close(fig)
    return filename


def plot_cdfs() -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)")
        return []
    written = []
    router = load("router_latency.json")
    if router:
        series = {path["label"]: path["samples_us"] for path in router["paths"].values()}
        written.append(_cdf_plot(plt, np, series, "latency (us), identity model, concurrency 1",
                                 "direct Triton vs proxies vs router",
                                 "router_latency_cdf.png"))
    seed = load("seed_scenario.json")
    if seed:
        written.append(_cdf_plot(plt, np, seed["latency_ms_samples"], "latency (ms)",
                                 "seed scenario through the router", "seed_latency_cdf.png"))
    if (RESULTS / "policy_hit_ratio.png").exists():
        written.append("policy_hit_ratio.png")
    return written


def summary_rows() -> list[tuple[str, str, str]]:
    rows = []
    lu = load("load_unload.json")
    if lu:
        m = lu["median"]
        rows.append(("load + warm-up of a demo model (warm)", "Triton", f"median {m['load_and_warmup_s']:.2f}s"))
        rows.append(("unload until memory free", "Triton",
                     f"median {m['unload_to_free_s']:.2f}s (call returns in {m['unload_returns_s'] * 1000:.1f}ms)"))
    profile = load("load_profile.json")
    if profile:
        m = profile["median"]
        rows.append(("load of a demo model: model.py imports", "Triton stub",
                     (f"median {m['imports_s'] * 1000:.0f}ms of {m['ensure_s'] * 1000:.0f}ms; "
                     f"control plane {(m['warmup_plan_s'] + m['warmup_infer_s'] + m['control_plane_rest_s']) * 1000:.0f}ms; "
                     f"unload seen {m['polling_lag_s'] * 1000:.0f}ms after Triton freed it")))
    cold = load("cold_bandwidth.json")
    if cold:
        b = cold["mb_per_s"]
        rows.append(("verified cold download", "cold tier",
                     (f"local {b['local']:.0f} MB/s, S3 (moto) one GET {b['s3_one_get']:.0f} MB/s, "
                     f"ranged {b['s3_ranged']:.0f} MB/s")))
    headroom = load("policy_headroom.json")
    if headroom:
        for r in headroom:
            if r["policy"] == "lru" and r["trace"] in ("seed", "zipf-1.0"):
                rows.append((f"headroom 1, {r['trace']} ({r['models']} models, {r['slots']} slots)", "lru",
                             (f"hit {r['hit_ratio']:.3f} -> {r['hit_ratio_with_headroom']:.3f}, miss wait "
                             f"{r['miss_wait_s_per_request'] * 1000:.0f} -> "
                             f"{r['miss_wait_s_per_request_with_headroom'] * 1000:.0f}ms per request")))
    policy = load("policy.json")
    if policy:
        for r in policy:
            if r["is_default"] or r["policy"] == "lru":
                rows.append((f"policy {r['trace']} ({r['models']} models, {r['slots']} slots)",
                             r["policy"] + (" (default)" if r["is_default"] else ""),
                             (f"hit {r['hit_ratio']:.3f} = {r['hit_ratio_vs_belady']:.3f}x Belady, "
                             f"miss cost {r['cost_weighted_miss_s']:.0f}s")))
    router = load("router_latency.json")
    if router:
        paths, ratios = router["paths"], router["router_added_p50_over_nginx_added_p50"]
        refs = [paths[k] for k in ("nginx", "passthrough") if k in paths]
        ref = ", ".join(f"{p['label']} +{p['added_p50_us']:.0f}/+{p['added_p99_us']:.0f}us" for p in refs)
        direct_rps = paths["direct"]["throughput"]["requests_per_s"]
        for key, ratio in ratios.items():
            p = paths[key]
            rows.append((f"{p['label']} latency added (identity, c=1)", "router",
                         f"p50 +{p['added_p50_us']:.0f}us, p99 +{p['added_p99_us']:.0f}us"
                         + (f" = {ratio:.1f}x nginx's p50" if ratio else "") + f" ({ref})"))
            rows.append((f"{p['label']} throughput ({router['conditions']['throughput_model']})",
                         "router", (f"{p['throughput']['requests_per_s'] / direct_rps * 100:.0f}% of "
                                    f"direct ({p['throughput']['requests_per_s']:.0f} vs {direct_rps:.0f} "
                                    "req/s)")))
    seed = load("seed_scenario.json")
    if seed:
        for group in ("frequent", "occasional"):
            g = seed["mixed"][group]
            rows.append((f"seed scenario: {group} customers", "end to end",
                         f"p50 {g['p50_ms']:.1f}ms p99 {g['p99_ms']:.1f}ms, {g['errors']} errors"))
        h = seed["hot_path_frequent_only"]
        rows.append(("seed scenario: hot path only", "end to end",
                     f"p50 {h['p50_ms']:.1f}ms p99 {h['p99_ms']:.1f}ms"))
        if seed.get("load_only_p50_s"):
            rows.append(("seed scenario: occasional p50 / bare load", "end to end",
                         (f"{seed['occasional_p50_over_load_only']:.2f}x "
                         f"(bare load {seed['load_only_p50_s'] * 1000:.0f}ms)")))
        rows.append(("seed scenario: cache", "end to end",
                     (f"hit ratio {seed['hit_ratio']:.3f}, {seed['loads_per_minute']:.1f} loads/min, "
                     f"{seed['errors']} errors")))
    compare = load("seed_scenario_compare.json")
    if compare and compare.get("family_occasional_p50_over_models_bare_load") is not None:
        rows.append(("seed scenario: occasional p50, family / separate models' bare load",
                     "end to end", (f"{compare['family_occasional_p50_over_models_bare_load']:.3f}x "
                                    f"({compare['family_occasional_p50_ms']:.1f}ms vs "
                                    f"{compare['models_bare_load_p50_ms']:.0f}ms)")))
    family = load("family_swap.json")
    if family and "family" in family:
        copy_ms = family["memcpy"]["numpy_copyto"]["p50_ms"]
        for layout in ("family", "models"):
            r = family.get(layout)
            if r:
                rows.append((f"{layout}: miss - hit p50 ({family['conditions']['size_mb']:g} MB)",
                             "end to end", (f"{r['miss_minus_hit_p50_ms']:.1f}ms = "
                                            f"{r['miss_minus_hit_p50_ms'] / copy_ms:.1f}x memcpy "
                                            f"({copy_ms:.1f}ms); hit p50 {r['hit']['p50_ms']:.1f}ms")))
    mixed = load("mixed_traffic.json")
    if mixed:
        c = mixed["conditions"]
        for side, runs in mixed["sides"].items():
            r = runs[-1]
            label = (f"mixed traffic: {c['clients']} clients, {c['variants']} variants of "
                     f"{c['size_mb']:g} MB, room for {c['room']} ({side})")
            rows.append((label, "end to end",
                         (f"{r['req_per_s']:.0f} req/s, p50 {r['p50_ms']:.0f}ms p99 {r['p99_ms']:.0f}ms "
                          f"({r['p99_over_p50']:.2f}x), {r['errors']} errors")))
    adapters = load("adapter_traffic.json")
    if adapters:
        c = adapters["conditions"]
        for side, s in adapters["summary"].items():
            rows.append(((f"LoRA adapters through the router: {c['adapters']} adapters, "
                         f"{c['slots']} slots ({side})"), "end to end",
                         (f"hit p50 {s['hit']['p50_ms']:.2f}ms, miss p50 {s['miss']['p50_ms']:.2f}ms, "
                          f"no adapter p50 {s['base']['p50_ms']:.2f}ms")))
    capacity = load("capacity.json")
    if capacity:
        c, h, b, d = (capacity["conditions"], capacity["hot_per_s"], capacity["background_p95_ms"],
                      capacity["deadline"])
        rows.append(((f"hot model at {c['hot_offered_per_s']:.0f}/s, {c['servers']} servers "
                      "(device time simulated)"), "end to end",
                     (f"one copy {h['one_copy']}/s, auto {h['auto_steady']}/s = {h['ratio']}x; "
                      f"background p95 {b['auto_steady_ratio']}x alone's")))
        rows.append((f"{d['deadline_ms']:.0f} ms deadlines at {d['offered_per_s']:.0f}/s on one copy",
                     "router", (f"{d['in_time_per_s']['told']}/s in time vs "
                                f"{d['in_time_per_s']['untold']}/s unrefused; refusal p99 "
                                f"{d['refused_p99_ms']} ms")))
    fair = load("fair_share.json")
    if fair:
        c = fair["conditions"]
        plain, shares = fair["plain"]["background_beside_flood"], fair["fair"]["background_beside_flood"]
        rows.append(((f"{c['background_variants']} customers beside a flood of one family "
                      "(device time simulated)"), "end to end",
                     (f"background p95 {shares['p95_ratio']}x alone's with fair shares "
                      f"({shares['timeouts']} timed out) vs {plain['p95_ratio']}x without "
                      f"({plain['timeouts']} timed out)")))
    thrash = load("thrash.json")
    if thrash:
        c = thrash["conditions"]
        for r in thrash["results"]:
            workers = f"{r['router_workers']} worker{'s' if r['router_workers'] > 1 else ''}"
            label = f"thrash: {c['clients']} clients over {c['models']} models, {c['max_loaded']} fit"
            rows.append((f"{label} ({r['layout']}, {workers})",
                         "end to end", (f"{r['failed']} of {r['requests']} failed, p50 {r['p50_ms']:.0f}ms "
                                        f"p99 {r['p99_ms']:.0f}ms, {r['requests_per_s']:.0f} req/s")))
    shadow = load("shadow_overhead.json")
    if shadow:
        p, cpu = shadow["primary"], shadow["cpu_ms_per_primary_request"]
        for c, ratio in shadow["p99_vs_no_shadow_median_of_rounds"].items():
            rows.append((f"primary with a {c} shadow (100%)", "router",
                         (f"p99 {p[c]['p99_ms']:.1f}ms vs {p['none']['p99_ms']:.1f}ms without "
                         f"({(ratio or 1) * 100 - 100:+.0f}% median of rounds); serving loop "
                         f"+{cpu[c]['loop'] - cpu['none']['loop']:.2f}ms CPU per mirror")))
    canary = load("canary_overhead.json")
    if canary:
        ph = canary["phases"]
        rows.append(("requests while a canary is checked", "router",
                     (f"p99 {ph['canary']['p99_ms']:.1f}ms vs {ph['none']['p99_ms']:.1f}ms without; "
                     f"serving loop +{ph['canary']['loop_cpu_ms_per_s'] - ph['none']['loop_cpu_ms_per_s']:.1f}"
                     f"ms CPU per second ({sum(canary['conditions']['canary_window_requests'].values())} "
                     "requests in the window)")))
    abuse = load("abuse.json")
    if abuse:
        size_mib = abuse["conditions"]["size_bytes"] / (1 << 20)
        for r in abuse["rows"][1:]:
            rows.append((f"hostile HTTP body: {r['body']} ({size_mib:g} MiB)", "router",
                         (f"answered {r['status']} with {r['cpu_s'] * 1000:.0f}ms CPU = "
                          f"{r['cpu_vs_normal']:.2f}x a normal body's")))
    soak = load("soak.json")
    if soak:
        c = soak["conditions"]
        memory = ", ".join(f"{kind} {m['start_mb']:.0f} -> {m['end_mb']:.0f} MB"
                           for kind, m in soak["memory"].items()
                           if kind in ("control plane", "router worker", "tritonserver"))
        rows.append(((f"soak: {c['clients']} clients, {c['variants']} variants, room for {c['room']}, "
                     f"{c['duration_s']:g} s"), "end to end",
                     (f"{soak['failed']} of {soak['requests']} failed, {soak['wrong_answers']} wrong, "
                      f"{soak['req_per_s']:.0f} req/s, p99 {soak['p99_ms']:.0f}ms; {memory}")))
    fill = load("slot_fill.json")
    if fill:
        best = min(fill["rows"], key=lambda r: r["p50_ms"] if "threads" in r else float("inf"))
        rows.append(((f"family slot fill ({fill['conditions']['bytes'] / 1e6:.0f} MB, "
                     f"{fill['conditions']['device']})"), "family runtime",
                     f"p50 {best['p50_ms']:.1f}ms with {best['threads']} threads"
                     + (f" ({best['read']})" if "read" in best else "")))
    lora = load("lora.json")
    if lora:
        for size, ratios in lora["throughput_ratio_many_vs_one"].items():
            for base, ratio in ratios.items():
                rows.append((f"LoRA {lora['adapters']} vs 1 adapter ({size} {base})", lora["device"],
                             f"{ratio * 100:.0f}% of single-adapter throughput"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="each benchmark's own (longer) defaults")
    ap.add_argument("--only", help="comma-separated subset of: " + ", ".join(QUICK))
    args = ap.parse_args(argv)
    plan = FULL if args.full else QUICK
    chosen = args.only.split(",") if args.only else list(plan)
    RESULTS.mkdir(parents=True, exist_ok=True)
    timings, failed = {}, []
    for name in chosen:
        print(f"\n=== {name}: {' '.join(plan[name])}", flush=True)
        start = time.monotonic()
        rc = subprocess.call([sys.executable, *plan[name]], cwd=ROOT)
        timings[name] = round(time.monotonic() - start, 1)
        if rc != 0:
            failed.append(name)
    plots = plot_cdfs()
    rows = summary_rows()
    summary = {
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": versions(), "mode": "full" if args.full else "quick", "seconds": timings,
        "failed": failed, "plots": plots,
        "rows": [{"benchmark": a, "subject": b, "result": c} for a, b, c in rows],
    }
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2))
    width = max((len(r[0]) for r in rows), default=10)
    print(f"\n=== summary ({summary['mode']}; {os.cpu_count()} CPUs; python {platform.python_version()}, "
          f"torch {summary['versions']['torch']}, nvidia-pytriton {summary['versions']['nvidia-pytriton']})")
    for a, b, c in rows:
        print(f"  {a:<{width}}  {b:<20}  {c}")
    print(f"  wall time per benchmark (s): {timings}")
    print(f"  results and plots in {RESULTS}: summary.json {' '.join(plots)}")
    if failed:
        print(f"  FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
