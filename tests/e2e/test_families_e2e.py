"""The demo fleet as a model family, driven as a person does: `mmctl up` on its defaults,
unmodified Triton clients through the router, mmctl for pins, experiments and shadows."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from safetensors.torch import save_file

from control_plane.demo.fleet import FleetSpec, customer_weights
from tests.product import Product
from tests.reference import mlp_scores

pytestmark = pytest.mark.integration

FEATURES = np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(3, 64)


def reference_scores(name: str) -> np.ndarray:
    """What the customer's own model answers: its weights in the recommender MLP."""
    return mlp_scores(customer_weights(FleetSpec(), name), FEATURES)


def grpc_infer(url: str, model: str, user: str | None = None):
    client = grpcclient.InferenceServerClient(url)
    x = grpcclient.InferInput("FEATURES", list(FEATURES.shape), "FP32")
    x.set_data_from_numpy(FEATURES)
    result = client.infer(model, [x], headers={"x-user-id": user} if user else None)
    return result.as_numpy("SCORES"), result.get_response()


@pytest.fixture
def product(tmp_path):
    p = Product(tmp_path / "state", None, "--fleet-size", "6", "--max-loaded", "3",
                "--policy", "lru").start()
    yield p
    p.stop()
    p.assert_no_triton_left()


def test_the_demo_family_serves_every_variant_by_name_through_the_router(product):
    endpoints = product.json("endpoints")
    grpc_url, http_url = endpoints["router_grpc"], endpoints["router_http"]
    status = {m["model"]: m for m in product.json("status")}
    assert {f"cust00{i}" for i in range(1, 7)} <= set(status)
    assert "recommender" not in status  # the family model is the product's, not a model

    # Misses round-robin through more variants than slots: every answer is the customer's own.
    for name in ["cust001", "cust002", "cust003", "cust004", "cust005", "cust001", "cust006"]:
        scores, response = grpc_infer(grpc_url, name)
        np.testing.assert_allclose(scores, reference_scores(name), rtol=1e-5, atol=1e-6)
        # A variant answers as a model of its own: Triton's answer, no family or slot in it.
        assert response.model_name == name and not response.parameters
    ready = {m["model"] for m in product.json("status") if m["state"] == "ready"}
    assert len(ready) <= 3 and "cust006" in ready

    # Pinned variants keep their slots through the thrash.
    assert product.mmctl("pin", "cust002").returncode == 0
    for name in ["cust003", "cust004", "cust005", "cust001"]:
        grpc_infer(grpc_url, name)
    assert next(m for m in product.json("status") if m["model"] == "cust002")["state"] == "ready"

    # Metadata and config describe the variant as a model of its own, loaded or not.
    client = grpcclient.InferenceServerClient(grpc_url)
    for name in ("cust002", "cust006"):
        metadata = client.get_model_metadata(name)
        assert metadata.name == name
        assert [o.name for o in metadata.outputs] == ["SCORES"]
        config = client.get_model_config(name).config
        assert config.name == name and [o.name for o in config.output] == ["SCORES"]
        assert "mms_family_slots" not in config.parameters
    assert client.is_model_ready("cust002") and not client.is_model_ready("cust999")

    # HTTP, unmodified.
    http = httpclient.InferenceServerClient(http_url)
    x = httpclient.InferInput("FEATURES", list(FEATURES.shape), "FP32")
    x.set_data_from_numpy(FEATURES)
    result = http.infer("cust003", [x])
    np.testing.assert_allclose(result.as_numpy("SCORES"), reference_scores("cust003"), rtol=1e-5, atol=1e-6)
    assert http.get_model_metadata("cust003")["outputs"] == [
        {"name": "SCORES", "datatype": "FP32", "shape": [-1, 1]}]

    # Slot control is model control: refused on the public port, over gRPC and HTTP.
    refused = requests.post(f"http://{http_url}/v2/models/cust003/infer", timeout=10, json={
        "parameters": {"mms_family_control": '{"op": "status"}'},
        "inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]})
    assert refused.status_code == 403 and "model control" in refused.text
    with pytest.raises(Exception, match="PERMISSION_DENIED"):
        grpcclient.InferenceServerClient(grpc_url).infer(
            "cust003", [grpcclient.InferInput("FEATURES", [1, 64], "FP32").set_data_from_numpy(
                np.zeros((1, 64), np.float32))], parameters={"mms_family_control": "{}"})
    # Nor may a client name the variant a family model answers for: another variant's weights
    # would answer under this name, past that variant's routes and limits.
    for model in ("cust003", "recommender"):
        crossed = requests.post(f"http://{http_url}/v2/models/{model}/infer", timeout=10, json={
            "parameters": {"mms_variant": "cust004"},
            "inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]})
        assert crossed.status_code == 400 and "set by the router" in crossed.text, crossed.text
    with pytest.raises(Exception, match="INVALID_ARGUMENT"):
        grpcclient.InferenceServerClient(grpc_url).infer(
            "cust003", [grpcclient.InferInput("FEATURES", [1, 64], "FP32").set_data_from_numpy(
                np.zeros((1, 64), np.float32))], parameters={"mms_variant": "cust004"})

    # A wrong shape is Triton's own answer, about the variant the client named.
    bad = grpcclient.InferInput("FEATURES", [1, 32], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 32), np.float32))
    with pytest.raises(Exception, match="for model 'cust003'"):
        client.infer("cust003", [bad])

    metrics = requests.get(product.url + "/metrics", timeout=5).text
    assert 'mms_loads_total{result="ok",server="triton0"}' in metrics

    # One cache per server: with the family's variants in all three places (one pinned), a
    # model of the user's own and a LoRA base load beside it, evicting the least recently
    # used variants, and everything answers its own values.
    root = Path(__file__).resolve().parents[1]
    out = product.mmctl("registry", "add", "simple", "--from-dir", str(root / "fixtures" / "models" / "simple"))
    assert out.returncode == 0, out.stderr
    out = product.mmctl("load", "simple")
    assert out.returncode == 0, out.stdout + out.stderr
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    out = product.mmctl("adapter", "add", "acme", "--base", "tinylm", "--path",
                        str(root / "fixtures" / "adapters" / "acme"))
    assert out.returncode == 0, out.stdout + out.stderr
    out = product.mmctl("load", "tinylm:acme")
    assert out.returncode == 0, out.stdout + out.stderr
    status = {m["model"]: m for m in product.json("status")}
    assert status["tinylm"]["state"] == "ready" and status["cust002"]["state"] == "ready"
    for name in ("cust002", "cust005"):
        scores, _response = grpc_infer(grpc_url, name)
        np.testing.assert_allclose(scores, reference_scores(name), rtol=1e-5, atol=1e-6)


def test_ab_tests_and_shadows_work_on_variant_names(product):
    grpc_url = product.json("endpoints")["router_grpc"]
    created = product.mmctl("experiment", "create", "ab", "--control", "cust001", "--treatment",
                            "cust002", "--treatment-percent", "50", "--sticky")
    assert created.returncode == 0, created.stderr
    seen = {}
    for user in [f"user{i}" for i in range(24)]:
        scores, response = grpc_infer(grpc_url, "cust001", user=user)
        model = response.parameters["model"].string_param
        np.testing.assert_allclose(scores, reference_scores(model), rtol=1e-5, atol=1e-6)
        seen.setdefault(model, set()).add(user)
        again, _ = grpc_infer(grpc_url, "cust001", user=user)  # sticky
        np.testing.assert_allclose(again, scores)
    assert set(seen) == {"cust001", "cust002"}
    assert product.mmctl("experiment", "delete", "ab").returncode == 0

    assert product.mmctl("shadow", "start", "cust003", "--model", "cust004", "--percent", "100").returncode == 0
    # A busy router sheds mirrors (by design: the primaries come first; a CI run shed 3 of
    # 10), so requests go on until 10 mirrors were compared, at most 40 of them.
    sent, deadline = 0, time.monotonic() + 30
    while True:  # workers report every 0.25 s
        if sent < 40:
            scores, response = grpc_infer(grpc_url, "cust003")
            np.testing.assert_allclose(scores, reference_scores("cust003"), rtol=1e-5, atol=1e-6)
            sent += 1
        report = product.json("shadow", "report", "cust003")
        if report.get("compared", 0) >= 10 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # The shadow ran on cust004's own weights: every answer differs from cust003's.
    assert report["errors"] == 0 and report["compared"] >= 10, report
    assert report["diverged"] == report["compared"], report


SCALER = Path(__file__).resolve().parents[1] / "fixtures" / "families" / "scaler"
SCALERS = {"acme": (2.0, 1.0), "globex": (3.0, -1.0), "initech": (-1.0, 0.5)}


def scaler_file(path: Path, scale: float, shift: float, length: int = 4) -> Path:
    save_file({"scale": torch.full((length,), scale), "shift": torch.full((4,), shift)}, str(path))
    return path


def scaler_infer(url: str, name: str) -> np.ndarray:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    inp = grpcclient.InferInput("INPUT0", [2, 4], "FP32")
    inp.set_data_from_numpy(x)
    return grpcclient.InferenceServerClient(url).infer(name, [inp]).as_numpy("OUTPUT0")


def scaler_expected(name: str) -> np.ndarray:
    scale, shift = SCALERS[name]
    return np.arange(8, dtype=np.float32).reshape(2, 4) * scale + shift


def test_a_users_family_is_added_and_its_variants_registered_with_mmctl(tmp_path):
    state = tmp_path / "state"
    p = Product(state, None, "--fleet-size", "0", "--max-loaded", "2").start()
    try:
        base = scaler_file(tmp_path / "base.safetensors", 1.0, 0.0)
        added = p.mmctl("family", "add", "scaler", "--from-dir", str(SCALER), "--weights", str(base))
        assert added.returncode == 0, added.stderr
        for name, (scale, shift) in SCALERS.items():
            out = p.mmctl("registry", "add", name, "--family", "scaler", "--weights",
                          str(scaler_file(tmp_path / f"{name}.safetensors", scale, shift)))
            assert out.returncode == 0, out.stderr
            assert f"{name}.v1" in out.stdout and "production" in out.stdout

        # Bad input: a clear error, exit 2, nothing registered.
        wrong = p.mmctl("registry", "add", "wrong", "--family", "scaler", "--weights",
                        str(scaler_file(tmp_path / "wrong.safetensors", 1.0, 0.0, length=5)))
        assert wrong.returncode == 2 and "do not match family scaler: scale is F32[5]" in wrong.stderr
        truncated = tmp_path / "truncated.safetensors"
        truncated.write_bytes((tmp_path / "acme.safetensors").read_bytes()[:-5])
        cut = p.mmctl("registry", "add", "cut", "--family", "scaler", "--weights", str(truncated))
        assert cut.returncode == 2 and "truncated" in cut.stderr
        unknown = p.mmctl("registry", "add", "stray", "--family", "nosuch", "--weights", str(base))
        assert unknown.returncode == 2 and "unknown model family 'nosuch'" in unknown.stderr
        names = {v["model"] for v in p.json("registry", "list")}
        assert names == set(SCALERS)

        url = p.json("endpoints")["router_grpc"]
        for name in ["acme", "globex", "initech", "acme"]:  # three variants, two slots
            np.testing.assert_allclose(scaler_infer(url, name), scaler_expected(name))
        families = p.json("family", "list")
        assert families[0]["family"] == "scaler" and families[0]["variants"] == [
            "acme.v1", "globex.v1", "initech.v1"]
        assert families[0]["servers"]["triton0"]["slots"] == 2
    finally:
        p.stop()
        p.assert_no_triton_left()

    # A clean stop empties the tmpfs warm tier: the family comes back from the cold store.
    p = Product(state, None, "--fleet-size", "0", "--max-loaded", "2").start()
    try:
        url = p.json("endpoints")["router_grpc"]
        np.testing.assert_allclose(scaler_infer(url, "globex"), scaler_expected("globex"))
    finally:
        p.stop()
        p.assert_no_triton_left()


def test_canaries_and_rate_limits_work_on_variant_names(tmp_path):
    """A canary from one variant of the family to another is promoted with no client error;
    a rate limit on a variant refuses its overflow only."""
    p = Product(tmp_path / "state", None, "--fleet-size", "6", "--max-loaded", "3").start()
    try:
        url = p.json("endpoints")["router_grpc"]
        grpc_infer(url, "cust003")  # the baseline is loaded; the candidate starts cold
        started = p.mmctl("canary", "start", "cust003", "--to", "cust004", "--stages", "50,100",
                          "--stage-seconds", "6", "--check-interval", "0.3", "--min-requests", "5")
        assert started.returncode == 0, started.stderr
        # Anonymous requests are split at random: at 50% for 6 s both variants answer some
        # (2 s on a busy machine, with requests taking 200-400 ms, twice gave every one to
        # cust004: 1 in 2^(n-1) for n requests).
        served_by, deadline = set(), time.monotonic() + 90
        while p.json("canary", "status", "cust003")["status"] == "running":
            assert time.monotonic() < deadline, p.json("canary", "status", "cust003")["history"][-3:]
            scores, response = grpc_infer(url, "cust003")  # any error fails the test
            model = response.parameters["model"].string_param
            np.testing.assert_allclose(scores, reference_scores(model), rtol=1e-5, atol=1e-6)
            served_by.add(model)
        assert served_by == {"cust003", "cust004"}
        status = p.json("canary", "status", "cust003")
        assert status["status"] == "promoted" and status["serving"] == "cust004"

        grpc_infer(url, "cust005")
        assert p.mmctl("limit", "set", "cust005", "--qps", "0.5", "--burst", "3").returncode == 0
        outcomes = []
        for _ in range(6):
            try:
                grpc_infer(url, "cust005")
                outcomes.append("ok")
            except Exception as exc:  # noqa: BLE001  (the refusals are what is counted)
                assert "RESOURCE_EXHAUSTED" in str(exc)
                outcomes.append("limited")
        assert outcomes.count("ok") == 3 and outcomes.count("limited") == 3, outcomes
        grpc_infer(url, "cust006")  # another variant of the family is unaffected
    finally:
        p.stop()
        p.assert_no_triton_left()
