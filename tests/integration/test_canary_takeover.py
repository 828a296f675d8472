"""A canary survives the death of its leader: two control planes (`mmctl control-plane`) on a
real PostgreSQL (pgserver), one Triton, two router workers (`mmctl router`) that know both.

Clients send real requests through the workers while the leader runs a canary to a faulty
candidate (every other request fails); too few reach the canary for a verdict.  The leader
is SIGKILLed; the standby takes the lease over and, after fewer canary requests than a
verdict needs on its own, rolls the canary back: it judged the requests the old leader saw
and its own as one window.  Every answer is the baseline's or the candidate's own scores (or
the candidate's injected failure), and after the rollback every answer is the baseline's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
import pytest
import requests

from control_plane.rollouts.canary import window_key
from control_plane.state import open_database
from control_plane.state.state_store import StateStore
from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from tests.integration.answers import Answers, features
from tests.integration.cluster import ControlPlane, RouterWorkers, log_tails
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

TOKEN = "canary-takeover-admin-token"
TRITON_KEY = "canary-takeover-triton-key"
LEASE_TTL_S = 3.0
BASELINE, CANDIDATE = "cust001", "cust017-faulty"
INJECTED_FAILURE = "injected failure"  # the faulty candidate's error (fail_fraction)
MIN_REQUESTS = 40  # canary requests a verdict needs
BEFORE_KILL = 24  # canary requests the old leader sees (a hold: fewer than MIN_REQUESTS)
BATCH = 4


class Outcomes:
    """Requests sent through the router to BASELINE's route, sorted by who answered them."""

    def __init__(self, router_http: str, answers: Answers):
        self.router_http = router_http
        self.answers = answers
        self.baseline = self.canary_ok = self.canary_failed = 0
        self.wrong: list[str] = []
        self.sent = 0

    @property
    def canary(self) -> int:
        return self.canary_ok + self.canary_failed

    def send(self, count: int, allowed: tuple[str, ...] = (BASELINE, CANDIDATE)) -> None:
        """``count`` requests, each on a new connection (SO_REUSEPORT spreads them over the
        workers); an answer that is not one of ``allowed``'s own is kept in ``wrong``."""
        for _ in range(count):
            self.sent += 1
            x = features(1, seed=self.sent)
            body = {"inputs": [{"name": "FEATURES", "shape": list(x.shape), "datatype": "FP32",
                                "data": x.ravel().tolist()}]}
            resp = requests.post(f"{self.router_http}/v2/models/{BASELINE}/infer", json=body,
                                 headers={"Connection": "close"}, timeout=60)
            if resp.status_code != 200:
                if CANDIDATE in allowed and INJECTED_FAILURE in resp.text:
                    self.canary_failed += 1
                else:
                    self.wrong.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
                continue
            (out,) = resp.json()["outputs"]
            scores = np.asarray(out["data"], np.float32).reshape(out["shape"])
            found = self.answers.which(list(allowed), x, scores)
            if found == BASELINE:
                self.baseline += 1
            elif found == CANDIDATE:
                self.canary_ok += 1
            else:
                self.wrong.append(f"answered {scores.ravel().tolist()}: none of {allowed}")


@pytest.fixture
def stack(postgres_url, fleet_template, tmp_path):
    repo = tmp_path / "repository"
    shutil.copytree(fleet_template, repo)
    triton = TritonProcess(TritonLaunchConfig(
        repository=repo, work_dir=tmp_path / "node",
        extra_args=[f"--grpc-restricted-protocol=model-repository:admin-key={TRITON_KEY}",
                    f"--http-restricted-api=model-repository:admin-key={TRITON_KEY}"]))
    triton.start()
    planes: list[ControlPlane] = []
    routers = None
    try:
        servers_file = tmp_path / "servers.json"
        servers_file.write_text(json.dumps({"servers": [
            {"name": "node", "grpc_url": triton.grpc_url, "http_url": triton.http_url,
             "node": "node", "memory_budget": "4GiB", "max_loaded": 8}]}))
        env = dict(os.environ, MMCTL_TOKEN=TOKEN, MMCTL_STATE_URL=postgres_url,
                   MMCTL_TRITON_ADMIN_KEY=TRITON_KEY, PYTHONUNBUFFERED="1")
        args = ["--servers-file", str(servers_file), "--repository", str(repo), "--fleet-size",
                "0", "--lease-ttl", str(LEASE_TTL_S), "--reconcile-interval", "0.5"]
        planes.append(ControlPlane("cp-a", tmp_path, args, env, TOKEN))
        logs = [planes[0].log]
        wait_for(planes[0].ready, 120, "the first control plane did not lead", log_tails(logs))
        planes.append(ControlPlane("cp-b", tmp_path, args, env, TOKEN))
        logs.append(planes[1].log)
        wait_for(lambda: planes[1].answers("/livez") == 200, 60, "the standby did not start",
                 log_tails(logs))
        routers = RouterWorkers(["w0", "w1"], tmp_path, [cp.url for cp in planes], env)
        routers.wait_ready(logs)
        yield {"leader": planes[0], "standby": planes[1], "routers": routers,
               "logs": logs + routers.logs, "answers": Answers(repo), "postgres_url": postgres_url}
    finally:
        if routers is not None:
            routers.stop()
        for cp in planes:
            cp.stop()
        triton.stop()
        assert not triton.alive(), "tritonserver was left running"


def saved_canary_requests(postgres_url: str) -> int:
    """Canary requests in the window the leader last saved to the shared state."""
    store = StateStore(open_database(postgres_url))
    try:
        text = store.get(window_key(BASELINE))
    finally:
        store.close()
    return json.loads(text)["variants"].get("canary", {}).get("requests", 0) if text else 0


def live_workers(cp: ControlPlane) -> int:
    resp = cp.call("GET", "/v1/dataplane/workers")
    return sum(1 for w in resp.json() if w["live"]) if resp.ok else 0


def current_workers(cp: ControlPlane) -> int:
    """Live workers that have every change the control plane published."""
    resp = cp.call("GET", "/v1/dataplane/workers")
    return sum(1 for w in resp.json() if w["live"] and w["current"]) if resp.ok else 0


def test_a_standby_taking_over_judges_the_canary_on_the_requests_seen_before(stack):
    leader, standby, logs = stack["leader"], stack["standby"], stack["logs"]
    answers: Answers = stack["answers"]
    answers.assert_distinct([BASELINE, CANDIDATE], features(1, 0))
    for model in (BASELINE, CANDIDATE):
        assert leader.call("POST", f"/v1/models/{model}/load", {}).ok
    started = leader.call("POST", f"/v1/canaries/{BASELINE}", {
        "to": CANDIDATE, "stages": [50, 100], "stage_s": 3600, "check_interval_s": 1,
        "min_requests": MIN_REQUESTS, "max_error_rate": 0.05, "max_failed_checks": 1})
    assert started.ok, started.text
    sent = Outcomes(stack["routers"].http, answers)

    # Before the kill: fewer canary requests than a verdict needs. The leader holds.
    while sent.canary < BEFORE_KILL:
        sent.send(BATCH)
    status = leader.call("GET", f"/v1/canaries/{BASELINE}").json()  # counts every answer
    assert status["variants"]["canary"]["requests"] == sent.canary, status["variants"]
    assert status["variants"]["baseline"]["requests"] == sent.baseline
    assert status["status"] == "running"
    # No verdict yet (holds change no progress and stay out of the history).
    assert [d["decision"] for d in status["history"]] == ["start"], status["history"]
    before = (sent.canary, sent.baseline, sent.canary_failed)
    # The leader saves the window every few seconds; a takeover may lose the last ones, so
    # the kill waits for the save (what the standby could restore is then known exactly).
    wait_for(lambda: saved_canary_requests(stack["postgres_url"]) == before[0], 30,
             "the leader did not save the canary's window", log_tails(logs))

    leader.proc.send_signal(signal.SIGKILL)
    leader.proc.wait(10)
    wait_for(standby.ready, 30, "the standby did not lead", log_tails(logs))
    wait_for(lambda: live_workers(standby) == 2, 30, "the workers did not reach the new leader",
             log_tails(logs))

    # After the kill: the canary requests the standby sees are too few for a verdict alone.
    while sent.canary < MIN_REQUESTS:
        sent.send(BATCH)
    after = (sent.canary - before[0], sent.baseline - before[1], sent.canary_failed - before[2])
    assert after[0] < MIN_REQUESTS

    def decided() -> dict | None:
        body = standby.call("GET", f"/v1/canaries/{BASELINE}").json()
        return body if body["status"] != "running" else None

    canary = wait_for(decided, 30, "the new leader did not judge the canary", log_tails(logs))
    last = canary["history"][-1]
    assert canary["status"] == "rolled_back" and last["decision"] == "rollback", last
    # Judged on one window: the old leader's requests and the new one's.  (A check may run
    # before the workers reported the last few answers: never more than were sent.)
    seen = (last, before, after)
    assert after[0] < MIN_REQUESTS <= last["canary"]["requests"] <= sent.canary, seen
    assert after[1] < last["baseline"]["requests"] <= sent.baseline, seen
    assert after[2] < last["canary"]["errors"] <= sent.canary_failed, seen
    assert canary["serving"] == BASELINE
    assert sent.wrong == [], sent.wrong[:5]

    # Rolled back: once both workers have the published rollback (a verdict is published
    # before it can be read), every answer is the baseline's own.
    wait_for(lambda: current_workers(standby) == 2, 10, "the workers did not get the rollback",
             log_tails(logs))
    rolled_back = Outcomes(stack["routers"].http, answers)
    rolled_back.sent = sent.sent
    rolled_back.send(12, allowed=(BASELINE,))
    assert rolled_back.wrong == [] and rolled_back.baseline == 12, rolled_back.wrong[:5]
