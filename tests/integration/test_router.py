"""The router in front of a real tritonserver, driven by unmodified tritonclient clients."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.integration.answers import Answers
from tests.product import Product

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def product(fleet_template, tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("router")
    repo = root / "repository"
    shutil.copytree(fleet_template, repo)
    p = Product(root / "state", repo, "--max-loaded", "8", "--max-request-bytes", "1MiB").start()
    p.endpoints = p.json("endpoints")
    yield p
    p.stop()


def grpc_client(p) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(p.endpoints["router_grpc"])


def http_client(p) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(p.endpoints["router_http"])


def features(rows=2, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)


def grpc_infer(client, model, data, **kw):
    x = grpcclient.InferInput("FEATURES", list(data.shape), "FP32")
    x.set_data_from_numpy(data)
    return client.infer(model, [x], **kw)


def test_unmodified_clients_get_byte_identical_outputs(product):
    p = product
    g, h = grpc_client(p), http_client(p)
    assert g.is_server_live() and g.is_server_ready()
    assert h.is_server_live() and h.is_server_ready()
    assert g.get_server_metadata().name == "triton"
    data = features(4)
    via_router = grpc_infer(g, "cust002", data)  # cold: the first request loads it
    assert g.is_model_ready("cust002") and h.is_model_ready("cust002")
    direct = grpc_infer(grpcclient.InferenceServerClient(p.endpoints["triton"][0]["grpc"]), "cust002", data)
    assert via_router.get_response().raw_output_contents == direct.get_response().raw_output_contents
    # A model served as itself: Triton's answer, with no routing parameters of the router's.
    assert via_router.get_response() == direct.get_response()
    assert g.get_model_metadata("cust002").inputs[0].name == "FEATURES"
    assert g.get_model_config("cust002").config.max_batch_size == 64
    meta = h.get_model_metadata("cust002")
    assert meta["name"] == "cust002" and meta["inputs"][0]["name"] == "FEATURES"
    for binary in (True, False):
        x = httpclient.InferInput("FEATURES", [4, 64], "FP32")
        x.set_data_from_numpy(data, binary_data=binary)
        out = h.infer("cust002", [x])
        assert out.as_numpy("SCORES").tobytes() == direct.as_numpy("SCORES").tobytes()
        assert "parameters" not in out.get_response()
    # Triton's `timeout` request parameter (microseconds) bounds only a scheduler's queue,
    # where the model's queue policy allows; this model has none, so Triton serves it, and
    # so does the router (it is no deadline of the router's).
    direct_http = httpclient.InferenceServerClient(p.endpoints["triton"][0]["http"])
    x = httpclient.InferInput("FEATURES", [4, 64], "FP32")
    x.set_data_from_numpy(data)
    for client in (direct_http, h):
        out = client.infer("cust002", [x], timeout=1)
        assert out.as_numpy("SCORES").tobytes() == direct.as_numpy("SCORES").tobytes()
    # Streaming through the router.
    results = []
    g.start_stream(callback=lambda result, error: results.append((result, error)))
    x = grpcclient.InferInput("FEATURES", [4, 64], "FP32")
    x.set_data_from_numpy(data)
    g.async_stream_infer("cust002", [x])
    g.stop_stream()
    assert results and results[0][1] is None
    assert results[0][0].as_numpy("SCORES").tobytes() == direct.as_numpy("SCORES").tobytes()


def test_bad_requests_get_clear_errors(product):
    g, h = grpc_client(product), http_client(product)
    with pytest.raises(InferenceServerException, match="NOT_FOUND.*Request for unknown model: 'nope' is not found"):
        grpc_infer(g, "nope", features())
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*unexpected shape"):
        grpc_infer(g, "cust002", np.zeros((2, 3), np.float32))
    x = grpcclient.InferInput("FEATURES", [1, 64], "INT32")
    x.set_data_from_numpy(np.zeros((1, 64), np.int32))
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*data-type"):
        g.infer("cust002", [x])
    with pytest.raises(InferenceServerException, match="NOT_FOUND.*Request for unknown model: '../etc'"):
        grpc_infer(g, "../etc", features())  # as Triton answers a name it does not serve
    big = np.zeros((8, 64 * 1024), np.float32)  # 2 MiB > the 1 MiB limit
    x = grpcclient.InferInput("FEATURES", list(big.shape), "FP32")
    x.set_data_from_numpy(big)
    with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED"):
        g.infer("cust002", [x])
    resp = requests.post(f"http://{product.endpoints['router_http']}/v2/models/cust002/infer",
                         data=b"x" * (2 << 20), timeout=10)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]
    resp = requests.post(f"http://{product.endpoints['router_http']}/v2/models/cust002/infer",
                         data=b"{not json", timeout=10)
    assert resp.status_code == 400
    with pytest.raises(InferenceServerException, match="not found|unknown model"):
        h.get_model_metadata("nope")


def test_model_control_is_refused_on_the_public_port(product):
    g = grpc_client(product)
    for call in (lambda: g.load_model("cust003"), lambda: g.unload_model("cust002"),
                 lambda: g.get_model_repository_index(), lambda: g.get_log_settings(),
                 lambda: g.get_trace_settings()):
        with pytest.raises(InferenceServerException, match="PERMISSION_DENIED"):
            call()
    base = f"http://{product.endpoints['router_http']}"
    for method, path in (("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/cust003/load"),
                         ("POST", "/v2/repository/models/cust002/unload"),
                         ("POST", "/v2/logging"),
                         ("GET", "/v2/trace/setting")):
        assert requests.request(method, base + path, timeout=5).status_code == 403, path
    # A version segment that smuggles a path to Triton's repository API is refused.
    sneaky = "/v2/models/cust002/versions/1%2F..%2F..%2F..%2Frepository%2Fmodels%2Fcust003%2Fload%3F/infer"
    resp = requests.post(base + sneaky, json={"inputs": []}, timeout=5)
    assert (resp.status_code, resp.json()) == (404, {"error": "Not Found"})  # Triton: no such route
    # Adapter management rides on inference inputs: refused on the public port too.
    x = grpcclient.InferInput("ADAPTER_CONTROL", [1, 1], "BYTES")
    x.set_data_from_numpy(np.array([[b'{"op": "status"}']], dtype=object))
    with pytest.raises(InferenceServerException, match="PERMISSION_DENIED.*ADAPTER_CONTROL"):
        g.infer("cust002", [x])
    assert "cust003" not in {m["model"] for m in product.json("status") if m["state"] == "ready"}


def test_ab_assignment_is_sticky_and_reported(product):
    p = product
    assert p.mmctl("experiment", "create", "rec-ab", "--control", "cust004", "--treatment", "cust017-v2",
                   "--treatment-percent", "30", "--sticky").returncode == 0
    g = grpc_client(p)
    seen = {}
    for user in range(40):
        for _ in range(2):
            r = grpc_infer(g, "cust004", features(1), headers={"x-user-id": f"u{user}"})
            params = r.get_response().parameters
            pair = (params["variant"].string_param, params["model"].string_param)
            assert seen.setdefault(user, pair) == pair  # sticky
            assert params["experiment"].string_param == "rec-ab"
    assert {v for v, _ in seen.values()} == {"control", "treatment"}
    # The user id may also come as a request parameter.
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(features(1))
    r = g.infer("cust004", [x], parameters={"user_id": "u7"})
    assert r.get_response().parameters["variant"].string_param == seen[7][0]
    # Both ports read a user id alike: the request parameter (a string, or a whole number:
    # gRPC's int64 was ignored), else x-user-id (HTTP once preferred the header).
    h = httpclient.InferenceServerClient(p.json("endpoints")["router_http"])
    hx = httpclient.InferInput("FEATURES", [1, 64], "FP32")
    hx.set_data_from_numpy(features(1))

    def http_variant(**kw):
        return h.infer("cust004", [hx], **kw).get_response()["parameters"]["variant"]

    assert http_variant(headers={"x-user-id": "u3"}) == seen[3][0]
    assert http_variant(parameters={"user_id": "u5"}, headers={"x-user-id": "u6"}) == seen[5][0]
    r = g.infer("cust004", [x], parameters={"user_id": "u5"}, headers={"x-user-id": "u6"})
    assert r.get_response().parameters["variant"].string_param == seen[5][0]
    numbered = {}
    for number in range(1000, 1016):  # a whole-number user id: the same arm on both ports
        r = g.infer("cust004", [x], parameters={"user_id": number})
        numbered[number] = r.get_response().parameters["variant"].string_param
        assert http_variant(parameters={"user_id": number}) == numbered[number]
    assert set(numbered.values()) == {"control", "treatment"}  # hashed, not random per request
    h.close()
    grpc_infer(g, "cust004", features(1))  # no user id: random, counted
    # Reading the figures asks every router worker for its report first (2 s at most; a
    # very busy machine may need another read): every request is counted, never twice.
    deadline = time.monotonic() + 10
    while True:
        stats = p.json("experiment", "stats", "rec-ab")["variants"]
        counted = sum(v["requests"] for v in stats.values())
        if counted >= 117 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counted == 117, stats
    assert sum(v["random_assignments"] for v in stats.values()) == 1
    assert all(v["p99_ms"] is not None for v in stats.values())
    assert p.mmctl("experiment", "disable", "rec-ab").returncode == 0
    r = grpc_infer(g, "cust004", features(1), headers={"x-user-id": "u1"})
    assert not r.get_response().parameters  # disabled: cust004 answers as itself, no variant
    assert p.mmctl("experiment", "delete", "rec-ab").returncode == 0


def _drive(p, model, seconds, until=None):
    g = grpc_client(p)
    deadline = time.monotonic() + seconds
    errors = 0
    while time.monotonic() < deadline:
        try:
            grpc_infer(g, model, features(1))
        except InferenceServerException:
            errors += 1
        if until is not None and until():
            break
        time.sleep(0.01)
    return errors


def canary_status(p, name):
    return p.json("canary", "status", name)


def test_failing_canary_rolls_back_automatically(product):
    p = product
    assert p.mmctl("canary", "start", "cust005", "--to", "cust017-faulty", "--stages", "50,100",
                   "--stage-seconds", "30", "--check-interval", "0.5", "--min-requests", "10",
                   "--max-failed-checks", "2", "--max-error-rate", "0.05").returncode == 0
    # Up to 120 s (it ends at the rollback): on a starved CI machine 60 s of requests once
    # ended with the canary still holding for more evidence.
    _drive(p, "cust005", 120, until=lambda: canary_status(p, "cust005")["status"] != "running")
    status = canary_status(p, "cust005")
    assert status["status"] == "rolled_back", status["history"]
    last = status["history"][-1]
    assert last["decision"] == "rollback" and "error rate" in last["reason"]
    assert last["canary"]["requests"] >= 10
    # After the rollback every request goes to the baseline and succeeds.
    g = grpc_client(p)
    for _ in range(10):
        r = grpc_infer(g, "cust005", features(1))
        assert not r.get_response().parameters  # the baseline, answering as itself


def test_healthy_canary_is_promoted(product):
    p = product
    assert p.mmctl("canary", "start", "cust006", "--to", "cust017-v3", "--stages", "50,100",
                   "--stage-seconds", "1", "--check-interval", "0.3", "--min-requests", "5").returncode == 0
    errors = _drive(p, "cust006", 90, until=lambda: canary_status(p, "cust006")["status"] != "running")
    assert errors == 0, f"{errors} requests failed during a healthy canary"
    status = canary_status(p, "cust006")
    assert status["status"] == "promoted", status["history"]
    assert status["serving"] == "cust017-v3"
    r = grpc_infer(grpc_client(p), "cust006", features(1)).get_response()
    # cust017-v3 is the registry's cust017 version 3: clients see that, not the Triton name.
    assert (r.model_name, r.model_version, r.parameters["model"].string_param) == ("cust006", "3", "cust017")


def test_idle_canary_holds(product):
    p = product
    assert p.mmctl("canary", "start", "cust007", "--to", "cust017-faulty", "--stages", "50,100",
                   "--stage-seconds", "1", "--check-interval", "0.3", "--min-requests", "5",
                   "--max-failed-checks", "1").returncode == 0
    time.sleep(3)
    status = canary_status(p, "cust007")
    assert status["status"] == "running" and status["stage_index"] == 0
    decisions = [h["decision"] for h in status["history"]]
    assert decisions[0] == "start" and set(decisions[1:]) == {"hold"} and len(decisions) >= 3
    assert p.mmctl("canary", "abort", "cust007").returncode == 0
    assert canary_status(p, "cust007")["status"] == "aborted"


def test_slow_and_dead_shadows_never_touch_the_primary(product):
    p = product
    g = grpc_client(p)
    direct = grpcclient.InferenceServerClient(p.endpoints["triton"][0]["grpc"])
    # Pinned: loading the shadows must not evict the primaries compared against below.
    for model in ("cust008", "cust003"):
        assert p.mmctl("pin", model).returncode == 0
    assert p.mmctl("shadow", "start", "cust008", "--model", "slow", "--percent", "100").returncode == 0
    data = features(2, seed=5)
    grpc_infer(g, "cust008", data)
    expected = grpc_infer(direct, "cust008", data).get_response().raw_output_contents
    start = time.monotonic()
    for _ in range(150):
        r = grpc_infer(g, "cust008", data)
        assert r.get_response().raw_output_contents == expected
        assert not r.get_response().parameters  # cust008 itself: a shadow changes nothing here
    elapsed_s = time.monotonic() - start
    assert elapsed_s < 20, "the slow shadow (3 s per request) slowed the primary"
    # Router workers report to the control plane in batches (every 0.25 s): every offered
    # mirror is accounted for once the last batch is in.
    deadline = time.monotonic() + 5
    while True:
        report = p.json("shadow", "report", "cust008")
        accounted = report["mirrored"] + report["dropped"] + report["shed"]
        if accounted >= 151 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["dropped"] > 0 and accounted == 151, report
    assert p.mmctl("shadow", "stop", "cust008").returncode == 0
    # A shadow that cannot even load: the primary does not notice, the errors are counted.
    assert p.mmctl("shadow", "start", "cust003", "--model", "broken", "--percent", "100").returncode == 0
    expected3 = grpc_infer(direct, "cust003", data).get_response().raw_output_contents
    for _ in range(20):
        assert grpc_infer(g, "cust003", data).get_response().raw_output_contents == expected3
    deadline = time.monotonic() + 30
    while p.json("shadow", "report", "cust003")["errors"] == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    report = p.json("shadow", "report", "cust003")
    assert report["errors"] > 0 and report["compared"] == 0
    assert p.mmctl("shadow", "stop", "cust003").returncode == 0
    for model in ("cust008", "cust003"):
        assert p.mmctl("unpin", model).returncode == 0
    metrics = requests.get(f"http://{p.endpoints['router_http']}/metrics", timeout=5).text
    assert 'mmr_shadow_dropped_total{route="cust008"}' in metrics


def test_rate_limit_rejects_the_burst_overflow_only(product):
    p = product
    g = grpc_client(p)
    grpc_infer(g, "cust001", features(1))  # loaded before the limit starts counting
    assert p.mmctl("limit", "set", "cust001", "--qps", "0.5", "--burst", "5").returncode == 0
    admitted = rejected = 0
    for _ in range(12):
        try:
            grpc_infer(g, "cust001", features(1))
            admitted += 1
        except InferenceServerException as exc:
            assert "RESOURCE_EXHAUSTED" in str(exc) and "retry in" in str(exc)
            rejected += 1
    assert (admitted, rejected) == (5, 7)
    resp = requests.post(f"http://{p.endpoints['router_http']}/v2/models/cust001/infer",
                         json={"inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32",
                                           "data": [0.0] * 64}]}, timeout=10)
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
    grpc_infer(g, "cust002", features(1))  # another model is unaffected
    assert p.mmctl("limit", "clear", "cust001").returncode == 0
    grpc_infer(g, "cust001", features(1))


def test_router_health_and_metrics(product):
    base = f"http://{product.endpoints['router_http']}"
    grpc_infer(grpc_client(product), "cust002", features(1))
    body = requests.get(base + "/health/cust002", timeout=5).json()
    # Ready or not in Triton's terms, nothing more: where it runs and why it failed are the
    # admin API's.
    assert body == {"model": "cust002", "healthy": True, "state": "READY"}, body
    assert requests.get(base + "/health/identity", timeout=5).status_code == 503  # not loaded
    assert requests.get(base + "/health/nope", timeout=5).status_code == 404
    metrics = requests.get(base + "/metrics", timeout=5).text
    assert 'mmr_requests_total{code="OK",model="cust002",route="cust002",variant="default"}' in metrics
    assert "mmr_request_seconds_bucket" in metrics and "mmr_cold_load_waits_total" in metrics


def test_a_killed_triton_is_waited_for_or_refused_as_unavailable_then_serves_again(fleet_template, tmp_path):
    import os
    import shutil
    import signal

    repo = tmp_path / "repository"
    shutil.copytree(fleet_template, repo)
    # A slow reconcile loop leaves a window in which Triton is down and not yet restarted.
    p = Product(tmp_path / "state", repo, "--max-loaded", "4", "--reconcile-interval", "6").start()
    try:
        endpoints = p.json("endpoints")
        g = grpcclient.InferenceServerClient(endpoints["router_grpc"])
        answers = Answers(repo)
        answers.assert_answer("cust001", features(1), grpc_infer(g, "cust001", features(1))
                              .as_numpy("SCORES"))
        triton_pids = p.triton_pids()
        assert len(triton_pids) == 1
        os.kill(triton_pids[0], signal.SIGKILL)
        time.sleep(0.5)
        # The request either waits for the restarted Triton within its deadline and gets
        # cust001's own answer, or is refused in words a client can act on: never a hang,
        # never another answer.
        try:
            answers.assert_answer("cust001", features(1, seed=2),
                                  grpc_infer(g, "cust001", features(1, seed=2)).as_numpy("SCORES"))
        except InferenceServerException as exc:
            assert re.search("UNAVAILABLE.*is unavailable", str(exc)), exc
            assert "127.0.0.1" not in str(exc) and "triton0" not in str(exc), exc
        # The control plane restarts its Triton; the model is loaded again on demand.
        deadline = time.monotonic() + 60
        while True:
            try:
                scores = grpc_infer(g, "cust001", features(1, seed=1)).as_numpy("SCORES")
                break
            except InferenceServerException:
                assert time.monotonic() < deadline, "the router did not recover"
                time.sleep(1)
        answers.assert_answer("cust001", features(1, seed=1), scores)
    finally:
        p.stop()
