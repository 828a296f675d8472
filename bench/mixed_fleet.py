"""A mixed fleet on one server: a model family, separate models and a LoRA base share one
cache, under Zipf traffic over all of them, through the router of a real `mmctl up`.

One `mmctl up` serves ``--variants`` demo fine-tunes of ``--size-mb`` MB as a family, with
room for ``--room`` entries (``--max-loaded``); two models of a user's own are registered
(``tests/fixtures/models/simple`` and ``strings``: Triton's add/sub examples, INT32 and
BYTES) and a PEFT adapter of the demo LoRA base (``tinylm:acme``).  ``--clients`` gRPC
tritonclient threads send requests one after the other for ``--duration`` seconds, each to a
name drawn from a Zipf law over all of them (the separate models and the adapter placed
among the busiest variants, so that every kind is hot sometimes and cold other times).

Every answer is checked: a variant's against the reference MLP over its own weights file,
the add/sub models' against the sum and the difference of what was sent, the adapter's
against what Triton itself answers for ``tinylm`` with ``adapter=acme`` (asked outside the
timed calls).  A wrong answer or a failed request makes the command exit 1.

It prints requests, errors, req/s, p50/p99 per kind and overall, and how often each kind
left the cache (a model's loads, less the one it holds at the end), from the control
plane's own records.

    .venv/bin/python -m bench.mixed_fleet [--variants 12] [--size-mb 10] [--room 4]
        [--clients 4] [--duration 30] [--zipf 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.mixed_traffic import cpu_busy, run_threads, zipf_shares
from bench.soak import error_text
from tests.product import Product
from tests.reference import ReferenceAnswers

FIXTURES = ROOT / "tests" / "fixtures"
SEPARATE = ("simple", "strings")
ADAPTER = "tinylm:acme"
PROMPTS = ["the cat sat on", "one two three"]
SMOKE = ["--variants", "4", "--size-mb", "1", "--room", "3", "--clients", "2", "--duration", "4"]


def kind_of(name: str) -> str:
    return "adapter" if ":" in name else "model" if name in SEPARATE else "variant"


def request_for(name: str):
    """(inputs, outputs to read, parameters) of one request for ``name``."""
    if kind_of(name) == "variant":
        x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
        x.set_data_from_numpy(np.ones((1, 64), np.float32))
        return [x], "SCORES", None
    if kind_of(name) == "adapter":
        text = grpcclient.InferInput("TEXT", [len(PROMPTS), 1], "BYTES")
        text.set_data_from_numpy(np.array([[p] for p in PROMPTS], dtype=object))
        return [text], "GENERATED_TEXT", {"max_new_tokens": 8}
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    shape, dtype = [16], "INT32"
    if name == "strings":  # the same numbers, sent as text, in a batch of one
        a, b = (np.array([[str(v).encode() for v in x]], dtype=object) for x in (a, b))
        shape, dtype = [1, 16], "BYTES"
    inputs = [grpcclient.InferInput("INPUT0", shape, dtype), grpcclient.InferInput("INPUT1", shape, dtype)]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, "OUTPUT0", None


def answer_key(name: str, result) -> str:
    """What a request for ``name`` answered, as a comparable string."""
    if kind_of(name) == "adapter":
        return json.dumps([v.decode() if isinstance(v, bytes) else str(v)
                           for v in result.as_numpy("GENERATED_TEXT").reshape(-1).tolist()])
    if kind_of(name) == "variant":
        return repr(float(np.asarray(result.as_numpy("SCORES")).ravel()[0]))
    out = result.as_numpy("OUTPUT0").reshape(-1).tolist()
    return json.dumps([int(v.decode()) if isinstance(v, bytes) else int(v) for v in out])


def order_of(names_variants: list[str]) -> list[str]:
    """The Zipf order: the separate models and the adapter among the busiest variants."""
    order = list(names_variants)
    for i, name in enumerate((*SEPARATE, ADAPTER)):
        order.insert(min(len(order), 1 + 2 * i), name)
    return order


def run(args) -> dict:
    variants = [f"cust{i:03d}" for i in range(1, args.variants + 1)]
    state = Path(args.work) / "state"
    product = Product(state, None, "--fleet-size", str(args.variants), "--model-size-mb",
                      str(args.size_mb), "--max-loaded", str(args.room), "--fleet-layout", "family",
                      "--policy", args.policy, "--router-workers", "1").start()
    try:
        for name in SEPARATE:
            out = product.mmctl("registry", "add", name, "--from-dir", str(FIXTURES / "models" / name))
            assert out.returncode == 0, out.stdout + out.stderr
        out = product.mmctl("adapter", "add", "acme", "--base", "tinylm", "--path",
                            str(FIXTURES / "adapters" / "acme"))
        assert out.returncode == 0, out.stdout + out.stderr
        endpoints = product.json("endpoints")
        repository = Path(endpoints["repository"])
        router = endpoints["router_grpc"]
        names = order_of(variants)
        # Each name once, outside the timed calls: every one is warm, and the expected answers
        # of the models checked by what Triton answers are read here.
        warm = grpcclient.InferenceServerClient(router)
        for name in names:
            inputs, _output, params = request_for(name)
            warm.infer(name, inputs, parameters=params)
        inputs, _output, params = request_for(ADAPTER)
        warm.infer(ADAPTER, inputs, parameters=params)  # its base loaded again, if it left
        triton = grpcclient.InferenceServerClient(endpoints["triton"][0]["grpc"])
        expected_adapter = answer_key(ADAPTER, triton.infer("tinylm", inputs, parameters={
            **params, "adapter": "acme"}))
        reference = ReferenceAnswers(repository, variants)
        expected_sum = json.dumps([int(v) + 3 for v in range(16)])

        shares = zipf_shares(len(names), args.zipf)
        records: list[tuple[float, str, str | None]] = []
        answers: dict[str, set[str]] = {}
        lock = threading.Lock()
        deadline = time.monotonic() + args.duration
        busy0, total0 = cpu_busy()

        def client_loop(index: int) -> None:
            rng = np.random.default_rng([args.seed, index])
            client = grpcclient.InferenceServerClient(router)
            while time.monotonic() < deadline:
                name = names[int(rng.choice(len(names), p=shares))]
                inputs, _output, params = request_for(name)
                t0 = time.perf_counter()
                error = None
                try:
                    result = client.infer(name, inputs, parameters=params, client_timeout=args.timeout)
                    with lock:
                        answers.setdefault(name, set()).add(answer_key(name, result))
                except Exception as exc:  # noqa: BLE001  (every failure is a result)
                    error = error_text(exc)
                records.append((time.perf_counter() - t0, name, error))
            client.close()

        elapsed = run_threads(args.clients, client_loop)
        busy1, total1 = cpu_busy()
        rows = requests.get(endpoints["admin"] + "/v1/status", headers=product.admin_headers(),
                            timeout=30).json()
        # Checked while the warm tier (the variants' weights files) is still there.
        wrong = []
        for name, seen in sorted(answers.items()):
            for answer in sorted(seen):
                if kind_of(name) == "variant":
                    why = reference.check(name, np.ones((1, 64), np.float32),
                                          np.array([[float(answer)]], np.float32))
                elif kind_of(name) == "adapter":
                    why = None if answer == expected_adapter else f"expected {expected_adapter}"
                else:
                    why = None if answer == expected_sum else f"expected {expected_sum}"
                if why is not None:
                    wrong.append({"model": name, "answer": answer, "why": why})
    finally:
        product.stop()

    by_model = {r["model"]: r for r in (rows["models"] if isinstance(rows, dict) else rows)}

    def left_cache(name: str) -> int:
        model = name.partition(":")[0] if kind_of(name) == "adapter" else name
        row = by_model.get(model) or next((r for m, r in by_model.items()
                                           if m.startswith(model + ".v")), {})
        return max(0, int(row.get("loads", 0)) - (1 if row.get("state") == "ready" else 0))

    kinds: dict[str, dict] = {}
    for kind in ("variant", "model", "adapter"):
        ms = np.array([d for d, n, e in records if e is None and kind_of(n) == kind]) * 1000
        members = [n for n in names if kind_of(n) == kind]
        kinds[kind] = {
            "names": len(members), "requests": int(sum(1 for _, n, _ in records if kind_of(n) == kind)),
            "p50_ms": round(float(np.percentile(ms, 50)), 2) if len(ms) else None,
            "p99_ms": round(float(np.percentile(ms, 99)), 2) if len(ms) else None,
            # The adapter's base model (tinylm) is what leaves the cache for an adapter.
            "evicted": sum(left_cache(n) for n in members)}
    ok_ms = np.array([d for d, _, e in records if e is None]) * 1000
    errors = Counter(e for _, _, e in records if e is not None)
    return {"requests": len(records), "errors": sum(errors.values()),
            "error_messages": dict(errors.most_common(5)), "wrong": wrong,
            "req_per_s": round(len(records) / elapsed, 1),
            "p50_ms": round(float(np.percentile(ok_ms, 50)), 2) if len(ok_ms) else None,
            "p99_ms": round(float(np.percentile(ok_ms, 99)), 2) if len(ok_ms) else None,
            "cpu_busy": round((busy1 - busy0) / max(1.0, total1 - total0), 3), "kinds": kinds}


def main(argv=None) -> dict:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", type=int, default=12)
    ap.add_argument("--size-mb", type=float, default=10.0)
    ap.add_argument("--room", type=int, default=4, help="mmctl up --max-loaded")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--policy", default="lru", help="mmctl up --policy (lru, gdsf, ...)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help=" ".join(SMOKE))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mixed_fleet.json")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args([*SMOKE, *raw] if "--smoke" in raw else raw)
    with tempfile.TemporaryDirectory(prefix="bench-mixed-fleet-") as work:
        args.work = work
        result = run(args)
    outcome = {"benchmark": "mixed_fleet", "conditions": {
        "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "variants": args.variants, "size_mb": args.size_mb, "room": args.room,
        "separate_models": list(SEPARATE), "adapter": ADAPTER, "clients": args.clients,
        "duration_s": args.duration, "zipf": args.zipf, "policy": args.policy,
        "client": "tritonclient gRPC through the router (1 worker), one request at a time per client"},
        "result": result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(outcome, indent=2))
    r = result
    print(f"mixed_fleet: {args.variants} variants of {args.size_mb:g} MB + {len(SEPARATE)} models "
          f"+ {ADAPTER} on one server, room for {args.room}, policy {args.policy}, {args.clients} gRPC clients, Zipf "
          f"{args.zipf}, {args.duration:g}s, {os.cpu_count()} CPUs (CPU busy {r['cpu_busy']:.0%})")
    print(f"  all: {r['requests']} requests, {r['errors']} errors, {r['req_per_s']} req/s, "
          f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms")
    for kind, k in r["kinds"].items():
        print(f"  {kind:<8} {k['names']:>3} names  {k['requests']:>6} requests  p50 {k['p50_ms']} ms  "
              f"p99 {k['p99_ms']} ms  left the cache {k['evicted']} times")
    for message, count in r["error_messages"].items():
        print(f"      {count} x {message[:160]}")
    print("  every distinct answer checked: " + ("ok" if not r["wrong"] else f"WRONG {r['wrong'][:3]}"))
    print(f"wrote {args.out}")
    return outcome


if __name__ == "__main__":
    done = main()
    sys.exit(1 if done["result"]["errors"] or done["result"]["wrong"] else 0)
