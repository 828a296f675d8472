"""Thrash: more concurrent clients over more models than fit, through the router of a real
`mmctl up`.  Reports failed requests, latency and loads, for separate Triton models and for
one model family, with one and two router workers, side by side in one run.

Each client sends its requests one after the other, every one to a model drawn at random
from ``--models`` demo customers, while ``--max-loaded`` of them fit; every answer is checked
against the reference MLP over that model's own weights file in the repository Triton serves
from (``tests.reference``).  A failed request is any exception the client sees
or a wrong answer.

    .venv/bin/python -m bench.thrash [--clients 40] [--requests 6] [--models 16] [--max-loaded 4]

``--smoke``: 4 clients x 2 requests over 4 models with room for 2, family layout, one worker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.seed_scenario import metric_sum
from tests.product import Product
from tests.reference import ReferenceAnswers

SMOKE = ["--clients", "4", "--requests", "2", "--models", "4", "--max-loaded", "2",
         "--layouts", "family", "--workers", "1"]
FEATURES = np.ones((1, 64), np.float32)


def thrash(url: str, models: list[str], clients: int, requests_each: int,
           reference: ReferenceAnswers) -> list[dict]:
    records: list[dict] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        c = grpcclient.InferenceServerClient(url)
        x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
        x.set_data_from_numpy(FEATURES)
        for _ in range(requests_each):
            model = rng.choice(models)
            t0 = time.perf_counter()
            try:
                error = reference.check(model, FEATURES,
                                        c.infer(model, [x], client_timeout=240).as_numpy("SCORES"))
                ok = error is None
            except Exception as exc:  # noqa: BLE001  (every failure is a result the bench reports)
                ok, error = False, str(exc)[:200]
            records.append({"model": model, "latency_s": time.perf_counter() - t0, "ok": ok, "error": error})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def run_case(args, layout: str, workers: int) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"thrash-{layout}-{workers}-"))
    product = Product(state / "state", None, "--fleet-size", str(args.models), "--fleet-layout", layout,
                      "--max-loaded", str(args.max_loaded), "--router-workers", str(workers),
                      "--policy", "lru").start()
    try:
        endpoints = product.json("endpoints")
        models = [f"cust{i:03d}" for i in range(1, args.models + 1)]
        reference = ReferenceAnswers(Path(endpoints["repository"]), models, layout)
        start = time.perf_counter()
        records = thrash(endpoints["router_grpc"], models, args.clients, args.requests, reference)
        wall_s = time.perf_counter() - start
        metrics = requests.get(endpoints["admin"] + "/metrics", timeout=10).text
    finally:
        product.stop()
    latencies = np.array([r["latency_s"] for r in records])
    failed = [r for r in records if not r["ok"]]
    return {
        "layout": layout, "router_workers": workers, "requests": len(records), "failed": len(failed),
        "first_errors": sorted({r["error"] for r in failed})[:3],
        "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1),
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1),
        "max_ms": round(float(latencies.max()) * 1000, 1),
        "requests_per_s": round(len(records) / wall_s, 1),
        "loads": int(metric_sum(metrics, "mms_loads_total")),
        "evictions": int(metric_sum(metrics, "mms_evictions_total")),
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--requests", type=int, default=6, help="requests per client, one after the other")
    p.add_argument("--models", type=int, default=16)
    p.add_argument("--max-loaded", type=int, default=4)
    p.add_argument("--layouts", default="models,family")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--smoke", action="store_true", help="smallest size: " + " ".join(SMOKE))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "thrash.json")
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args([*(argv if argv is not None else sys.argv[1:]), *SMOKE])
    print(f"thrash: {args.clients} gRPC clients x {args.requests} requests over {args.models} demo models, "
          f"--max-loaded {args.max_loaded}, policy lru; {os.cpu_count()} cores, {platform.machine()}")
    results = []
    for layout in args.layouts.split(","):
        for workers in map(int, args.workers.split(",")):
            r = run_case(args, layout, workers)
            results.append(r)
            print(f"  {layout:7} workers={workers}: failed {r['failed']}/{r['requests']}, p50 {r['p50_ms']} ms, "
                  f"p99 {r['p99_ms']} ms, max {r['max_ms']} ms, {r['requests_per_s']} req/s, "
                  f"loads {r['loads']}, evictions {r['evictions']}"
                  + (f"; errors: {r['first_errors']}" if r["failed"] else ""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"conditions": vars(args) | {"out": str(args.out)}, "results": results},
                                   indent=2))
    return results


if __name__ == "__main__":
    main()
