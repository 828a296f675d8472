"""Fair shares of a saturated server: one customer floods a model family that every customer
shares, beside 20 customers at a low rate, through the router of a real `mmctl up`: without a
concurrency (Triton's own queue, first come first served) against `--server-concurrency`.

These machines have no GPU and 2 cores, so device time is simulated, openly: the demo family
(`control_plane.demo.fleet`, the recommender's MLP, tiny weights) sleeps ``--service-ms``
(25 ms) per batch, and every request is one whole batch (4 rows, max batch 4), so the
family's one instance serves 40 requests/s, whoever they are for.  The bench prints the CPU
use of each phase and flags one above 70% (its numbers then measure the CPU).

Two products run side by side on one Triton each, the same repository, interleaved per round
(``--rounds``, medians reported): *plain* (no concurrency) and *fair*
(``--server-concurrency``, 2).  Each round runs on each product:

1. background alone: ``--background`` variants at ``--background-rate`` requests/s in all;
2. flood: the same background, plus cust001 at ``--overload`` times what the background
   leaves of the instance.

Every request is a gRPC call (tritonclient's asyncio client) with a ``--timeout-s`` deadline,
every answer checked against the variant's own weights.  Reported: the background's p50/p95
beside the flood against alone (target: at most 1.3x; a request that arrives while a flood
batch runs waits for it, so one service time over alone is the floor on one instance), the
background requests that timed out, the flood's answers per second (the gate must not lose
throughput), refusals at once (RESOURCE_EXHAUSTED) apart from errors.

    .venv/bin/python -m bench.fair_share [--rounds 3] [--phase-s 45] [--concurrency 2]

``--smoke``: 4 background variants, 1 round, 3 s phases, 5 s deadlines (the suite runs it:
the bench still works).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.mixed_traffic import cpu_busy
from bench.open_loop import open_loop, outcome_of
from control_plane.demo.fleet import (
    DEMO_FAMILY,
    FleetSpec,
    base_weights,
    customer_weights,
    generate_family_fleet,
)
from tests.product import Product
from tests.reference import mlp_scores

RESULTS = ROOT / "bench" / "results"
CPU_FLAG = 0.70
FLOOD = "cust001"
ROWS = 4  # rows per request = the family's max batch: one request, one batch
# The smoke's deadline is longer than the bench's: the flood's queue wait nears 2 s within a
# 3 s phase, and on a busy CI machine (the simulated device time plus its CPU) every flood
# request past the first second then timed out, which says nothing about the bench working.
SMOKE = ["--rounds", "1", "--phase-s", "3", "--background", "4", "--background-rate", "4",
         "--timeout-s", "5"]


class Traffic:
    """A fixed-rate open loop of requests per variant, each answer checked against the
    variant's own weights."""

    def __init__(self, url: str, spec: FleetSpec, names: list[str], timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s
        rng = np.random.default_rng(11)
        self.x = rng.standard_normal((ROWS, spec.feature_dim)).astype(np.float32)
        base = base_weights(spec)
        self.expected = {n: mlp_scores(customer_weights(spec, n, base), self.x) for n in names}
        self.rng = np.random.default_rng(7)

    async def run(self, rates: dict[str, float], seconds: float) -> list[tuple]:
        """(model, sent, finished, outcome) per request; outcomes ok, wrong, refused
        (RESOURCE_EXHAUSTED), timeout, error: ..."""
        import tritonclient.grpc.aio as grpcclient

        client = grpcclient.InferenceServerClient(self.url)

        async def one(model: str) -> str:
            inputs = [grpcclient.InferInput("FEATURES", list(self.x.shape), "FP32")]
            inputs[0].set_data_from_numpy(self.x)
            try:
                answer = await client.infer(model, inputs, client_timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001  (every failure is counted by kind)
                return outcome_of(exc)
            ok = np.allclose(answer.as_numpy("SCORES"), self.expected[model], rtol=1e-4, atol=1e-5)
            return "ok" if ok else "wrong"

        try:
            return await open_loop(rates, seconds, self.rng, one)
        finally:
            await client.close()


def summarize(results: list[tuple], models, since: float = 0.0, until: float = 1e18) -> dict:
    chosen = [r for r in results if r[0] in models and since <= r[1] < until]
    latencies = [(r[2] - r[1]) * 1000 for r in chosen if r[3] == "ok"]
    return {"sent": len(chosen), "ok": len(latencies),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1) if latencies else None,
            "p95_ms": round(float(np.percentile(latencies, 95)), 1) if latencies else None,
            "timeouts": sum(1 for r in chosen if r[3] == "timeout"),
            "refused": sum(1 for r in chosen if r[3] == "refused"),
            "wrong": sum(1 for r in chosen if r[3] == "wrong"),
            "errors": [r[3] for r in chosen if r[3].startswith("error")][:5],
            "error_count": sum(1 for r in chosen if r[3].startswith("error"))}


def phase(traffic: Traffic, rates: dict[str, float], seconds: float) -> dict:
    busy0, total0 = cpu_busy()
    started = time.monotonic()
    results = asyncio.run(traffic.run(rates, seconds))
    busy1, total1 = cpu_busy()
    return {"results": results, "started": started,
            "cpu_busy": round((busy1 - busy0) / max(1.0, total1 - total0), 3)}


def settle(product: Product, seconds: float = 60.0) -> None:
    """Wait until the family executes nothing more: Triton runs every request it accepted,
    also after its client gave up, and the next phase must not start behind the last."""
    import requests

    url = product.json("endpoints")["triton"][0]["http"].removeprefix("http://")

    def executions() -> int:
        try:
            body = requests.get(f"http://{url}/v2/models/{DEMO_FAMILY}/stats", timeout=5).json()
        except (requests.RequestException, ValueError):
            return -1
        return sum(int(m.get("execution_count", 0)) for m in body.get("model_stats", []))

    deadline, last = time.monotonic() + seconds, executions()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = executions()
        if now == last:
            return
        last = now


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=45.0)
    parser.add_argument("--service-ms", type=float, default=25.0)
    parser.add_argument("--overload", type=float, default=3.0)
    parser.add_argument("--background", type=int, default=20)
    parser.add_argument("--background-rate", type=float, default=16.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--router-workers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "fair_share.json")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *argv])

    capacity_per_s = 1000.0 / args.service_ms
    spec = FleetSpec(count=args.background + 1, hidden_dim=16, hidden_layers=1, max_batch_size=ROWS,
                     extra_parameters=(("execute_delay_s", str(args.service_ms / 1000.0)),))
    names = spec.names()
    background = names[1:]
    bg_rates = {n: args.background_rate / len(background) for n in background}
    flood_rate = args.overload * (capacity_per_s - args.background_rate)
    work = Path(tempfile.mkdtemp(prefix="mms-fair-share-"))
    repository = work / "repository"
    generate_family_fleet(repository, spec)
    common = ["--fleet-size", "0", "--router-workers", str(args.router_workers),
              "--max-loaded", str(len(names)), "--headroom-models", "0"]
    products = {
        "plain": Product(work / "plain", repository, *common),
        "fair": Product(work / "fair", repository, *common,
                        "--server-concurrency", str(args.concurrency)),
    }
    rounds: list[dict] = []
    try:
        traffic = {}
        for key, product in products.items():
            product.start()
            for name in names:  # every variant in a slot before any timing
                out = product.mmctl("load", name)
                assert out.returncode == 0, out.stderr
            traffic[key] = Traffic(product.json("endpoints")["router_grpc"], spec, names, args.timeout_s)
        for n in range(args.rounds):
            row = {}
            for key, product in products.items():
                alone = phase(traffic[key], bg_rates, args.phase_s)
                settle(product)
                flood = phase(traffic[key], {FLOOD: flood_rate, **bg_rates}, args.phase_s)
                settle(product)
                skip = flood["started"] + 1.0  # the flood's queue builds in the first second
                row[key] = {"alone": summarize(alone["results"], set(background)),
                            "background": summarize(flood["results"], set(background), since=skip),
                            "flood": summarize(flood["results"], {FLOOD}, since=skip),
                            "flood_seconds": args.phase_s - 1.0,
                            "cpu_busy": {"alone": alone["cpu_busy"], "flood": flood["cpu_busy"]}}
            rounds.append(row)
            print(f"round {n + 1}: background p95 beside the flood: plain "
                  f"{row['plain']['background']['p95_ms']} ms, fair {row['fair']['background']['p95_ms']} ms",
                  flush=True)
    finally:
        for product in products.values():
            product.stop()
    report = report_of(rounds, args, capacity_per_s, flood_rate)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    return report


def report_of(rounds: list[dict], args, capacity_per_s: float, flood_rate: float) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    def ratio(a, b):
        return round(a / b, 2) if a and b else None

    by_product = {}
    for key in ("plain", "fair"):
        rows = [r[key] for r in rounds]
        alone_p95 = med([r["alone"]["p95_ms"] for r in rows])
        beside_p95 = med([r["background"]["p95_ms"] for r in rows])
        by_product[key] = {
            "background_alone": {"p50_ms": med([r["alone"]["p50_ms"] for r in rows]), "p95_ms": alone_p95,
                                 "samples": sum(r["alone"]["ok"] for r in rows)},
            "background_beside_flood": {
                "p50_ms": med([r["background"]["p50_ms"] for r in rows]), "p95_ms": beside_p95,
                "p95_ratio": ratio(beside_p95, alone_p95),
                "samples": sum(r["background"]["ok"] for r in rows),
                "timeouts": sum(r["background"]["timeouts"] for r in rows),
                "refused": sum(r["background"]["refused"] for r in rows)},
            "flood": {"answered_per_s": med([r["flood"]["ok"] / r["flood_seconds"] for r in rows]),
                      "p50_ms": med([r["flood"]["p50_ms"] for r in rows]),
                      "timeouts": sum(r["flood"]["timeouts"] for r in rows),
                      "refused_at_once": sum(r["flood"]["refused"] for r in rows)},
            "wrong_answers": sum(r[p]["wrong"] for r in rows for p in ("alone", "background", "flood")),
            "errors": sum(r[p]["error_count"] for r in rows for p in ("alone", "background", "flood")),
            "error_samples": [e for r in rows for p in ("alone", "background", "flood")
                              for e in r[p]["errors"]][:5],
            "cpu_busy": [r["cpu_busy"] for r in rows]}
    return {
        "conditions": {
            "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "rounds": args.rounds, "phase_s": args.phase_s, "router_workers": args.router_workers,
            "simulated": f"device time simulated: the family's one instance sleeps {args.service_ms} ms "
                         f"per batch, one request per batch ({capacity_per_s:.0f} requests/s in all)",
            "background_variants": args.background, "background_offered_per_s": args.background_rate,
            "flood_offered_per_s": round(flood_rate, 1), "timeout_s": args.timeout_s,
            "fair": f"--server-concurrency {args.concurrency}", "plain": "no concurrency",
            "floor": f"a background request that arrives while a flood batch runs waits for it: "
                     f"alone + up to {args.service_ms:g} ms is the least one instance allows"},
        **by_product,
        "target_background_p95_ratio": 1.3,
    }


def print_report(report: dict) -> None:
    c = report["conditions"]
    print(f"fair share: {c['rounds']} round(s), {c['router_workers']} router workers, {c['cpus']} CPUs; "
          f"{c['simulated']}; {c['background_variants']} background variants at "
          f"{c['background_offered_per_s']}/s in all, cust001 flooding at {c['flood_offered_per_s']}/s")
    for key in ("plain", "fair"):
        r = report[key]
        a, b, f = r["background_alone"], r["background_beside_flood"], r["flood"]
        print(f"{key:5} ({c[key]}): background p95 alone {a['p95_ms']} ms, beside the flood "
              f"{b['p95_ms']} ms = {b['p95_ratio']}x (p50 {a['p50_ms']} -> {b['p50_ms']} ms; "
              f"{b['samples']} samples, {b['timeouts']} timed out, {b['refused']} refused); flood "
              f"answered {f['answered_per_s']}/s, {f['timeouts']} timed out, {f['refused_at_once']} "
              f"refused at once; {r['wrong_answers']} wrong answers, {r['errors']} errors "
              f"{r['error_samples']}")
        for n, cpu in enumerate(r["cpu_busy"]):
            flags = [k for k, v in cpu.items() if v > CPU_FLAG]
            print(f"  CPU round {n + 1}: " + ", ".join(f"{k} {v:.0%}" for k, v in cpu.items())
                  + (f"  (above {CPU_FLAG:.0%}: these numbers measure this machine's CPU)" if flags else ""))
    print(f"target: background p95 beside the flood <= {report['target_background_p95_ratio']}x alone; "
          f"{c['floor']}")


if __name__ == "__main__":
    result = main()
    bad = sum(result[k]["wrong_answers"] + result[k]["errors"] for k in ("plain", "fair"))
    sys.exit(0 if bad == 0 else 1)
