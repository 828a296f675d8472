"""Through the router a client sees Triton: the same requests sent to a real tritonserver
directly and through `mmctl up` get the same status codes and the same message texts, and
every answer carries the name (and version) the client asked for.

The model is tests/fixtures/models/simple (Triton's add_sub shape).  Direct: one Triton
with ``simple`` loaded and ``cold`` (the same model under another name) not loaded.  Through
the router: ``simple`` has registry versions 1 (the repository folder ``simple``, retired
when version 2 was promoted), 2 (concrete ``simple.v2``, production) and 3 (``simple.v3``,
registered); ``cold`` is registered and never loaded.
"""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from tests.product import Product

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "simple"
CLIENTS = {"grpc": grpcclient, "http": httpclient}


def copy_model(dest: Path, name: str) -> Path:
    folder = dest / name
    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("README.md", "__pycache__"))
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "simple"', f'name: "{name}"'))
    return folder


class Side:
    """One way to reach the models: Triton directly, or the router."""

    def __init__(self, grpc_url: str, http_url: str):
        self.urls = {"grpc": grpc_url, "http": http_url}
        self.grpc = grpcclient.InferenceServerClient(grpc_url)
        self.http = httpclient.InferenceServerClient(http_url)

    def client(self, protocol: str):
        return self.grpc if protocol == "grpc" else self.http

    def get(self, path: str) -> requests.Response:
        return requests.get(f"http://{self.urls['http']}{path}", timeout=60)

    def close(self) -> None:
        """Close the clients' connections (Triton waits for open HTTP connections to close
        before it stops, up to its exit timeout)."""
        self.grpc.close()
        self.http.close()


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    direct_repo = root / "direct"
    copy_model(direct_repo, "simple")
    copy_model(direct_repo, "cold")
    triton = TritonProcess(TritonLaunchConfig(repository=direct_repo, work_dir=root / "triton"))
    triton.start()
    product_repo = root / "repository"
    copy_model(product_repo, "simple")
    copy_model(product_repo, "cold")
    # Room for two models: simple's versions 2 and 3 fill it, so a public call that loaded
    # the cold model would have to evict one of them.
    product = Product(root / "state", product_repo, "--max-loaded", "2")
    try:
        product.start()
        source = copy_model(root / "source", "simple")
        out = product.mmctl("registry", "add", "simple", "--from-dir", str(source))
        assert out.returncode == 0, out.stdout + out.stderr
        out = product.mmctl("registry", "promote", "simple", "--version", "2", "--stage", "production")
        assert out.returncode == 0, out.stdout + out.stderr
        out = product.mmctl("registry", "add", "simple", "--from-dir", str(source))
        assert out.returncode == 0 and "simple version 3, registered" in out.stdout, out.stdout + out.stderr
        endpoints = product.json("endpoints")
        direct = Side(triton.grpc_url, triton.http_url)
        direct.grpc.load_model("simple")
        routed = Side(endpoints["router_grpc"], endpoints["router_http"])
        routed.product = product
        assert infer(routed, "grpc", "simple")[0] == "OK"  # loads simple.v2
        yield direct, routed
        direct.close()
        routed.close()
    finally:
        product.stop()
        triton.stop()


def inputs(module, names=("INPUT0", "INPUT1"), shape=(16,), datatype="INT32"):
    out = []
    for i, name in enumerate(names):
        tensor = module.InferInput(name, list(shape), datatype)
        tensor.set_data_from_numpy(np.full(shape, i + 2, dtype=np.int32 if datatype == "INT32" else np.float32))
        out.append(tensor)
    return out


def outcome(call, *args, **kwargs):
    """("OK", result) or (status, message) of a tritonclient call."""
    try:
        return "OK", call(*args, **kwargs)
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()


def infer(side: Side, protocol: str, model: str, version: str = "", **kw):
    return outcome(side.client(protocol).infer, model, inputs(CLIENTS[protocol], **kw),
                   model_version=version)


def loaded(product) -> set[str]:
    return {m["model"] for m in product.json("status") if m["state"] == "ready"}


ERROR_CASES = {
    "unknown model": {"model": "nosuch"},
    "unknown model with a version": {"model": "nosuch", "version": "1"},
    "unknown version": {"model": "simple", "version": "7"},
    "version 0": {"model": "simple", "version": "0"},
    "version out of range": {"model": "simple", "version": "99999999999999999999"},
    "wrong shape": {"model": "simple", "shape": (15,)},
    "wrong datatype": {"model": "simple", "datatype": "FP32"},
    "wrong input name": {"model": "simple", "names": ("INPUT0", "WRONG")},
    "missing input": {"model": "simple", "names": ("INPUT0",)},
    "internal concrete name": {"model": "simple.v2"},
    "invalid name": {"model": "a..b"},
}
GRPC_ONLY_VERSIONS = ("abc", "-1", "1a")  # HTTP: a path Triton does not route (404 below)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_infer_errors_match_triton(sides, protocol, case):
    direct, routed = sides
    want = infer(direct, protocol, **ERROR_CASES[case])
    got = infer(routed, protocol, **ERROR_CASES[case])
    assert want[0] != "OK", want
    assert got == want


@pytest.mark.parametrize("version", GRPC_ONLY_VERSIONS)
def test_grpc_non_numeric_versions_are_refused_on_every_call(sides, version):
    direct, routed = sides
    calls = (lambda c: c.infer("simple", inputs(grpcclient), model_version=version),
             lambda c: c.is_model_ready("simple", version),
             lambda c: c.get_model_metadata("simple", version),
             lambda c: c.get_model_config("simple", version),
             lambda c: c.get_inference_statistics("simple", version))
    for call in calls:
        want = outcome(call, direct.grpc)
        got = outcome(call, routed.grpc)
        if version == "1a":  # std::stol reads "1a" as 1: Triton serves it, the router refuses it
            assert got[0] == "StatusCode.INVALID_ARGUMENT" and "'1a'" in got[1], got
        else:
            assert got == want and want[0] == "StatusCode.INVALID_ARGUMENT"


@pytest.mark.parametrize("path", [
    "/v2/models/simple/versions/abc", "/v2/models/simple/versions/abc/ready",
    "/v2/models/simple/versions/-1/config", "/v2/models/simple/versions/x1/stats",
    "/v2/models/simple/versions/99999999999999999999", "/v2/models/simple/versions/7",
    "/v2/models/simple/versions/7/config", "/v2/models/simple/versions/7/stats",
    "/v2/models/nosuch", "/v2/models/nosuch/config", "/v2/models/nosuch/stats",
    "/v2/models/nosuch/ready", "/v2/models/cold/ready", "/v2/models/cold/stats",
    "/v2/models/simple.v2", "/v2/models/simple.v2/ready",
])
def test_http_status_and_body_match_triton(sides, path):
    direct, routed = sides
    want, got = direct.get(path), routed.get(path)
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    assert want.status_code >= 400


def test_numbers_of_thousands_of_digits_are_refused_as_triton_refuses_them(sides):
    """A version or header length past Python's 4,300-digit int() limit was a 500 (HTTP) and
    UNKNOWN (gRPC) with a traceback logged per request; Triton refuses both as invalid."""
    direct, routed = sides
    digits = "1" * 5000
    want, got = (side.get(f"/v2/models/simple/versions/{digits}/ready") for side in (direct, routed))
    # Triton answers 400 ("failed to get model version"), and now and then 404 when its path
    # matching gives up on a path this long (seen with requests from several threads at once,
    # never one at a time): the router always answers Triton's 400.
    assert got.status_code == 400 and want.status_code in (400, 404), (got.status_code, got.text[:200])
    assert "failed to get model version" in got.text
    assert len(got.text) < 500
    for call in (lambda c: c.is_model_ready("simple", digits),
                 lambda c: c.infer("simple", inputs(grpcclient), model_version=digits)):
        want, got = outcome(call, direct.grpc), outcome(call, routed.grpc)
        assert got[0] == want[0] == "StatusCode.INVALID_ARGUMENT", got
    for side in (direct, routed):
        resp = requests.post(f"http://{side.urls['http']}/v2/models/simple/infer", data=b"{}",
                             headers={"Inference-Header-Content-Length": digits}, timeout=60)
        assert resp.status_code == 400, (side, resp.status_code, resp.text[:200])


def test_a_float_request_parameter_is_served_as_triton_serves_it(sides):
    """Triton takes a float request parameter (HTTP JSON; gRPC double_param) and passes it on
    to the model; the router refused it over HTTP ('It should be either int, bool, or
    string')."""
    direct, routed = sides
    body = {"parameters": {"key1": 123.123}, "inputs": [
        {"name": "INPUT0", "shape": [16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [16], "datatype": "INT32", "data": [3] * 16}]}
    answers = [requests.post(f"http://{side.urls['http']}/v2/models/simple/infer", json=body,
                             timeout=60) for side in (direct, routed)]
    assert [a.status_code for a in answers] == [200, 200], [a.text[:300] for a in answers]
    for answer in answers:
        sums = next(o for o in answer.json()["outputs"] if o["name"] == "OUTPUT0")["data"]
        assert sums == [v + 3 for v in range(16)]
    for protocol in ("grpc", "http"):
        got = [outcome(side.client(protocol).infer, "simple", inputs(CLIENTS[protocol]),
                       parameters={"key1": 123.123})[0] for side in (direct, routed)]
        assert got == ["OK", "OK"], (protocol, got)


def test_http_non_numeric_version_on_infer_is_not_routed(sides):
    direct, routed = sides
    for side in (direct, routed):
        resp = requests.post(f"http://{side.urls['http']}/v2/models/simple/versions/abc/infer",
                             json={"inputs": []}, timeout=60)
        assert (resp.status_code, resp.json()) == (404, {"error": "Not Found"})


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_readiness_matches_triton_and_a_cold_model_is_not_ready(sides, protocol):
    direct, routed = sides
    for model, version in (("simple", ""), ("simple", "7"), ("simple", "0"), ("cold", ""),
                           ("nosuch", ""), ("nosuch", "1"), ("simple.v2", ""), ("a..b", "")):
        want = outcome(direct.client(protocol).is_model_ready, model, version)
        got = outcome(routed.client(protocol).is_model_ready, model, version)
        assert got == want, (model, version)
    assert outcome(routed.client(protocol).is_model_ready, "cold") == ("OK", False)
    assert "cold" not in loaded(routed.product)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_statistics_errors_match_triton(sides, protocol):
    direct, routed = sides
    for model, version in (("nosuch", ""), ("cold", ""), ("simple", "7"), ("simple.v2", "")):
        want = outcome(direct.client(protocol).get_inference_statistics, model, version)
        got = outcome(routed.client(protocol).get_inference_statistics, model, version)
        assert got == want and want[0] != "OK", (model, version)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_metadata_and_config_errors_match_triton(sides, protocol):
    direct, routed = sides
    for model, version in (("nosuch", ""), ("simple", "7"), ("simple.v2", ""), ("nosuch", "2")):
        for method in ("get_model_metadata", "get_model_config"):
            want = outcome(getattr(direct.client(protocol), method), model, version)
            got = outcome(getattr(routed.client(protocol), method), model, version)
            assert got == want and want[0] != "OK", (method, model, version)


def test_responses_carry_the_asked_name_and_registry_version(sides):
    _direct, routed = sides
    for protocol in ("grpc", "http"):
        for version, served in (("", "2"), ("2", "2"), ("3", "3")):
            status, result = infer(routed, protocol, "simple", version)
            assert status == "OK", result
            response = result.get_response()
            if protocol == "grpc":
                name, got_version = response.model_name, response.model_version
                model_param = response.parameters["model"].string_param
            else:
                name, got_version = response["model_name"], response["model_version"]
                model_param = response["parameters"]["model"]
            assert (name, got_version, model_param) == ("simple", served, "simple")
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full(16, 5, np.int32))
        # A retired version is not served: Triton's answer for a version it does not have.
        assert infer(routed, protocol, "simple", "1")[1] == \
            "Request for unknown model: 'simple' version 1 is not found"
    g, h = routed.grpc, routed.http
    meta = g.get_model_metadata("simple")
    assert (meta.name, list(meta.versions)) == ("simple", ["2"])
    assert h.get_model_metadata("simple")["versions"] == ["2"]
    assert h.get_model_metadata("simple", "3")["versions"] == ["3"]
    assert g.get_model_config("simple").config.name == "simple"
    assert h.get_model_config("simple", "2")["name"] == "simple"
    stats = g.get_inference_statistics("simple").model_stats
    assert [(s.name, s.version) for s in stats] == [("simple", "2")]
    stats = h.get_inference_statistics("simple", "2")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("simple", "2")]
    assert "simple.v2" not in routed.get("/v2/models/simple/stats").text


def test_every_model_statistics_list_public_names_only(sides):
    """Statistics with no model named (Triton: every loaded model)."""
    _direct, routed = sides
    assert infer(routed, "grpc", "simple")[0] == "OK"
    grpc_stats = {(s.name, s.version) for s in routed.grpc.get_inference_statistics("").model_stats}
    http_stats = {(s["name"], s["version"]) for s in routed.http.get_inference_statistics("")["model_stats"]}
    assert ("simple", "2") in grpc_stats and grpc_stats == http_stats
    assert not [name for name, _ in grpc_stats if name.startswith("simple.")]


def test_error_texts_name_the_asked_model_not_the_internal_one(sides):
    _direct, routed = sides
    for protocol in ("grpc", "http"):
        _status, message = infer(routed, protocol, "simple", shape=(15,))
        assert "'simple'" in message and "simple.v2" not in message, message
    results = []
    routed.grpc.start_stream(callback=lambda result, error: results.append(error))
    try:
        routed.grpc.async_stream_infer("simple", inputs(grpcclient, shape=(15,)))
        routed.grpc.async_stream_infer("nosuch", inputs(grpcclient))
    finally:
        routed.grpc.stop_stream()
    messages = [str(e) for e in results]
    assert len(messages) == 2 and "simple.v2" not in " ".join(messages), messages
    assert "Request for unknown model: 'nosuch' is not found" in messages[1]


def test_cold_model_metadata_comes_from_its_config_without_loading(sides):
    direct, routed = sides
    product = routed.product
    assert infer(routed, "grpc", "simple", "3")[0] == "OK"  # two versions loaded: no room left
    assert loaded(product) == {"simple.v2", "simple.v3"}
    for protocol in ("grpc", "http"):
        client = routed.client(protocol)
        assert outcome(client.is_model_ready, "cold") == ("OK", False)
        meta = client.get_model_metadata("cold", as_json=True) if protocol == "grpc" else client.get_model_metadata("cold")
        want = direct.client(protocol).get_model_metadata("simple", as_json=True) if protocol == "grpc" \
            else direct.http.get_model_metadata("simple")
        assert meta == dict(want, name="cold"), protocol
        # The configuration as the file says it (Triton adds its defaults when it loads one).
        config = client.get_model_config("cold", as_json=True) if protocol == "grpc" else client.get_model_config("cold")
        want = direct.client(protocol).get_model_config("simple", as_json=True) if protocol == "grpc" \
            else direct.http.get_model_config("simple")
        if protocol == "grpc":
            config, want = config["config"], want["config"]
        assert config["name"] == "cold"
        for key in ("backend", "input", "output", "model_warmup"):
            assert config[key] == want[key], (protocol, key)
        assert config.get("max_batch_size", 0) == want.get("max_batch_size", 0)
        assert outcome(client.get_inference_statistics, "cold")[0] != "OK"
    # Nothing was loaded for these calls, and nothing was evicted.
    assert loaded(product) == {"simple.v2", "simple.v3"}


def test_unknown_names_create_no_metric_series(sides):
    _direct, routed = sides
    names = [f"probe{uuid.uuid4().hex[:12]}" for _ in range(6)]
    routed.get(f"/v2/models/{names[0]}")
    routed.get(f"/v2/models/{names[1]}/ready")
    routed.get(f"/v2/models/{names[2]}/config")
    outcome(routed.grpc.get_model_metadata, names[3])
    infer(routed, "grpc", names[4])
    infer(routed, "http", names[5])
    outcome(routed.grpc.get_inference_statistics, names[0])
    text = routed.get("/metrics").text + requests.get(routed.product.url + "/metrics", timeout=30).text
    assert not [n for n in names if n in text]


def test_concrete_names_are_not_public(sides):
    direct, routed = sides
    # simple.v2 is loaded and serves "simple", yet by its own name it does not exist.
    assert "simple.v2" in loaded(routed.product)
    for protocol in ("grpc", "http"):
        want = infer(direct, protocol, "simple.v2")
        assert infer(routed, protocol, "simple.v2") == want
        assert re.match(r"(404|StatusCode.NOT_FOUND)$", want[0]) and "'simple.v2' is not found" in want[1]
        assert outcome(routed.client(protocol).is_model_ready, "simple.v2") == ("OK", False)


def test_official_example_client_expectations(sides):
    """What Triton's example clients (simple_{grpc,http}_health_metadata, *_infer_client)
    check, against the router."""
    _direct, routed = sides
    for protocol in ("grpc", "http"):
        client = routed.client(protocol)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
        server = client.get_server_metadata()
        assert (server.name if protocol == "grpc" else server["name"]) == "triton"
        meta = client.get_model_metadata("simple")
        assert (meta.name if protocol == "grpc" else meta["name"]) == "simple"
        config = client.get_model_config("simple")
        assert (config.config.name if protocol == "grpc" else config["name"]) == "simple"
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("wrong_model_name")
        assert "Request for unknown model" in info.value.message()
        stats = client.get_inference_statistics(model_name="simple")
        assert len(stats.model_stats if protocol == "grpc" else stats["model_stats"]) == 1
        with pytest.raises(InferenceServerException) as info:
            client.infer("wrong_model_name", inputs(CLIENTS[protocol]))
        assert info.value.message().startswith("Request for unknown model")


def test_expose_versions_makes_concrete_names_callable_as_triton_names_them(tmp_path):
    """`mmctl up --expose-versions`: concrete names answer as Triton names them (its own
    version), beside the logical names."""
    repository = tmp_path / "repository"
    copy_model(repository, "simple")
    product = Product(tmp_path / "state", repository, "--expose-versions").start()
    try:
        out = product.mmctl("registry", "add", "simple", "--from-dir", str(copy_model(tmp_path / "src", "simple")))
        assert out.returncode == 0 and "simple version 2, registered" in out.stdout, out.stdout + out.stderr
        endpoints = product.json("endpoints")
        routed = Side(endpoints["router_grpc"], endpoints["router_http"])
        for protocol in ("grpc", "http"):
            status, result = infer(routed, protocol, "simple.v2")
            assert status == "OK", result
            response = result.get_response()
            name, version = ((response.model_name, response.model_version) if protocol == "grpc"
                             else (response["model_name"], response["model_version"]))
            assert (name, version) == ("simple.v2", "1")  # Triton's own version of that model
            status, result = infer(routed, protocol, "simple.v2", "1")
            assert status == "OK", result
            assert infer(routed, protocol, "simple", "2")[0] == "OK"  # logical names as ever
    finally:
        product.stop()
