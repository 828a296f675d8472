"""Triton's own ports, as a local process or a web page in the operator's browser sees them:
the Tritons `mmctl up` starts take model control, shared memory, trace and log settings only
with the key the control plane holds (state directory, mode 0600), while inference stays
open to the router workers."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from control_plane.demo.fleet import FleetSpec, customer_weights
from tests.product import Product
from tests.reference import mlp_scores

FEATURES = np.random.default_rng(7).standard_normal((2, 64)).astype(np.float32)

PYTHON_MODEL = """
import triton_python_backend_utils as pb_utils
open("{marker}", "w").write("ran")
class TritonPythonModel:
    def execute(self, requests):
        return []
"""
CONFIG = 'name: "x"\nbackend: "python"\nmax_batch_size: 0\n'


@pytest.fixture(scope="module")
def product(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-ports")
    p = Product(root / "state", None, "--fleet-size", "3", "--max-loaded", "2").start()
    yield p
    p.stop()


def triton_of(product) -> dict:
    return product.json("endpoints")["triton"][0]


def test_a_text_plain_load_from_a_local_process_runs_no_code(product, tmp_path):
    """The no-CORS request a web page can send, and a local user's curl: refused, and the
    model's code never runs."""
    marker = tmp_path / "ran"
    body = json.dumps({"parameters": {
        "config": CONFIG, "file:1/model.py": __import__("base64").b64encode(
            PYTHON_MODEL.format(marker=marker).encode()).decode()}})
    http = triton_of(product)["http"]
    answer = requests.post(f"http://{http}/v2/repository/models/x/load", data=body,
                           headers={"Content-Type": "text/plain"}, timeout=30)
    assert answer.status_code in (401, 403), answer.text
    assert "restricted" in answer.text.lower() or "admin-key" in answer.text
    assert not marker.exists()
    for path in ("/v2/repository/index", "/v2/logging", "/v2/trace/setting",
                 "/v2/systemsharedmemory/status"):
        method = requests.post if path == "/v2/repository/index" else requests.get
        assert method(f"http://{http}{path}", timeout=10).status_code in (401, 403), path


def test_model_control_over_grpc_needs_the_key(product):
    client = grpcclient.InferenceServerClient(triton_of(product)["grpc"])
    with pytest.raises(InferenceServerException, match="restricted"):
        client.load_model("cust003")
    with pytest.raises(InferenceServerException, match="restricted"):
        client.get_model_repository_index()
    with pytest.raises(InferenceServerException, match="restricted"):
        client.register_system_shared_memory("r", "/mms-attack", 64)


def test_inference_stays_open_and_the_control_plane_still_loads(product):
    """The control plane loads with the key; the router reaches the same Triton for inference
    without it, and the answer is the variant's own."""
    assert product.mmctl("load", "cust002").returncode == 0
    x = grpcclient.InferInput("FEATURES", [2, 64], "FP32")
    x.set_data_from_numpy(FEATURES)
    routed = grpcclient.InferenceServerClient(product.json("endpoints")["router_grpc"]).infer(
        "cust002", [x]).as_numpy("SCORES")
    expected = mlp_scores(customer_weights(FleetSpec(), "cust002"), FEATURES)
    np.testing.assert_allclose(routed, expected, rtol=1e-4, atol=1e-5)
    assert grpcclient.InferenceServerClient(triton_of(product)["grpc"]).is_server_ready()


def test_the_key_is_owner_only_and_never_logged(product):
    key_file = product.state_dir / "triton.key"
    key = key_file.read_text().strip()
    assert len(key) >= 32
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(product.state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((product.state_dir / "state.db").stat().st_mode) == 0o600
    assert key not in product.log_text()
    for server in product.json("fleet"):
        assert server["model_control"] == "restricted"


def test_the_router_workers_credential_opens_the_data_plane_only(product):
    """Router workers parse untrusted input: what they hold must not open model control."""
    dataplane = (product.state_dir / "dataplane.token").read_text().strip()
    admin = product.token_file.read_text().strip()
    assert dataplane != admin
    assert stat.S_IMODE((product.state_dir / "dataplane.token").stat().st_mode) == 0o600
    sent = {"Authorization": f"Bearer {dataplane}", "Content-Type": "application/json"}
    load = requests.post(product.url + "/v1/models/cust004/load", headers=sent, data="{}", timeout=30)
    assert load.status_code == 403, load.text
    assert "data-plane token" in load.json()["message"] and dataplane not in load.text
    assert product.json("status") and all(m["model"] != "cust004" or m["state"] != "ready"
                                          for m in product.json("status"))
    for method, path in (("GET", "/v1/status"), ("POST", "/v1/models/cust001/pin"),
                         ("GET", "/v1/registry/models"), ("GET", "/")):
        answer = requests.request(method, product.url + path, headers=sent, data="{}", timeout=30)
        assert answer.status_code == 403, (path, answer.status_code)
    assert requests.get(product.url + "/v1/dataplane/workers", headers=sent, timeout=30).status_code == 200
    # The workers were started with it, and with no admin token in their environment.
    workers = [p for p in product.processes()["processes"] if p["role"] == "router-worker"]
    assert workers
    for worker in workers:
        environ = Path(f"/proc/{worker['pid']}/environ").read_bytes()
        assert dataplane.encode() in environ and admin.encode() not in environ


def test_a_token_that_is_not_utf8_is_refused_as_a_wrong_one(product):
    """Bytes that are not UTF-8 in the Authorization header, or a lone surrogate in the
    status page's sign-in: once a 500 with a traceback logged per request."""
    answer = requests.get(product.url + "/v1/status", headers={"Authorization": b"Bearer \xff\xfe"},
                          timeout=30)
    assert answer.status_code == 401, answer.text
    answer = requests.post(product.url + "/v1/session", data=b'{"token": "\\ud800"}',
                           headers={"Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 401, answer.text
    assert product.json("status")  # the admin API goes on answering


def test_a_failed_fill_shows_no_secret_anywhere(product):
    """A variant whose fill fails: its failure text reaches the client, the health answers,
    `mmctl status --json`, the logs and the metrics, and none of them holds a secret."""
    endpoints = product.json("endpoints")
    repository = Path(endpoints["repository"])
    weights = repository / "cust003" / "weights.safetensors"
    weights.unlink()
    weights.mkdir()  # the fill cannot read it
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(FEATURES[:1])
    with pytest.raises(InferenceServerException) as failed:
        grpcclient.InferenceServerClient(endpoints["router_grpc"]).infer("cust003", [x])
    outputs = [str(failed.value),
               requests.get(f"http://{endpoints['router_http']}/health/cust003", timeout=30).text,
               requests.get(product.url + "/health/cust003", timeout=30).text,
               product.mmctl("health", "cust003").stdout, product.mmctl("status", "--json").stdout,
               requests.get(f"http://{endpoints['router_http']}/metrics", timeout=30).text,
               requests.get(product.url + "/metrics", timeout=30).text, product.log_text()]
    # The public port says the model is unavailable, and nothing of why or where; the admin
    # API tells the failure.
    assert json.loads(outputs[1]) == {"model": "cust003", "healthy": False, "state": "UNAVAILABLE"}
    assert "cust003" in outputs[2] and "cannot" in outputs[2]
    secrets = [(repository / ".mms-family-key").read_text().strip(),
               (product.state_dir / "triton.key").read_text().strip(),
               (product.state_dir / "dataplane.token").read_text().strip(),
               product.token_file.read_text().strip()]
    for text in outputs:
        for secret in secrets:
            assert secret not in text


def test_sign_out_ends_the_session_for_good(product):
    """A copied cookie opens nothing once its browser signed out (it lived 12 h before)."""
    json_type = {"Content-Type": "application/json"}
    signed_in = requests.post(product.url + "/v1/session", headers=json_type, timeout=30,
                              json={"token": product.token_file.read_text().strip()})
    assert signed_in.status_code == 200
    cookie = {"mms_session": signed_in.cookies["mms_session"]}
    assert requests.get(product.url + "/v1/overview", cookies=cookie, timeout=30).status_code == 200
    out = requests.delete(product.url + "/v1/session", cookies=cookie, headers=json_type, timeout=30)
    assert out.status_code == 200
    assert requests.get(product.url + "/v1/overview", cookies=cookie, timeout=30).status_code == 401
    behind_tls = requests.post(product.url + "/v1/session", timeout=30,
                               headers={**json_type, "X-Forwarded-Proto": "https"},
                               json={"token": product.token_file.read_text().strip()})
    assert "secure" in behind_tls.headers["Set-Cookie"].lower()
