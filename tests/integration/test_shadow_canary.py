"""Shadows and canaries on the real stack (`mmctl up`, real tritonserver, tritonclient):
an unknown shadow is refused, requests over HTTP are mirrored and compared as gRPC ones are,
a healthy candidate that starts cold is promoted through the registry, and a busy state
database never stalls the serving loop."""

from __future__ import annotations

import shutil
import sqlite3
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from control_plane.demo.fleet import base_weights, customer_weights, write_model
from tests.conftest import SMALL
from tests.product import Product

pytestmark = pytest.mark.integration

CANDIDATE = "cust001.v2"  # version 2 of cust001 in the registry (folder name <model>.v<N>)
TWIN = "cust004-twin"  # cust004's weights under another name: a shadow that never diverges


@pytest.fixture(scope="module")
def product(fleet_template, tmp_path_factory):
    root = tmp_path_factory.mktemp("shadow-canary")
    repo = root / "repository"
    shutil.copytree(fleet_template, repo)
    write_model(repo, CANDIDATE, SMALL, customer_weights(SMALL, CANDIDATE, base_weights(SMALL)))
    write_model(repo, TWIN, SMALL, customer_weights(SMALL, "cust004", base_weights(SMALL)))
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


def http_infer(client, model, data, binary: bool):
    x = httpclient.InferInput("FEATURES", list(data.shape), "FP32")
    x.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput("SCORES", binary_data=binary)
    return client.infer(model, [x], outputs=[out]).as_numpy("SCORES")


COUNTS = ("mirrored", "dropped", "shed", "errors", "timeouts", "compared", "diverged")


def shadow_counts_after(p, route, before, n, timeout_s=30):
    """The route's shadow counts since ``before`` once each of ``n`` offers is accounted for
    and each mirror has an outcome (router workers report in batches), or as they are at
    the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = p.json("shadow", "report", route)
        c = {k: report[k] - before.get(k, 0) for k in COUNTS}
        if ((c["mirrored"] + c["dropped"] + c["shed"] >= n
                and c["compared"] + c["errors"] + c["timeouts"] >= c["mirrored"])
                or time.monotonic() > deadline):
            return c, report
        time.sleep(0.2)


def test_requests_over_http_are_mirrored_and_compared(product):
    """JSON and binary-tensor bodies over HTTP reach the shadow as gRPC requests do: mirrored,
    compared with the primary's answer, counted; the client's answers are the primary's."""
    p = product
    router = httpclient.InferenceServerClient(p.endpoints["router_http"])
    direct = httpclient.InferenceServerClient(p.endpoints["triton"][0]["http"])
    models = ("cust004", TWIN, "cust005")
    for model in models:  # loaded before the mirrors, and nothing compared is evicted
        assert p.mmctl("pin", model).returncode == 0
    rng = np.random.default_rng(7)
    batches = [rng.standard_normal((n, 64)).astype(np.float32) for n in (1, 3, 2, 4)]
    n = 8
    try:
        for shadow in (TWIN, "cust005"):
            assert p.mmctl("shadow", "start", "cust004", "--model", shadow, "--percent", "100").returncode == 0
            before = p.json("shadow", "report", "cust004")
            for i in range(n):
                data, binary = batches[i % len(batches)], i % 2 == 1
                answer = http_infer(router, "cust004", data, binary)
                np.testing.assert_array_equal(answer, http_infer(direct, "cust004", data, binary))
            c, report = shadow_counts_after(p, "cust004", before, n)
            # A mirror is shed only when the machine runs the router's loop late.
            assert c["mirrored"] > 0 and c["mirrored"] + c["shed"] == n and c["dropped"] == 0, report
            assert c["compared"] == c["mirrored"] and c["errors"] == c["timeouts"] == 0, report
            # The same weights compare equal, JSON or binary; another model's outputs diverge.
            assert c["diverged"] == (0 if shadow == TWIN else c["compared"]), report
            assert report["mean_latency_delta_ms"] is not None
            assert p.mmctl("shadow", "stop", "cust004").returncode == 0
    finally:
        p.mmctl("shadow", "stop", "cust004")
        for model in models:
            assert p.mmctl("unpin", model).returncode == 0
    metrics = requests.get(f"http://{p.endpoints['router_http']}/metrics", timeout=5).text
    assert 'mmr_shadow_results_total{result="diverged",route="cust004"}' in metrics
    assert 'mmr_shadow_results_total{result="match",route="cust004"}' in metrics


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
    # Behind SQLite, a request would wait until the COMMIT, which comes only after this
    # loop: until the write's 30 s busy timeout.  A few seconds tell the two apart, however
    # busy the machine.
    assert max(latencies_s) < 5.0, f"a request waited {max(latencies_s):.1f}s behind SQLite"
    assert admin_get(p, "/v1/limits")["cust003"]["qps"] == 1000.0
    assert p.mmctl("limit", "clear", "cust003").returncode == 0
    assert p.mmctl("unpin", "cust003").returncode == 0
