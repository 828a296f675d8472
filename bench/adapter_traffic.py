"""LoRA adapters through the router of a real `mmctl up`: what a hit and a miss cost, the
current code side by side with another git revision's (``--baseline REV``) in one run.

One `mmctl up` per side serves ``recommender_lora`` with ``--adapters`` PEFT adapters and
``--slots`` device slots (``max_device_adapters``).  One tritonclient gRPC client sends, one
request at a time through the router (1 worker):

* hits: ``--requests`` requests for ``recommender_lora:cust001`` (in a slot after the first);
* base: as many for ``recommender_lora`` itself (no adapter), the floor;
* misses: as many round-robin over every adapter, more than the slots hold, so that under
  LRU each request finds its adapter evicted: the miss path (in the current code, the
  control plane's ensure and one control request naming the victim; in a revision before
  adapters were the manager's entries, the model's own cache).

Every answer is checked against the same adapter's scores from an in-process copy of the
model over the same files (values, ``atol`` 1e-5); a wrong or failed answer makes the
command exit 1.  ``--rounds`` interleaves the sides.  It prints p50/p99 per kind and side and
the current hit p50 over the baseline's (the target: at most 1.1).

    .venv/bin/python -m bench.adapter_traffic [--adapters 8] [--slots 4] [--requests 300]
        [--baseline REV] [--rounds 1] [--out bench/results/adapter_traffic.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.mixed_traffic import cpu_busy, run_sides
from bench.seed_scenario import metric_sum
from control_plane.demo.lora import RECOMMENDER, LoraDemoSpec, generate_adapters, write_lora_model
from tests.product import Product

SMOKE = ["--adapters", "3", "--slots", "2", "--requests", "20"]
BASE = RECOMMENDER


def write_repository(where: Path, args) -> list[str]:
    spec = LoraDemoSpec(adapters=args.adapters, parameters={"max_device_adapters": str(args.slots)})
    folder = write_lora_model(where, BASE, spec)
    return generate_adapters(folder / "adapters", BASE, spec.names(), spec.rank, spec)


def references(repository: Path, names: list[str], features: np.ndarray) -> dict[str, np.ndarray]:
    """Each adapter's scores (and the base's, key None) from the model's own serving core,
    in this process, over the same files."""
    import threading

    from control_plane.demo.fleet import base_weights
    from model_runtime.lora.models import RecommenderMLP
    from model_runtime.lora.runtime import LoraSettings, build_server, recommender_runner
    from model_runtime.lora.server import Job

    net = RecommenderMLP(base_weights(LoraDemoSpec().recommender))
    settings = LoraSettings.from_parameters(
        {"max_device_adapters": "1", "manifest_poll_s": "0",
         "adapter_dir": str(repository / BASE / "adapters")}, repository / BASE)
    server = build_server(net, recommender_runner(net), settings, base_name=BASE, start_watcher=False)
    out = {}
    try:
        for name in [None, *names]:
            done, box = threading.Event(), {}

            def reply(result, error, box=box, done=done):
                box["result"], box["error"] = result, error
                done.set()

            server.submit([Job(name, features, reply, rows=len(features))])
            assert done.wait(60) and box["error"] is None, box.get("error")
            out[name] = box["result"]
    finally:
        server.close()
    return out


def timed(client, model: str, features: np.ndarray) -> tuple[float, np.ndarray | None, str | None]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    x = grpcclient.InferInput("FEATURES", list(features.shape), "FP32")
    x.set_data_from_numpy(features)
    started = time.perf_counter()
    try:
        result = client.infer(model, [x])
    except InferenceServerException as exc:  # counted and printed: a failed request fails the run
        return (time.perf_counter() - started) * 1000, None, str(exc)[:200]
    return (time.perf_counter() - started) * 1000, result.as_numpy("SCORES"), None


def run_side(label: str, args, work: Path, code_dir: Path | None) -> dict:
    import tritonclient.grpc as grpcclient

    repository = work / label / "repository"
    names = write_repository(repository, args)
    features = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    expected = references(repository, names, features)
    product = Product(work / label / "state", repository, "--router-workers", "1", "--policy", "lru",
                      code_dir=code_dir).start()
    try:
        endpoints = product.json("endpoints")
        client = grpcclient.InferenceServerClient(endpoints["router_grpc"])
        plans = {
            "hit": [f"{BASE}:{names[0]}"] * args.requests,
            "base": [BASE] * args.requests,
            "miss": [f"{BASE}:{names[i % len(names)]}" for i in range(args.requests)],
        }
        for warm in (BASE, f"{BASE}:{names[0]}"):  # the base's load is not what is measured
            timed(client, warm, features)
        kinds, errors, wrong = {}, [], 0
        misses_before = adapter_misses(product)
        busy0, total0 = cpu_busy()
        for kind, models in plans.items():
            ms = []
            for model in models:
                took, scores, error = timed(client, model, features)
                adapter = model.partition(":")[2] or None
                if error is not None:
                    errors.append(error)
                    continue
                if not np.allclose(scores, expected[adapter], atol=1e-5):
                    wrong += 1
                ms.append(took)
            ms.sort()
            kinds[kind] = {"requests": len(models), "ok": len(ms),
                           "p50_ms": round(float(np.percentile(ms, 50)), 3) if ms else None,
                           "p99_ms": round(float(np.percentile(ms, 99)), 3) if ms else None}
        busy1, total1 = cpu_busy()
        misses = adapter_misses(product) - misses_before
        client.close()
        return {"label": label, "kinds": kinds, "errors": len(errors), "error_samples": errors[:3],
                "wrong": wrong, "misses_counted": misses,
                "cpu_busy": round((busy1 - busy0) / max(1.0, total1 - total0), 3)}
    finally:
        product.stop()


def adapter_misses(product: Product) -> float:
    """Misses the model counted, as the control plane exposes them (from the model's status,
    which a listing reads afresh: the periodic refresh runs every 10 s)."""
    requests.get(product.url + f"/v1/adapters/{BASE}", headers=product.admin_headers(),
                 timeout=30).raise_for_status()
    return metric_sum(requests.get(product.url + "/metrics", headers=product.admin_headers(),
                                   timeout=10).text, "mms_adapter_cache_misses_total")


def median(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return float(np.median(found)) if found else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4, help="the base's max_device_adapters")
    ap.add_argument("--requests", type=int, default=300, help="per kind (hit, base, miss)")
    ap.add_argument("--baseline", default=None, help="git revision to run side by side")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved runs per side")
    ap.add_argument("--smoke", action="store_true", help=" ".join(SMOKE))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "adapter_traffic.json")
    raw = list(argv if argv is not None else sys.argv[1:])
    args = ap.parse_args([*SMOKE, *raw] if "--smoke" in raw else raw)
    if args.adapters <= args.slots:
        ap.error("--adapters must be more than --slots, or no request misses")

    sides = run_sides(args, run_side, "bench-adapters-")

    summary = {side: {kind: {"p50_ms": median([r["kinds"][kind]["p50_ms"] for r in runs]),
                             "p99_ms": median([r["kinds"][kind]["p99_ms"] for r in runs])}
                      for kind in ("hit", "base", "miss")} for side, runs in sides.items()}
    ratio = None
    if "baseline" in summary and summary["baseline"]["hit"]["p50_ms"]:
        ratio = round(summary["current"]["hit"]["p50_ms"] / summary["baseline"]["hit"]["p50_ms"], 3)
    result = {"benchmark": "adapter_traffic", "conditions": {
        "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "base": BASE, "adapters": args.adapters, "slots": args.slots, "requests": args.requests,
        "baseline": args.baseline, "rounds": args.rounds, "policy": "lru",
        "client": "tritonclient gRPC through the router (1 worker), one request at a time, batch 1"},
        "sides": sides, "summary": summary, "hit_p50_current_over_baseline": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    print(f"adapter_traffic: {BASE}, {args.adapters} adapters, {args.slots} device slots, "
          f"{args.requests} requests per kind, {args.rounds} round(s), {os.cpu_count()} CPUs; "
          "p50 / p99 ms (median over rounds)")
    print(f"  {'side':<9} {'hit':>17} {'base (no adapter)':>19} {'miss':>17} {'miss-hit':>9} "
          f"{'misses':>7} {'errors':>6} {'wrong':>5} {'cpu':>5}")
    failed = False
    for side, runs in sides.items():
        s = summary[side]
        cells = [f"{s[k]['p50_ms']:.2f} / {s[k]['p99_ms']:.2f}" if s[k]["p50_ms"] is not None else "-"
                 for k in ("hit", "base", "miss")]
        gap = (s["miss"]["p50_ms"] - s["hit"]["p50_ms"]) if s["miss"]["p50_ms"] and s["hit"]["p50_ms"] else None
        errors = sum(r["errors"] for r in runs)
        wrong = sum(r["wrong"] for r in runs)
        failed |= bool(errors or wrong)
        print(f"  {side:<9} {cells[0]:>17} {cells[1]:>19} {cells[2]:>17} "
              f"{gap if gap is None else round(gap, 2):>9} {sum(r['misses_counted'] for r in runs):>7.0f} "
              f"{errors:>6} {wrong:>5} {max(r['cpu_busy'] for r in runs):>5.0%}")
        for r in runs:
            for sample in r["error_samples"]:
                print(f"    {r['label']} error: {sample}")
    if ratio is not None:
        print(f"  hit p50, current over baseline {args.baseline}: {ratio:.3f} (target <= 1.1)")
    print(f"results: {args.out}")
    if failed:
        print("FAILED: a request failed or an answer was not its adapter's own")
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
