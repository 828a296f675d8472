"""Model families vs separate models, in one run: what a miss costs against a plain memcpy
of the same bytes, what a hit costs, and a family's resident memory over many swaps.

Two `mmctl up` stacks in turn on their defaults (host-DRAM warm tier), each serving
``--variants`` demo fine-tunes of ``--size-mb`` MB with room for ``--slots`` of them:
``--fleet-layout family`` (one Triton model with weight slots: a miss is a copy into a
slot) and ``--fleet-layout models`` (a Triton model per customer: a miss is a Triton load).
Unmodified tritonclient gRPC through the router measures:

* hits: ``--hits`` requests to one loaded variant (p50/p99);
* misses: round-robin over every variant, so each request finds its variant out of the
  slots (p50/p99/max), and miss p50 minus hit p50;
* memcpy: a plain copy of the same bytes in this process (numpy ``copyto`` and torch
  ``copy_`` between preallocated buffers), p50 of 20;
* swap cycles (family): ``--cycles`` more misses; the family process's resident memory
  (its own pages, RssAnon: the warm tier's files it keeps mapped are shared memory, counted
  apart) after the first round and after the cycles, against one slot's bytes.

Every distinct answer a variant gave is checked against the reference MLP over its own
weights file (outside the timed calls); a wrong one makes the command exit 1.

``--light-fleet`` (family layout): the variants are written as ``bench.seed_scenario
--variant-mb`` writes them (``bench.sized_fleet``: one random draw of the hidden layers shared by all, each
variant's own first and last layer) into a repository in /dev/shm that ``mmctl up`` serves,
instead of its demo fleet (a full random draw per variant, and the demo's extra models):
the same sizes and files for a miss, written in a fraction of the time (850 MB variants).

``--layouts family,ray`` (or any list with ``ray``): the same hits and misses against Ray
Serve's model multiplexing (``bench.ray_peer``: one replica keeping ``--slots`` variants,
loading a missing one from variants of the same size written as ``--light-fleet`` writes
them; JSON over HTTP), checked the same way.

``--baseline REV``: the family layout of the current code and of git revision REV (a
worktree of this repository, whose code the product's processes run), ``--repeats`` runs
each, interleaved; prints each run and the medians of both sides.

    .venv/bin/python -m bench.family_swap [--variants 20] [--size-mb 100] [--slots 4]
        [--baseline REV --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.copy_floor import memcpy_baseline, percentiles
from bench.process_memory import family_rss_bytes, gpu_used_mib
from bench.product_spans import miss_traces, read_spans
from control_plane.admin.access import DATAPLANE_TOKEN_FILE_NAME
from tests.product import Product
from tests.reference import expected_scores, scores_match


def check_answers(repository: Path, layout: str, answers: dict[str, set[float]]) -> dict:
    """Every distinct answer each variant gave (to all-ones features) against the reference MLP
    over its weights file, one variant's weights in memory at a time (they may be 850 MB): a
    miss that answered from a stale slot would look fast and be wrong."""
    features = np.ones((1, 64), np.float32)
    wrong = []
    for name, seen in sorted(answers.items()):
        expected = float(expected_scores(repository, name, features, layout)[0, 0])
        wrong += [{"model": name, "answer": a, "expected": expected}
                  for a in sorted(seen) if not scores_match(a, expected)]
    return {"models": len(answers), "wrong": wrong}


def light_repository(args) -> Path:
    """The family's variants written cheaply into host DRAM (see --light-fleet)."""
    from bench.sized_fleet import write_sized_fleet
    from control_plane.demo.fleet import demo_spec

    where = args.work_dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
    # A folder of its own: the warm tier stages beside the repository (repository.staging).
    repo = Path(tempfile.mkdtemp(prefix="bench-family-", dir=where)) / "repository"
    started = time.perf_counter()
    write_sized_fleet(repo, demo_spec(args.variants, args.size_mb), "family")
    print(f"wrote {args.variants} variants of {args.size_mb:g} MB into {repo} in "
          f"{time.perf_counter() - started:.1f}s", flush=True)
    return repo


def side_runtime(repository: Path, code_dir: Path) -> None:
    """Give the family folders of ``repository`` the family runtime of the checkout at
    ``code_dir`` (its ``model_runtime/family`` and the modules beside it that runtimes carry),
    as that version writes them: the bench wrote them with this checkout's."""
    from control_plane.families.folders import RUNTIME_PACKAGE

    package = code_dir / "model_runtime" / "family"
    for copy in repository.glob(f"*/*/{RUNTIME_PACKAGE}"):
        shutil.rmtree(copy)
        shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for shared in (code_dir / "model_runtime").glob("*.py"):
            if shared.name != "__init__.py":
                shutil.copy2(shared, copy / shared.name)


def empty_ensure_seconds(product: Product, model: str, count: int) -> list[float]:
    """Round trips of the router workers' ensure call (``/v1/dataplane/ensure``) for a model
    that is loaded: the control plane answers at once, so this is the call's own cost, timed
    from this process with the workers' token.  Each ensure's hold is ended after it (the
    ``answered`` call, untimed), as a worker does."""
    token = (product.state_dir / DATAPLANE_TOKEN_FILE_NAME).read_text().strip()
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        answer = session.post(product.url + "/v1/dataplane/ensure", json={"model": model}, timeout=30)
        times.append(time.perf_counter() - t0)
        answer.raise_for_status()
        session.post(product.url + "/v1/dataplane/answered", json={"model": model, "count": 1},
                     timeout=30).raise_for_status()
    return times


def run_peer(args, work: Path) -> dict:
    """The same hits and misses against Ray Serve's multiplexing (``bench.ray_peer``) over
    variants of the same size written the way ``--light-fleet`` writes them."""
    from bench.ray_peer import RayPeer
    from control_plane.demo.fleet import WEIGHTS_FILE

    repo = light_repository(args)
    started = time.perf_counter()
    try:
        peer = RayPeer(repo, WEIGHTS_FILE, args.slots, work / "ray.log")
        print(f"ray: Ray Serve ready in {time.perf_counter() - started:.1f}s", flush=True)
        client = peer.client(300)
        try:
            names = [f"cust{i:03d}" for i in range(1, args.variants + 1)]
            timed = Timed(lambda name: float(client.infer(name, np.ones((1, 64), np.float32))[0, 0]))
            out = {"layout": "ray", "first_request_s": round(first_then_warm(timed, names), 3),
                   **hits_then_misses(timed, names, args)}
            out["answers"] = check_answers(repo, "family", timed.answers)
            return out
        finally:
            client.close()
            peer.close()
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)


class Timed:
    """``timed(name)``: one request's seconds; ``infer(name)`` gives its score, and every
    distinct score of a variant is kept for the check against its weights file."""

    def __init__(self, infer):
        self.infer = infer
        self.answers: dict[str, set[float]] = {}

    def __call__(self, name: str) -> float:
        t0 = time.perf_counter()
        score = self.infer(name)
        elapsed = time.perf_counter() - t0
        self.answers.setdefault(name, set()).add(score)
        return elapsed


def first_then_warm(timed: Timed, names: list[str]) -> float:
    """The first request's seconds (the family model's own load, or a load), then 20 more."""
    first_s = timed(names[0])
    for _ in range(20):
        timed(names[0])
    return first_s


def hits_then_misses(timed: Timed, names: list[str], args) -> dict:
    """``args.hits`` hits on the first variant, then ``args.rounds`` round-robin passes over
    every variant (each a miss when they outnumber the room)."""
    hits = [timed(names[0]) for _ in range(args.hits)]
    misses = []
    for _ in range(args.rounds):
        misses += [timed(n) for n in names]
    out = {"hit": percentiles(hits), "miss": percentiles(misses)}
    out["miss_minus_hit_p50_ms"] = round(out["miss"]["p50_ms"] - out["hit"]["p50_ms"], 3)
    return out


def run_layout(layout: str, args, work: Path, traced: bool = False, misses_only: int = 0,
               code_dir: Path | None = None, label: str | None = None) -> dict:
    """One ``mmctl up`` of ``layout``, timed.  ``traced``: with the product's spans on, written
    to a file and read back once it stopped (``traces``: the round trips of each miss).
    ``misses_only``: just that many misses after the first request (a run that counts; its
    timings would include the tracing).  ``code_dir``: the checkout whose code runs the
    product (default this one); ``label``: the run's name (its state folder)."""
    if layout == "ray":
        return run_peer(args, work)
    repo = light_repository(args) if args.light_fleet and layout == "family" else None
    if repo is not None and code_dir is not None:
        side_runtime(repo, code_dir)
    spans_file = work / f"{layout}-spans.jsonl"
    label = label or layout + ("-traced" if traced else "")
    started = time.perf_counter()
    try:
        product = Product(work / label, repo,
                          "--fleet-size", str(args.variants), "--model-size-mb",
                          str(args.size_mb), "--max-loaded", str(args.slots), "--fleet-layout", layout,
                          "--policy", "lru", "--router-workers", "1",
                          *(["--trace-exporter", f"file={spans_file}"] if traced else []),
                          code_dir=code_dir).start()
    except BaseException:
        if repo is not None:
            shutil.rmtree(repo.parent, ignore_errors=True)
        raise
    print(f"{label}: mmctl up ready in {time.perf_counter() - started:.1f}s"
          + (" (traced)" if traced else ""), flush=True)
    try:
        out = measure(product, layout, args, misses_only)
    finally:
        product.stop()  # the processes flush their spans as they exit
        if repo is not None:
            shutil.rmtree(repo.parent, ignore_errors=True)
    if traced:
        out["traces"] = miss_traces(read_spans(spans_file))
    return out


def measure(product: Product, layout: str, args, misses_only: int) -> dict:
    client = grpcclient.InferenceServerClient(product.json("endpoints")["router_grpc"])
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    names = [f"cust{i:03d}" for i in range(1, args.variants + 1)]
    # each variant's distinct answers, checked at the end
    timed = Timed(lambda name: float(client.infer(name, [x], client_timeout=300)
                                     .as_numpy("SCORES")[0, 0]))
    answers = timed.answers
    first_s = first_then_warm(timed, names)
    repository = Path(product.json("endpoints")["repository"])
    if misses_only:
        for i in range(misses_only):
            timed(names[i % len(names)])
        return {"layout": layout, "answers": check_answers(repository, layout, answers)}
    out = {"layout": layout, "first_request_s": round(first_s, 3), **hits_then_misses(timed, names, args),
           "empty_ensure": percentiles(empty_ensure_seconds(product, names[0], args.hits))}
    if layout == "family" and args.cycles:
        rss_before, gpu_before = family_rss_bytes(), gpu_used_mib()
        t0 = time.perf_counter()
        cycles = [timed(names[i % len(names)]) for i in range(args.cycles)]
        out["cycles"] = {"count": args.cycles, "seconds": round(time.perf_counter() - t0, 1),
                         "latency": percentiles(cycles), "rss_before_bytes": rss_before,
                         "rss_after_bytes": family_rss_bytes(), "gpu_used_before_mib": gpu_before,
                         "gpu_used_after_mib": gpu_used_mib()}
    if layout == "family":
        families = product.json("family", "list")
        out["slot_bytes"] = families[0]["slot_bytes"]
        out["slots"] = next(iter(families[0]["servers"].values()))["slots"]
        out["family_servers"] = families[0]["servers"]
    out["answers"] = check_answers(repository, layout, answers)
    out["fleet"] = product.json("fleet")
    out["fleet_written_by"] = "bench (--light-fleet)" if product.repository is not None else "mmctl up's demo"
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", type=int, default=20)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--slots", type=int, default=4, help="--max-loaded")
    ap.add_argument("--hits", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="round-robin passes over the variants")
    ap.add_argument("--cycles", type=int, default=1000, help="family swap cycles for the memory check")
    ap.add_argument("--layouts", default="family,models",
                    help="of family, models and ray (the same requests against Ray Serve's "
                         "multiplexing over variants of the same size: bench.ray_peer)")
    ap.add_argument("--light-fleet", action="store_true",
                    help="family layout: variants with shared hidden layers, written by the bench "
                         "into /dev/shm, instead of mmctl up's demo fleet (quick at 850 MB)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where --light-fleet writes the repository (default /dev/shm)")
    ap.add_argument("--traced-misses", type=int, default=20,
                    help="family: a run of its own with the product's tracing on, that many misses, "
                         "whose spans count each miss's round trips (0: none)")
    ap.add_argument("--trace-timed", action="store_true",
                    help="count the round trips in the timed run itself (one product start; its "
                         "timings then include the tracing)")
    ap.add_argument("--baseline", default=None,
                    help="git revision whose family layout runs side by side with this one's")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --baseline: runs per side, interleaved")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "family_swap.json")
    args = ap.parse_args(argv)
    if args.baseline:
        return compare_sides(args)

    work = Path(tempfile.mkdtemp(prefix="bench-family-"))
    try:
        results = {layout: run_layout(layout, args, work, traced=args.trace_timed and layout == "family")
                   for layout in args.layouts.split(",")}
        if "family" in results and args.traced_misses and not args.trace_timed:
            counted = run_layout("family", args, work, traced=True, misses_only=args.traced_misses)
            results["family"]["traces"] = counted["traces"]
            results["family"]["traces"]["answers"] = counted["answers"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    slot_bytes = results.get("family", {}).get("slot_bytes") or int(args.size_mb * 1e6)
    memcpy = memcpy_baseline(slot_bytes)
    result = {"benchmark": "family_swap", "conditions": {
        "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "variants": args.variants, "size_mb": args.size_mb, "slots": args.slots,
        "client": "tritonclient gRPC through the router (1 worker), batch 1, sequential",
        "tracing": ("on in the timed run (--trace-timed)" if args.trace_timed else
                    "off in the timed runs; a separate family run with tracing on counts round trips"),
        "warm tier": "host DRAM (tmpfs), every variant staged", "loadavg": os.getloadavg(),
        "fleet": ("variants with shared hidden layers, written by the bench (--light-fleet)"
                  if args.light_fleet else "mmctl up's demo fleet")},
        "memcpy": memcpy, **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    copy_ms = memcpy["numpy_copyto"]["p50_ms"]
    if "torch_pinned_h2d" in memcpy:
        print(f"pinned host-to-device copy of {slot_bytes / 1e6:.1f} MB on {memcpy['cuda_device']}: "
              f"{memcpy['torch_pinned_h2d']['p50_ms']:.1f} ms (p50)")
    print(f"family_swap: {args.variants} variants of {args.size_mb:g} MB, room for {args.slots}, "
          f"{os.cpu_count()} CPUs; plain memcpy of {slot_bytes / 1e6:.1f} MB: numpy {copy_ms:.1f} ms, "
          f"torch {memcpy['torch_copy_']['p50_ms']:.1f} ms (p50)")
    print(f"  {'layout':<8} {'first':>8} {'hit p50':>9} {'hit p99':>9} {'miss p50':>9} "
          f"{'miss p99':>9} {'miss max':>9} {'miss-hit':>9} {'/memcpy':>8}")
    for layout, r in results.items():
        print(f"  {layout:<8} {r['first_request_s'] * 1000:>7.0f}ms {r['hit']['p50_ms']:>8.1f}ms "
              f"{r['hit']['p99_ms']:>8.1f}ms {r['miss']['p50_ms']:>8.1f}ms {r['miss']['p99_ms']:>8.1f}ms "
              f"{r['miss']['max_ms']:>8.1f}ms {r['miss_minus_hit_p50_ms']:>8.1f}ms "
              f"{r['miss_minus_hit_p50_ms'] / copy_ms:>7.2f}x")
    if "family" in results and "models" in results:
        f, m = results["family"], results["models"]
        print(f"  same run: family hit p50 / models hit p50 = {f['hit']['p50_ms'] / m['hit']['p50_ms']:.2f}; "
              f"models miss p50 / family miss p50 = {m['miss']['p50_ms'] / f['miss']['p50_ms']:.0f}x")
    family = results.get("family", {})
    if family.get("empty_ensure"):
        ensure_ms = family["empty_ensure"]["p50_ms"]
        print(f"  family miss-hit p50 {family['miss_minus_hit_p50_ms']:.2f} ms against an empty ensure "
              f"round trip of {ensure_ms:.2f} ms (p50, same run): "
              f"{family['miss_minus_hit_p50_ms'] / ensure_ms:.2f}x")
    traces = family.get("traces")
    if traces:
        trips = traces["round_trips_before_inference"]
        print(f"  family: {traces['misses']} traced misses, round trips before the inference: max "
              f"{trips['max']} ({'; '.join(trips['calls'])})")
        print("  span p50 of a traced miss: " + ", ".join(
            f"{name} {ms:.2f} ms" for name, ms in traces["span_p50_ms"].items()))
        if traces.get("answers", {}).get("wrong"):
            family["answers"]["wrong"] += traces["answers"]["wrong"]
    cycles = family.get("cycles")
    if cycles and cycles["rss_before_bytes"] and cycles["rss_after_bytes"]:
        growth = cycles["rss_after_bytes"] - cycles["rss_before_bytes"]
        print(f"  {cycles['count']} swap cycles in {cycles['seconds']}s (p50 {cycles['latency']['p50_ms']:.1f} ms): "
              f"family process's own memory (RssAnon) {cycles['rss_before_bytes'] / 1e6:.0f} MB -> "
              f"{cycles['rss_after_bytes'] / 1e6:.0f} MB ({growth / 1e6:+.1f} MB; one slot is "
              f"{slot_bytes / 1e6:.1f} MB)")
        if cycles.get("gpu_used_before_mib") is not None:
            print(f"  GPU memory in use: {cycles['gpu_used_before_mib']:.0f} MiB -> "
                  f"{cycles['gpu_used_after_mib']:.0f} MiB over the cycles")
    for layout, r in results.items():
        checked = r["answers"]
        print(f"  {layout}: answers of {checked['models']} variants against their weights files: "
              + ("ok" if not checked["wrong"] else f"WRONG {checked['wrong'][:3]}"))
    print(f"wrote {args.out}")
    return result


def compare_sides(args) -> dict:
    """``--baseline``: the family layout of both checkouts, interleaved; each run's hit and miss
    p50s, miss - hit and the empty ensure round trip, then each side's medians."""
    from bench.mixed_traffic import run_sides

    def side(label: str, args, work: Path, code_dir: Path | None) -> dict:
        return run_layout("family", args, work, code_dir=code_dir, label=label)

    sides = run_sides(args, side, "bench-family-sides-", repeats=args.repeats)
    memcpy = memcpy_baseline(int(args.size_mb * 1e6))
    print(f"family_swap: {args.variants} variants of {args.size_mb:g} MB, room for {args.slots}, "
          f"{os.cpu_count()} CPUs, current code against {args.baseline}, {args.repeats} interleaved "
          f"run(s) each; plain memcpy of the same bytes: {memcpy['numpy_copyto']['p50_ms']:.2f} ms")
    print(f"  {'side':<10} {'hit p50':>9} {'miss p50':>9} {'miss p99':>9} {'miss-hit':>9} "
          f"{'ensure':>8} {'answers':>8}")
    summary = {}
    for name, runs in sides.items():
        for r in runs:
            print(f"  {name:<10} {r['hit']['p50_ms']:>7.2f}ms {r['miss']['p50_ms']:>7.2f}ms "
                  f"{r['miss']['p99_ms']:>7.2f}ms {r['miss_minus_hit_p50_ms']:>7.2f}ms "
                  f"{r['empty_ensure']['p50_ms']:>6.2f}ms "
                  f"{'ok' if not r['answers']['wrong'] else 'WRONG':>8}")
        summary[name] = {key: round(statistics.median(pick(r) for r in runs), 3) for key, pick in (
            ("hit_p50_ms", lambda r: r["hit"]["p50_ms"]), ("miss_p50_ms", lambda r: r["miss"]["p50_ms"]),
            ("miss_minus_hit_p50_ms", lambda r: r["miss_minus_hit_p50_ms"]),
            ("empty_ensure_p50_ms", lambda r: r["empty_ensure"]["p50_ms"]))}
    for name, m in summary.items():
        print(f"  median {name}: hit {m['hit_p50_ms']:.2f} ms, miss {m['miss_p50_ms']:.2f} ms, "
              f"miss - hit {m['miss_minus_hit_p50_ms']:.2f} ms "
              f"({m['miss_minus_hit_p50_ms'] / m['empty_ensure_p50_ms']:.1f}x an empty ensure of "
              f"{m['empty_ensure_p50_ms']:.2f} ms)")
    result = {"benchmark": "family_swap", "baseline": args.baseline, "conditions": {
        "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "variants": args.variants, "size_mb": args.size_mb, "slots": args.slots,
        "repeats": args.repeats, "loadavg": os.getloadavg(),
        "client": "tritonclient gRPC through the router (1 worker), batch 1, sequential"},
        "memcpy": memcpy, "sides": sides, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    wrong = [r for runs in sides.values() for r in runs if r["answers"]["wrong"]]
    result["family"] = {"answers": {"wrong": [w["answers"]["wrong"] for w in wrong]}}
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(1 if any(r["answers"]["wrong"] for r in outcome.values()
                      if isinstance(r, dict) and "answers" in r) else 0)
