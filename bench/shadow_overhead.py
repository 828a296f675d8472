"""What a shadow costs the primary: primary latency with and without a shadow, same run.

Starts the real product (`mmctl up`: tritonserver + control plane + router) in a child
process and sends one primary model's requests open loop (fixed arrival rate, independent
of completions) through the router with the async tritonclient, for the whole run.  The
run is cut into short blocks; each block has one condition: no shadow, a healthy shadow,
or a failing shadow (it errors on every second request), each mirroring 100% of the
primary's requests.  Conditions rotate block by block (through the admin API, which costs
far less than a CLI process), so background load on a shared machine falls on all of them
alike.  Each request counts for the condition active when it was sent; requests sent in
the first ``--settle`` seconds of a block are dropped (mirrors of the previous block may
still run).  Reported: the primary's p50/p99 per condition, pooled over its blocks, the
median over rounds of the per-round p99 ratio, and the shadow counters (mirrored,
dropped, shed, compared, errors) of the blocks that had a shadow.

    .venv/bin/python -m bench.shadow_overhead [--rate 100] [--block-seconds 3] [--rounds 20]
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
import requests
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from control_plane.demo.fleet import FleetSpec, generate_extras, generate_fleet
from tests.product import Product

PRIMARY = "cust001"
SHADOWS = {"healthy": "cust002", "failing": "cust017-faulty"}
REPORT_COUNTS = ("mirrored", "dropped", "shed", "compared", "diverged", "errors", "timeouts")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _ticks(stat_path: Path) -> int:
    """utime + stime of one /proc stat file (the name field may hold spaces)."""
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds used so far: the serving event loop (the main thread of `mmctl up`), the
    whole `mmctl up` process (loop, gRPC threads, shadow analysis thread...), and
    everything the request path runs on (that process, tritonserver and its model stubs)."""
    out = {"loop": 0.0, "process": 0.0, "all": 0.0}
    try:
        out["loop"] = _ticks(Path(f"/proc/{pid}/task/{pid}/stat")) / CLOCK_TICKS_PER_S
        out["process"] = _ticks(Path(f"/proc/{pid}/stat")) / CLOCK_TICKS_PER_S
        for p in _descendants(pid):
            try:
                out["all"] += _ticks(Path(f"/proc/{p}/stat")) / CLOCK_TICKS_PER_S
            except OSError:
                pass  # a stub that just exited
    except OSError:
        pass
    return out


class Conditions:
    """Switches the primary's shadow through the admin API; remembers when each began."""

    def __init__(self, product: Product):
        self.pid = product.proc.pid
        self.cpu: dict[str, dict[str, float]] = {}  # condition -> CPU seconds while settled
        self.sent: dict[str, int] = {}  # condition -> requests sent while settled
        self.url = f"{product.url}/v1/shadows/{PRIMARY}"
        self.headers = {**product.admin_headers(), "Content-Type": "application/json"}
        self.active = "none"
        self.since = 0.0
        self.counts: dict[str, dict[str, int]] = {}
        self._last: dict = {}

    def report(self) -> dict:
        resp = requests.get(self.url, headers=self.headers, timeout=10)
        return resp.json() if resp.status_code == 200 else {}

    def switch(self, condition: str) -> None:
        if self.active != "none":
            requests.delete(self.url, headers=self.headers, timeout=10).raise_for_status()
            report = self.report()  # the route's report is cumulative: keep per-condition deltas
            delta = {k: report.get(k, 0) - self._last.get(k, 0) for k in REPORT_COUNTS}
            into = self.counts.setdefault(self.active, dict.fromkeys(REPORT_COUNTS, 0))
            for k, v in delta.items():
                into[k] += v
            self._last = report
        if condition != "none":
            requests.post(self.url, headers=self.headers, timeout=10,
                          data=json.dumps({"model": SHADOWS[condition], "percent": 100})).raise_for_status()
        self.active = condition
        self.since = time.perf_counter()


async def run_blocks(url: str, conditions: Conditions, order: list[str], rate_per_s: float,
                     block_s: float, settle_s: float, timeout_s: float = 30.0) -> list[tuple]:
    """One open-loop stream; the condition changes every ``block_s``.  Returns
    (condition, round, latency s, ok) for each request sent after its block settled."""
    client = grpcaio.InferenceServerClient(url)
    x = InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    results: list[tuple] = []
    block = {"condition": "none", "round": -1, "settled_at": float("inf")}

    async def one(condition: str, round_: int, keep: bool) -> None:
        t0 = time.perf_counter()
        try:
            await client.infer(PRIMARY, [x], client_timeout=timeout_s)
            ok = True
        except Exception:  # noqa: BLE001 - an error is a result here, counted per condition
            ok = False
        if keep:
            results.append((condition, round_, time.perf_counter() - t0, ok))

    sent = [0]

    async def switcher() -> None:
        for i, condition in enumerate(order):
            await asyncio.to_thread(conditions.switch, condition)
            block.update(condition=condition, round=i // len(set(order)),
                         settled_at=time.perf_counter() + settle_s)
            await asyncio.sleep(settle_s)
            cpu_start, sent_start = cpu_seconds(conditions.pid), sent[0]
            await asyncio.sleep(block_s - settle_s)
            cpu_end = cpu_seconds(conditions.pid)
            used = conditions.cpu.setdefault(condition, dict.fromkeys(cpu_end, 0.0))
            for k in used:
                used[k] += cpu_end[k] - cpu_start[k]
            conditions.sent[condition] = conditions.sent.get(condition, 0) + sent[0] - sent_start
        await asyncio.to_thread(conditions.switch, "none")

    switching = asyncio.create_task(switcher())
    tasks = []
    start = time.perf_counter()
    i = 0
    while not switching.done():
        delay = start + i / rate_per_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.perf_counter()
        tasks.append(asyncio.create_task(one(block["condition"], block["round"],
                                             now >= block["settled_at"])))
        i += 1
        sent[0] = i
    await switching
    await asyncio.gather(*tasks)
    await client.close()
    return results


def summarize(latencies_s: list[float], errors: int) -> dict:
    a = np.array(latencies_s) * 1000
    return {"requests": int(a.size) + errors, "errors": errors,
            "p50_ms": float(np.percentile(a, 50)) if a.size else None,
            "p90_ms": float(np.percentile(a, 90)) if a.size else None,
            "p99_ms": float(np.percentile(a, 99)) if a.size else None,
            "mean_ms": float(a.mean()) if a.size else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0, help="primary requests per second")
    ap.add_argument("--block-seconds", type=float, default=3.0, help="length of one block")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds dropped at a block's start")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of one block per condition")
    ap.add_argument("--conditions", default="none,healthy,failing")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "shadow_overhead.json")
    args = ap.parse_args(argv)
    names = args.conditions.split(",")
    # Rotate the order round by round: no condition always follows the same one.
    order = [names[(r + k) % len(names)] for r in range(args.rounds) for k in range(len(names))]

    work = Path(tempfile.mkdtemp(prefix="bench-shadow-"))
    repo = work / "repository"
    spec = FleetSpec(count=2)
    generate_fleet(repo, spec)
    generate_extras(repo, spec)
    product = Product(work / "state", repo, "--max-loaded", "8").start()
    try:
        router = product.json("endpoints")["router_grpc"]
        for model in (PRIMARY, *SHADOWS.values()):  # no load or eviction inside a block
            assert product.mmctl("pin", model).returncode == 0, f"pin {model} failed"
        conditions = Conditions(product)
        asyncio.run(run_blocks(router, conditions, ["none"], args.rate, 3.0, 3.0))  # warm-up
        results = asyncio.run(run_blocks(router, conditions, order, args.rate, args.block_seconds,
                                         args.settle))
        counts = conditions.counts
        cpu_ms_per_request = {c: {k: round(v * 1000 / max(1, conditions.sent.get(c, 0)), 3)
                                  for k, v in used.items()} for c, used in conditions.cpu.items()}
    finally:
        product.stop()
        shutil.rmtree(work, ignore_errors=True)

    summary = {c: summarize([lat for cc, _, lat, ok in results if cc == c and ok],
                            sum(1 for cc, _, _, ok in results if cc == c and not ok)) for c in names}
    per_round: dict[str, list[float]] = {c: [] for c in names if c != "none"}
    for r in range(args.rounds):
        base = [lat for c, rr, lat, ok in results if rr == r and c == "none" and ok]
        for c, ratios in per_round.items():
            this = [lat for cc, rr, lat, ok in results if rr == r and cc == c and ok]
            if base and this:
                ratios.append(float(np.percentile(this, 99) / np.percentile(base, 99)))
    base_p99 = summary["none"]["p99_ms"] if "none" in summary else None
    result = {
        "benchmark": "shadow_overhead",
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": os.getloadavg(),
            "processes": "client (this) | mmctl up (control plane + router) | tritonserver + stubs",
            "primary": PRIMARY, "shadows": SHADOWS, "shadow_percent": 100,
            "rate_per_s": args.rate, "block_seconds": args.block_seconds, "rounds": args.rounds,
            "settle_s": args.settle, "order": "rotating, one block per condition per round",
            "model": "recommender MLP 64-128-128-1, python backend, KIND_CPU, 1 row per request",
        },
        "primary": summary,
        "p99_vs_no_shadow_pooled": {c: summary[c]["p99_ms"] / base_p99 for c in per_round if base_p99},
        "p99_vs_no_shadow_median_of_rounds": {c: float(np.median(v)) if v else None
                                              for c, v in per_round.items()},
        "shadow_counts": counts,
        # CPU per primary request: robust to other work on the machine, unlike p99.
        "cpu_ms_per_primary_request": cpu_ms_per_request,
        "latency_ms_samples": {c: [round(lat * 1000, 3) for cc, _, lat, ok in results if cc == c and ok]
                               for c in names},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"primary {PRIMARY} at {args.rate:g} req/s open loop, {args.rounds} rounds x "
          f"{args.block_seconds:g}s blocks per condition, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}:")
    print(f"  {'shadow':<8} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'p99 vs none':>11} {'median of rounds':>16}")
    for c in names:
        s = summary[c]
        pooled = result["p99_vs_no_shadow_pooled"].get(c)
        median = result["p99_vs_no_shadow_median_of_rounds"].get(c)
        print(f"  {c:<8} {s['requests']:>8} {s['errors']:>6} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} "
              f"{'' if pooled is None else f'{pooled * 100 - 100:+.1f}%':>11} "
              f"{'' if median is None else f'{median * 100 - 100:+.1f}%':>16}")
    print("  CPU ms per primary request (serving loop / `mmctl up` process / with Triton + stubs):")
    for c in names:
        u = cpu_ms_per_request.get(c, {})
        print(f"  {c:<8} {u.get('loop', 0):>6.3f} / {u.get('process', 0):>6.3f} / {u.get('all', 0):>6.3f}")
    for c, totals in counts.items():
        print(f"  {c} shadow: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
