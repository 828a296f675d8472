"""Soak: minutes of skewed traffic over a fleet of variants that does not fit, every answer
checked, every process's memory sampled, while an operator polls ``mmctl status``.

One `mmctl up` (tritonserver + control plane + router workers) serves ``--variants`` demo
customers (one model family by default: a miss is a copy into a weight slot; ``--layout
models``: a Triton model each) with room for ``--room`` of them.  ``--clients`` threads send
requests one after the other for ``--duration`` seconds through the router with unmodified
tritonclient clients (``--protocol mixed``: even threads gRPC, odd threads HTTP), each to a
variant drawn from a Zipf law (``--zipf``, cust001 the busiest) with random features, and
each answer is checked against the reference MLP over that variant's own weights file in the
repository Triton serves from (``tests.reference``).  Meanwhile a thread runs
the real ``mmctl status`` every ``--status-every`` seconds, as an operator watching the
fleet would, and another samples the resident memory of every process of the product: the
``mmctl up`` supervisor, the control plane, each router worker, each tritonserver and each
python-backend stub; VmRSS, and apart its own pages (RssAnon), since VmRSS also counts the
shared memory a process maps (a family keeps its variants' warm-tier files mapped).

It prints the requests, the failures grouped by their exact message with counts, wrong
answers, req/s, p50/p99 per minute and the memory per process kind at the start and end;
writes ``bench/results/soak.json`` (and the product's log beside it) and exits 1 if any
request failed or any answer was wrong.  ``--smoke``: 6 variants, room for 3, 2 clients,
4 seconds (the smoke test in ``make test``).

    .venv/bin/python -m bench.soak [--variants 50] [--room 8] [--clients 8] [--duration 240]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from control_plane.demo.fleet import (
    FEATURES_INPUT,
    demo_spec,
    generate_family_fleet,
    generate_fleet,
)
from tests.product import Product
from tests.reference import ReferenceAnswers

SMOKE = {"variants": 6, "room": 3, "clients": 2, "duration": 4.0, "status_every": 1.0,
         "rss_every": 1.0}
RESULTS = ROOT / "bench" / "results"


def zipf_weights(count: int, exponent: float) -> np.ndarray:
    """Request share of the variant of rank 1..count: proportional to 1 / rank^exponent."""
    w = 1.0 / np.arange(1, count + 1) ** exponent
    return w / w.sum()


# ---------------------------------------------------------------------------- processes
def process_kind(pid: int, root_pid: int, cmdline: str) -> str:
    if pid == root_pid:
        return "mmctl up (supervisor)"
    if "triton_python_backend_stub" in cmdline:
        return "python stub"
    if "tritonserver" in cmdline:
        return "tritonserver"
    if "control_plane.runtime.service" in cmdline:
        return "control plane"
    if "router.worker" in cmdline:
        return "router worker"
    return "other: " + (cmdline.split(" ", 1)[0].rsplit("/", 1)[-1] or "?")


def product_processes(root_pid: int) -> list[tuple[int, str, int, int]]:
    """(pid, kind, VmRSS bytes, RssAnon bytes) of ``root_pid`` and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (2nd field) may hold spaces or parentheses: split after its ')'.
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    members, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in members:
                members.add(pid)
                frontier.append(pid)
    out = []
    for pid in sorted(members):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # exited between the listing and the read
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status.splitlines()
                  if line.startswith(("VmRSS:", "RssAnon:"))}
        out.append((pid, process_kind(pid, root_pid, cmdline), fields.get("VmRSS", 0),
                    fields.get("RssAnon", 0)))
    return out


def rss_by_kind(root_pid: int) -> dict[str, dict]:
    kinds: dict[str, dict] = {}
    for _, kind, rss, own in product_processes(root_pid):
        k = kinds.setdefault(kind, {"processes": 0, "rss_mb": 0.0, "own_mb": 0.0})
        k["processes"] += 1
        k["rss_mb"] = round(k["rss_mb"] + rss / 1e6, 1)
        k["own_mb"] = round(k["own_mb"] + own / 1e6, 1)
    return kinds


# ---------------------------------------------------------------------------- traffic
class Client:
    """One tritonclient client (gRPC or HTTP), the way an application holds one."""

    def __init__(self, protocol: str, endpoints: dict, timeout_s: float):
        self.protocol = protocol
        self.timeout_s = timeout_s
        if protocol == "grpc":
            self.client = grpcclient.InferenceServerClient(endpoints["router_grpc"])
        else:
            self.client = httpclient.InferenceServerClient(
                endpoints["router_http"], connection_timeout=timeout_s, network_timeout=timeout_s)

    def infer(self, model: str, features: np.ndarray) -> np.ndarray:
        lib = grpcclient if self.protocol == "grpc" else httpclient
        x = lib.InferInput(FEATURES_INPUT, list(features.shape), "FP32")
        x.set_data_from_numpy(features)
        wanted = [lib.InferRequestedOutput("SCORES")]
        if self.protocol == "grpc":
            result = self.client.infer(model, [x], outputs=wanted, client_timeout=self.timeout_s)
        else:
            result = self.client.infer(model, [x], outputs=wanted)
        return result.as_numpy("SCORES")

    def close(self) -> None:
        self.client.close()


def error_text(exc: BaseException) -> str:
    """The message a client sees, whole (tritonclient's gRPC errors start with the status
    code): grouping by it is what tells two failures apart."""
    text = str(exc).strip() or type(exc).__name__
    return text if text.startswith("[") else f"{type(exc).__name__}: {text}"


def client_loop(index: int, protocol: str, endpoints: dict, names: list[str], shares: np.ndarray,
                reference: ReferenceAnswers, feature_dim: int, args, start: float, deadline: float,
                stop: threading.Event, records: list) -> None:
    rng = np.random.default_rng([args.seed, index])
    client = Client(protocol, endpoints, args.timeout)
    try:
        while time.monotonic() < deadline and not stop.is_set():
            model = names[int(rng.choice(len(names), p=shares))]
            features = rng.standard_normal((1, feature_dim)).astype(np.float32)
            t0 = time.monotonic()
            wrong = error = None
            try:
                answer = client.infer(model, features)
                wrong = reference.check(model, features, answer)
            except Exception as exc:  # noqa: BLE001  (every failure is a result the soak reports)
                error = error_text(exc)
            records.append((t0 - start, time.monotonic() - t0, model, protocol, error, wrong))
    finally:
        client.close()


def status_loop(product: Product, every_s: float, stop: threading.Event, polls: list) -> None:
    """``mmctl status`` through the real CLI, as an operator runs it."""
    start = time.monotonic()
    while not stop.wait(every_s):
        t0 = time.monotonic()
        out = product.mmctl("status")
        polls.append({"t_s": round(t0 - start, 2), "seconds": round(time.monotonic() - t0, 3),
                      "exit": out.returncode,
                      "error": None if out.returncode == 0 else (out.stderr or out.stdout).strip()})


def rss_loop(root_pid: int, every_s: float, stop: threading.Event, start: float, samples: list) -> None:
    while True:
        samples.append({"t_s": round(time.monotonic() - start, 1), "kinds": rss_by_kind(root_pid)})
        if stop.wait(every_s):
            return


# ---------------------------------------------------------------------------- report
def per_minute(records: list) -> list[dict]:
    rows = []
    if not records:
        return rows
    for minute in range(int(max(r[0] for r in records) // 60) + 1):
        rs = [r for r in records if minute * 60 <= r[0] < (minute + 1) * 60]
        ok_ms = np.array([r[1] for r in rs if r[4] is None and r[5] is None]) * 1000
        span = min(60.0, max(r[0] for r in rs) - minute * 60) if rs else 60.0
        rows.append({"minute": minute, "requests": len(rs),
                     "failed": sum(r[4] is not None for r in rs),
                     "wrong": sum(r[5] is not None for r in rs),
                     "req_per_s": round(len(rs) / max(span, 1e-9), 1),
                     "p50_ms": round(float(np.percentile(ok_ms, 50)), 2) if ok_ms.size else None,
                     "p99_ms": round(float(np.percentile(ok_ms, 99)), 2) if ok_ms.size else None})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1, help="traffic (models and features) per client")
    ap.add_argument("--variants", type=int, default=50, help="fleet size: cust001..custNNN")
    ap.add_argument("--room", type=int, default=8, help="models that fit (mmctl up --max-loaded)")
    ap.add_argument("--clients", type=int, default=8, help="client threads, each one request at a time")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of traffic")
    ap.add_argument("--status-every", type=float, default=2.0,
                    help="seconds between `mmctl status` polls (0: none)")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent over the variants")
    ap.add_argument("--protocol", choices=("mixed", "grpc", "http"), default="mixed")
    ap.add_argument("--layout", choices=("family", "models"), default="family",
                    help="the fleet as one model family or as a Triton model per customer")
    ap.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (s)")
    ap.add_argument("--up-args", default="", help="extra `mmctl up` options")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size: " + ", ".join(f"{k} {v:g}" for k, v in SMOKE.items()))
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args(argv)
    if args.smoke:  # the smallest size, except what the command line sets itself
        for key, value in SMOKE.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, type(getattr(args, key))(value))
    if args.room >= args.variants:
        ap.error(f"--room ({args.room}) must be below --variants ({args.variants}): a soak that "
                 "never evicts tests nothing")

    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    repo = work / "repository"
    spec = demo_spec(args.variants)
    (generate_family_fleet if args.layout == "family" else generate_fleet)(repo, spec)
    names = spec.names()
    reference = ReferenceAnswers(repo, names, args.layout)  # each variant's own weights file
    shares = zipf_weights(len(names), args.zipf)
    log_path = args.out.with_suffix(".log")
    product = Product(work / "state", repo, "--fleet-layout", args.layout, "--max-loaded",
                      str(args.room), "--policy", "lru", *args.up_args.split())
    started = time.monotonic()
    product.start()
    up_s = time.monotonic() - started
    print(f"soak: mmctl up ready in {up_s:.1f} s; {args.clients} clients for {args.duration:g} s",
          flush=True)
    load_before = os.getloadavg()
    records: list = []
    polls: list[dict] = []
    rss: list[dict] = []
    stop = threading.Event()
    try:
        endpoints = product.json("endpoints")
        # The first request loads the family (or the first model): memory at the start is
        # then the serving fleet's, not an idle one's.
        first = Client("grpc", endpoints, args.timeout)
        features = np.ones((1, spec.feature_dim), np.float32)
        first_wrong = reference.check(names[0], features, first.infer(names[0], features))
        first.close()
        assert first_wrong is None, first_wrong
        start, start_epoch = time.monotonic(), time.time()
        deadline = start + args.duration
        helpers = [threading.Thread(target=rss_loop, args=(product.proc.pid, args.rss_every, stop,
                                                           start, rss), daemon=True)]
        if args.status_every > 0:
            helpers.append(threading.Thread(target=status_loop, daemon=True,
                                            args=(product, args.status_every, stop, polls)))
        protocols = [("grpc" if i % 2 == 0 else "http") if args.protocol == "mixed" else args.protocol
                     for i in range(args.clients)]
        clients = [threading.Thread(target=client_loop, args=(
            i, protocols[i], endpoints, names, shares, reference, spec.feature_dim, args, start,
            deadline, stop, records), daemon=True) for i in range(args.clients)]
        for t in helpers + clients:
            t.start()
        for t in clients:
            t.join()
        wall_s = time.monotonic() - start
        stop.set()
        for t in helpers:
            t.join(timeout=60)
        status_end = product.json("status")
    finally:
        stop.set()
        product.stop()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        tritons = "".join(f"\n===== {path.name} (last 300 lines)\n" + "\n".join(
            path.read_text(errors="replace").splitlines()[-300:])
            for path in sorted((work / "state" / "triton").glob("*.log")))
        log_path.write_text(product.log_text() + tritons)
        shutil.rmtree(work, ignore_errors=True)

    failures = Counter(r[4] for r in records if r[4] is not None)
    # When each message was seen (wall clock, as the product's log writes it), to line the
    # failures up with the log.
    seen: dict[str, list[str]] = {}
    for r in sorted(records):
        if r[4] is not None:
            at = start_epoch + r[0]
            seen.setdefault(r[4], []).append(
                time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1000):03d}")
    wrong = [r[5] for r in records if r[5] is not None]
    ok_ms = np.array([r[1] for r in records if r[4] is None and r[5] is None]) * 1000
    status_failures = Counter(p["error"] for p in polls if p["exit"] != 0)
    status_s = np.array([p["seconds"] for p in polls])
    kinds = sorted({k for s in rss for k in s["kinds"]})
    memory = {k: {"start_mb": rss[0]["kinds"].get(k, {}).get("rss_mb"),
                  "end_mb": rss[-1]["kinds"].get(k, {}).get("rss_mb"),
                  "max_mb": max(s["kinds"].get(k, {}).get("rss_mb", 0.0) for s in rss),
                  # The process's own pages (RssAnon): VmRSS also counts the shared memory it
                  # maps, a family's kept mappings of its variants' files in the warm tier.
                  "own_start_mb": rss[0]["kinds"].get(k, {}).get("own_mb"),
                  "own_end_mb": rss[-1]["kinds"].get(k, {}).get("own_mb"),
                  "processes_start": rss[0]["kinds"].get(k, {}).get("processes", 0),
                  "processes_end": rss[-1]["kinds"].get(k, {}).get("processes", 0)}
              for k in kinds}
    per_variant = Counter(r[2] for r in records)
    result = {
        "benchmark": "soak",
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "variants": args.variants, "room": args.room, "layout": args.layout,
            "clients": args.clients, "protocols": dict(Counter(protocols)),
            "duration_s": args.duration, "status_every_s": args.status_every,
            "rss_every_s": args.rss_every, "zipf": args.zipf, "seed": args.seed,
            "timeout_s": args.timeout, "policy": "lru", "up_args": args.up_args,
            "model": f"recommender MLP {spec.feature_dim}-{spec.hidden_dim}x{spec.hidden_layers}-1, "
                     f"python backend, {spec.instance_kind}",
            "traffic": "closed loop, one request at a time per client, batch 1, random features",
            "answers": "every one against the reference MLP over the variant's weights file",
            "up_s": round(up_s, 1),
            "loadavg_start": [round(v, 2) for v in load_before],
            "loadavg_end": [round(v, 2) for v in os.getloadavg()],
        },
        "requests": len(records),
        "failed": sum(failures.values()),
        "failures": [{"count": n, "message": m, "at": seen[m][:20]} for m, n in failures.most_common()],
        "wrong_answers": len(wrong),
        "wrong_answer_examples": wrong[:5],
        "req_per_s": round(len(records) / wall_s, 1),
        "p50_ms": round(float(np.percentile(ok_ms, 50)), 2) if ok_ms.size else None,
        "p99_ms": round(float(np.percentile(ok_ms, 99)), 2) if ok_ms.size else None,
        "per_minute": per_minute(records),
        "variants_requested": len(per_variant),
        "busiest_share": round(per_variant.most_common(1)[0][1] / len(records), 3) if records else None,
        "status_polls": {"count": len(polls), "failed": sum(status_failures.values()),
                         "failures": [{"count": n, "message": m} for m, n in status_failures.most_common()],
                         "p50_s": round(float(np.percentile(status_s, 50)), 3) if polls else None},
        "memory": memory,
        "rss_samples": rss,
        "loaded_at_end": sorted(m["model"] for m in status_end if m.get("state") == "ready"),
        "log": str(log_path),
        "out": str(args.out),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    report(result)
    return result


def report(r: dict) -> None:
    c = r["conditions"]
    print(f"soak: {c['variants']} variants ({c['layout']}), room for {c['room']}, {c['clients']} clients "
          f"{c['protocols']}, Zipf {c['zipf']:g}, {c['duration_s']:g} s, `mmctl status` every "
          f"{c['status_every_s']:g} s; {c['cpus']} CPUs, load average {c['loadavg_start'][0]:.2f} at "
          f"start, {c['loadavg_end'][0]:.2f} at end; mmctl up ready in {c['up_s']} s")
    print(f"  requests {r['requests']}, failed {r['failed']}, wrong answers {r['wrong_answers']}, "
          f"{r['req_per_s']} req/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms "
          f"({r['variants_requested']} variants asked, the busiest {r['busiest_share']} of requests)")
    print(f"  {'minute':>6} {'requests':>8} {'failed':>6} {'wrong':>5} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for m in r["per_minute"]:
        print(f"  {m['minute']:>6} {m['requests']:>8} {m['failed']:>6} {m['wrong']:>5} {m['req_per_s']:>7} "
              f"{m['p50_ms'] if m['p50_ms'] is not None else '-':>8} "
              f"{m['p99_ms'] if m['p99_ms'] is not None else '-':>8}")
    print(f"  {'process kind':<24} {'count':>9} {'RSS start MB':>13} {'end MB':>9} {'max MB':>9} "
          f"{'own start MB':>13} {'own end MB':>11}")
    for kind, m in r["memory"].items():
        print(f"  {kind:<24} {m['processes_start']:>4} -> {m['processes_end']:<2} "
              f"{m['start_mb'] if m['start_mb'] is not None else '-':>13} "
              f"{m['end_mb'] if m['end_mb'] is not None else '-':>9} {m['max_mb']:>9} "
              f"{m['own_start_mb'] if m['own_start_mb'] is not None else '-':>13} "
              f"{m['own_end_mb'] if m['own_end_mb'] is not None else '-':>11}")
    print("  (RSS: VmRSS, shared mappings included, a family's warm-tier files among them; own: "
          "RssAnon, the process's own pages, what a leak grows)")
    s = r["status_polls"]
    print(f"  mmctl status: {s['count']} polls, {s['failed']} failed, p50 {s['p50_s']} s")
    for f in s["failures"]:
        print(f"    {f['count']} x {f['message']}")
    for f in r["failures"]:
        print(f"  FAILED {f['count']} x {f['message']}")
    for w in r["wrong_answer_examples"]:
        print(f"  WRONG {w}")
    print(f"wrote {r['out']} and {r['log']}")


if __name__ == "__main__":
    outcome = main()
    sys.exit(1 if outcome["failed"] or outcome["wrong_answers"] else 0)
