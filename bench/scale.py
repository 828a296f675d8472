"""Ten thousand models: what the catalogue's size costs, side by side with 50 and 1,000.

Each catalogue is a real `mmctl up` with the demo fleet as one model family of N variants
(``--fleet-size N``), ``--max-loaded 8`` and ``--router-workers 4``.  For each it reports:

* start-up to ready (``mmctl up`` until the admin API and every router worker answer);
* the control plane's CPU at idle (``/proc/<pid>/stat`` over ``--idle-s`` seconds, no traffic);
* what router workers are sent: the whole published state (what a new worker gets, and what
  every worker was sent on every change before per-key changes) and the bytes of one load;
* how long a change takes to reach every worker (``mms_dataplane_propagation_seconds``,
  publish to each worker's acknowledgement) over ``--changes`` loads and unloads;
* ``mmctl status NAME`` and ``mmctl status --state ready`` (the command, as a person runs it);
* hit latency through the router (gRPC, one loaded model, sequential requests);
* a Zipf replay through the router over every variant: requests, failures, throughput;
* the Prometheus series of the control plane and of the router afterwards.

    .venv/bin/python -m bench.scale [--sizes 50,1000,10000] [--idle-s 15] [--replay 3000]
        [--baseline-tree DIR]   # another checkout, measured side by side in the same run

``--smoke``: 20 variants, one router worker, 1 s idle, 2 changes, 20 hits, 40 replayed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
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

from tests.product import MMCTL, Product
from tests.reference import ReferenceAnswers

SMOKE = ["--sizes", "20", "--workers", "1", "--idle-s", "1", "--changes", "2", "--hits", "20",
         "--replay", "40"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def control_plane_pid(product: Product) -> int:
    processes = product.processes()["processes"]
    return next(p["pid"] for p in processes if p["role"] == "control-plane")


def histogram_quantile(metrics: str, name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of a label-free histogram."""
    buckets = sorted((float("inf") if le == "+Inf" else float(le), float(v))
                     for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', metrics, re.MULTILINE))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= q * total)


def series(metrics: str) -> int:
    return sum(1 for line in metrics.splitlines() if line and not line.startswith("#"))


def timed_mmctl(product: Product, *args: str) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run([*MMCTL, "--url", product.url, "--token-file", str(product.token_file),
                           *args], capture_output=True, text=True, check=True,
                          env=dict(os.environ, **product.client_env()))
    return time.perf_counter() - start, len(done.stdout.splitlines())


def hit_latency(url: str, model: str, count: int) -> dict:
    client = grpcclient.InferenceServerClient(url)
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    client.infer(model, [x])  # loaded, and the router's caches warm
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        client.infer(model, [x])
        latencies.append(time.perf_counter() - start)
    ms = np.array(latencies) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def zipf_replay(url: str, models: list[str], requests_total: int, reference: ReferenceAnswers,
                clients: int = 8) -> dict:
    """Every answer checked against the reference MLP over the variant's own weights file."""
    features = np.ones((1, 64), np.float32)
    rng = np.random.default_rng(7)
    ranks = np.arange(1, len(models) + 1)
    weights = 1.0 / ranks ** 1.1
    picks = rng.choice(len(models), size=requests_total, p=weights / weights.sum())
    failures: list[str] = []
    lock = threading.Lock()

    def client(share: np.ndarray) -> None:
        c = grpcclient.InferenceServerClient(url)
        x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
        x.set_data_from_numpy(features)
        for i in share:
            try:
                wrong = reference.check(models[i], features,
                                        c.infer(models[i], [x], client_timeout=120).as_numpy("SCORES"))
                if wrong:
                    raise AssertionError(wrong)
            except Exception as exc:  # noqa: BLE001  (every failure is a result the bench reports)
                with lock:
                    failures.append(f"{models[i]}: {str(exc)[:160]}")

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(picks[i::clients],)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - start
    return {"requests": requests_total, "distinct_models": len(set(picks.tolist())),
            "failed": len(failures), "first_failures": failures[:3],
            "throughput_rps": round(requests_total / wall_s, 1)}


def start_stack(size: int, args, label: str = "") -> tuple[Product, float]:
    """`mmctl up` with ``size`` demo variants (from the current directory's checkout), and
    the seconds it took to be ready."""
    state = Path(tempfile.mkdtemp(prefix=f"scale{label}-{size}-"))
    start = time.perf_counter()
    product = Product(state / "state", None, "--fleet-size", str(size), "--model-size-mb", "0.01",
                      "--max-loaded", "8", "--router-workers", str(args.workers),
                      "--reconcile-interval", "2").start()
    return product, time.perf_counter() - start


def idle_cpu(product: Product, seconds: float) -> float:
    """The control plane's CPU, in cores, over ``seconds`` without traffic."""
    time.sleep(3)  # the workers' first polls and the first reconcile passes settle
    pid = control_plane_pid(product)
    before, t0 = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.perf_counter() - t0)


def admin_post(product: Product, path: str) -> None:
    requests.post(product.url + path, json={}, headers=product.admin_headers(),
                  timeout=120).raise_for_status()


def what_one_load_sends(product: Product, model: str) -> tuple[bytes, bytes]:
    """What a new worker gets (the whole published state) and what a worker that is up to
    date gets for one load of ``model``, asked as a worker would."""
    snapshot, headers = product.url + "/v1/dataplane/snapshot", product.admin_headers()
    whole = requests.get(snapshot, headers=headers, timeout=30, params={"worker": "bench", "since": "-1"})
    published = json.loads(whole.content)
    admin_post(product, f"/v1/models/{model}/load")
    change = requests.get(snapshot, headers=headers, timeout=30, params={
        "worker": "bench", "since": str(published["version"]), "epoch": published["epoch"]})
    return whole.content, change.content


def run_size(size: int, args) -> dict:
    product, startup_s = start_stack(size, args)
    try:
        endpoints = product.json("endpoints")
        models = [f"cust{i:03d}" for i in range(1, size + 1)]
        idle = idle_cpu(product, args.idle_s)
        whole, change = what_one_load_sends(product, models[-1])
        for i in range(args.changes):  # loads and unloads of variants: placement changes
            model = models[(i * 7919) % size]
            admin_post(product, f"/v1/models/{model}/load")
            admin_post(product, f"/v1/models/{model}/unload")
        control_metrics = requests.get(product.url + "/metrics", timeout=30).text
        name = "mms_dataplane_propagation_seconds"
        propagation = {"p50_s": histogram_quantile(control_metrics, name, 0.5),
                       "p99_s": histogram_quantile(control_metrics, name, 0.99),
                       "acknowledgements": int(float(re.search(rf"^{name}_count (\S+)$", control_metrics,
                                                               re.MULTILINE).group(1)))}
        status_one_s, _ = timed_mmctl(product, "status", models[size // 2])
        status_ready_s, lines = timed_mmctl(product, "status", "--state", "ready")
        hits = hit_latency(endpoints["router_grpc"], models[0], args.hits)
        reference = ReferenceAnswers(Path(endpoints["repository"]), models, "family")
        replay = zipf_replay(endpoints["router_grpc"], models, args.replay, reference)
        router_text = requests.get(f"http://{endpoints['router_http']}/metrics", timeout=30).text
        control_metrics = requests.get(product.url + "/metrics", timeout=30).text
    finally:
        product.stop()
    return {
        "models": size, "startup_s": round(startup_s, 1),
        "control_plane_idle_cpu_percent": round(100 * idle, 2),
        "whole_state_bytes": len(whole), "one_load_bytes": len(change),
        "one_load_changes": json.loads(change).get("changes", []),
        "propagation": propagation,
        "mmctl_status_one_s": round(status_one_s, 3),
        "mmctl_status_ready_s": round(status_ready_s, 3), "mmctl_status_ready_lines": lines,
        "hit": hits, "zipf_replay": replay,
        "series": {"control_plane": series(control_metrics), "router": series(router_text)},
    }


def run_baseline(size: int, tree: Path, args) -> dict:
    """The same catalogue on another checkout of the product (``--baseline-tree``, e.g. the
    commit before per-key changes): start-up, idle CPU and what one load sends a worker."""
    here = Path.cwd()
    os.chdir(tree)  # its processes run its code: python -m mmctl from its root
    try:
        product, startup_s = start_stack(size, args, "-baseline")
    finally:
        os.chdir(here)
    try:
        idle = idle_cpu(product, args.idle_s)
        whole, change = what_one_load_sends(product, f"cust{size:03d}")
    finally:
        product.stop()
    return {"models": size, "tree": str(tree), "startup_s": round(startup_s, 1),
            "control_plane_idle_cpu_percent": round(100 * idle, 2),
            "whole_state_bytes": len(whole), "one_load_bytes": len(change)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50,1000,10000")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--idle-s", type=float, default=15.0)
    parser.add_argument("--changes", type=int, default=40)
    parser.add_argument("--hits", type=int, default=500)
    parser.add_argument("--replay", type=int, default=3000)
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="Another checkout of the product (git worktree add DIR <commit>): "
                             "start-up, idle CPU and bytes per load measured on it too, in this run")
    parser.add_argument("--smoke", action="store_true", help="smallest size: " + " ".join(SMOKE))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*(argv if argv is not None else sys.argv[1:]), *SMOKE])
    conditions = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                  "python": platform.python_version(), "router_workers": args.workers,
                  "max_loaded": 8, "layout": "family (demo fleet)", "idle_s": args.idle_s}
    print(json.dumps({"conditions": conditions}), flush=True)
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        result = run_size(size, args)
        results.append(result)
        print(json.dumps(result), flush=True)
    base = next((r for r in results if r["models"] == min(int(s) for s in args.sizes.split(","))), None)
    print(f"\n{'models':>7} {'start s':>8} {'idle cpu %':>10} {'whole B':>10} {'load B':>7} "
          f"{'prop p99':>9} {'status 1':>9} {'hit p50':>8} {'hit p99':>8} {'vs base':>8} "
          f"{'replay fail':>11} {'series cp/r':>12}")
    for r in results:
        ratio = r["hit"]["p50_ms"] / base["hit"]["p50_ms"] if base else float("nan")
        print(f"{r['models']:>7} {r['startup_s']:>8} {r['control_plane_idle_cpu_percent']:>10} "
              f"{r['whole_state_bytes']:>10} {r['one_load_bytes']:>7} "
              f"{r['propagation']['p99_s']!s:>9} {r['mmctl_status_one_s']:>9} "
              f"{r['hit']['p50_ms']:>8} {r['hit']['p99_ms']:>8} {ratio:>8.2f} "
              f"{r['zipf_replay']['failed']:>4}/{r['zipf_replay']['requests']:<6} "
              f"{r['series']['control_plane']:>5}/{r['series']['router']:<6}")
    baselines = []
    if args.baseline_tree is not None:
        for size in (int(s) for s in args.sizes.split(",")):
            baseline = run_baseline(size, args.baseline_tree.resolve(), args)
            baselines.append(baseline)
            print(json.dumps(baseline), flush=True)
        print(f"\n{'models':>7} {'':>9} {'start s':>8} {'idle cpu %':>10} {'whole B':>10} {'load B':>9}")
        for r, b in zip(results, baselines):
            for label, row in (("this tree", r), ("baseline", b)):
                print(f"{r['models']:>7} {label:>9} {row['startup_s']:>8} "
                      f"{row['control_plane_idle_cpu_percent']:>10} {row['whole_state_bytes']:>10} "
                      f"{row['one_load_bytes']:>9}")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": conditions, "results": results, "baselines": baselines},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
