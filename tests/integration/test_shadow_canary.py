"""Shadows and canaries on the real stack (`mmctl up`, real tritonserver, tritonclient):
an unknown shadow is refused, a healthy candidate that starts cold is promoted through the
registry, and a busy state database never stalls the serving loop."""

from __future__ import annotations

import shutil
import sqlite3
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from control_plane.demo.fleet import base_weights, customer_weights, write_model
from tests.conftest import SMALL
from tests.product import Product

pytestmark = pytest.mark.integration

CANDIDATE = "cust001.v2"  # version 2 of cust001 in the registry (folder name <model>.v<N>)


@pytest.fixture(scope="module")
def product(fleet_template, tmp_path_factory):
    root = tmp_path_factory.mktemp("shadow-canary")
    repo = root / "repository"
    shutil.copytree(fleet_template, repo)
    write_model(repo, CANDIDATE, SMALL, customer_weights(SMALL, CANDIDATE, base_weights(SMALL)))
    p = Product(root / "state", repo, "--max-loaded", "8").start()
    p.endpoints = p.json("endpoints")
    yield p
    p.stop()


def infer(client, model):
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    return client.infer(model, [x])


def admin_get(p, path):
    resp = requests.get(p.url + path, headers=p.admin_headers(), timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_shadow_start_with_an_unknown_model_is_refused(product):
    p = product
    out = p.mmctl("shadow", "start", "cust002", "--model", "nosuch-model", "--percent", "100")
    assert out.returncode == 4, (out.stdout, out.stderr)
    assert "unknown model 'nosuch-model'" in out.stderr
    route = next((r for r in admin_get(p, "/v1/routes") if r["name"] == "cust002"), None)
    assert route is None or route["shadow"] is None


def test_a_healthy_candidate_that_starts_cold_is_promoted_through_the_registry(product):
    p = product
    status = {m["model"]: m for m in p.json("status")}
    assert status.get(CANDIDATE, {}).get("state") != "ready", "the candidate must start cold"
    versions = {v["name"]: v for v in p.json("registry", "list", "cust001")}
    assert versions["cust001"]["stage"] == "production" and versions[CANDIDATE]["stage"] == "registered"
    g = grpcclient.InferenceServerClient(p.endpoints["router_grpc"])
    infer(g, "cust001")  # the baseline is loaded; the candidate's load (> 1 s) comes with traffic
    # The latency gate is far below a load and far above an inference on this machine.
    assert p.mmctl("canary", "start", "cust001", "--to", CANDIDATE, "--stages", "50,100",
                   "--stage-seconds", "1", "--check-interval", "0.3", "--min-requests", "5",
                   "--max-failed-checks", "1", "--max-p99-ms", "500").returncode == 0
    stop = threading.Event()
    errors: list[str] = []

    def traffic():
        client = grpcclient.InferenceServerClient(p.endpoints["router_grpc"])
        while not stop.is_set():
            try:
                infer(client, "cust001")
            except InferenceServerException as exc:  # a healthy rollout: clients see none
                errors.append(str(exc))
            time.sleep(0.01)

    threads = [threading.Thread(target=traffic) for _ in range(4)]  # several wait for the load
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while p.json("canary", "status", "cust001")["status"] == "running":
            assert time.monotonic() < deadline, p.json("canary", "status", "cust001")["history"][-3:]
            time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == [], errors[:5]
    canary = p.json("canary", "status", "cust001")
    assert canary["status"] == "promoted", canary["history"][-3:]
    assert canary["serving"] == CANDIDATE
    versions = {v["name"]: v for v in p.json("registry", "list", "cust001")}
    assert versions[CANDIDATE]["stage"] == "production"  # the registry says what serves
    assert versions["cust001"]["stage"] == "retired"
    route = next(r for r in admin_get(p, "/v1/routes") if r["name"] == "cust001")
    assert route["target"] is None, "promotion left a route alias beside the registry"
    direct = grpcclient.InferenceServerClient(p.endpoints["triton"][0]["grpc"])
    expected = infer(direct, CANDIDATE).get_response().raw_output_contents
    assert infer(g, "cust001").get_response().raw_output_contents == expected


def test_a_locked_state_database_never_stalls_serving(product):
    """Route-table writes wait for SQLite in their own thread, not on the serving loop."""
    p = product
    g = grpcclient.InferenceServerClient(p.endpoints["router_grpc"])
    assert p.mmctl("pin", "cust003").returncode == 0
    for _ in range(5):
        infer(g, "cust003")
    blocker = sqlite3.connect(str(p.state_dir / "state.db"), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # a backup, a slow disk, another writer...
    latencies_s = []
    try:
        changed = {}

        def change_route():
            changed["out"] = p.mmctl("limit", "set", "cust003", "--qps", "1000")

        t = threading.Thread(target=change_route)
        t.start()
        end = time.monotonic() + 3
        while time.monotonic() < end:
            t0 = time.perf_counter()
            infer(g, "cust003")
            latencies_s.append(time.perf_counter() - t0)
            time.sleep(0.01)
        t.join(30)
    finally:
        blocker.execute("COMMIT")
        blocker.close()
    assert changed["out"].returncode == 0, changed["out"].stderr
    assert max(latencies_s) < 1.0, f"a request waited {max(latencies_s):.1f}s behind SQLite"
    assert admin_get(p, "/v1/limits")["cust003"]["qps"] == 1000.0
    assert p.mmctl("limit", "clear", "cust003").returncode == 0
    assert p.mmctl("unpin", "cust003").returncode == 0
