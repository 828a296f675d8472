"""What a hop in front of Triton adds to a gRPC request: direct, Python pass-throughs (grpc.aio
and grpc's thread-pool server), nginx and the product's router (in-process, or with N router workers), side by side in one run.

Starts the real product (`mmctl up`: tritonserver + control plane + router) in child
processes, nginx (`grpc_pass`) and bench/passthrough_proxy.py in front of the first product's
Triton, then measures from this process with unmodified tritonclient gRPC clients:

* latency at concurrency 1 of the `identity` model (p50/p90/p99), every path in turn in
  blocks of --block requests, the order rotated each round, so all see the same machine state;
* throughput at saturation (--threads client threads, one connection each), every path for
  --seconds per round, the order reversed every other round.

    .venv/bin/python -m bench.router_latency [--requests 3000] [--seconds 8] [--workers 1,2]

With `mmctl up --router-workers`, one product per worker count (each with its own Triton,
same models and config); without it, one product whose router runs inside `mmctl up`.
nginx comes from Debian's nginx-light: installed with apt-get when missing and run as root
(--no-install: never), else that path is skipped and the output says why.
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proxies import NginxGrpcProxy, PassthroughProxy, ensure_nginx, nginx_version
from control_plane.demo.fleet import FleetSpec, generate_extras, generate_fleet
from tests.product import MMCTL, Product

RESULT_FILE = ROOT / "bench" / "results" / "router_latency.json"
WARM_REQUESTS = 200
PATH_READY_TIMEOUT_S = 60.0
QUANTILES = ("p50_us", "p90_us", "p99_us")


@dataclass
class Hop:
    """One way to reach Triton: a key for the JSON, a label for people, a gRPC address."""

    key: str
    label: str
    url: str


def router_workers_supported() -> bool:
    """Whether this checkout's `mmctl up` takes --router-workers."""
    out = subprocess.run([*MMCTL, "up", "--help"], capture_output=True, text=True, cwd=ROOT,
                         check=False)
    return "--router-workers" in out.stdout


def router_label(workers: int | None) -> str:
    if not workers:  # None: mmctl up without the flag; 0: the flag's in-process router
        return "router (in-process)"
    return f"router ({workers} worker{'s' if workers > 1 else ''})"


def client(url: str) -> grpcclient.InferenceServerClient:
    # A local subchannel pool gives every client its own TCP connection: gRPC would otherwise
    # share one between channels with equal arguments, and the saturation threads would all
    # land on one router worker (SO_REUSEPORT spreads connections, not requests).
    return grpcclient.InferenceServerClient(url, channel_args=[
        ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.use_local_subchannel_pool", 1)])


def model_inputs(model: str, rows: int) -> list[grpcclient.InferInput]:
    if model == "identity":
        x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(np.ones((1, 16), np.float32))
    else:  # a demo recommender (cust001)
        x = grpcclient.InferInput("FEATURES", [rows, 64], "FP32")
        x.set_data_from_numpy(np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32))
    return [x]


def start_products(work: Path, worker_counts: list[int | None], stack: ExitStack) -> list[Product]:
    """One `mmctl up` per worker count (None: without --router-workers), started together;
    each is stopped when ``stack`` closes, also one that failed to come up."""

    def prepare(workers: int | None) -> Product:
        home = work / ("inproc" if workers is None else f"workers{workers}")
        repo = home / "repository"  # its own copy: a product may write into its repository
        spec = FleetSpec(count=2)
        generate_fleet(repo, spec)
        generate_extras(repo, spec)
        (home / "state").mkdir(parents=True)
        extra = ["--max-loaded", "8",
                 # Product's 0.5s reconcile would be background CPU in every measurement
                 "--reconcile-interval", "2"]
        if workers is not None:
            extra += ["--router-workers", str(workers)]
        return Product(home / "state", repo, *extra)

    products = [prepare(n) for n in worker_counts]
    for product in products:
        stack.callback(product.stop)
    with ThreadPoolExecutor(len(products)) as pool:
        return list(pool.map(Product.start, products))


def wait_serving(hop: Hop, model: str, inputs) -> None:
    """Until ``model`` answers through ``hop`` (a router worker learns a pin from its snapshot),
    then WARM_REQUESTS more to warm channels, caches and the model instance."""
    c = client(hop.url)
    deadline = time.monotonic() + PATH_READY_TIMEOUT_S
    while True:
        try:
            c.infer(model, inputs)
            break
        except InferenceServerException as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{hop.label} ({hop.url}) does not serve {model}: {e}") from None
            time.sleep(0.2)
    for _ in range(WARM_REQUESTS):
        c.infer(model, inputs)
    c.close()


def percentiles_us(samples_s: list[float]) -> dict:
    a = np.array(samples_s) * 1e6
    return {q: float(np.percentile(a, float(q[1:3]))) for q in QUANTILES} | {"n": int(a.size)}


def latency_run(hops: list[Hop], requests: int, block: int) -> dict[str, dict]:
    """Concurrency 1 on `identity`: ``requests`` per hop in blocks of ``block``, hop by hop."""
    inputs = model_inputs("identity", 1)
    clients = {h.key: client(h.url) for h in hops}
    samples: dict[str, list[float]] = {h.key: [] for h in hops}
    errors = dict.fromkeys(samples, 0)
    block = max(1, min(block, requests))
    rounds = max(1, requests // block)
    for r in range(rounds):
        for i in range(len(hops)):  # rotated: no hop always runs right after the same other
            key = hops[(i + r) % len(hops)].key
            c = clients[key]
            for _ in range(block):
                t0 = time.perf_counter()
                try:
                    c.infer("identity", inputs)
                except InferenceServerException:
                    errors[key] += 1
                    continue
                samples[key].append(time.perf_counter() - t0)
    for c in clients.values():
        c.close()
    out = {}
    for key, s in samples.items():
        if not s:
            raise RuntimeError(f"every request through {key} failed")
        out[key] = percentiles_us(s) | {"errors": errors[key],
                                        "samples_us": [round(x * 1e6, 1) for x in s]}
    return out


def throughput_run(url: str, model: str, inputs, threads: int, seconds: float) -> dict:
    """``threads`` clients, each with its own connection, as fast as answers come."""
    counts, errors = [0] * threads, [0] * threads
    clients = [client(url) for _ in range(threads)]
    start_at = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def worker(i: int) -> None:
        start_at.wait()
        while time.monotonic() < stop_at[0]:
            try:
                clients[i].infer(model, inputs)
                counts[i] += 1
            except InferenceServerException:  # an error is a result here, counted
                errors[i] += 1

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    start = time.monotonic()
    stop_at[0] = start + seconds
    start_at.wait()
    for t in ts:
        t.join()
    elapsed = time.monotonic() - start
    for c in clients:
        c.close()
    return {"requests_per_s": sum(counts) / elapsed, "errors": sum(errors), "seconds": elapsed}


def throughput_rounds(hops: list[Hop], model: str, rows: int, threads: int, seconds: float,
                      rounds: int) -> dict[str, dict]:
    """Every hop for ``seconds`` per round, in order, then reversed: a drift in the machine's
    load between the first and the last hop evens out."""
    inputs = model_inputs(model, rows)
    runs: dict[str, list[dict]] = {h.key: [] for h in hops}
    for r in range(rounds):
        for hop in (hops if r % 2 == 0 else hops[::-1]):
            runs[hop.key].append(throughput_run(hop.url, model, inputs, threads, seconds))
    return {key: {"requests_per_s": float(np.mean([x["requests_per_s"] for x in rs])),
                  "requests_per_s_rounds": [round(x["requests_per_s"], 1) for x in rs],
                  "errors": sum(x["errors"] for x in rs)}
            for key, rs in runs.items()}


def summarize(hops: list[Hop], latency: dict, tput: dict) -> dict:
    """Per hop: latency, what it adds over direct, throughput; and router/nginx added p50."""
    direct = latency["direct"]
    paths = {}
    for h in hops:
        lat = latency[h.key]
        paths[h.key] = {"label": h.label, "url": h.url,
                        **{q: lat[q] for q in QUANTILES}, "n": lat["n"], "errors": lat["errors"],
                        **{f"added_{q}": lat[q] - direct[q] for q in QUANTILES},
                        "throughput": tput[h.key], "samples_us": lat["samples_us"]}
    nginx_added = paths["nginx"]["added_p50_us"] if "nginx" in paths else None
    ratio = {}
    for key, p in paths.items():
        if key.startswith(("router", "passthrough")):  # the pass-throughs: the Python floor
            # the ratio only means something when nginx measurably adds latency
            ratio[key] = p["added_p50_us"] / nginx_added if nginx_added and nginx_added > 0 else None
    return {"paths": paths, "router_added_p50_over_nginx_added_p50": ratio}


def conditions(args, router_mode: str, nginx: str | None, load_before: tuple) -> dict:
    versions = {}
    for dist in ("grpcio", "tritonclient", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    cpu_model = next((line.split(":", 1)[1].strip() for line in
                      Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
                     platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {
        "machine": platform.node(), "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model, "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), **versions, "router_mode": router_mode,
        "nginx": nginx_version(nginx) if nginx else None,
        "nginx_worker_processes": NginxGrpcProxy.worker_processes if nginx else None,
        "processes": "client (this) | mmctl up per router mode (control plane + router, "
                     "tritonserver + stubs) | nginx | passthrough proxy",
        "direct_triton": "direct, pass-through and nginx reach the first product's Triton; "
                         "each product has its own Triton with the same models and config",
        "latency_model": "identity", "latency_requests_per_path": args.requests,
        "latency_block": args.block, "throughput_model": args.throughput_model,
        "throughput_threads": args.threads, "throughput_seconds_per_round": args.seconds,
        "throughput_rounds": args.rounds, "rows_per_request": args.rows,
    }


def print_report(result: dict, skipped: dict[str, str]) -> None:
    c, paths = result["conditions"], result["paths"]
    ratios = result["router_added_p50_over_nginx_added_p50"]
    print(f"\nconditions: {c['cpus']} cores ({c['cpus_usable']} usable, {c['cpu_model']}), load "
          f"average {'/'.join(map(str, c['load_average_before']))} before, "
          f"{'/'.join(map(str, c['load_average_after']))} after; python {c['python']}, grpcio "
          f"{c['grpcio']}; nginx {c['nginx'] or '-'} with worker_processes "
          f"{c['nginx_worker_processes'] or '-'}; router: {c['router_mode']}")
    print(f"latency: identity, concurrency 1, {c['latency_requests_per_path']} requests per path in "
          f"blocks of {c['latency_block']}; throughput: {c['throughput_model']}, {c['throughput_threads']} "
          f"threads, {c['throughput_rounds']} x {c['throughput_seconds_per_round']:g}s per path")
    w = max(len(p["label"]) for p in paths.values())
    print(f"  {'path':<{w}} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'+p50 us':>8} {'+p99 us':>8} "
          f"{'req/s':>8} {'+p50/nginx+p50':>15}")
    for key, p in paths.items():
        added = ("-", "-") if key == "direct" else (f"{p['added_p50_us']:.0f}", f"{p['added_p99_us']:.0f}")
        ratio = ratios.get(key)
        ratio_s = "-" if key not in ratios else ("n/a" if ratio is None else f"{ratio:.2f}x")
        errors = p["errors"] + p["throughput"]["errors"]
        print(f"  {p['label']:<{w}} {p['p50_us']:>8.0f} {p['p90_us']:>8.0f} {p['p99_us']:>8.0f} "
              f"{added[0]:>8} {added[1]:>8} {p['throughput']['requests_per_s']:>8.0f} {ratio_s:>15}"
              + (f"  ({errors} errors)" if errors else ""))
    for key, why in skipped.items():
        print(f"  skipped {key}: {why}")
    for note in result["notes"]:
        print(f"  note: {note}")


def parse_workers(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 0 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"--workers {text!r}: give distinct router worker counts >= 0, comma-separated, e.g. "
            "1,2,4 (0: the router inside mmctl up)")
    return counts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000, help="latency requests per path")
    ap.add_argument("--block", type=int, default=100, help="latency requests per path and turn")
    ap.add_argument("--threads", type=int, default=8, help="client threads for saturation")
    ap.add_argument("--seconds", type=float, default=8.0, help="throughput seconds per path and round")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds (odd ones reversed)")
    ap.add_argument("--throughput-model", choices=("identity", "cust001"), default="identity")
    ap.add_argument("--rows", type=int, default=1, help="rows per cust001 request")
    ap.add_argument("--workers", type=parse_workers, default=[1, 2],
                    help="router worker counts, comma-separated (default 1,2; 0: in-process)")
    ap.add_argument("--no-install", action="store_true", help="never apt-get install nginx-light")
    ap.add_argument("--out", type=Path, default=RESULT_FILE)
    args = ap.parse_args(argv)
    for name in ("requests", "block", "threads", "rounds", "rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} ({getattr(args, name)}) must be at least 1")
    if args.seconds <= 0:
        ap.error(f"--seconds ({args.seconds}) must be more than 0")

    load_before = os.getloadavg()
    notes: list[str] = []
    if router_workers_supported():
        worker_counts: list[int | None] = list(args.workers)
        router_mode = "mmctl up --router-workers " + ",".join(map(str, args.workers))
    else:
        worker_counts = [None]
        router_mode = "in-process (mmctl up has no --router-workers)"
        notes.append("this mmctl up has no --router-workers: the router ran inside mmctl up, "
                     f"--workers {','.join(map(str, args.workers))} was not used")
    nginx, nginx_missing = ensure_nginx(install=not args.no_install)
    skipped = {"nginx": nginx_missing} if nginx is None else {}

    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        products = start_products(work, worker_counts, stack)
        direct = products[0].json("endpoints")["triton"][0]["grpc"]
        hops = [Hop("direct", "direct to Triton", direct)]
        for key, sync in (("passthrough", False), ("passthrough_sync", True)):
            proxy = PassthroughProxy(direct, sync=sync)
            stack.callback(proxy.stop)
            hops.append(Hop(key, proxy.label, proxy.start().addr))
        if nginx is not None:
            front = NginxGrpcProxy(nginx, direct)
            stack.callback(front.stop)
            hops.append(Hop("nginx", front.label, front.start().addr))
        for workers, product in zip(worker_counts, products):
            key = "router" if workers is None else f"router_w{workers}"
            hops.append(Hop(key, router_label(workers), product.json("endpoints")["router_grpc"]))
        for product in products:
            for model in {"identity", args.throughput_model}:
                pinned = product.mmctl("pin", model)
                if pinned.returncode != 0:
                    raise RuntimeError(f"mmctl pin {model} failed: {pinned.stderr.strip()}")
        for hop in hops:
            for model in {"identity", args.throughput_model}:
                wait_serving(hop, model, model_inputs(model, args.rows))
        print(f"latency: {len(hops)} paths x {args.requests} requests ...", flush=True)
        latency = latency_run(hops, args.requests, args.block)
        print(f"throughput: {len(hops)} paths x {args.rounds} x {args.seconds:g}s ...", flush=True)
        tput = throughput_rounds(hops, args.throughput_model, args.rows, args.threads, args.seconds,
                                 args.rounds)
    result = {"benchmark": "router_latency",
              "conditions": conditions(args, router_mode, nginx, load_before),
              **summarize(hops, latency, tput), "skipped": skipped, "notes": notes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_report(result, skipped)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
