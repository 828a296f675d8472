"""What the router adds to a request: direct Triton vs through the router, side by side.

Starts the real product (`mmctl up`: tritonserver + control plane + router) in a child
process, then measures from this process with unmodified tritonclient gRPC clients:

* latency at concurrency 1 of the `identity` model (p50/p90/p99), direct and routed,
  alternating blocks so both see the same machine state;
* throughput at saturation of a recommender model with N client threads, direct and routed.

    .venv/bin/python -m bench.router_latency [--requests 3000] [--threads 8] [--seconds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from control_plane.demo_fleet import FleetSpec, generate_extras, generate_fleet
from control_plane.triton_process import free_port
from tests.product import Product


def wait_ready(addr: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    import grpc

    while time.monotonic() < deadline:
        try:
            grpc.channel_ready_future(grpc.insecure_channel(addr)).result(timeout=1)
            return
        except grpc.FutureTimeoutError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {addr}")


def percentiles_us(samples_s: list[float]) -> dict:
    a = np.array(samples_s) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p90_us": float(np.percentile(a, 90)),
            "p99_us": float(np.percentile(a, 99)), "n": len(a)}


def latency_run(urls: dict[str, str], requests: int, block: int = 100) -> dict:
    x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    clients = {name: grpcclient.InferenceServerClient(url) for name, url in urls.items()}
    for c in clients.values():  # warm both paths (channels, model, caches)
        for _ in range(200):
            c.infer("identity", [x])
    samples: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(requests // block):
        for name, client in clients.items():
            for _ in range(block):
                t0 = time.perf_counter()
                client.infer("identity", [x])
                samples[name].append(time.perf_counter() - t0)
    out = {k: percentiles_us(v) for k, v in samples.items()}
    for k, v in samples.items():  # kept for the latency CDF plot (bench/run_all.py)
        out[k]["samples_us"] = [round(x * 1e6, 1) for x in v]
    return out


def throughput_run(url: str, model: str, threads: int, seconds: float, rows: int) -> dict:
    data = np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32)
    counts = [0] * threads
    errors = [0] * threads
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        x = grpcclient.InferInput("FEATURES", [rows, 64], "FP32")
        x.set_data_from_numpy(data)
        while time.monotonic() < stop:
            try:
                client.infer(model, [x])
                counts[i] += 1
            except Exception:  # noqa: BLE001 - an error is a result here, counted
                errors[i] += 1

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    start = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = time.monotonic() - start
    return {"requests_per_s": sum(counts) / elapsed, "errors": sum(errors), "seconds": elapsed}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000, help="per path, concurrency 1")
    ap.add_argument("--threads", type=int, default=8, help="client threads for saturation")
    ap.add_argument("--seconds", type=float, default=8.0, help="per throughput run")
    ap.add_argument("--rows", type=int, default=1, help="rows per recommender request")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router.json")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    repo = work / "repository"
    spec = FleetSpec(count=2)
    generate_fleet(repo, spec)
    generate_extras(repo, spec)
    product = Product(work / "state", repo, "--max-loaded", "8").start()
    try:
        endpoints = product.json("endpoints")
        for model in ("identity", "cust001"):
            assert product.mmctl("pin", model).returncode == 0
        direct, routed = endpoints["triton"][0]["grpc"], endpoints["router_grpc"]
        proxy_addr = f"127.0.0.1:{free_port()}"
        proxy = subprocess.Popen([sys.executable, "-m", "bench.passthrough_proxy", proxy_addr, direct],
                                 cwd=ROOT)
        wait_ready(proxy_addr)
        urls = {"direct": direct, "proxy": proxy_addr, "router": routed}
        latency = latency_run(urls, args.requests)
        tput = {}
        for name, url in (("direct", direct), ("proxy", proxy_addr), ("router", routed),
                          ("direct_again", direct)):
            tput[name] = throughput_run(url, "cust001", args.threads, args.seconds, args.rows)
    finally:
        if "proxy" in locals():
            proxy.kill()
        product.stop()
        shutil.rmtree(work, ignore_errors=True)

    direct_tput = (tput["direct"]["requests_per_s"] + tput["direct_again"]["requests_per_s"]) / 2
    result = {
        "benchmark": "router_latency",
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "processes": "client (this) | mmctl up (control plane + router) | tritonserver + stubs",
            "latency_requests_per_path": args.requests, "throughput_threads": args.threads,
            "throughput_seconds": args.seconds, "rows_per_request": args.rows,
        },
        "latency_identity": latency,
        "router_overhead_us": {q: latency["router"][q] - latency["direct"][q]
                               for q in ("p50_us", "p90_us", "p99_us")},
        "plain_proxy_overhead_us": {q: latency["proxy"][q] - latency["direct"][q]
                                    for q in ("p50_us", "p90_us", "p99_us")},
        "throughput_recommender": tput,
        "router_throughput_ratio": tput["router"]["requests_per_s"] / direct_tput,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"identity, concurrency 1, {args.requests} requests per path ({os.cpu_count()} CPUs):")
    print(f"  {'path':<8} {'p50 us':>9} {'p90 us':>9} {'p99 us':>9}")
    for name in ("direct", "proxy", "router"):
        r = latency[name]
        print(f"  {name:<8} {r['p50_us']:>9.0f} {r['p90_us']:>9.0f} {r['p99_us']:>9.0f}")
    for label, key in (("proxy adds", "plain_proxy_overhead_us"), ("router adds", "router_overhead_us")):
        o = result[key]
        print(f"  {label:<11} {o['p50_us']:>6.0f} {o['p90_us']:>9.0f} {o['p99_us']:>9.0f}")
    print("  (proxy = a plain grpc.aio pass-through of the same bytes: the floor of a Python hop)")
    print(f"recommender cust001, {args.threads} threads x {args.seconds:.0f}s, {args.rows} row(s)/request:")
    for name, r in tput.items():
        print(f"  {name:<13} {r['requests_per_s']:>8.0f} req/s  errors {r['errors']}")
    print(f"  router keeps {result['router_throughput_ratio'] * 100:.0f}% of direct throughput, "
          f"the plain proxy {tput['proxy']['requests_per_s'] / direct_tput * 100:.0f}%")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
