"""Benchmarks run: each one here once at its smallest size, so a benchmark that crashes, or
stops printing its numbers, fails the suite instead of rotting until someone runs it.

Every benchmark runs in its own process with its results written to a temporary folder (a
smoke never overwrites a measured run in bench/results/).  The benchmarks of the selected
tests start together, a few at a time, when the first of them needs its result: most of a
smoke run is waiting (Triton's unloads, start-ups), so that keeps the whole module near a
minute and a half on two cores instead of three.  The numbers themselves mean nothing at
this size; that they are printed, and that the JSON holds them, is what is checked.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import proxies

ROOT = Path(__file__).resolve().parents[2]
PARALLEL = 4  # benchmarks at a time: enough to overlap their waits, few enough for 2 cores
# The pool's threads start their benchmarks one at a time: a CI sandbox once failed an exec
# with EFAULT ("Bad address") while other threads of this process were starting theirs.
SPAWN_LOCK = threading.Lock()
SPAWN_TRIES = 3
NUMBER = r"-?\d+(?:\.\d+)?"


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and shutil.which("nvidia-smi") is not None


@dataclass
class Smoke:
    """One benchmark's smallest run: its arguments (``{out}``: the temporary results
    folder), what its output must show (regular expressions, in order of appearance), and
    a check of its JSON result."""

    args: list[str]
    printed: list[str]
    result_file: str | None = None
    check: Callable[[dict | list], None] = lambda result: None
    exit_code: int = 0
    timeout_s: float = 240.0


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def check_soak(result: dict) -> None:
    assert result["requests"] > 0 and result["req_per_s"] > 0 and positive(result["p99_ms"])
    assert result["failed"] == 0, result["failures"]
    assert result["wrong_answers"] == 0, result["wrong_answer_examples"]
    kinds = result["memory"]
    for kind in ("control plane", "router worker", "tritonserver", "python stub"):
        assert positive(kinds[kind]["start_mb"]) and positive(kinds[kind]["end_mb"]), kinds
    assert result["status_polls"]["count"] >= 1 and result["status_polls"]["failed"] == 0


def check_thrash(result: dict) -> None:
    for row in result["results"]:
        assert row["requests"] > 0 and row["failed"] == 0, row
        assert positive(row["p50_ms"]) and positive(row["requests_per_s"])


def check_scale(result: dict) -> None:
    row = result["results"][0]
    assert positive(row["startup_s"]) and positive(row["hit"]["p50_ms"])
    assert row["zipf_replay"]["failed"] == 0, row["zipf_replay"]["first_failures"]


def check_seed(result: dict) -> None:
    assert result["errors"] == 0, result["error_messages"]
    assert result["answers_ok"], result["answers"]
    assert positive(result["mixed"]["frequent"]["p50_ms"])


def check_family_swap(result: dict) -> None:
    family = result["family"]
    assert positive(family["hit"]["p50_ms"]) and positive(family["miss"]["p50_ms"])
    assert positive(family["cycles"]["rss_after_bytes"])
    assert family["answers"]["models"] == 3 and not family["answers"]["wrong"], family["answers"]
    # Each miss that copied a variant: the ensure and one control request, nothing else.
    trips = family["traces"]["round_trips_before_inference"]
    assert family["traces"]["misses"] >= 2 and trips["calls"] == ["ensure + family.load"], trips
    assert positive(family["empty_ensure"]["p50_ms"])


def check_capacity(result: dict) -> None:
    assert result["errors"]["wrong_answers"] == 0 and result["errors"]["other"] == 0, result["errors"]
    # Served, or refused at once with the reason (the deadline check): on a CI machine whose
    # cores the other tests (image builds among them) starve, the steady window once
    # answered nothing in time and refused what it could not.
    for key in ("one_copy", "auto_steady"):
        assert positive(result["hot_per_s"][key]) or result["refused"][key] > 0, (
            key, result["hot_per_s"], result["refused"])
    assert positive(result["background_p95_ms"]["alone"])
    assert positive(result["deadline"]["in_time_per_s"]["told"]), result["deadline"]


def check_fair_share(result: dict) -> None:
    for key in ("plain", "fair"):
        assert result[key]["wrong_answers"] == 0 and result[key]["errors"] == 0, result[key]
        assert positive(result[key]["background_alone"]["p95_ms"]), result[key]
        # The flood was served or refused at once with the reason.  Not its rate: on a CI
        # machine whose cores the other tests starve, the router's queue-deadline check once
        # refused a whole 3 s flood at once (227 requests) while the background was served.
        flood = result[key]["flood"]
        assert positive(flood["answered_per_s"]) or flood["refused_at_once"] > 0, result[key]


def check_router_latency(result: dict) -> None:
    for key in ("direct", "router_w1"):
        assert positive(result["paths"][key]["p50_us"]), result["paths"].keys()
    if proxies.find_nginx() is None:
        assert "nginx" in result["skipped"]


def check_gpu(result: dict) -> None:
    assert positive(result["load_evict"]["peak_mib"])


# The longest first, so the last to finish is a short one.
SMOKES: dict[str, Smoke] = {
    "status_page_shot": Smoke(
        ["-m", "bench.status_page_shot", "--seconds", "2", "--out", "{out}/status_page.png"],
        [r"\d+ requests in 2 s; the page: "]),
    "capacity": Smoke(
        ["-m", "bench.capacity", "--smoke", "--out", "{out}/capacity.json",
         "--plot", "{out}/capacity.png"],
        [r"device time simulated: every model's one instance sleeps",
         rf"hot model offered {NUMBER}/s: one copy {NUMBER}/s, auto \(steady\) {NUMBER}/s",
         rf"background p95: alone {NUMBER} ms", rf"deadlines of 100 ms .* p99 {NUMBER} ms"],
        "capacity.json", check_capacity),
    "fair_share": Smoke(
        ["-m", "bench.fair_share", "--smoke", "--out", "{out}/fair_share.json"],
        [r"device time simulated: the family's one instance sleeps",
         rf"plain \(no concurrency\): background p95 alone {NUMBER} ms, beside the flood",
         rf"fair  \(--server-concurrency 2\): background p95 alone {NUMBER} ms, beside the flood"],
        "fair_share.json", check_fair_share),
    "router_latency": Smoke(
        ["-m", "bench.router_latency", "--requests", "40", "--block", "20", "--threads", "2",
         "--seconds", "1", "--rounds", "1", "--workers", "1", "--no-install",
         "--out", "{out}/router_latency.json"],
        [rf"^\s+direct to Triton\s+{NUMBER}", rf"^\s+router \(1 worker\)\s+{NUMBER}"]
        + ([] if proxies.find_nginx() else [r"skipped nginx: "]),
        "router_latency.json", check_router_latency),
    "soak": Smoke(["-m", "bench.soak", "--smoke", "--out", "{out}/soak.json"],
                  [rf"requests \d+, failed 0, wrong answers 0, {NUMBER} req/s, p50 {NUMBER} ms",
                   rf"tritonserver\s+1 -> 1\s+{NUMBER}\s+{NUMBER}", r"mmctl status: \d+ polls, 0 failed"],
                  "soak.json", check_soak),
    "lora": Smoke(["-m", "bench.lora_bench", "--smoke", "--out", "{out}/lora.json"],
                  [rf"-> tinylm: 4-adapter throughput = {NUMBER}% of single-adapter",
                   rf"swap-in \(bank.write \+ synchronize\).*p50 {NUMBER} us",
                   r"process RSS growth"], "lora.json",
                  lambda r: assert_(positive(r["throughput_ratio_many_vs_one"]["demo"]["tinylm"]), r)),
    "load_profile": Smoke(
        ["-m", "bench.load_profile", "--cycles", "1", "--out", "{out}/load_profile.json"],
        [rf"= ensure \(miss with room, no eviction\)\s+{NUMBER} ms"], "load_profile.json",
        lambda r: assert_(r["median"]["ensure_s"] > 0 and r["median"]["index_polls"] >= 1, r)),
    "canary_overhead": Smoke(
        ["-m", "bench.canary_overhead", "--seconds", "0.5", "--fill", "50", "--rate", "20",
         "--warm-seconds", "0.5", "--out", "{out}/canary.json"],
        [rf"none\s+\d+\s+0\s+{NUMBER}\s+{NUMBER}", rf"canary\s+\d+\s+0\s+{NUMBER}\s+{NUMBER}"],
        "canary.json", lambda r: assert_(all(p["errors"] == 0 for p in r["phases"].values()), r)),
    "seed_scenario": Smoke(
        ["-m", "bench.seed_scenario", "--layout", "family", "--customers", "14", "--slots", "13",
         "--rate", "4", "--seconds", "2", "--hot-seconds", "1", "--bare-loads", "1",
         "--check-answers", "2", "--out", "{out}/seed.json"],
        [rf"mixed: occasional\s+\d+\s+0\s+{NUMBER}", r"answers against the weights files: ok"],
        "seed_family.json", check_seed),
    "family_swap": Smoke(
        ["-m", "bench.family_swap", "--variants", "3", "--size-mb", "1", "--slots", "2", "--hits", "3",
         "--rounds", "1", "--cycles", "3", "--layouts", "family", "--trace-timed",
         "--out", "{out}/family_swap.json"],
        [rf"family\s+{NUMBER}ms\s+{NUMBER}ms",
         r"round trips before the inference: max 2 \(ensure \+ family.load\)",
         rf"3 swap cycles .* family process's own memory \(RssAnon\) {NUMBER} MB",
         r"family: answers of 3 variants against their weights files: ok"], "family_swap.json",
        check_family_swap),
    "family_swap_baseline": Smoke(
        ["-m", "bench.family_swap", "--variants", "3", "--size-mb", "1", "--slots", "2", "--hits", "3",
         "--rounds", "1", "--cycles", "0", "--traced-misses", "0", "--light-fleet",
         "--baseline", "HEAD", "--out", "{out}/family_swap_sides.json"],
        [rf"^\s+baseline\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+ok",
         rf"^\s+current\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+ok",
         rf"median current: hit {NUMBER} ms, miss {NUMBER} ms, miss - hit -?{NUMBER} ms"],
        "family_swap_sides.json",
        lambda r: assert_(set(r["sides"]) == {"baseline", "current"}
                          and r["summary"]["current"]["miss_p50_ms"] > 0, r["summary"])),
    "mixed_traffic": Smoke(
        ["-m", "bench.mixed_traffic", "--smoke", "--traced", "--out", "{out}/mixed_traffic.json"],
        [rf"^\s+current\s+\d+\s+0\s+{NUMBER}\s+{NUMBER}ms",
         (rf"^\s+miss\s+{NUMBER}% of requests, p50 / p99 ms: request {NUMBER} / {NUMBER}, .*"
          rf"room {NUMBER} / {NUMBER}, fill {NUMBER} / {NUMBER}$"),
         r"current: every distinct answer against its variant's weights file: ok"],
        "mixed_traffic.json",
        lambda r: assert_(r["sides"]["current"][0]["misses"] > 0 and not r["sides"]["current"][0]["wrong"]
                          and r["sides"]["current"][0]["waits"]["miss"]["fill"][0] > 0, r)),
    "mixed_fleet": Smoke(
        ["-m", "bench.mixed_fleet", "--smoke", "--out", "{out}/mixed_fleet.json"],
        [rf"^\s+all: \d+ requests, 0 errors, {NUMBER} req/s",
         rf"^\s+variant\s+4 names\s+\d+ requests\s+p50 {NUMBER} ms",
         r"every distinct answer checked: ok"],
        "mixed_fleet.json",
        lambda r: assert_(r["result"]["requests"] > 0 and not r["result"]["wrong"]
                          and r["result"]["kinds"]["variant"]["requests"] > 0, r)),
    "adapter_traffic": Smoke(
        ["-m", "bench.adapter_traffic", "--smoke", "--out", "{out}/adapter_traffic.json"],
        [(rf"^\s+current\s+{NUMBER} / {NUMBER}\s+{NUMBER} / {NUMBER}\s+{NUMBER} / {NUMBER}\s+{NUMBER}"
         rf"\s+\d+\s+0\s+0")],
        "adapter_traffic.json",
        lambda r: assert_(r["sides"]["current"][0]["misses_counted"] >= 10
                          and r["sides"]["current"][0]["kinds"]["miss"]["ok"] == 20, r)),
    "scale": Smoke(["-m", "bench.scale", "--smoke", "--out", "{out}/scale.json"],
                   [rf"^\s+20\s+{NUMBER}\s+{NUMBER}\s+\d+\s+\d+"], "scale.json", check_scale),
    "thrash": Smoke(["-m", "bench.thrash", "--smoke", "--out", "{out}/thrash.json"],
                    [rf"family\s+workers=1: failed 0/8, p50 {NUMBER} ms"], "thrash.json", check_thrash),
    "shadow_overhead": Smoke(
        ["-m", "bench.shadow_overhead", "--rounds", "1", "--block-seconds", "0.5", "--settle", "0.1",
         "--rate", "20", "--out", "{out}/shadow.json"],
        [rf"healthy.*{NUMBER}", rf"failing.*{NUMBER}"], "shadow.json",
        lambda r: assert_(positive(r["primary"]["none"]["p99_ms"]), r["primary"])),
    "load_unload": Smoke(
        ["-m", "bench.load_unload", "--cycles", "1", "--out", "{out}/load_unload.json"],
        [rf"load \+ warm-up \(ensure\)\s+median {NUMBER} s", rf"unload until memory free\s+median {NUMBER} s"],
        "load_unload.json", lambda r: assert_(positive(r["median"]["load_and_warmup_s"]), r)),
    "gpu": Smoke(["-m", "bench.gpu", "--model-size-mb", "10", "--cycles", "1", "--out", "{out}/gpu.json"],
                 [r"GPU memory: before the product"] if has_gpu() else
                 [(r"needs a CUDA GPU and nvidia-smi; this machine has none\. Skipped, for lack of a "
                  r"GPU: adapter swap-in .* KIND_GPU load/evict cycles")],
                 "gpu.json" if has_gpu() else None, check_gpu, exit_code=0 if has_gpu() else 2),
    "cold_bandwidth": Smoke(
        ["-m", "bench.cold_bandwidth", "--size-mb", "4", "--repeats", "1", "--out", "{out}/cold.json"],
        [rf"local directory store\s+{NUMBER} MB/s", rf"S3 \(moto\), one GET per object\s+{NUMBER} MB/s"],
        "cold.json", lambda r: assert_(all(positive(v) for v in r["mb_per_s"].values()), r)),
    "abuse": Smoke(["-m", "bench.abuse", "--quick", "--repeats", "1", "--out", "{out}/abuse.json"],
                   [rf"normal\s+\d+\s+200\s+{NUMBER}", r"gzip_empty_members\s+\d+\s+400",
                    rf"deep_nesting\s+\d+\s+\d+\s+{NUMBER}"], "abuse.json",
                   lambda r: assert_(all(positive(row["cpu_s"]) or row["body"] == "gzip_empty_members"
                                         for row in r["rows"]), r["rows"])),
    "slot_fill": Smoke(
        # 20 MB: at least the 16 MiB a fill reads in place from (slots.IN_PLACE_MIN_BYTES).
        ["-m", "bench.slot_fill", "--size-mb", "20", "--repeats", "1", "--threads", "1,2",
         "--out", "{out}/slot_fill.json"],
        ([] if has_gpu() else [r"skipped for lack of a GPU"])
        + [rf"SlotBank.fill, kept mapping, 2 threads.*{NUMBER} ms\s+{NUMBER} GB/s",
           rf"SlotBank.fill, preadv, 2 threads.*{NUMBER} ms\s+{NUMBER} GB/s"]
        + ([] if has_gpu() else [rf"SlotBank.fill, read in place out of the kept mapping\s+{NUMBER} ms",
                                 rf"then its copy afterwards \(settle.*{NUMBER} ms\s+{NUMBER} GB/s"])
        + [rf"SlotBank.fill, first out of a new mapping.*{NUMBER} ms"], "slot_fill.json",
        lambda r: assert_(all(positive(row["p50_ms"]) for row in r["rows"]), r)),
    # Without a GPU it refuses, naming what it skipped (exit 2): it must never pass silently.
    "policy_replay": Smoke(
        ["-m", "bench.policy_replay", "--quick", "--requests", "2000", "--headroom", "1", "--no-plot",
         "--out", "{out}"],
        [rf"seed\s+50\s+14\s+2000\s+lru\S*\s+{NUMBER}", rf"belady\s+{NUMBER}"], "policy.json",
        lambda r: assert_(all(0 <= row["hit_ratio"] <= 1 for row in r), r[:1])),
    "http_parse_offloop": Smoke(
        ["-m", "bench.http_parse_offloop", "--mib", "1", "--bodies", "1"],
        [rf'"where": "parse_infer_request \(loop\)", "check_ms": {NUMBER}, "loop_lag_max_ms": {NUMBER}',
         rf'"where": "read_infer_request \(thread\)", "check_ms": {NUMBER}']),
}


def assert_(condition: bool, context) -> None:
    assert condition, context


@dataclass
class Run:
    name: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    out_dir: Path


def run_smoke(name: str, smoke: Smoke, out_dir: Path) -> Run:
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [a.replace("{out}", str(out_dir)) for a in smoke.args]
    started = time.monotonic()
    process = start_process([sys.executable, *args])
    try:
        stdout, stderr = process.communicate(timeout=smoke.timeout_s)
        return Run(name, process.returncode, stdout, stderr, time.monotonic() - started, out_dir)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, _ = process.communicate()
        return Run(name, -1, stdout or "", f"timed out after {smoke.timeout_s:.0f}s",
                   time.monotonic() - started, out_dir)


def start_process(argv: list[str]) -> subprocess.Popen:
    """Popen, one thread at a time; an exec that failed with EFAULT never ran, so it is tried
    again (any other error is the benchmark's own and fails its test)."""
    for attempt in range(SPAWN_TRIES):
        try:
            with SPAWN_LOCK:
                return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        except OSError as exc:
            if exc.errno != errno.EFAULT or attempt == SPAWN_TRIES - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """Every selected benchmark, started together (PARALLEL at a time) on first use."""
    selected = [item.callspec.params["bench"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "bench" in item.callspec.params]
    pool = ThreadPoolExecutor(PARALLEL)
    root = tmp_path_factory.mktemp("bench-smoke")
    futures: dict[str, Future] = {name: pool.submit(run_smoke, name, SMOKES[name], root / name)
                                  for name in selected}
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("bench", list(SMOKES))
def test_bench_runs_at_its_smallest_size_and_prints_its_numbers(bench, smoke_runs):
    smoke = SMOKES[bench]
    run = smoke_runs[bench].result()
    tail = f"\n--- stdout (end)\n{run.stdout[-3000:]}\n--- stderr (end)\n{run.stderr[-3000:]}"
    assert run.returncode == smoke.exit_code, f"{bench} exited {run.returncode} after {run.seconds:.0f}s" + tail
    position = 0
    for pattern in smoke.printed:
        found = re.compile(pattern, re.MULTILINE).search(run.stdout, position)
        assert found, f"{bench} did not print /{pattern}/ (after what came before it)" + tail
        position = found.end()
    if smoke.result_file is not None:
        path = run.out_dir / smoke.result_file
        assert path.is_file(), f"{bench} wrote no {smoke.result_file}" + tail
        smoke.check(json.loads(path.read_text()))


def test_router_latency_says_it_skips_nginx_when_nginx_is_missing(monkeypatch):
    """nginx is not part of make setup: without it (and without installing it) the benchmark
    measures the other hops and prints why nginx's is missing (its smoke above then checks
    the line); this machine may have it, so its absence is simulated here."""
    monkeypatch.setattr(proxies, "find_nginx", lambda: None)
    nginx, why = proxies.ensure_nginx(install=False)
    assert nginx is None
    assert why == ("nginx is not installed (--no-install given); as root: apt-get update && "
                   "apt-get install -y nginx-light")
