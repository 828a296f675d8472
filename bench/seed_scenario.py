"""The seed scenario end to end on the real stack, with small models and scaled time.

50 per-customer fine-tunes; the top 12 customers send 80% of the requests and are pinned;
GPU "slots" = --max-loaded.  `mmctl up` (tritonserver + control plane + router) runs in a
child process; this process sends open-loop arrivals at a fixed rate through the router
with the async tritonclient and reports, per customer group, p50/p99 latency, plus hit
ratio, loads per minute and errors.  A first phase sends only frequent customers' traffic
to measure the hot-path latency on the same machine, for comparison.

    .venv/bin/python -m bench.seed_scenario [--rate 4] [--seconds 60] [--slots 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.traces import seed_scenario  # noqa: E402
from control_plane.demo_fleet import FleetSpec, generate_fleet  # noqa: E402
from tests.product import Product  # noqa: E402

TOP = 12


def customer(model_id: int) -> str:
    return f"cust{model_id + 1:03d}"  # trace id 0 (the busiest) -> cust001


async def open_loop(url: str, names: list[str], rate_per_s: float, timeout_s: float) -> list[dict]:
    """Send names[i] at t = i / rate regardless of completions; return one record each."""
    client = grpcaio.InferenceServerClient(url)
    x = InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    results: list[dict] = []

    async def one(name: str) -> None:
        t0 = time.perf_counter()
        try:
            await client.infer(name, [x], client_timeout=timeout_s)
            ok, error = True, None
        except Exception as exc:
            ok, error = False, str(exc)[:200]
        results.append({"model": name, "latency_s": time.perf_counter() - t0, "ok": ok, "error": error})

    start = time.perf_counter()
    tasks = []
    for i, name in enumerate(names):
        delay = start + i / rate_per_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(name)))
    await asyncio.gather(*tasks)
    await client.close()
    return results


def metric_sum(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def summarize(records: list[dict], frequent: set[str]) -> dict:
    out = {}
    for group, pick in (("frequent", lambda r: r["model"] in frequent),
                        ("occasional", lambda r: r["model"] not in frequent)):
        rows = [r for r in records if pick(r)]
        lat = np.array([r["latency_s"] for r in rows if r["ok"]]) * 1000
        out[group] = {
            "requests": len(rows), "errors": sum(not r["ok"] for r in rows),
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        }
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (open loop)")
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the mixed phase")
    ap.add_argument("--hot-seconds", type=float, default=15.0, help="frequent-only phase")
    ap.add_argument("--slots", type=int, default=15, help="--max-loaded (the seed has 12-15)")
    ap.add_argument("--customers", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "seed_scenario.json")
    args = ap.parse_args(argv)

    n_mixed = int(args.rate * args.seconds)
    n_hot = int(args.rate * args.hot_seconds)
    trace = seed_scenario(n_customers=args.customers, n_requests=n_mixed, seed=args.seed, top=TOP,
                          slots=args.slots)
    names = [customer(i) for i in trace.requests.tolist()]
    frequent = {customer(i) for i in range(TOP)}
    hot_names = [customer(i) for i in trace.requests.tolist() if i < TOP][:n_hot]

    work = Path(tempfile.mkdtemp(prefix="bench-seed-"))
    repo = work / "repository"
    generate_fleet(repo, FleetSpec(count=args.customers))
    product = Product(work / "state", repo, "--max-loaded", str(args.slots)).start()
    try:
        endpoints = product.json("endpoints")
        router = endpoints["router_grpc"]
        pin_start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:  # pins load concurrently
            codes = list(pool.map(lambda n: product.mmctl("pin", n).returncode, sorted(frequent)))
        assert codes == [0] * TOP, f"pinning failed: {codes}"
        pin_s = time.monotonic() - pin_start
        hot = asyncio.run(open_loop(router, hot_names, args.rate, args.timeout))
        before = requests.get(f"http://{endpoints['router_http']}/metrics", timeout=10).text
        admin_before = requests.get(endpoints["admin"] + "/metrics", timeout=10).text
        mixed_start = time.monotonic()
        mixed = asyncio.run(open_loop(router, names, args.rate, args.timeout))
        mixed_s = time.monotonic() - mixed_start
        after = requests.get(f"http://{endpoints['router_http']}/metrics", timeout=10).text
        admin_after = requests.get(endpoints["admin"] + "/metrics", timeout=10).text
        status = product.json("status")
    finally:
        product.stop()
        shutil.rmtree(work, ignore_errors=True)

    cold_waits = metric_sum(after, "mmr_cold_load_waits_total") - metric_sum(before, "mmr_cold_load_waits_total")
    loads = (metric_sum(admin_after, "mms_loads_total", result="ok")
             - metric_sum(admin_before, "mms_loads_total", result="ok"))
    groups = summarize(mixed, frequent)
    hot_summary = summarize(hot, frequent)["frequent"]
    frequent_waits = sum(metric_sum(after, "mmr_cold_load_waits_total", model=m) -
                         metric_sum(before, "mmr_cold_load_waits_total", model=m) for m in frequent)
    pinned_ready = sorted(m["model"] for m in status if m["pinned"] and m["state"] == "ready")
    errors = sorted({r["error"] for r in mixed if not r["ok"]})
    result = {
        "benchmark": "seed_scenario",
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "customers": args.customers, "pinned": TOP, "slots": args.slots,
            "rate_per_s": args.rate, "mixed_requests": n_mixed, "hot_requests": len(hot_names),
            "traffic": "top 12 customers send 80% (trace 'seed', Zipf 0.6 within groups)",
            "model": "recommender MLP 64-128-128-1, python backend, KIND_CPU",
            "pin_all_12_s": round(pin_s, 2),
        },
        "hot_path_frequent_only": hot_summary,
        "mixed": groups,
        "hit_ratio": 1 - cold_waits / max(1, len(mixed)),
        "cold_load_waits": cold_waits,
        "cold_load_waits_of_frequent_customers": frequent_waits,
        "loads": loads,
        "loads_per_minute": loads / (mixed_s / 60),
        "errors": sum(not r["ok"] for r in mixed) + sum(not r["ok"] for r in hot),
        "error_messages": errors[:5],
        "pinned_ready_after": len(pinned_ready),
        "latency_ms_samples": {  # for the latency CDF plot (bench/run_all.py)
            "hot path": [round(r["latency_s"] * 1000, 3) for r in hot if r["ok"]],
            "frequent": [round(r["latency_s"] * 1000, 3) for r in mixed if r["ok"] and r["model"] in frequent],
            "occasional": [round(r["latency_s"] * 1000, 3) for r in mixed
                           if r["ok"] and r["model"] not in frequent],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"seed scenario: {args.customers} customers, top {TOP} pinned ({pin_s:.1f}s to load them), "
          f"{args.slots} slots, {args.rate:g} req/s open loop, {os.cpu_count()} CPUs")
    print(f"  {'phase / group':<26} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p99 ms':>9}")
    rows = [("hot path (frequent only)", hot_summary), ("mixed: frequent", groups["frequent"]),
            ("mixed: occasional", groups["occasional"])]
    for label, g in rows:
        p50 = f"{g['p50_ms']:.2f}" if g["p50_ms"] is not None else "-"
        p99 = f"{g['p99_ms']:.2f}" if g["p99_ms"] is not None else "-"
        print(f"  {label:<26} {g['requests']:>8} {g['errors']:>6} {p50:>8} {p99:>9}")
    print(f"  hit ratio {result['hit_ratio']:.3f}; cold-load waits {cold_waits:.0f} "
          f"(frequent customers: {frequent_waits:.0f}); loads {loads:.0f} = "
          f"{result['loads_per_minute']:.1f}/min; errors {result['errors']}")
    for e in errors[:3]:
        print(f"  error: {e}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
