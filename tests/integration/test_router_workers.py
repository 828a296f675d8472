"""Router workers in their own processes (`mmctl up --router-workers 2`), on the real stack.

The control plane can be SIGKILLed under traffic without a client error, a killed worker is
started again while the other serves, a rate limit holds across both workers, and a canary
is judged on both workers' traffic.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bench.capacity import write_repository
from control_plane.demo.fleet import FleetSpec, base_weights, customer_weights, write_model
from tests.integration.answers import Answers, features
from tests.product import Product

pytestmark = pytest.mark.integration

# Models whose load takes at least 1.5 s (their initialize sleeps): a miss longer than a
# short deadline on any machine, however fast.
SLOW_LOAD = FleetSpec(count=1, hidden_dim=32, hidden_layers=1, extra_parameters=(("load_delay_s", "1.5"),))
SLOW_LOADS = ("slowload1", "slowload2")
# One instance answering one request per 25 ms (40 requests/s), no batching: a copy a
# flood can put behind (bench.capacity's model, its answer X times 3).
PACED, PACED_FACTOR, PACED_SERVICE_MS = "paced", 3.0, 25.0
BODY = {"inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32", "data": [1.0] * 64}]}


@pytest.fixture(scope="module")
def product(fleet_template, tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    repo = root / "repository"
    shutil.copytree(fleet_template, repo)
    for name in SLOW_LOADS:
        write_model(repo, name, SLOW_LOAD, customer_weights(SLOW_LOAD, name, base_weights(SLOW_LOAD)))
    write_repository(repo, {PACED: PACED_FACTOR}, PACED_SERVICE_MS)
    p = Product(root / "state", repo, "--max-loaded", "8", "--router-workers", "2").start()
    p.endpoints = p.json("endpoints")
    p.answers = Answers(repo)
    yield p
    p.stop()
    p.assert_no_triton_left()


def roles(p: Product) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for proc in p.json("endpoints")["processes"]:
        found.setdefault(proc["role"], []).append(proc["pid"])
    return found


def post_new_connection(p: Product, model: str, x: np.ndarray | None = None) -> requests.Response:
    """One request on a connection of its own: the kernel spreads connections over the
    workers (SO_REUSEPORT), so a stream of these reaches both."""
    body = BODY if x is None else {"inputs": [{"name": "FEATURES", "shape": list(x.shape),
                                               "datatype": "FP32", "data": x.ravel().tolist()}]}
    return requests.post(f"http://{p.endpoints['router_http']}/v2/models/{model}/infer", json=body,
                         headers={"Connection": "close"}, timeout=60)


def http_scores(resp: requests.Response) -> np.ndarray:
    (out,) = resp.json()["outputs"]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def infer_grpc(client, model: str, x: np.ndarray, timeout_s: float | None = None) -> np.ndarray:
    inp = grpcclient.InferInput("FEATURES", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], client_timeout=timeout_s).as_numpy("SCORES")


def wrong_answer(p: Product, model: str, x: np.ndarray, scores: np.ndarray) -> str | None:
    """None when ``scores`` is ``model``'s own answer to ``x``, else what was answered."""
    if p.answers.matches(model, x, scores):
        return None
    found = p.answers.which([f"cust00{i}" for i in range(1, 9)], x, scores)
    return f"{model}: answered {scores.ravel().tolist()}, the answer of {found or 'no model here'}"


def workers(p: Product) -> list[dict]:
    resp = requests.get(p.url + "/v1/dataplane/workers", headers=p.admin_headers(), timeout=10)
    assert resp.status_code == 200, resp.text
    return [w for w in resp.json() if w["live"]]


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = check()
        except AssertionError:  # the control plane is restarting: mmctl cannot reach it yet
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_endpoints_list_every_process_with_its_role(product):
    found = roles(product)
    assert len(found["supervisor"]) == 1 and len(found["control-plane"]) == 1
    assert len(found["router-worker"]) == 2 and len(found["triton"]) == 1
    assert len({pid for pids in found.values() for pid in pids}) == 5
    for pids in found.values():
        for pid in pids:
            assert os.path.exists(f"/proc/{pid}")


def test_routers_serve_through_a_control_plane_sigkill_with_zero_errors(product):
    p = product
    assert p.mmctl("pin", "cust004").returncode == 0
    grpc_client = grpcclient.InferenceServerClient(p.endpoints["router_grpc"])
    x = features(1)
    # loaded before the kill
    p.answers.assert_answer("cust003", x, infer_grpc(grpc_client, "cust003", x))
    p.answers.assert_distinct(["cust003", "cust004"], x)
    before = roles(p)
    errors: list[str] = []
    served = [0]
    stop = threading.Event()

    def traffic(thread: int, use_grpc: bool):
        client = grpcclient.InferenceServerClient(p.endpoints["router_grpc"]) if use_grpc else None
        sent = 0
        while not stop.is_set():
            for model in ("cust003", "cust004"):
                sent += 1
                x = features(1, seed=thread * 100_000 + sent)
                try:
                    if use_grpc:
                        scores = infer_grpc(client, model, x)
                    else:
                        resp = post_new_connection(p, model, x)
                        if resp.status_code != 200:
                            errors.append(f"HTTP {resp.status_code}: {resp.text}")
                            continue
                        scores = http_scores(resp)
                except Exception as exc:  # noqa: BLE001  every failure counts, whatever its kind
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if (wrong := wrong_answer(p, model, x, scores)) is not None:
                    errors.append(wrong)
                    continue
                served[0] += 1
            time.sleep(0.01)

    threads = [threading.Thread(target=traffic, args=(i, g))
               for i, g in enumerate((True, True, False, False))]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        os.kill(before["control-plane"][0], signal.SIGKILL)
        served_at_kill = served[0]
        after = wait_for(lambda: (r := roles(p))["control-plane"] != before["control-plane"] and r, 120,
                         "the supervisor to start the control plane again")
        time.sleep(2.0)  # traffic on the new control plane's snapshot too
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == [], errors[:5]
    assert served[0] > served_at_kill + 20, "traffic did not go on"
    assert after["triton"] == before["triton"], "the new control plane did not adopt the running Triton"
    assert after["router-worker"] == before["router-worker"]
    status = {m["model"]: m for m in p.json("status")}
    assert status["cust004"]["pinned"] and status["cust004"]["state"] == "ready"
    assert status["cust003"]["state"] == "ready"
    assert p.mmctl("unpin", "cust004").returncode == 0


def test_misses_wait_through_a_control_plane_sigkill_and_succeed(product):
    """Clients waiting for cold loads when the control plane is SIGKILLed: their misses are
    asked again of its next life (the supervisor starts it) and succeed."""
    p = product
    cold = ["cust005", "cust006", "cust007", "cust008"]
    for model in cold:
        assert p.mmctl("unload", model).returncode == 0
    before = roles(p)
    errors: list[str] = []
    served: list[str] = []

    def client(model: str, seed: int) -> None:
        c = grpcclient.InferenceServerClient(p.endpoints["router_grpc"])
        x = features(1, seed)
        try:
            scores = infer_grpc(c, model, x, timeout_s=200)
        except Exception as exc:  # noqa: BLE001  every failure counts, whatever its kind
            errors.append(f"{model}: {type(exc).__name__}: {exc}")
            return
        if (wrong := wrong_answer(p, model, x, scores)) is not None:
            errors.append(wrong)
        else:
            served.append(model)

    threads = [threading.Thread(target=client, args=(m, i)) for i, m in enumerate(cold * 2)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the misses are waiting for their loads
    os.kill(before["control-plane"][0], signal.SIGKILL)
    for t in threads:
        t.join()
    assert errors == [], errors[:5]
    assert sorted(served) == sorted(cold * 2)
    wait_for(lambda: roles(p)["control-plane"] != before["control-plane"], 120,
             "the supervisor to start the control plane again")


def test_a_killed_worker_is_restarted_while_the_other_serves(product):
    p = product
    before = roles(p)["router-worker"]
    os.kill(before[0], signal.SIGKILL)
    # Connections the kernel had queued on the dying worker's socket are reset with it;
    # once it is gone, every new connection reaches the live worker.  Gone means reaped: a
    # killed thread group's leader is a zombie while its other threads still hold the
    # sockets, and the supervisor reaps it only once all of them have exited.
    wait_for(lambda: not os.path.exists(f"/proc/{before[0]}"), 10, "the killed worker to be reaped")
    for seed in range(20):
        x = features(1, seed)
        resp = post_new_connection(p, "cust002", x)
        assert resp.status_code == 200, resp.text
        p.answers.assert_answer("cust002", x, http_scores(resp))
    after = wait_for(lambda: len(w := roles(p)["router-worker"]) == 2 and before[0] not in w and w, 60,
                     "the supervisor to start the worker again")
    assert before[1] in after
    wait_for(lambda: len(workers(p)) >= 2 and all(w["pid"] in after for w in workers(p)[-2:]), 30,
             "the new worker to connect")
    processes = json.loads((p.state_dir / "processes.json").read_text())["processes"]
    assert sum(x["restarts"] for x in processes if x["role"] == "router-worker") >= 1


def test_a_rate_limit_holds_across_both_workers(product):
    p = product
    # A burst of a few tokens: with a burst of 1 a token not taken within 1/qps s is lost,
    # and a loaded machine leaves such gaps between the hammering clients' requests.
    qps, burst, window_s = 20.0, 5, 10.0
    assert p.mmctl("limit", "set", "cust005", "--qps", str(qps), "--burst",
                   str(burst)).returncode == 0
    assert post_new_connection(p, "cust005").status_code in (200, 429)  # loaded before counting
    time.sleep(1.0)
    before = {w["worker"]: w["requests"] for w in workers(p)}
    ok, limited = [0], [0]
    end = time.monotonic() + window_s

    def hammer():
        while time.monotonic() < end:
            status = post_new_connection(p, "cust005").status_code
            if status == 200:
                ok[0] += 1
            elif status == 429:
                limited[0] += 1
            else:
                raise AssertionError(f"unexpected HTTP {status}")

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.0)  # the workers' last reports
    try:
        allowed = qps * window_s + burst
        assert limited[0] > ok[0], "the load did not exceed the limit; the test proves nothing"
        # Held across both workers: a limit each worker kept alone would let about twice as
        # many through.  A busy machine only ever lets fewer through (tokens go unused while
        # no request is waiting), so the floor is loose and the ceiling tight.
        assert 0.75 * allowed <= ok[0] <= 1.10 * allowed, (ok[0], allowed, limited[0])
        served_by = {w["worker"]: w["requests"] - before.get(w["worker"], 0) for w in workers(p)}
        assert sum(1 for n in served_by.values() if n > 0) == 2, served_by
    finally:
        assert p.mmctl("limit", "clear", "cust005").returncode == 0


def test_a_burst_within_a_limit_is_served_whole_on_both_workers(product):
    """Requests that arrive together wait for one grant of tokens from the control plane;
    those the grant did not cover ask again while the bucket has tokens.  Before, each of
    them was refused ("retry in 0.000s") though the burst was far from spent."""
    p = product
    # A grant is about 5% of a second's tokens over the workers: 5 here, for 60 requests.
    assert p.mmctl("limit", "set", "cust005", "--qps", "200", "--burst", "200").returncode == 0
    try:
        assert post_new_connection(p, "cust005").status_code == 200  # loaded before the burst
        time.sleep(1.5)  # the bucket full again
        start = threading.Barrier(60)
        statuses: list[str] = []

        def one():
            start.wait()
            resp = post_new_connection(p, "cust005")
            statuses.append("200" if resp.status_code == 200 else f"{resp.status_code}: {resp.text}")

        threads = [threading.Thread(target=one) for _ in range(60)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses == ["200"] * 60, [s for s in statuses if s != "200"][:3]
    finally:
        assert p.mmctl("limit", "clear", "cust005").returncode == 0


def test_a_canary_is_judged_on_both_workers_samples(product):
    p = product
    assert post_new_connection(p, "cust006").status_code == 200
    assert p.mmctl("canary", "start", "cust006", "--to", "cust017-faulty", "--stages", "50,100",
                   "--stage-seconds", "60", "--check-interval", "8", "--min-requests", "10",
                   "--max-failed-checks", "1").returncode == 0
    before = {w["worker"]: w["samples"] for w in workers(p)}
    sent = 80
    pending = list(range(sent))
    lock = threading.Lock()

    def send():
        while True:
            with lock:
                if not pending:
                    return
                pending.pop()
            post_new_connection(p, "cust006")  # the faulty candidate fails about half the time

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.0)  # the workers' reports
    status = p.json("canary", "status", "cust006")
    counted = sum(v["requests"] + v["client_errors"] for v in status["variants"].values())
    by_worker = {w["worker"]: w["samples"] - before.get(w["worker"], 0) for w in workers(p)}
    assert counted == sent, (status["variants"], by_worker)
    assert sum(1 for n in by_worker.values() if n > 0) == 2, by_worker
    assert sum(by_worker.values()) == sent
    final = wait_for(lambda: (s := p.json("canary", "status", "cust006"))["status"] != "running" and s, 60,
                     "the canary decision")
    assert final["status"] == "rolled_back", final["history"][-3:]
    assert final["serving"] == "cust006"


# A deadline shorter than SLOW_LOAD's load (1.5 s at least).
DEADLINE_S = 1.0
DEADLINE_MS = str(int(DEADLINE_S * 1000))


def model_state(p: Product, model: str) -> str:
    return next(m["state"] for m in p.json("status", "--all") if m["model"] == model)


def test_a_request_whose_deadline_is_shorter_than_its_models_load_is_refused_at_once(product):
    """A model whose load takes at least 1.5 s: with its load time known, a request with a
    1 s deadline (gRPC's own deadline; HTTP's X-Request-Timeout-Ms) is refused at once,
    RESOURCE_EXHAUSTED / 429 saying why, and its load starts; the retry is answered, with the
    model's own scores, within the same deadline.  (1 s: shorter than the load, so that only
    a refusal made before the load could end reaches the client within it; no shorter, so
    that how fast a busy machine delivers that answer does not decide the test: a refusal at
    once has taken more than 150 ms to reach the client on a busy CI machine.)"""
    x = features(2, seed=6)
    client = grpcclient.InferenceServerClient(product.endpoints["router_grpc"])
    for model in SLOW_LOADS:  # the first loads: the control plane learns their time
        assert wrong_answer(product, model, x, infer_grpc(client, model, x, timeout_s=60)) is None
        assert product.mmctl("unload", model).returncode == 0
        wait_for(lambda m=model: model_state(product, m) == "warm", 30, f"{model} unloaded")
    known = {m["model"]: m["load_time_s"] for m in product.json("status", "--all") if m["model"] in SLOW_LOADS}
    assert set(known) == set(SLOW_LOADS) and all(s >= 1.5 for s in known.values()), known
    time.sleep(0.5)  # the workers have the placement without them

    with pytest.raises(InferenceServerException) as refused:
        infer_grpc(client, "slowload1", x, timeout_s=DEADLINE_S)
    # Refused before the client's own deadline passed (it would say DEADLINE_EXCEEDED), so
    # before the load, which takes longer than that deadline, could have ended: not after
    # waiting for it.
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
    assert "longer than the" in refused.value.message() and "deadline" in refused.value.message()

    body = {"inputs": [{"name": "FEATURES", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}
    url = f"http://{product.endpoints['router_http']}/v2/models/slowload2/infer"
    resp = requests.post(url, json=body, headers={"X-Request-Timeout-Ms": DEADLINE_MS}, timeout=10)
    assert resp.status_code == 429, resp.text
    assert "deadline" in resp.json()["error"] and int(resp.headers["Retry-After"]) >= 1

    for model in SLOW_LOADS:  # loading since the refusal
        wait_for(lambda m=model: model_state(product, m) == "ready", 30, f"{model} loaded")
    time.sleep(0.5)
    assert wrong_answer(product, "slowload1", x,
                        infer_grpc(client, "slowload1", x, timeout_s=DEADLINE_S)) is None
    resp = requests.post(url, json=body, headers={"X-Request-Timeout-Ms": DEADLINE_MS}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert wrong_answer(product, "slowload2", x, http_scores(resp)) is None


def test_a_copy_behind_on_its_deadlines_is_not_sent_every_request_after(product):
    """40 requests with 100 ms to live, sent at once to a model that answers 40 a second,
    nearly all time out, and Triton still runs each of them (a second of work).  The router
    counts them in the copy's queue until Triton answers them: of the 80 requests a second
    with 100 ms to live sent after the burst, within a second those that can start in time
    are answered (each answer the model's own) and the others refused at once.  (When the
    router forgot a request at its deadline, it had no answer to learn the copy's rate from
    and saw its queue empty: it sent every request, and each timed out behind the burst for
    as long as the flood lasted.)"""
    import asyncio

    import tritonclient.grpc.aio as aioclient

    assert product.mmctl("load", PACED).returncode == 0
    x = np.arange(1, 5, dtype=np.float32)

    async def go() -> list[tuple[float, str]]:
        client = aioclient.InferenceServerClient(product.endpoints["router_grpc"])  # one worker
        outcomes: list[tuple[float, str]] = []

        async def one(started: float) -> None:
            inputs = [aioclient.InferInput("X", [4], "FP32")]
            inputs[0].set_data_from_numpy(x)
            sent = time.monotonic()
            try:
                y = (await client.infer(PACED, inputs, client_timeout=0.1)).as_numpy("Y")
                kind = "answered" if np.allclose(y, x * PACED_FACTOR) else f"wrong: {y}"
            except InferenceServerException as exc:
                kind = {"StatusCode.RESOURCE_EXHAUSTED": "refused",
                        "StatusCode.DEADLINE_EXCEEDED": "timeout"}.get(exc.status(), str(exc))
            outcomes.append((sent - started, kind))

        try:
            started = time.monotonic()
            sending = [asyncio.ensure_future(one(started)) for _ in range(40)]
            for n in range(160):  # then 80 a second for 2 s
                await asyncio.sleep(max(0.0, started + 0.05 + n / 80 - time.monotonic()))
                sending.append(asyncio.ensure_future(one(started)))
            await asyncio.gather(*sending)
        finally:
            await client.close()
        return outcomes

    outcomes = asyncio.run(go())
    assert all(kind in ("answered", "refused", "timeout") for _, kind in outcomes), outcomes
    last = [kind for sent, kind in outcomes if sent >= 1.05]  # the flood's last second
    assert last.count("answered") >= 10, outcomes  # about 40 fit in it
    assert last.count("refused") >= 10, outcomes
