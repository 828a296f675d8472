"""LoRA adapters end to end: `mmctl up` (tritonserver + control plane + router) as a child
process, adapters driven with `mmctl adapter ...`, inference through the router with
``base:adapter`` names compared with the same request sent straight to Triton."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from control_plane.demo.lora import LoraDemoSpec, write_demo_adapter, write_lora_model
from model_runtime.lora.models import TinyLMConfig
from tests.product import Product

pytestmark = [
    pytest.mark.integration,
]

SPEC = LoraDemoSpec(
    tinylm=TinyLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64),
    parameters={"max_device_adapters": "2", "manifest_poll_s": "0.2"},
)
PROMPTS = [b"hello", b"LoRA on Triton"]


@pytest.fixture(scope="module")
def product(fleet_template, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    repo = root / "repository"
    shutil.copytree(fleet_template, repo)
    write_lora_model(repo, "tinylm", SPEC)
    write_lora_model(repo, "recommender_lora", SPEC)
    write_demo_adapter(repo / "tinylm" / "adapters", "tinylm", "cust001", rank=4, spec=SPEC)
    # A twin of tinylm (the same base weights) with the same acme: a shadow that must agree.
    write_lora_model(repo, "tinylm", SPEC, name="tinylm2")
    write_demo_adapter(repo / "tinylm2" / "adapters", "tinylm", "acme", rank=8, spec=SPEC)
    src = root / "uploads"
    for name in ("acme", "globex"):
        write_demo_adapter(src, "tinylm", name, rank=8, spec=SPEC)
    write_demo_adapter(src, "recommender_lora", "wrongbase", rank=4, spec=SPEC)
    broken = write_demo_adapter(src, "tinylm", "broken", rank=4, spec=SPEC)
    (broken / "adapter_config.json").write_text('{"r": "eight"}')
    p = Product(root / "state", repo, "--max-loaded", "8").start()
    p.endpoints = p.json("endpoints")
    p.src = src
    yield p
    p.stop()
    deadline = time.monotonic() + 20  # Triton exits after its parent, not with it
    while p.triton_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not p.triton_pids(), "tritonserver was left running"


def generate(client, model, prompts=PROMPTS, **params):
    text = grpcclient.InferInput("TEXT", [len(prompts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[p] for p in prompts], dtype=object))
    return client.infer(model, [text], parameters={"max_new_tokens": 8, **params})


def router_client(p) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(p.endpoints["router_grpc"])


def triton_client(p) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(p.endpoints["triton"][0]["grpc"])


def adapters(p, base="tinylm") -> dict[str, dict]:
    return {a["name"]: a for a in p.json("adapter", "list", base)["adapters"]}


def test_add_validates_and_refuses_with_the_reason(product):
    p = product
    out = p.mmctl("adapter", "add", "support-bot/acme", "--base", "tinylm", "--path", str(p.src / "acme"))
    assert out.returncode == 0, out.stderr
    assert "added tinylm:acme (support-bot/acme): cold" in out.stdout
    listed = p.json("adapter", "list", "tinylm")
    assert not listed["loaded"]  # listing never loads the base
    rows = {a["name"]: a for a in listed["adapters"]}
    assert set(rows) == {"acme", "cust001"}
    assert rows["acme"]["tier"] == rows["cust001"]["tier"] == "cold"
    assert rows["acme"]["rank"] == 8 and rows["acme"]["label"] == "support-bot/acme"
    assert rows["acme"]["uri"].startswith("file://") and rows["acme"]["registered"]
    assert not rows["cust001"]["registered"]  # found in the adapter directory
    # From the cold-store URI acme was published to.
    out = p.mmctl("adapter", "add", "globex", "--base", "tinylm", "--path", rows["acme"]["uri"], "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["sha256"] == rows["acme"]["sha256"]
    cases = [
        (["broken", "--base", "tinylm", "--path", str(p.src / "broken")], 2,
         "adapter 'broken' refused: 'r' must be a positive integer"),
        (["wrongbase", "--base", "tinylm", "--path", str(p.src / "wrongbase")], 2,
         "name no linear layer of tinylm"),
        (["acme2", "--base", "recommender_lora", "--path", str(p.src / "acme")], 2,
         "name no linear layer of recommender_lora"),
        (["acme", "--base", "tinylm", "--path", str(p.src / "acme")], 2, "already exists"),
        (["x", "--base", "cust001", "--path", str(p.src / "acme")], 2, "not a LoRA base"),
        (["x", "--base", "nope", "--path", str(p.src / "acme")], 4, "unknown base model 'nope'"),
        (["team/a b", "--base", "tinylm", "--path", str(p.src / "acme")], 2, "last part is the adapter's name"),
    ]
    for args, code, words in cases:
        out = p.mmctl("adapter", "add", *args)
        assert out.returncode == code and words in out.stderr, (args, out.returncode, out.stderr)
    assert set(adapters(p)) == {"acme", "cust001", "globex"}  # nothing left behind
    assert not [d for d in (p.repository / "tinylm" / "adapters").iterdir() if d.name.startswith(".")]


def test_router_base_adapter_name_equals_the_adapter_parameter_on_triton(product):
    p = product
    router, triton = router_client(p), triton_client(p)
    via_router = generate(router, "tinylm:acme")  # the base is cold: this request loads it
    direct = generate(triton, "tinylm", adapter="acme")
    base = generate(triton, "tinylm")
    got = via_router.as_numpy("GENERATED_TEXT").reshape(-1).tolist()
    assert got == direct.as_numpy("GENERATED_TEXT").reshape(-1).tolist()
    assert got != base.as_numpy("GENERATED_TEXT").reshape(-1).tolist()
    params = via_router.get_response().parameters
    assert params["model"].string_param == "tinylm" and params["adapter"].string_param == "acme"
    # HTTP through the router (JSON and binary tensors), and the streaming gRPC path
    h = httpclient.InferenceServerClient(p.endpoints["router_http"])
    for binary in (False, True):
        x = httpclient.InferInput("TEXT", [2, 1], "BYTES")
        x.set_data_from_numpy(np.array([[q] for q in PROMPTS], dtype=object), binary_data=binary)
        out = h.infer("tinylm:acme", [x], parameters={"max_new_tokens": 8})
        assert out.as_numpy("GENERATED_TEXT").reshape(-1).tolist() == got
        assert out.get_response()["parameters"]["adapter"] == "acme"
    results = []
    router.start_stream(callback=lambda result, error: results.append((result, error)))
    text = grpcclient.InferInput("TEXT", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([[q] for q in PROMPTS], dtype=object))
    router.async_stream_infer("tinylm:acme", [text], parameters={"max_new_tokens": 8})
    router.stop_stream()
    assert results and results[0][1] is None
    assert results[0][0].as_numpy("GENERATED_TEXT").reshape(-1).tolist() == got


def test_unknown_adapter_fails_that_request_only(product):
    p = product
    router = router_client(p)
    with pytest.raises(InferenceServerException) as info:
        generate(router, "tinylm:ghost")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "tinylm:ghost" in info.value.message()  # worded as Triton words an unknown model
    resp = requests.post(f"http://{p.endpoints['router_http']}/v2/models/tinylm:ghost/infer", timeout=30,
                         json={"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]})
    assert resp.status_code == 404 and "not found" in resp.text
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*BASE:ADAPTER"):
        generate(router, "tinylm:a:b")
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*selects adapter 'acme'"):
        generate(router, "tinylm:acme", adapter="globex")
    assert generate(router, "tinylm:cust001").as_numpy("GENERATED_TEXT").shape == (2, 1)


def test_list_pin_load_unload_and_metrics(product):
    p = product
    router = router_client(p)
    generate(router, "tinylm:acme")
    rows = adapters(p)
    assert rows["acme"]["tier"] == "device"  # a device slot (gpu on a GPU server)
    assert rows["acme"]["requests"] >= 1 and rows["acme"]["misses"] >= 1 and rows["acme"]["last_used"]
    assert rows["globex"]["tier"] == "cold"
    out = p.mmctl("adapter", "list", "tinylm")
    assert out.returncode == 0 and "ADAPTER" in out.stdout and "acme (support-bot/acme)" in out.stdout
    assert "device slots used" in out.stdout
    # pin: confirmed by the model; the 2 slots of this base cannot hold 3 pins
    assert p.json("adapter", "pin", "tinylm", "acme")["pinned"]
    assert p.json("adapter", "pin", "tinylm", "cust001")["tier"] == "device"
    out = p.mmctl("adapter", "pin", "tinylm", "globex")
    assert out.returncode == 5 and "hold pinned adapters (acme, cust001)" in out.stderr, out.stderr
    rows = adapters(p)
    assert rows["acme"]["pinned"] and rows["cust001"]["pinned"] and not rows["globex"]["pinned"]
    out = p.mmctl("adapter", "unload", "tinylm", "acme")
    assert out.returncode == 2 and "unpin it first" in out.stderr
    assert not p.json("adapter", "unpin", "tinylm", "cust001")["pinned"]
    assert not p.json("adapter", "unpin", "tinylm", "acme")["pinned"]
    # unload / load
    assert p.json("adapter", "unload", "tinylm", "acme")["tier"] == "cold"
    assert p.json("adapter", "load", "tinylm", "globex")["tier"] == "device"
    assert p.json("adapter", "load", "tinylm", "acme")["tier"] == "device"
    out = p.mmctl("adapter", "load", "tinylm", "ghost")
    assert out.returncode == 4 and "unknown adapter 'ghost'" in out.stderr
    metrics = requests.get(p.url + "/metrics", timeout=10).text
    assert 'mms_adapter_requests_total{adapter="acme",base="tinylm"}' in metrics
    assert 'mms_adapter_cache_misses_total{adapter="acme",base="tinylm"}' in metrics
    assert 'mms_adapter_load_seconds{adapter="acme",base="tinylm"}' in metrics


def test_a_shadow_of_adapter_requests_has_the_adapter_loaded_on_the_shadow(product):
    """Requests for tinylm:acme mirrored to tinylm2 need acme in a slot of tinylm2: the mirror
    has it placed there as a request would, and its answers agree with the primary's."""
    p = product
    router = router_client(p)
    generate(router, "tinylm:acme")
    # The shadow's base is loaded first: a mirror waits at most the shadow timeout (5 s),
    # which a cold base model's load can pass on a busy machine; acme's placement in one of
    # its slots is what the mirror does here.
    load = p.mmctl("load", "tinylm2")
    assert load.returncode == 0, load.stderr
    assert p.mmctl("shadow", "start", "tinylm", "--model", "tinylm2", "--percent", "100").returncode == 0
    try:
        before = p.json("shadow", "report", "tinylm")
        for _ in range(4):
            generate(router, "tinylm:acme")
        deadline = time.monotonic() + 30
        while True:
            report = p.json("shadow", "report", "tinylm")
            c = {k: report[k] - before.get(k, 0)
                 for k in ("mirrored", "compared", "diverged", "errors", "timeouts")}
            if (c["compared"] + c["errors"] + c["timeouts"] >= max(1, c["mirrored"])
                    or time.monotonic() > deadline):
                break
            time.sleep(0.2)
        assert c["mirrored"] > 0 and c["errors"] == c["timeouts"] == 0, report
        assert c["compared"] == c["mirrored"], report
        assert c["diverged"] == 0, report  # the twin's acme answers as tinylm's
    finally:
        assert p.mmctl("shadow", "stop", "tinylm").returncode == 0
    rows = {r["model"]: r for r in p.json("status", "--all", "tinylm2:*")}
    assert rows["tinylm2:acme"]["state"] == "ready"


def test_rate_limit_per_adapter(product):
    p = product
    router = router_client(p)
    generate(router, "tinylm:acme")  # the base is loaded before the limit starts counting
    out = p.mmctl("limit", "set", "tinylm:acme", "--qps", "0.2", "--burst", "2")
    assert out.returncode == 0, out.stderr
    try:
        outcomes = []
        for _ in range(4):
            try:
                generate(router, "tinylm:acme", max_new_tokens=1)
                outcomes.append("ok")
            except InferenceServerException as exc:
                assert "RESOURCE_EXHAUSTED" in str(exc) and "tinylm:acme" in str(exc)
                outcomes.append("limited")
        assert outcomes.count("ok") == 2 and outcomes[-1] == "limited"
        for other in ("tinylm:globex", "tinylm"):  # other adapters and the base are not limited
            for _ in range(3):
                generate(router, other, max_new_tokens=1)
    finally:
        assert p.mmctl("limit", "clear", "tinylm:acme").returncode == 0
    assert "tinylm:acme" not in requests.get(p.url + "/v1/limits", headers=p.admin_headers(),
                                             timeout=10).json()


def test_remove_then_requests_get_not_found(product):
    p = product
    router = router_client(p)
    generate(router, "tinylm:globex")
    out = p.mmctl("adapter", "remove", "tinylm", "globex")
    assert out.returncode == 0 and "removed tinylm:globex" in out.stdout, out.stderr
    assert "globex" not in adapters(p)
    with pytest.raises(InferenceServerException) as info:
        generate(router, "tinylm:globex")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    out = p.mmctl("adapter", "remove", "tinylm", "globex")
    assert out.returncode == 4


def texts(result) -> list:
    return result.as_numpy("GENERATED_TEXT").reshape(-1).tolist()


def adapter_rows(p) -> dict[str, dict]:
    """``mmctl status --all`` rows of tinylm's adapters (entries tinylm:NAME)."""
    return {r["model"]: r for r in p.json("status", "--all", "tinylm:*")}


def test_the_control_plane_decides_which_adapters_hold_the_slots(product):
    """Four adapters, two slots: the manager's LRU picks who leaves, a pin keeps its slot,
    every answer equals the adapter's own (values, not shapes), also under concurrent swaps,
    and `mmctl status` lists each adapter with its state and tier."""
    p = product
    names = ["acme", "cust001", "initech", "umbrella"]
    for name in ("initech", "umbrella"):
        write_demo_adapter(p.src, "tinylm", name, rank=8, spec=SPEC)
        out = p.mmctl("adapter", "add", name, "--base", "tinylm", "--path", str(p.src / name))
        assert out.returncode == 0, out.stderr
    router, triton = router_client(p), triton_client(p)
    own = {}
    for name in names:  # one after another: each evicts the least recently used of two
        own[name] = texts(generate(router, f"tinylm:{name}"))
        # Still in its slot: Triton alone answers the same for it.
        assert texts(generate(triton, "tinylm", adapter=name)) == own[name]
    assert len({tuple(t) for t in own.values()}) == 4  # four adapters, four answers
    rows = adapter_rows(p)
    assert {n for n, r in rows.items() if r["state"] == "ready"} == {"tinylm:initech", "tinylm:umbrella"}
    assert rows["tinylm:umbrella"]["tier"] == "hot" and rows["tinylm:umbrella"]["server"]
    assert rows["tinylm:acme"]["state"] == "warm" and rows["tinylm:acme"]["tier"] == "warm"
    with pytest.raises(InferenceServerException) as info:  # Triton alone no longer loads one
        generate(triton, "tinylm", adapter="acme")
    assert info.value.status() == "StatusCode.NOT_FOUND" and "not in a device slot" in info.value.message()
    out = p.mmctl("status")  # ready ones listed, warm ones counted
    assert out.returncode == 0 and "tinylm:umbrella" in out.stdout and "adapter slot" in out.stdout
    assert "tinylm:acme" not in out.stdout and "more warm models" in out.stdout
    out = p.mmctl("status", "tinylm:*")
    assert out.returncode == 0 and "tinylm:acme" in out.stdout and "tinylm:globex" not in out.stdout
    # A pin keeps its slot whatever the traffic; the other slot turns over.  The commands of
    # a model work on the entry as `mmctl adapter ...` does.
    out = p.mmctl("pin", "tinylm:acme")
    assert out.returncode == 0 and out.stdout.startswith("tinylm:acme: ready on ") and "pinned" in out.stdout
    try:
        for name in ["cust001", "initech", "umbrella", "cust001"]:
            assert texts(generate(router, f"tinylm:{name}")) == own[name]
        rows = adapter_rows(p)
        assert rows["tinylm:acme"]["state"] == "ready" and rows["tinylm:acme"]["pinned"]
        assert rows["tinylm:cust001"]["state"] == "ready"
        # Concurrent clients on all four: the one free slot is taken in turns; every answer is
        # its adapter's own, none is lost.
        import concurrent.futures

        def client(name: str) -> list[bool]:
            c = router_client(p)
            try:
                return [texts(generate(c, f"tinylm:{name}", max_new_tokens=8)) == own[name]
                        for _ in range(6)]
            finally:
                c.close()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(client, names * 2))
        assert all(all(r) for r in results), results
    finally:
        out = p.mmctl("unpin", "tinylm:acme")
        assert out.returncode == 0 and "pinned" not in out.stdout, out.stdout
    out = p.mmctl("unload", "tinylm:cust001")
    assert out.returncode == 0 and out.stdout.strip() == "tinylm:cust001: warm", out.stdout
    out = p.mmctl("load", "tinylm:cust001")
    assert out.returncode == 0 and out.stdout.startswith("tinylm:cust001: ready on "), out.stdout
    assert p.mmctl("pin", "tinylm:ghost").returncode == 4  # unknown adapter: not found
    # The base unloaded takes its adapters with it; the next request loads both again.
    out = p.mmctl("unload", "tinylm")
    assert out.returncode == 0, out.stderr
    assert not [r for r in adapter_rows(p).values() if r["state"] == "ready"]
    assert texts(generate(router, "tinylm:initech")) == own["initech"]
    assert adapter_rows(p)["tinylm:initech"]["state"] == "ready"
    metrics = requests.get(p.url + "/metrics", timeout=10).text
    assert 'mms_adapter_cache_misses_total{adapter="initech",base="tinylm"}' in metrics
    evicted = [line for line in metrics.splitlines() if line.startswith('mms_adapter_evictions_total{base="tinylm"}')]
    assert evicted and float(evicted[0].split()[-1]) >= 2  # the LRU turns above


def test_a_base_left_by_an_earlier_version_is_handed_over_before_its_first_load(tmp_path):
    """The manifest of a base written before the control plane held the slots says nothing
    of residency: the start writes it before Triton can load the base, so the first load
    already leaves the slots to the control plane.  (Written by the adapter recovery, it
    could come after a first request had loaded the base, whose model then decided on its
    own until it read the manifest again: here it never does, manifest_poll_s is 0.)"""
    from model_runtime.lora.manifest import Manifest, read_manifest, write_manifest

    repo = tmp_path / "repository"
    spec = LoraDemoSpec(tinylm=SPEC.tinylm,
                        parameters={"max_device_adapters": "2", "manifest_poll_s": "0"})
    write_lora_model(repo, "tinylm", spec)
    adapter_dir = repo / "tinylm" / "adapters"
    for name in ("acme", "globex"):
        write_demo_adapter(adapter_dir, "tinylm", name, rank=4, spec=spec)
    write_manifest(adapter_dir, Manifest(generation=1))  # as an earlier version left it
    assert read_manifest(adapter_dir).residency == "model"
    p = Product(tmp_path / "state", repo, "--router-workers", "1").start()
    try:
        p.endpoints = p.json("endpoints")
        assert texts(generate(router_client(p), "tinylm:acme"))  # the base's first load
        with pytest.raises(InferenceServerException) as info:  # globex is in no slot
            generate(triton_client(p), "tinylm", adapter="globex")
        assert info.value.status() == "StatusCode.NOT_FOUND" and "not in a device slot" in info.value.message()
    finally:
        p.stop()
