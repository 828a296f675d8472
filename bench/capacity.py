"""Capacity where the traffic is: a hot model offered three times what one copy serves,
beside background models at a low rate, through the router of a real `mmctl up` with
several Triton servers: one copy against `mmctl scale --replicas auto`.

These machines have no GPU and 2 cores, so device time is simulated, openly: every model is
a python-backend model whose one instance *sleeps* a fixed service time per request
(``--service-ms``, 25 ms: 40 requests/s per copy) and answers ``Y = factor * X``.  A copy's
capacity is its instance's time, not this machine's CPU; the bench prints the CPU use of
each phase and flags a phase above 70% (its numbers then measure the CPU, not the product).

Each round (``--rounds``, interleaved; the medians are reported) runs three phases on the
same product, each a fixed-rate open loop of gRPC requests (tritonclient's asyncio client,
every answer checked against ``factor * X``; a request not answered within
``--timeout-s`` is counted as timed out):

1. background alone: ``--background`` models at ``--background-rate`` requests/s in all;
2. one copy: the same background, plus the hot model at ``--overload`` times one copy's
   capacity, with ``--replicas 1``;
3. auto: the same, after ``mmctl scale hot --replicas auto --min 1 --max SERVERS``; the copies
   of the hot model are sampled every 0.5 s, and the steady window starts once the copies
   stopped changing (the ramp before it is reported apart).

It reports the hot model's throughput in phase 2 and in phase 3's steady window (target:
at least 2.5x), the background's p95 in phases 2 and 3 against phase 1 (target: at most
1.3x), the errors (target: 0 in the steady window), and plots the hot model's copies and
throughput over time into ``bench/results/capacity_copies.png``.

    .venv/bin/python -m bench.capacity [--servers 4] [--rounds 3] [--phase-s 15] [--auto-s 40]

``--smoke``: 2 servers, 2 background models, 1 round, 2 s phases (the suite runs it: the bench
still works).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.capacity_report import plot, print_report, report_of
from bench.mixed_traffic import cpu_busy
from bench.open_loop import open_loop, outcome_of
from tests.product import Product

HOT = "hot"
RESULTS = ROOT / "bench" / "results"
SMOKE = ["--servers", "2", "--rounds", "1", "--phase-s", "2", "--auto-s", "6", "--background", "2",
         "--background-rate", "10"]

MODEL_PY = '''\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Stands for a model on a GPU: one instance, busy --service-ms per request."""

    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.service_s = float(params["service_ms"]["string_value"]) / 1000.0
        self.factor = np.float32(params["factor"]["string_value"])

    def execute(self, requests):
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            time.sleep(self.service_s)
            answers.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", (x * self.factor).astype(np.float32))]))
        return answers
'''

CONFIG = '''\
backend: "python"
max_batch_size: 0
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 4 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters [
  {{ key: "service_ms", value: {{ string_value: "{service_ms}" }} }},
  {{ key: "factor", value: {{ string_value: "{factor}" }} }}
]
'''


def write_repository(root: Path, names: dict[str, float], service_ms: float) -> None:
    for name, factor in names.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL_PY)
        (root / name / "config.pbtxt").write_text(CONFIG.format(service_ms=service_ms, factor=factor))


class Traffic:
    """A fixed-rate open loop of requests per model, each answer checked."""

    def __init__(self, url: str, factors: dict[str, float], timeout_s: float):
        self.url = url
        self.factors = factors
        self.timeout_s = timeout_s
        self.rng = np.random.default_rng(7)

    async def run(self, rates: dict[str, float], seconds: float, timeout_s: float | None = None,
                  tell_deadline: bool = True) -> list[tuple]:
        """(model, sent, finished, outcome) for every request sent in ``seconds``, at
        ``rates[model]`` requests/s each (evenly spaced, phases drawn at random).  Outcomes:
        ok, wrong, refused (RESOURCE_EXHAUSTED: rate limit or deadline), timeout, error: ...
        ``tell_deadline`` False: the request carries no deadline (the router cannot refuse
        it for one), and the client gives up on it after ``timeout_s`` all the same."""
        import tritonclient.grpc.aio as grpcclient

        client = grpcclient.InferenceServerClient(self.url)
        x = np.arange(4, dtype=np.float32).reshape(4) + 1
        limit_s = self.timeout_s if timeout_s is None else timeout_s

        async def one(model: str) -> str:
            inputs = [grpcclient.InferInput("X", [4], "FP32")]
            inputs[0].set_data_from_numpy(x)
            try:
                if tell_deadline:
                    answer = await client.infer(model, inputs, client_timeout=limit_s)
                else:
                    answer = await asyncio.wait_for(client.infer(model, inputs), limit_s)
            except Exception as exc:  # noqa: BLE001  (every failure is counted by kind)
                return outcome_of(exc)
            y = answer.as_numpy("Y")
            return "ok" if y is not None and np.allclose(y, x * self.factors[model]) else "wrong"

        try:
            return await open_loop(rates, seconds, self.rng, one)
        finally:
            await client.close()


def copies_of(product: Product) -> int:
    row = requests.get(f"{product.url}/v1/models/{HOT}", headers=product.admin_headers(),
                       timeout=10).json()
    return sum(1 for c in row.get("copies", []) if c["state"] == "ready")


def drain(endpoints: dict, timeout_s: float = 60.0) -> None:
    """Wait until no Triton executes the hot model any more: a request its client gave up
    on still takes its turn there (Triton's default scheduler runs what it accepted), and
    the next phase must not start behind the last one's."""
    def executions() -> int:
        total = 0
        for triton in endpoints["triton"]:
            url = triton["http"].removeprefix("http://")
            try:
                body = requests.get(f"http://{url}/v2/models/{HOT}/stats", timeout=5).json()
            except (requests.RequestException, ValueError):
                continue
            total += sum(int(m.get("execution_count", 0)) for m in body.get("model_stats", []))
        return total

    deadline = time.monotonic() + timeout_s
    last = executions()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = executions()
        if now == last:
            return
        last = now


def p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


def summarize(results: list[tuple], since: float, until: float, model_filter) -> dict:
    """The requests sent in ``[since, until)`` (their latencies, refusals, timeouts) and the
    throughput: answers that came in that window per second.  Counted by when they came,
    not by when they were sent: under overload the requests sent in a short window may all
    wait past their timeout while the copy keeps answering the ones before them."""
    chosen = [r for r in results if model_filter(r[0]) and since <= r[1] < until]
    ok = [r for r in chosen if r[3] == "ok"]
    latencies = [(r[2] - r[1]) * 1000 for r in ok]
    refused = [(r[2] - r[1]) * 1000 for r in chosen if r[3] == "refused"]
    window = max(1e-9, until - since)
    answered = sum(1 for r in results if r[3] == "ok" and model_filter(r[0]) and since <= r[2] < until)
    return {"sent": len(chosen), "ok": len(ok), "per_s": round(answered / window, 2),
            "refused": len(refused),
            "refused_p50_ms": round(float(np.percentile(refused, 50)), 1) if refused else None,
            "refused_p99_ms": round(float(np.percentile(refused, 99)), 1) if refused else None,
            "timeouts": sum(1 for r in chosen if r[3] == "timeout"),
            "wrong": sum(1 for r in chosen if r[3] == "wrong"),
            "errors": [r[3] for r in chosen if r[3].startswith("error")][:5],
            "error_count": sum(1 for r in chosen if r[3].startswith("error")),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1) if latencies else None,
            "p95_ms": round(p95(latencies), 1) if latencies else None,
            "latencies_ms": latencies}


def phase(product: Product, traffic: Traffic, rates: dict[str, float], seconds: float,
          sample_copies: bool = False, **how) -> dict:
    busy0, total0 = cpu_busy()
    samples: list[tuple[float, int]] = []

    async def run() -> list[tuple]:
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic(), await asyncio.to_thread(copies_of, product)))
                await asyncio.sleep(0.5)

        sampler = asyncio.ensure_future(sample()) if sample_copies else None
        results = await traffic.run(rates, seconds, **how)
        stop.set()
        if sampler is not None:
            await sampler
        return results

    started = time.monotonic()
    results = asyncio.run(run())
    busy1, total1 = cpu_busy()
    return {"results": results, "started": started, "seconds": seconds, "copies": samples,
            "cpu_busy": round((busy1 - busy0) / max(1.0, total1 - total0), 3)}


def steady_start(samples: list[tuple[float, int]], started: float) -> float:
    """When the copies reached the count they kept to the end (plus 1 s to settle)."""
    final = samples[-1][1] if samples else 1
    at = started
    for when, count in samples:
        if count != final:
            at = when
    return at + 1.0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=15.0)
    parser.add_argument("--auto-s", type=float, default=40.0)
    parser.add_argument("--service-ms", type=float, default=25.0)
    parser.add_argument("--overload", type=float, default=3.0)
    parser.add_argument("--background", type=int, default=20)
    parser.add_argument("--background-rate", type=float, default=50.0)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--deadline-s", type=float, default=0.1)
    parser.add_argument("--router-workers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "capacity.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "capacity_copies.png")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *argv])

    one_copy_per_s = 1000.0 / args.service_ms
    background = {f"bg{i:02d}": float(i + 2) for i in range(args.background)}
    factors = {HOT: 3.0, **background}
    hot_rate = args.overload * one_copy_per_s
    bg_rates = {name: args.background_rate / len(background) for name in background}
    work = Path(tempfile.mkdtemp(prefix="mms-capacity-"))
    repository = work / "repository"
    write_repository(repository, factors, args.service_ms)
    product = Product(work / "state", repository, "--triton-servers", str(args.servers),
                      "--router-workers", str(args.router_workers), "--max-loaded", str(len(factors)), "--scale-up-after", "2",
                      "--scale-down-after", "600", "--headroom-models", "0")
    rounds = []
    try:
        product.start()
        endpoints = product.json("endpoints")
        for name in factors:  # every model loaded before any timing
            out = product.mmctl("load", name)
            assert out.returncode == 0, out.stderr
        traffic = Traffic(endpoints["router_grpc"], factors, args.timeout_s)
        for n in range(args.rounds):
            out = product.mmctl("scale", HOT, "--replicas", "1")
            assert out.returncode == 0, out.stderr
            while copies_of(product) > 1:
                time.sleep(0.2)
            alone = phase(product, traffic, bg_rates, args.phase_s)
            one = phase(product, traffic, {HOT: hot_rate, **bg_rates}, args.phase_s)
            drain(endpoints)
            # Deadlines: twice what one copy serves, each request with 100 ms to live; told to
            # the router (it refuses what cannot start in time), or not (the client gives up).
            deadline_rate = {HOT: 2 * one_copy_per_s}
            told = phase(product, traffic, deadline_rate, args.phase_s, timeout_s=args.deadline_s)
            drain(endpoints)
            untold = phase(product, traffic, deadline_rate, args.phase_s, timeout_s=args.deadline_s,
                           tell_deadline=False)
            drain(endpoints)
            out = product.mmctl("scale", HOT, "--replicas", "auto", "--min", "1",
                                "--max", str(args.servers))
            assert out.returncode == 0, out.stderr
            auto = phase(product, traffic, {HOT: hot_rate, **bg_rates}, args.auto_s,
                         sample_copies=True)
            steady = steady_start(auto["copies"], auto["started"])
            end = auto["started"] + args.auto_s + 0.1
            is_bg = background.__contains__
            rounds.append({
                "background_alone": summarize(alone["results"], 0, 1e18, is_bg),
                "one_copy": {"hot": summarize(one["results"], one["started"] + 1,
                                              one["started"] + args.phase_s, HOT.__eq__),
                             "background": summarize(one["results"], 0, 1e18, is_bg)},
                "auto": {"hot_steady": summarize(auto["results"], steady, end, HOT.__eq__),
                         "hot_ramp": summarize(auto["results"], 0, steady, HOT.__eq__),
                         "background_steady": summarize(auto["results"], steady, 1e18, is_bg),
                         "ramp_s": round(steady - auto["started"], 1),
                         "copies": [(round(t - auto["started"], 2), c) for t, c in auto["copies"]],
                         "answered_at": [round(r[2] - auto["started"], 3) for r in auto["results"]
                                         if r[0] == HOT and r[3] == "ok"]},
                "deadline": {"told": summarize(told["results"], told["started"] + 1,
                                               told["started"] + args.phase_s, HOT.__eq__),
                             "untold": summarize(untold["results"], untold["started"] + 1,
                                                 untold["started"] + args.phase_s, HOT.__eq__)},
                "cpu_busy": {"alone": alone["cpu_busy"], "one_copy": one["cpu_busy"],
                             "deadline": max(told["cpu_busy"], untold["cpu_busy"]),
                             "auto": auto["cpu_busy"]}})
            print(f"round {n + 1}: one copy {rounds[-1]['one_copy']['hot']['per_s']}/s, auto "
                  f"{rounds[-1]['auto']['hot_steady']['per_s']}/s after {rounds[-1]['auto']['ramp_s']}s",
                  flush=True)
    finally:
        product.stop()
    report = report_of(rounds, args, one_copy_per_s, hot_rate)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(rounds, args.plot, one_copy_per_s)
    print_report(report)
    return report


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["errors"]["wrong_answers"] == 0 and result["errors"]["other"] == 0 else 1)
