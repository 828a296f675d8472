"""A client cycling through model names: past its miss budget it is refused before anything is
loaded or evicted for it, while other clients keep being served (`mmctl up --miss-budget`)."""

from __future__ import annotations

import http.client
import json
import time

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from control_plane.demo.fleet import FleetSpec, customer_weights
from tests.product import Product
from tests.reference import mlp_scores

FEATURES = np.random.default_rng(11).standard_normal((1, 64)).astype(np.float32)
RATE = 0.1  # --miss-budget: a miss earned every 10 s
BURST = 1  # 10 s of the rate at once


@pytest.fixture(scope="module")
def product(tmp_path_factory):
    root = tmp_path_factory.mktemp("miss-budget")
    p = Product(root / "state", None, "--fleet-size", "16", "--max-loaded", "4",
                "--router-workers", "1", "--miss-budget", str(RATE),
                "--client-header", "x-client-id").start()
    assert p.mmctl("pin", "cust001").returncode == 0
    yield p
    p.stop()


def infer_http(product, model: str, client: str | None) -> requests.Response:
    body = {"inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32",
                        "data": FEATURES.ravel().tolist()}]}
    headers = {"x-client-id": client} if client else {}
    return requests.post(f"http://{product.json('endpoints')['router_http']}/v2/models/{model}/infer",
                         data=json.dumps(body), headers=headers, timeout=120)


def expected(model: str) -> list[float]:
    return mlp_scores(customer_weights(FleetSpec(), model), FEATURES).ravel().tolist()


def assert_served(answer: requests.Response, model: str) -> None:
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["outputs"][0]["data"], expected(model), rtol=1e-4, atol=1e-5)


def resident(product) -> set[str]:
    return {m["model"] for m in product.json("status") if m["state"] == "ready"}


def test_a_client_cycling_through_names_is_refused_past_its_budget(product):
    started = time.monotonic()
    answers = [(m, infer_http(product, m, "mallory")) for m in (f"cust{i:03d}" for i in range(2, 12))]
    earned = int((time.monotonic() - started) * RATE)  # misses the rate gave back meanwhile
    served = [(m, a) for m, a in answers if a.status_code == 200]
    refused = [a for _, a in answers if a.status_code == 429]
    codes = [a.status_code for _, a in answers]
    assert BURST <= len(served) <= BURST + earned and len(served) + len(refused) == len(answers), codes
    for model, answer in served:
        assert_served(answer, model)
    assert "mallory" in refused[0].json()["error"] and "budget" in refused[0].json()["error"]
    assert float(refused[0].headers["Retry-After"]) > 0
    refused_models = {m for m, a in answers if a.status_code == 429}
    assert not refused_models & resident(product)  # nothing was loaded for a refused request
    assert "cust001" in resident(product)
    # Over gRPC too, from the same client.
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(FEATURES)
    client = grpcclient.InferenceServerClient(product.json("endpoints")["router_grpc"])
    with pytest.raises(InferenceServerException, match="budget") as exc:
        client.infer("cust013", [x], headers={"x-client-id": "mallory"})
    assert "RESOURCE_EXHAUSTED" in str(exc.value.status())
    # Its hits are still served: only misses spend the budget.
    assert_served(infer_http(product, "cust001", "mallory"), "cust001")
    metrics = requests.get(f"http://{product.json('endpoints')['router_http']}/metrics", timeout=30).text
    refused_count = [line for line in metrics.splitlines()
                     if line.startswith("mmr_miss_budget_refused_total")]
    assert refused_count and float(refused_count[0].split()[-1]) >= len(refused) + 1


def test_other_clients_keep_their_own_budget_and_loopback_is_not_counted(product):
    assert_served(infer_http(product, "cust001", "alice"), "cust001")
    assert_served(infer_http(product, "cust014", "alice"), "cust014")  # her own miss
    for model in ("cust015", "cust016", "cust002", "cust003", "cust004", "cust005", "cust006"):
        assert_served(infer_http(product, model, None), model)  # a local tool, no header


def infer_forged(product, model: str, lines: list[str]) -> tuple[int, str]:
    """An inference call whose client header comes as ``lines``, in order (what a client's own
    line followed by the line a trusted proxy appends looks like); over HTTP for an even
    cust number, gRPC for an odd one.  Returns (HTTP status or 429 for RESOURCE_EXHAUSTED,
    the error), after checking a served answer."""
    endpoints = product.json("endpoints")
    if int(model[4:]) % 2 == 0:
        body = json.dumps({"inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32",
                                       "data": FEATURES.ravel().tolist()}]}).encode()
        conn = http.client.HTTPConnection(endpoints["router_http"], timeout=120)
        try:
            conn.putrequest("POST", f"/v2/models/{model}/infer")
            for line in lines:
                conn.putheader("x-client-id", line)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            answer = conn.getresponse()
            status, text = answer.status, answer.read().decode()
        finally:
            conn.close()
        if status == 200:
            np.testing.assert_allclose(json.loads(text)["outputs"][0]["data"], expected(model),
                                       rtol=1e-4, atol=1e-5)
            return status, ""
        return status, json.loads(text)["error"]
    request = service_pb2.ModelInferRequest(model_name=model)
    x = request.inputs.add(name="FEATURES", datatype="FP32")
    x.shape.extend([1, 64])
    request.raw_input_contents.append(FEATURES.tobytes())
    with grpc.insecure_channel(endpoints["router_grpc"]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            response = stub.ModelInfer(request, timeout=120,
                                       metadata=[("x-client-id", line) for line in lines])
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            return 429, exc.details()
    scores = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
    np.testing.assert_allclose(scores, expected(model), rtol=1e-4, atol=1e-5)
    return 200, ""


def test_a_client_header_line_of_its_own_before_the_proxys_gets_no_fresh_budget(product):
    # The attack: each call carries a new line of the client's own before the one a trusted
    # proxy appends ("eve", what it saw); only the proxy's last entry names the client.
    models = [m for m in (f"cust{i:03d}" for i in range(7, 13)) if m not in resident(product)]
    assert len(models) >= 4, resident(product)
    started = time.monotonic()
    answers = [(m, infer_forged(product, m, [f"forged-{i}", "eve"])) for i, m in enumerate(models)]
    earned = int((time.monotonic() - started) * RATE)
    codes = [status for _, (status, _) in answers]
    served = codes.count(200)
    assert BURST <= served <= BURST + earned and served + codes.count(429) == len(codes), codes
    errors = [error for _, (status, error) in answers if status == 429]
    assert all("eve" in e and "budget" in e and "forged" not in e for e in errors), errors
    refused_models = {m for m, (status, _) in answers if status == 429}
    assert not refused_models & resident(product)  # nothing was loaded for a refused request
