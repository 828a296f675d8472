"""Mixed traffic: hits and misses at once, through the router of a real `mmctl up`, and its
tail.  A miss is a fill of a weight slot; the question is whether the fills wait behind
inference (and inference behind fills), which shows in p99 against p50.

One `mmctl up` serves ``--variants`` demo fine-tunes of ``--size-mb`` MB as a model family
with room for ``--room`` of them.  ``--clients`` tritonclient threads (HTTP by default) send
requests one after the other for ``--duration`` seconds, each to a variant drawn from a
Zipf law (``--zipf``; cust001 the busiest), so that hits and misses mix.  Every request of a
variant sends the same features, and every distinct answer a variant gave is checked
against the reference MLP over its own weights file once the traffic stopped (outside the
timed calls); a wrong one makes the command exit 1, as does any failed request.

``--baseline REV`` runs the same traffic against the product at git revision REV too (a
worktree of this repository, whose code the product's processes run), interleaved with the
current code ``--rounds`` times, and prints both side by side: what a change did, measured
in one run on one machine.

It prints requests, errors, req/s, p50/p95/p99 and p99/p50 per side, the misses (the
control plane's counter), this machine's CPU use during the traffic and the own memory
(RssAnon, MB) of the process holding the variants when the traffic started / at its peak; a run whose CPU use
is above 90% measures the machine more than the product, and says so.

``--peer ray`` runs the same traffic against Ray Serve's model multiplexing after each round
(``bench.ray_peer``: one replica keeping ``--room`` variants, loading a missing one from a
copy of the same weights files in tmpfs; JSON over HTTP): what a team would build with Ray
Serve instead, on the same machine in the same run.  Its "misses" are the replica's loads.

``--traced`` turns the product's spans on and prints, per class of request (a hit; a miss
that shared another's load; a miss that filled a slot), p50 / p99 of the request and of
what it waited for: the control plane's ensure, the wait for room before the fill command,
the fill and the inference.  Spans cost CPU: compare traced runs with traced runs.

    .venv/bin/python -m bench.mixed_traffic [--variants 20] [--size-mb 100] [--room 4]
        [--clients 8] [--duration 60] [--baseline REV] [--rounds 1] [--traced] [--peer ray]
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
from collections import Counter
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.process_memory import FAMILY_STUB, anon_rss_of
from bench.product_spans import by_trace, read_spans
from bench.seed_scenario import metric_sum
from bench.soak import Client, error_text
from control_plane.demo.fleet import WEIGHTS_FILE
from tests.product import Product
from tests.reference import ReferenceAnswers

SMOKE = ["--variants", "4", "--size-mb", "1", "--room", "2", "--clients", "2", "--duration", "3"]


def cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of this machine so far (/proc/stat)."""
    fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def misses_counted(endpoints: dict) -> float:
    """The control plane's miss counter (its /metrics)."""
    return metric_sum(requests.get(endpoints["admin"] + "/metrics", timeout=10).text,
                      "mms_cache_misses_total")


def zipf_shares(count: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** exponent
    return weights / weights.sum()


class PeakMemory:
    """The largest own memory (RssAnon) of the processes matching ``pattern`` (found once, at
    ``start()``), read from /proc every 20 ms until ``stop()``: what holding the variants
    cost at its worst."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.peak = 0
        self.pids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, sum(anon_rss_of(pid) for pid in self.pids))

    def start(self) -> None:
        self.pids = subprocess.run(["pgrep", "-f", self.pattern], capture_output=True, text=True,
                                   check=False).stdout.split()
        self.at_start = sum(anon_rss_of(pid) for pid in self.pids)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_threads(count: int, target) -> float:
    """``target(i)`` in ``count`` threads at once (a client each); the seconds until the
    last one ended."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - started


def traffic(new_client, count_misses, repository: Path, args, names: list[str],
            server_process: str) -> dict:
    """``args.clients`` threads, each with a client of its own (``new_client()``), send
    Zipf-drawn requests for ``args.duration`` seconds; every distinct answer is checked
    against the variant's weights file in ``repository``; ``count_misses()``: the server's
    own count of misses so far; ``server_process``: the command line (a pgrep pattern) of
    the process that holds the variants, whose peak own memory is sampled."""
    shares = zipf_shares(len(names), args.zipf)
    features = np.ones((1, 64), np.float32)
    records: list[tuple[float, str, str | None]] = []
    answers: dict[str, set[float]] = {}
    lock = threading.Lock()
    # Each variant once, so every one is in the warm tier and the family model is loaded.
    warm = new_client()
    for name in names:
        warm.infer(name, features)
    warm.close()
    misses_before = count_misses()
    deadline = time.monotonic() + args.duration
    busy0, total0 = cpu_busy()
    memory = PeakMemory(server_process)
    memory.start()

    def client_loop(index: int) -> None:
        rng = np.random.default_rng([args.seed, index])
        client = new_client()
        try:
            while time.monotonic() < deadline:
                model = names[int(rng.choice(len(names), p=shares))]
                t0 = time.perf_counter()
                error = None
                try:
                    answer = float(np.asarray(client.infer(model, features)).ravel()[0])
                    with lock:
                        answers.setdefault(model, set()).add(answer)
                except Exception as exc:  # noqa: BLE001  (every failure is a result)
                    error = error_text(exc)
                records.append((time.perf_counter() - t0, model, error))
        finally:
            client.close()

    elapsed = run_threads(args.clients, client_loop)
    busy1, total1 = cpu_busy()
    peak_bytes = memory.stop()
    misses = count_misses() - misses_before
    reference = ReferenceAnswers(repository, names)
    wrong = [{"model": m, "answer": a, "expected": float(reference.expected(m, features).ravel()[0])}
             for m, seen in sorted(answers.items()) for a in sorted(seen)
             if reference.check(m, features, np.array([[a]], np.float32)) is not None]
    ok_ms = np.array([d for d, _, e in records if e is None]) * 1000
    errors = Counter(e for _, _, e in records if e is not None)
    pct = (lambda q: round(float(np.percentile(ok_ms, q)), 2)) if len(ok_ms) else (lambda q: None)

    def latencies(chosen) -> dict:  # the busiest variant (mostly hits) against the others
        ms = np.array([d for d, m, e in records if e is None and chosen(m)]) * 1000
        return {"requests": len(ms), **{f"p{q}_ms": round(float(np.percentile(ms, q)), 2) if len(ms) else None
                                        for q in (50, 99)}}

    return {"busiest": {"model": names[0], **latencies(names[0].__eq__)},
            "others": latencies(lambda m: m != names[0]),
            "requests": len(records), "errors": sum(errors.values()),
            "error_messages": dict(errors.most_common(5)), "wrong": wrong,
            "req_per_s": round(len(records) / elapsed, 1), "p50_ms": pct(50), "p95_ms": pct(95),
            "p99_ms": pct(99), "p99_over_p50": round(pct(99) / pct(50), 2) if len(ok_ms) else None,
            "misses": misses, "miss_share": round(misses / max(1, len(records)), 3),
            "cpu_busy": round((busy1 - busy0) / max(1.0, total1 - total0), 3),
            "server_anon_mb": [round(memory.at_start / 1e6, 1), round(peak_bytes / 1e6, 1)]}


def where_requests_wait(spans: list[dict]) -> dict:
    """Per class of request, from the product's spans: p50 / p99 (ms) of the whole request
    and of what it waited for.  A *hit* asked the control plane nothing; a *shared* miss
    waited on a load another request started; a *miss* started the load that filled a slot:
    ``room`` is its load's time before the fill command went (placement, and the wait for a
    slot no request in flight holds), ``fill`` the command (the eviction and the copy)."""
    parts: dict[str, dict[str, list[float]]] = {}

    def duration(s: dict) -> float:
        return (s["end_time"] - s["start_time"]) * 1000

    for trace in by_trace(spans):
        root = next((s for s in trace if s["name"] == "infer" and s.get("parent_id") is None), None)
        names = {s["name"] for s in trace}
        if root is None or "triton.load" in names:  # the family model's own first load
            continue
        kind = "miss" if "load" in names else "shared" if "ensure" in names else "hit"
        got = parts.setdefault(kind, {})
        got.setdefault("request", []).append(duration(root))
        got.setdefault("inference", []).append(sum(duration(s) for s in trace if s["name"] == "triton.infer"))
        if kind == "hit":
            continue
        got.setdefault("ensure", []).append(sum(duration(s) for s in trace if s["name"] == "ensure"
                                                and s["kind"] == "SpanKind.CLIENT"))
        load = next((s for s in trace if s["name"] == "load"), None)
        fill = next((s for s in trace if s["name"] == "family.load"), None)
        if load is not None and fill is not None:
            got.setdefault("room", []).append((fill["start_time"] - load["start_time"]) * 1000)
            got.setdefault("fill", []).append(duration(fill))
    total = sum(len(p["request"]) for p in parts.values())
    return {kind: {"share": round(len(p["request"]) / max(1, total), 3),
                   **{what: [round(float(np.percentile(v, q)), 1) for q in (50, 99)]
                      for what, v in p.items()}}
            for kind, p in sorted(parts.items())}


def run_side(label: str, args, work: Path, code_dir: Path | None) -> dict:
    names = [f"cust{i:03d}" for i in range(1, args.variants + 1)]
    spans_file = work / f"{label}-spans.jsonl"
    started = time.perf_counter()
    product = Product(work / label, None, "--fleet-size", str(args.variants), "--model-size-mb",
                      str(args.size_mb), "--max-loaded", str(args.room), "--fleet-layout", "family",
                      "--policy", "lru", "--router-workers", "1",
                      *(["--trace-exporter", f"file={spans_file}"] if args.traced else []),
                      code_dir=code_dir).start()
    print(f"{label}: mmctl up ready in {time.perf_counter() - started:.1f}s", flush=True)
    try:
        endpoints = product.json("endpoints")
        repository = Path(endpoints["repository"])
        if args.peer and not (work / PEER_WEIGHTS).is_dir():
            keep_weights_for_peer(repository, names, work / PEER_WEIGHTS)
        result = traffic(lambda: Client(args.protocol, endpoints, args.timeout),
                         lambda: misses_counted(endpoints), repository, args, names, FAMILY_STUB)
    finally:
        product.stop()  # the processes flush their spans as they exit
    if args.traced:
        result["waits"] = where_requests_wait(read_spans(spans_file))
    return result


PEER_WEIGHTS = "peer-weights"  # in the work folder: the variants' files the peer serves


def keep_weights_for_peer(repository: Path, names: list[str], into: Path) -> None:
    """The variants' weights files as the product serves them, copied beside (tmpfs when the
    work folder is): the peer loads the same bytes from host memory."""
    for name in names:
        (into / name).mkdir(parents=True)
        shutil.copyfile(repository / name / WEIGHTS_FILE, into / name / WEIGHTS_FILE)


def run_peer_side(label: str, args, work: Path) -> dict:
    """The same traffic against the Ray Serve peer (``bench.ray_peer``) over the same files."""
    from bench.ray_peer import REPLICA_PROCESS, RayPeer

    names = [f"cust{i:03d}" for i in range(1, args.variants + 1)]
    started = time.perf_counter()
    peer = RayPeer(work / PEER_WEIGHTS, WEIGHTS_FILE, args.room, work / f"{label}.log")
    print(f"{label}: Ray Serve ready in {time.perf_counter() - started:.1f}s", flush=True)
    try:
        return traffic(lambda: peer.client(args.timeout), peer.loads, work / PEER_WEIGHTS, args, names,
                       REPLICA_PROCESS)
    finally:
        peer.close()


def baseline_checkout(rev: str, work: Path) -> Path:
    where = work / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
                   check=True, capture_output=True)
    return where


def run_sides(args, run_side, prefix: str, repeats: int | None = None) -> dict[str, list[dict]]:
    """``run_side(label, args, work, code_dir)`` ``repeats`` (default ``args.rounds``) times for
    the current code and, with ``args.baseline``, interleaved with a worktree of that revision;
    the results per side.  The worktree and the work folder are removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    sides: dict[str, list[dict]] = {}
    baseline = None
    try:
        if args.baseline:
            baseline = baseline_checkout(args.baseline, work)
        for r in range(args.rounds if repeats is None else repeats):
            if baseline is not None:
                sides.setdefault("baseline", []).append(run_side(f"baseline-{r}", args, work, baseline))
            sides.setdefault("current", []).append(run_side(f"current-{r}", args, work, None))
            if getattr(args, "peer", None) == "ray":
                sides.setdefault("ray", []).append(run_peer_side(f"ray-{r}", args, work))
    finally:
        if baseline is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)],
                           check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return sides


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", type=int, default=20)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--room", type=int, default=4, help="mmctl up --max-loaded")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per side")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--protocol", choices=("http", "grpc"), default="http")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline", default=None, help="git revision to run side by side")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved runs per side")
    ap.add_argument("--traced", action="store_true",
                    help="the product's spans on: where each class of request waited (costs CPU: "
                         "compare traced runs with traced runs only)")
    ap.add_argument("--peer", choices=("ray",), default=None,
                    help="ray: the same traffic against Ray Serve's model multiplexing over the "
                         "same weights files, after each round (bench.ray_peer; its environment "
                         "is made in .venv-peers/ray on first use)")
    ap.add_argument("--smoke", action="store_true", help=" ".join(SMOKE))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mixed_traffic.json")
    args = ap.parse_args([*SMOKE, *(argv or sys.argv[1:])] if "--smoke" in (argv or sys.argv[1:]) else argv)

    sides = run_sides(args, run_side, "bench-mixed-")

    result = {"benchmark": "mixed_traffic", "conditions": {
        "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "variants": args.variants, "size_mb": args.size_mb, "room": args.room,
        "clients": args.clients, "duration_s": args.duration, "zipf": args.zipf,
        "protocol": args.protocol, "baseline": args.baseline, "rounds": args.rounds,
        "traced": args.traced, "peer": args.peer,
        "client": f"tritonclient {args.protocol} through the router (1 worker), batch 1, "
                  "one request at a time per client, the same features per variant",
        **({"peer_side": "Ray Serve (bench.ray_peer): one replica, @serve.multiplexed with room for "
                         f"{args.room} variants (the least recently used leaves the cache at once; "
                         "a request still computing on it keeps its tensors until it ends), a miss loads the variant's safetensors file from "
                         "tmpfs; requests JSON over HTTP (requests.Session), one at a time per client"}
           if args.peer else {}),
        "warm tier": "host DRAM (tmpfs), every variant staged before the traffic"},
        "sides": sides}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    print(f"mixed_traffic: {args.variants} variants of {args.size_mb:g} MB, room for {args.room}, "
          f"{args.clients} {args.protocol} clients, Zipf {args.zipf}, {args.duration:g}s per run, "
          f"{os.cpu_count()} CPUs")
    print(f"  {'side':<9} {'requests':>8} {'errors':>6} {'req/s':>7} {'p50':>8} {'p95':>8} {'p99':>8} "
          f"{'p99/p50':>7} {'misses':>7} {'cpu':>5} {'memory MB':>11}")
    for label, runs in sides.items():
        for r in runs:
            print(f"  {label:<9} {r['requests']:>8} {r['errors']:>6} {r['req_per_s']:>7.1f} "
                  f"{r['p50_ms']:>6.1f}ms {r['p95_ms']:>6.1f}ms {r['p99_ms']:>6.1f}ms "
                  f"{r['p99_over_p50']:>7.2f} {r['misses']:>7.0f} {r['cpu_busy']:>5.0%} "
                  f"{r['server_anon_mb'][0]:>5.0f}/{r['server_anon_mb'][1]:<5.0f}"
                  + ("  (CPU-bound: measures the machine)" if r["cpu_busy"] > 0.9 else ""))
            busiest, others = r["busiest"], r["others"]
            print(f"      {busiest['model']} (the busiest variant): p50 {busiest['p50_ms']}ms, p99 "
                  f"{busiest['p99_ms']}ms; the {args.variants - 1} others: p50 {others['p50_ms']}ms, "
                  f"p99 {others['p99_ms']}ms")
            for message, count in r["error_messages"].items():
                print(f"      {count} x {message[:160]}")
            for kind, waits in r.get("waits", {}).items():
                print(f"      {kind:<6} {waits['share']:>6.1%} of requests, p50 / p99 ms: " + ", ".join(
                    f"{what} {p50:g} / {p99:g}" for what, (p50, p99) in
                    ((w, v) for w, v in waits.items() if w != "share")))
    for label, runs in sides.items():
        wrong = [w for r in runs for w in r["wrong"]]
        checked = "ok" if not wrong else f"WRONG {wrong[:3]}"
        print(f"  {label}: every distinct answer against its variant's weights file: {checked}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    outcome = main()
    bad = any(r["errors"] or r["wrong"] for runs in outcome["sides"].values() for r in runs)
    sys.exit(1 if bad else 0)
