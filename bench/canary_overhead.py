"""What a running canary costs the requests the router serves: latency without and with one.

Starts the real product (`mmctl up`: tritonserver + control plane + router) in a child
process.  Phases, in one run:

1. ``none``: open-loop traffic on the primary at ``--rate`` with no canary;
2. a canary of the primary (50% to the candidate, a stage that never ends, a check every
   second) and closed-loop traffic until its statistics window holds ``--fill`` requests
   (a canary that has run a while: the router keeps up to 50,000 per variant);
3. ``canary``: the same open-loop traffic while the canary is checked every second;
4. ``after``: the canary aborted, the same traffic again (the machine's drift).

Reported per phase: p50/p99 of the client's latency and the CPU the serving event loop
(the main thread of `mmctl up`) used per second and per request, which other work on a
shared machine does not inflate the way it inflates p99.

    .venv/bin/python -m bench.canary_overhead [--rate 100] [--seconds 20] [--fill 50000]
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
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shadow_overhead import cpu_seconds, summarize
from control_plane.demo.fleet import FleetSpec, generate_fleet
from tests.product import Product

PRIMARY, CANDIDATE = "cust001", "cust002"


def features() -> list[InferInput]:
    x = InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    return [x]


async def open_loop(url: str, rate_per_s: float, seconds: float) -> list[tuple[float, bool]]:
    """Send at t = i / rate for ``seconds`` regardless of completions; (latency s, ok) each."""
    client = grpcaio.InferenceServerClient(url)
    inputs = features()
    results: list[tuple[float, bool]] = []

    async def one() -> None:
        t0 = time.perf_counter()
        try:
            await client.infer(PRIMARY, inputs, client_timeout=30)
            ok = True
        except Exception:  # noqa: BLE001 - an error is a result here
            ok = False
        results.append((time.perf_counter() - t0, ok))

    start = time.perf_counter()
    tasks = []
    for i in range(int(rate_per_s * seconds)):
        delay = start + i / rate_per_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    await client.close()
    return results


async def closed_loop(url: str, requests: int, concurrency: int = 8) -> float:
    """Send ``requests`` as fast as ``concurrency`` clients go; seconds taken."""
    client = grpcaio.InferenceServerClient(url)
    inputs = features()
    left = [requests]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            try:
                await client.infer(PRIMARY, inputs, client_timeout=30)
            except Exception:  # noqa: BLE001, S110 - filling the window, errors count too
                pass

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    await client.close()
    return time.perf_counter() - start


def measure(product: Product, url: str, rate: float, seconds: float) -> dict:
    cpu_start = cpu_seconds(product.proc.pid)
    wall_start = time.perf_counter()
    results = asyncio.run(open_loop(url, rate, seconds))
    wall_s = time.perf_counter() - wall_start
    cpu_end = cpu_seconds(product.proc.pid)
    out = summarize([lat for lat, ok in results if ok], sum(not ok for _, ok in results))
    loop_s = cpu_end["loop"] - cpu_start["loop"]
    out.update(loop_cpu_ms_per_s=round(loop_s * 1000 / wall_s, 2),
               loop_cpu_ms_per_request=round(loop_s * 1000 / max(1, len(results)), 3),
               latency_ms_samples=[round(lat * 1000, 3) for lat, ok in results if ok])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second (open loop)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    ap.add_argument("--fill", type=int, default=50_000, help="requests sent before measuring")
    ap.add_argument("--warm-seconds", type=float, default=3.0,
                    help="requests before the first phase (channels and models warm)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "canary_overhead.json")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-canary-"))
    repo = work / "repository"
    generate_fleet(repo, FleetSpec(count=2))
    product = Product(work / "state", repo, "--max-loaded", "8").start()
    phases: dict[str, dict] = {}
    try:
        url = product.json("endpoints")["router_grpc"]
        for model in (PRIMARY, CANDIDATE):
            assert product.mmctl("pin", model).returncode == 0, f"pin {model} failed"
        asyncio.run(open_loop(url, args.rate, args.warm_seconds))  # warm channels and models
        phases["none"] = measure(product, url, args.rate, args.seconds)
        out = product.mmctl("canary", "start", PRIMARY, "--to", CANDIDATE, "--stages", "50",
                            "--stage-seconds", "1e9", "--check-interval", "1",
                            "--min-requests", "10", "--max-error-rate", "1")
        assert out.returncode == 0, out.stderr
        fill_s = asyncio.run(closed_loop(url, args.fill))
        phases["canary"] = measure(product, url, args.rate, args.seconds)
        status = product.json("canary", "status", PRIMARY)
        assert status["status"] == "running", status["history"][-1]
        window = {v: s["requests"] for v, s in status["variants"].items()}
        assert product.mmctl("canary", "abort", PRIMARY).returncode == 0
        phases["after"] = measure(product, url, args.rate, args.seconds)
    finally:
        product.stop()
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "benchmark": "canary_overhead",
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": os.getloadavg(),
            "processes": "client (this) | mmctl up (control plane + router) | tritonserver + stubs",
            "route": PRIMARY, "candidate": CANDIDATE, "canary": "50%, check every 1 s, never ends",
            "rate_per_s": args.rate, "seconds_per_phase": args.seconds, "fill_requests": args.fill,
            "fill_seconds": round(fill_s, 1), "canary_window_requests": window,
        },
        "phases": phases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{PRIMARY} at {args.rate:g} req/s open loop, {args.seconds:g}s per phase; canary "
          f"window {window} after {args.fill} requests; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}:")
    print(f"  {'phase':<8} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'loop CPU ms/s':>13} {'ms/request':>10}")
    for name, s in phases.items():
        print(f"  {name:<8} {s['requests']:>8} {s['errors']:>6} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} "
              f"{s['loop_cpu_ms_per_s']:>13.1f} {s['loop_cpu_ms_per_request']:>10.3f}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
