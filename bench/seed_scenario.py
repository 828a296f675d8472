"""The seed scenario end to end on the real stack, with small models and scaled time.

50 per-customer fine-tunes; the top 12 customers send 80% of the requests and are pinned;
GPU "slots" = --max-loaded.  `mmctl up` (tritonserver + control plane + router) runs in a
child process; this process sends open-loop arrivals at a fixed rate through the router
with the async tritonclient and reports, per customer group, p50/p99 latency, plus hit
ratio, loads per minute and errors.  A first phase sends only frequent customers' traffic
to measure the hot-path latency on the same machine, for comparison.  A last phase measures
a bare load of the same kind of model: every unpinned model is unloaded (until Triton frees
it), then one request goes to a cold occasional customer, so its latency is the load,
warm-up and inference with no eviction (``load_only_p50_s``): the floor an occasional
customer's first request could reach.

``--layout`` picks how the 50 fine-tunes are served: ``models`` (a Triton model each: a
miss is a Triton load), ``family`` (one model family: a miss is a copy into a weight slot),
or ``both`` (the default), one after the other in the same run, with the family's
occasional p50 put against the separate models' bare load.

``--variant-mb 850`` gives every customer the seed's weight size (the hidden layers
widened, as ``mmctl up --model-size-mb`` does).  Those fleets are written cheaply: the
hidden layers are one random draw that every customer shares, and only the first and the
last layer (a few MB) differ per customer; a family's variants are copies of the first
one's file with those bytes rewritten.  Every customer still answers differently, and at
the end a few customers' answers through the router are checked against their weights
files (``answers``).  On a GPU the models run as KIND_GPU instances (a family's slots in
device memory).  ``--work-dir`` puts the generated repository, which is the warm tier
Triton serves from, in host DRAM (e.g. /dev/shm): 50 x 850 MB is 42.5 GB.

    .venv/bin/python -m bench.seed_scenario [--rate 4] [--seconds 60] [--slots 15] [--layout both]
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
import torch
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.process_memory import gpu_used_mib
from bench.sized_fleet import check_answers, write_sized_fleet
from bench.traces import seed_scenario
from control_plane.demo.fleet import demo_spec, generate_family_fleet, generate_fleet
from tests.product import Product

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
        except Exception as exc:  # noqa: BLE001  (every failure is a result the bench reports)
            ok, error = False, str(exc)[:200]
        results.append({"model": name, "latency_s": time.perf_counter() - t0, "ok": ok, "error": error,
                        "sent_at": epoch0 + (t0 - start)})

    start = time.perf_counter()
    epoch0 = time.time()
    tasks = []
    for i, name in enumerate(names):
        delay = start + i / rate_per_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(name)))
    await asyncio.gather(*tasks)
    await client.close()
    return results


async def bare_loads(url: str, admin: str, headers: dict, names: list[str],
                     timeout_s: float) -> list[dict]:
    """For each name: unload every unpinned model (each call returns once Triton freed it),
    then time one request for ``name`` through the router: a load with room to spare."""
    client = grpcaio.InferenceServerClient(url)
    x = InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    post = {**headers, "Content-Type": "application/json"}
    rows = []
    try:
        for name in names:
            status = await asyncio.to_thread(
                lambda: requests.get(admin + "/v1/status", headers=headers, timeout=30).json())
            for m in status:
                if m["server"] is not None and not m["pinned"]:
                    await asyncio.to_thread(
                        requests.post, f"{admin}/v1/models/{m['model']}/unload", headers=post,
                        timeout=timeout_s)
            t0 = time.perf_counter()
            await client.infer(name, [x], client_timeout=timeout_s)
            latency_s = time.perf_counter() - t0
            rec = await asyncio.to_thread(
                lambda n=name: requests.get(f"{admin}/v1/models/{n}", headers=headers, timeout=30).json())
            rows.append({"model": name, "latency_s": latency_s, "load_time_s": rec.get("load_time_s")})
    finally:
        await client.close()
    return rows


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
    ap.add_argument("--variant-mb", type=float, default=None,
                    help="each customer's weights in MB (the seed's is 850); default: the small "
                         "demo model")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the generated repository (Triton's warm tier) and the state go; "
                         "default: the system's temporary folder")
    ap.add_argument("--check-answers", type=int, default=4,
                    help="customers whose answers are checked against their weights at the end")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    ap.add_argument("--bare-loads", type=int, default=7,
                    help="bare loads (no eviction) of occasional customers measured at the end")
    ap.add_argument("--log-out", type=Path, default=None,
                    help="keep the control plane's log there (the work folder is deleted)")
    ap.add_argument("--up-args", default="",
                    help="extra `mmctl up` options, e.g. \"--headroom-models 0\"")
    ap.add_argument("--layout", choices=("models", "family", "both"), default="both",
                    help="a Triton model per customer, one model family, or both in turn")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "seed_scenario.json",
                    help="the models layout's result; the family's goes beside it (_family)")
    args = ap.parse_args(argv)
    layouts = ("models", "family") if args.layout == "both" else (args.layout,)
    results = {}
    for layout in layouts:
        out = args.out if layout == "models" else args.out.with_name(args.out.stem + "_family.json")
        results[layout] = run(args, layout, out)
    if len(results) == 2 and results["models"]["load_only_p50_s"]:
        fam = results["family"]["mixed"]["occasional"]["p50_ms"]
        bare = results["models"]["load_only_p50_s"] * 1000
        models_occ = results["models"]["mixed"]["occasional"]["p50_ms"]
        comparison = {
            "family_occasional_p50_ms": fam, "models_occasional_p50_ms": models_occ,
            "models_bare_load_p50_ms": bare,
            "family_occasional_p50_over_models_bare_load": round(fam / bare, 4) if fam else None,
            "errors": {k: r["errors"] for k, r in results.items()},
        }
        path = args.out.with_name(args.out.stem + "_compare.json")
        path.write_text(json.dumps(comparison, indent=2))
        print(f"same run: occasional customers' p50 {fam:.1f} ms as a family vs {models_occ:.1f} ms "
              f"as separate models; a bare Triton load of one of them {bare:.0f} ms: family / bare "
              f"load = {comparison['family_occasional_p50_over_models_bare_load']}")
        print(f"wrote {path}")
    return results


def run(args, layout: str, out_path: Path) -> dict:
    """One layout's scenario; writes ``out_path`` and returns its result."""
    n_mixed = int(args.rate * args.seconds)
    n_hot = int(args.rate * args.hot_seconds)
    trace = seed_scenario(n_customers=args.customers, n_requests=n_mixed, seed=args.seed, top=TOP,
                          slots=args.slots)
    names = [customer(i) for i in trace.requests.tolist()]
    frequent = {customer(i) for i in range(TOP)}
    hot_names = [customer(i) for i in trace.requests.tolist() if i < TOP][:n_hot]

    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-seed-", dir=args.work_dir))
    repo = work / "repository"
    spec = demo_spec(args.customers, args.variant_mb)  # KIND_GPU where torch sees a GPU
    started = time.monotonic()
    if args.variant_mb:
        write_sized_fleet(repo, spec, layout)
    elif layout == "family":
        generate_family_fleet(repo, spec)
    else:
        generate_fleet(repo, spec)
    generate_s = time.monotonic() - started
    weight_bytes = sum(int(np.prod(s)) * 4 for s in (
        (spec.hidden_dim, spec.feature_dim + 1), *[(spec.hidden_dim, spec.hidden_dim + 1)] * (spec.hidden_layers - 1),
        (1, spec.hidden_dim + 1)))
    print(f"seed scenario ({layout}): wrote {args.customers} customers of {weight_bytes / 1e6:.1f} MB "
          f"({spec.instance_kind}) into {repo} in {generate_s:.1f}s", flush=True)
    started = time.monotonic()
    product = Product(work / "state", repo, "--max-loaded", str(args.slots),
                      *args.up_args.split()).start()
    up_s = time.monotonic() - started
    print(f"  mmctl up ready in {up_s:.1f}s", flush=True)
    load_before = os.getloadavg()
    answers: list[dict] = []
    gpu_mib: dict[str, float | None] = {}
    try:
        endpoints = product.json("endpoints")
        router = endpoints["router_grpc"]
        pin_start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:  # pins load concurrently
            codes = list(pool.map(lambda n: product.mmctl("pin", n).returncode, sorted(frequent)))
        assert codes == [0] * TOP, f"pinning failed: {codes}"
        pin_s = time.monotonic() - pin_start
        gpu_mib["after_pins"] = gpu_used_mib()
        print(f"  pinned the top {TOP} in {pin_s:.1f}s", flush=True)
        hot = asyncio.run(open_loop(router, hot_names, args.rate, args.timeout))
        before = requests.get(f"http://{endpoints['router_http']}/metrics", timeout=10).text
        admin_before = requests.get(endpoints["admin"] + "/metrics", timeout=10).text
        mixed_start = time.monotonic()
        mixed = asyncio.run(open_loop(router, names, args.rate, args.timeout))
        mixed_s = time.monotonic() - mixed_start
        after = requests.get(f"http://{endpoints['router_http']}/metrics", timeout=10).text
        admin_after = requests.get(endpoints["admin"] + "/metrics", timeout=10).text
        status = product.json("status")
        load_after_mixed = os.getloadavg()
        gpu_mib["after_mixed"] = gpu_used_mib()
        # Bare loads of the least requested customers: cold, and never one a pin holds.
        rare = [customer(i) for i in range(args.customers - 1, TOP - 1, -1)][:args.bare_loads]
        bare = asyncio.run(bare_loads(router, endpoints["admin"], product.admin_headers(), rare,
                                      args.timeout))
        # Two frequent and the rest occasional customers, the rarest first.
        checked = sorted(frequent)[:2] + [customer(i) for i in range(args.customers - 1, TOP - 1, -1)]
        answers = check_answers(router, repo, checked[:args.check_answers], layout, spec.feature_dim)
    finally:
        product.stop()
        if args.log_out is not None:
            args.log_out.parent.mkdir(parents=True, exist_ok=True)
            # Triton's own log after the control plane's: a model's load or stub failure is
            # written there (the last 300 lines of each server's).
            tritons = "".join(f"\n===== {path.name} (last 300 lines)\n" + "\n".join(
                path.read_text(errors="replace").splitlines()[-300:])
                for path in sorted((work / "state" / "triton").glob("*.log")))
            args.log_out.write_text(product.log_text() + tritons)
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
    load_only_p50_s = float(np.median([r["latency_s"] for r in bare])) if bare else None
    occasional_p50_s = (groups["occasional"]["p50_ms"] / 1000
                        if groups["occasional"]["p50_ms"] is not None else None)
    result = {
        "benchmark": "seed_scenario",
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "customers": args.customers, "pinned": TOP, "slots": args.slots, "layout": layout,
            "rate_per_s": args.rate, "mixed_requests": n_mixed, "hot_requests": len(hot_names),
            "traffic": "top 12 customers send 80% (trace 'seed', Zipf 0.6 within groups)",
            "model": (f"recommender MLP {spec.feature_dim}-" + "-".join([str(spec.hidden_dim)] * spec.hidden_layers)
                      + f"-1, python backend, {spec.instance_kind}"),
            "weight_bytes_per_customer": weight_bytes,
            "weights": ("hidden layers shared, first and last layer per customer" if args.variant_mb
                        else "every layer per customer"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "repository": str(repo),
            "generate_s": round(generate_s, 1), "up_s": round(up_s, 1),
            "pin_all_12_s": round(pin_s, 2),
            "up_args": args.up_args,
            # The machine is shared: 1/5/15-minute load averages at start, after the mixed
            # phase and at the end say how noisy the run was (2 cores here).
            "loadavg_start": [round(v, 2) for v in load_before],
            "loadavg_after_mixed": [round(v, 2) for v in load_after_mixed],
            "loadavg_end": [round(v, 2) for v in os.getloadavg()],
        },
        "hot_path_frequent_only": hot_summary,
        "mixed": groups,
        "load_only_p50_s": load_only_p50_s,
        "occasional_p50_over_load_only": (round(occasional_p50_s / load_only_p50_s, 3)
                                          if load_only_p50_s and occasional_p50_s else None),
        "bare_loads": [{**r, "latency_s": round(r["latency_s"], 4)} for r in bare],
        "hit_ratio": 1 - cold_waits / max(1, len(mixed)),
        "cold_load_waits": cold_waits,
        "cold_load_waits_of_frequent_customers": frequent_waits,
        "loads": loads,
        "loads_per_minute": loads / (mixed_s / 60),
        "errors": sum(not r["ok"] for r in mixed) + sum(not r["ok"] for r in hot),
        "error_messages": errors[:5],
        "pinned_ready_after": len(pinned_ready),
        "gpu_used_mib": gpu_mib,
        # A few customers asked once at the end: their answer against the reference MLP over
        # their weights file; distinct customers must answer differently.
        "answers": answers,
        "answers_ok": bool(answers) and all(a["ok"] for a in answers)
        and len({round(a["expected"], 7) for a in answers}) == len(answers),
        # Every mixed-phase request: send time (epoch s), customer, latency (ms), ok; to line
        # up with the control plane's log (--log-out).
        "mixed_requests": [[round(r["sent_at"], 3), r["model"], round(r["latency_s"] * 1000, 2), r["ok"]]
                           for r in sorted(mixed, key=lambda r: r["sent_at"])],
        "latency_ms_samples": {  # for the latency CDF plot (bench/run_all.py)
            "hot path": [round(r["latency_s"] * 1000, 3) for r in hot if r["ok"]],
            "frequent": [round(r["latency_s"] * 1000, 3) for r in mixed if r["ok"] and r["model"] in frequent],
            "occasional": [round(r["latency_s"] * 1000, 3) for r in mixed
                           if r["ok"] and r["model"] not in frequent],
        },
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"seed scenario ({layout}): {args.customers} customers, top {TOP} pinned ({pin_s:.1f}s to load them), "
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
    if load_only_p50_s is not None:
        ratio = result["occasional_p50_over_load_only"]
        print(f"  bare load (no eviction) p50 {load_only_p50_s * 1000:.0f} ms over {len(bare)} loads; "
              f"occasional p50 / bare load = {ratio if ratio is not None else '-'}")
    print(f"  load average (1 min) at start {load_before[0]:.2f}, after the mixed phase "
          f"{load_after_mixed[0]:.2f}")
    if answers:
        shown = ", ".join(f"{a['model']} {a['answer']} (expected {a['expected']:.6f})" for a in answers)
        print(f"  answers against the weights files: {'ok' if result['answers_ok'] else 'WRONG'}: {shown}")
    if any(v is not None for v in gpu_mib.values()):
        print(f"  GPU memory in use: {gpu_mib}")
    for e in errors[:3]:
        print(f"  error: {e}")
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
