"""LoRA serving through a real tritonserver: tinylm and recommender_lora end to end.

One Triton for the module (free loopback ports), stopped in teardown.  Expected outputs come
from the same runtime in-process (``model_runtime.lora``) on the same files, so the test
checks the transport, batching and per-request errors, not just "something came back".
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as tritonclient_grpc
from tritonclient.utils import InferenceServerException

from control_plane.demo.lora import LoraDemoSpec, generate_lora_demo, write_demo_adapter
from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from model_runtime.lora.manifest import Manifest, write_manifest
from model_runtime.lora.models import load_recommender, load_tinylm
from model_runtime.lora.runtime import (
    LoraSettings,
    TextPayload,
    build_server,
    recommender_runner,
    tinylm_runner,
)
from model_runtime.lora.server import Job

pytestmark = [
    pytest.mark.integration,
]

LOAD_DELAY_S = 1.0  # recommender_lora's cold loads are slowed to make blocking observable


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    repository = root / "repository"
    spec = LoraDemoSpec(adapters=4, rank=8, parameters={"max_device_adapters": "2", "manifest_poll_s": "0.2"})
    generate_lora_demo(repository, spec)
    # recommender_lora gets the slow-cold-load test hook
    config = repository / "recommender_lora" / "config.pbtxt"
    config.write_text(config.read_text() + (
        f'parameters {{ key: "adapter_load_delay_s" value: {{ string_value: "{LOAD_DELAY_S}" }} }}\n'
    ))
    triton = TritonProcess(TritonLaunchConfig(repository=repository, work_dir=root / "work"))
    triton.start()
    try:
        client = tritonclient_grpc.InferenceServerClient(triton.grpc_url)
        client.load_model("tinylm")
        client.load_model("recommender_lora")
        yield {"repository": repository, "client": client, "triton": triton}
    finally:
        triton.stop()
        assert not triton.alive()


@pytest.fixture(scope="module")
def reference(demo):
    """The same model files served in-process: the expected answers."""
    repository = demo["repository"]
    servers = {}
    lm = load_tinylm(repository / "tinylm" / "1" / "weights.safetensors")
    settings = LoraSettings.from_parameters({"manifest_poll_s": "0"}, repository / "tinylm")
    servers["tinylm"] = build_server(lm, tinylm_runner(lm), settings, base_name="tinylm")
    mlp = load_recommender(repository / "recommender_lora" / "1" / "weights.safetensors")
    settings = LoraSettings.from_parameters({"manifest_poll_s": "0"}, repository / "recommender_lora")
    servers["recommender_lora"] = build_server(mlp, recommender_runner(mlp), settings, base_name="recommender_lora")
    yield servers
    for server in servers.values():
        server.close()


def expected(server, adapter, payload, rows):
    done = threading.Event()
    out = {}

    def reply(result, error):
        out["result"], out["error"] = result, error
        done.set()

    server.submit([Job(adapter, payload, reply, rows=rows)])
    assert done.wait(30) and out["error"] is None, out
    return out["result"]


def text_request(client, prompts, adapter=None, max_new_tokens=12, adapter_input=False, **kwargs):
    text = tritonclient_grpc.InferInput("TEXT", [len(prompts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[p] for p in prompts], dtype=object))
    inputs = [text]
    params = {"max_new_tokens": max_new_tokens}
    if adapter and adapter_input:
        a = tritonclient_grpc.InferInput("ADAPTER", [len(prompts), 1], "BYTES")
        a.set_data_from_numpy(np.array([[adapter.encode()]] * len(prompts), dtype=object))
        inputs.append(a)
    elif adapter:
        params["adapter"] = adapter
    return client.infer("tinylm", inputs, parameters=params, **kwargs)


def control(client, model, command):
    ctl = tritonclient_grpc.InferInput("ADAPTER_CONTROL", [1, 1], "BYTES")
    ctl.set_data_from_numpy(np.array([[json.dumps(command).encode()]], dtype=object))
    return json.loads(client.infer(model, [ctl]).as_numpy("ADAPTER_STATUS")[0, 0])


def by_name(status):
    return {a["name"]: a for a in status["adapters"]}


def test_tinylm_generates_the_reference_text_for_base_and_adapters(demo, reference):
    client = demo["client"]
    prompts = [b"hello", b"Triton serves LoRA"]
    outputs = {}
    for adapter in [None, "cust001", "cust002"]:
        got = text_request(client, prompts, adapter).as_numpy("GENERATED_TEXT").reshape(-1).tolist()
        want = expected(reference["tinylm"], adapter, TextPayload(prompts, [12, 12]), rows=2)
        assert got == want
        outputs[adapter] = got
    assert len({tuple(v) for v in outputs.values()}) == 3  # adapters change the text
    via_input = text_request(client, prompts, "cust001", adapter_input=True)
    assert via_input.as_numpy("GENERATED_TEXT").reshape(-1).tolist() == outputs["cust001"]


def test_concurrent_mixed_requests_and_an_unknown_adapter_failing_alone(demo, reference):
    client = demo["client"]
    names = [None, "cust001", "cust002", "cust003", "ghost"]
    before = client.get_inference_statistics("tinylm", as_json=True)["model_stats"][0]

    def call(name):
        try:
            return text_request(client, [b"mixed batch"], name, max_new_tokens=8).as_numpy("GENERATED_TEXT")
        except InferenceServerException as exc:
            return exc

    with ThreadPoolExecutor(len(names)) as pool:
        results = dict(zip(names, pool.map(call, names)))
    ghost = results.pop("ghost")
    assert isinstance(ghost, InferenceServerException)
    assert ghost.status() == "StatusCode.NOT_FOUND"
    assert "adapter 'ghost' not found for tinylm" in ghost.message()
    for name, got in results.items():
        want = expected(reference["tinylm"], name, TextPayload([b"mixed batch"], [8]), rows=1)
        assert got.reshape(-1).tolist() == want, name
    after = client.get_inference_statistics("tinylm", as_json=True)["model_stats"][0]
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) >= 4


def test_recommender_lora_scores_match_reference_per_adapter(demo, reference):
    client = demo["client"]
    features = np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32)
    for adapter in [None, "cust001", "cust002"]:
        f = tritonclient_grpc.InferInput("FEATURES", [3, 64], "FP32")
        f.set_data_from_numpy(features)
        params = {"adapter": adapter} if adapter else {}
        got = client.infer("recommender_lora", [f], parameters=params).as_numpy("SCORES")
        want = expected(reference["recommender_lora"], adapter, features, rows=3)
        assert got.shape == (3, 1)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_a_cold_load_does_not_block_resident_adapters(demo):
    client = demo["client"]
    assert control(client, "recommender_lora", {"op": "load", "adapter": "cust001"})
    features = np.ones((1, 64), np.float32)

    def timed(adapter):
        f = tritonclient_grpc.InferInput("FEATURES", [1, 64], "FP32")
        f.set_data_from_numpy(features)
        started = time.perf_counter()
        client.infer("recommender_lora", [f], parameters={"adapter": adapter})
        return time.perf_counter() - started

    with ThreadPoolExecutor(2) as pool:
        cold = pool.submit(timed, "cust004")  # not loaded yet: waits LOAD_DELAY_S on disk
        time.sleep(0.1)
        resident = pool.submit(timed, "cust001")
        resident_s, cold_s = resident.result(), cold.result()
    assert cold_s >= LOAD_DELAY_S
    assert resident_s < LOAD_DELAY_S / 2, (resident_s, cold_s)


def test_manifest_pin_through_sync_and_lru_around_it(demo):
    client = demo["client"]
    adapter_dir = demo["repository"] / "tinylm" / "adapters"
    write_manifest(adapter_dir, Manifest(generation=7, pinned=("cust003",)))
    status = control(client, "tinylm", {"op": "sync"})
    assert status["manifest_generation"] == 7
    assert by_name(status)["cust003"]["pinned"] and by_name(status)["cust003"]["tier"] == "device"
    for adapter in ["cust001", "cust002", "cust004", "cust001"]:
        text_request(client, [b"x"], adapter, max_new_tokens=2)
    status = control(client, "tinylm", {"op": "status"})
    tiers = {name: a["tier"] for name, a in by_name(status).items()}
    assert tiers["cust003"] == "device" and tiers["cust001"] == "device"  # 2 slots
    assert tiers["cust002"] == "host" and tiers["cust004"] == "host"
    assert status["device_slots_used"] == 2
    write_manifest(adapter_dir, Manifest(generation=8))
    deadline = time.monotonic() + 10
    while control(client, "tinylm", {"op": "status"})["manifest_generation"] != 8:  # the poll
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert not by_name(control(client, "tinylm", {"op": "status"}))["cust003"]["pinned"]


def test_bad_adapters_are_refused_with_the_reason_and_serving_goes_on(demo):
    client = demo["client"]
    adapter_dir = demo["repository"] / "tinylm" / "adapters"
    write_demo_adapter(adapter_dir, "recommender_lora", "wrongbase", rank=4)
    broken = write_demo_adapter(adapter_dir, "tinylm", "broken", rank=4)
    (broken / "adapter_config.json").write_text('{"r": "eight"}')
    for name, reason in [("wrongbase", "name no linear layer of tinylm"), ("broken", "'r' must be")]:
        with pytest.raises(InferenceServerException) as info:
            text_request(client, [b"x"], name)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert f"adapter {name!r} refused" in info.value.message() and reason in info.value.message()
    assert text_request(client, [b"still serving"], "cust001").as_numpy("GENERATED_TEXT").shape == (1, 1)
    status = by_name(control(client, "tinylm", {"op": "status"}))
    assert status["broken"]["tier"] == "refused" and "'r' must be" in status["broken"]["error"]


def test_bad_requests_get_invalid_argument(demo):
    client = demo["client"]
    a = tritonclient_grpc.InferInput("ADAPTER", [1, 1], "BYTES")
    a.set_data_from_numpy(np.array([[b"cust001"]], dtype=object))
    cases = [
        (lambda: client.infer("tinylm", [a]), "input TEXT is required"),
        (lambda: text_request(client, [b"x"], max_new_tokens=100000), "max_new_tokens (100000)"),
        (lambda: text_request(client, [b"x"], "../etc"), "adapter name '../etc' is invalid"),
        (lambda: control(client, "tinylm", {"op": "explode"}), "op in"),
    ]
    for call, words in cases:
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
        assert words in info.value.message()
