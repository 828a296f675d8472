"""Bring your own model: a plain Triton model folder, one command, served by its name.

The model is tests/fixtures/models/simple, Triton's add_sub shape written as any Triton
python-backend model is (numpy, its own model_warmup, nothing from this product).  The stack
is `mmctl up`; the clients are tritonclient's, unmodified, talking to the router.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from control_plane.tiers.cold import folder_sha256
from tests.product import Product

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "simple"


@pytest.fixture
def product(repository, tmp_path):
    p = Product(tmp_path / "state", repository).start()
    yield p
    p.stop()
    p.assert_no_triton_left()


def add_sub(client_module, url: str, model: str):
    """One add_sub request as Triton's own example client sends it."""
    client = client_module.InferenceServerClient(url)
    in0 = np.arange(16, dtype=np.int32)
    in1 = np.full(16, 3, dtype=np.int32)
    inputs = [client_module.InferInput("INPUT0", [16], "INT32"),
              client_module.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in1)
    outputs = [client_module.InferRequestedOutput("OUTPUT0"), client_module.InferRequestedOutput("OUTPUT1")]
    result = client.infer(model, inputs, outputs=outputs)
    return client, in0, in1, result


def test_registry_lists_the_repository_on_a_fresh_stack(product):
    versions = {v["name"]: v for v in product.json("registry", "list")}
    # Every model folder Triton can serve is in the registry: one catalogue.
    assert {f"cust00{i}" for i in range(1, 9)} | {"identity", "slow", "broken"} <= set(versions)
    assert (versions["cust001"]["model"], versions["cust001"]["version"],
            versions["cust001"]["stage"]) == ("cust001", 1, "production")
    # The rollout drills are versions of cust017, under the folder names the README uses.
    assert {n: (versions[n]["model"], versions[n]["version"])
            for n in ("cust017-v2", "cust017-v3", "cust017-faulty")} == {
        "cust017-v2": ("cust017", 2), "cust017-v3": ("cust017", 3), "cust017-faulty": ("cust017", 4)}
    assert versions["cust001"]["tier"] == "warm"
    out = product.mmctl("registry", "list")
    assert out.returncode == 0 and out.stdout.splitlines()[0].split()[:4] == ["NAME", "MODEL", "VERSION", "STAGE"]


def test_a_plain_triton_model_is_served_by_its_name_after_one_command(product, tmp_path):
    src = tmp_path / "simple"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("__pycache__"))
    sha_before = folder_sha256(src)

    # The one command.  Its config says name: "simple"; Triton serves it as simple.v1.
    out = product.mmctl("registry", "add", "simple", "--from-dir", str(src))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("simple.v1: simple version 1, production"), out.stdout
    assert "clients ask for 'simple'" in out.stdout

    # Clients ask for "simple" at once, cold: the router loads its production version.
    endpoints = product.json("endpoints")
    for client_module, url in ((grpcclient, endpoints["router_grpc"]),
                               (httpclient, endpoints["router_http"])):
        client, in0, in1, result = add_sub(client_module, url, "simple")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), in0 + in1)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), in0 - in1)
        assert client.is_model_ready("simple")

    # mmctl takes the logical name too.
    health = product.mmctl("health", "simple")
    assert health.returncode == 0 and "simple.v1: healthy" in health.stdout, health.stdout + health.stderr
    pin = product.mmctl("pin", "simple")
    assert pin.returncode == 0 and "pinned" in pin.stdout, pin.stderr
    assert product.mmctl("unpin", "simple").returncode == 0
    unload = product.mmctl("unload", "simple")
    assert unload.returncode == 0 and unload.stdout.startswith("simple.v1: warm"), unload.stdout + unload.stderr
    load = product.mmctl("load", "simple")
    assert load.returncode == 0 and load.stdout.startswith("simple.v1: ready"), load.stdout + load.stderr

    # A second version is registered, not served, until promoted; then "simple" is v2.
    out = product.mmctl("registry", "add", "simple", "--from-dir", str(src))
    assert out.returncode == 0 and out.stdout.startswith("simple.v2: simple version 2, registered"), out.stdout
    assert product.mmctl("registry", "promote", "simple", "--version", "2", "--stage", "production").returncode == 0
    assert product.mmctl("load", "simple").stdout.startswith("simple.v2: ready")
    _client, in0, in1, result = add_sub(grpcclient, endpoints["router_grpc"], "simple")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), in0 + in1)

    assert folder_sha256(src) == sha_before  # the user's folder is left as it was


def test_unknown_and_unserved_logical_names_say_what_to_do(product, tmp_path):
    out = product.mmctl("load", "nosuch")
    assert out.returncode == 4 and "nosuch" in out.stderr
    src = tmp_path / "simple"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("__pycache__"))
    out = product.mmctl("registry", "add", "simple", "--from-dir", str(src), "--stage", "registered")
    assert out.returncode == 0 and "simple has no production version" in out.stdout
    out = product.mmctl("load", "simple")
    assert out.returncode == 4 and "simple has no production version" in out.stderr
    assert "simple.v1 (registered)" in out.stderr
    assert product.mmctl("load", "simple.v1").returncode == 0  # the concrete name always works


def test_a_model_that_refuses_zeros_is_served_and_its_check_can_be_turned_off(product, tmp_path):
    """No model_warmup in its config: the control plane checks it with one request of zeros,
    which this model refuses.  Triton loaded it, so it is served; `mmctl health` says the
    check failed and how to turn it off, and the registry's switch does."""
    src = tmp_path / "picky"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("__pycache__"))
    config = (src / "config.pbtxt").read_text()
    (src / "config.pbtxt").write_text(config[:config.index("model_warmup")].replace('"simple"', '"picky"'))
    code = (src / "1" / "model.py").read_text()
    (src / "1" / "model.py").write_text(code.replace(
        "            out0 = np.add(in0, in1)",
        "            if not in1.any():\n"
        "                responses.append(pb_utils.InferenceResponse(\n"
        "                    error=pb_utils.TritonError('INPUT1 must not be all zeros')))\n"
        "                continue\n"
        "            out0 = np.add(in0, in1)"))

    assert product.mmctl("registry", "add", "picky", "--from-dir", str(src)).returncode == 0
    load = product.mmctl("load", "picky")
    assert load.returncode == 0 and load.stdout.startswith("picky.v1: ready"), load.stdout + load.stderr
    _client, in0, in1, result = add_sub(grpcclient, product.json("endpoints")["router_grpc"], "picky")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), in0 + in1)  # served
    health = product.mmctl("health", "picky")
    assert health.returncode == 8, health.stdout + health.stderr
    assert "INPUT0" in health.stdout and "mms_warmup" in health.stdout, health.stdout
    assert "mms_warmup_failures_total" in requests.get(product.url + "/metrics", timeout=5).text

    off = product.mmctl("registry", "warmup", "picky", "--version", "1", "off")
    assert off.returncode == 0 and "synthetic warm-up off" in off.stdout, off.stdout + off.stderr
    assert product.mmctl("unload", "picky").returncode == 0
    load = product.mmctl("load", "picky")
    assert load.returncode == 0 and load.stdout.startswith("picky.v1: ready"), load.stdout + load.stderr
    assert product.mmctl("health", "picky").returncode == 0

    # Registered with the switch off from the start: loads at once.
    (src / "config.pbtxt").write_text((src / "config.pbtxt").read_text().replace('"picky"', '"picky2"'))
    assert product.mmctl("registry", "add", "picky2", "--from-dir", str(src),
                         "--no-synthetic-warmup").returncode == 0
    assert product.mmctl("load", "picky2").returncode == 0


def test_a_model_of_numbers_in_strings_is_served_though_the_synthetic_warmup_is_not_a_number(product):
    """Like Triton's simple_string example: BYTES inputs holding numbers.  Triton loads it; the
    control plane's b"warmup" request fails, which is reported, not held against it."""
    folder = FIXTURE.parent / "strings"
    assert product.mmctl("registry", "add", "strings", "--from-dir", str(folder)).returncode == 0
    load = product.mmctl("load", "strings")
    assert load.returncode == 0 and load.stdout.startswith("strings.v1: ready"), load.stdout + load.stderr
    client = grpcclient.InferenceServerClient(product.json("endpoints")["router_grpc"])
    a = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    b = np.array([[b"1"] * 16], dtype=np.object_)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "BYTES"), grpcclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("strings", inputs)
    assert [int(v) for v in result.as_numpy("OUTPUT0").ravel()] == [i + 1 for i in range(16)]
    assert [int(v) for v in result.as_numpy("OUTPUT1").ravel()] == [i - 1 for i in range(16)]
    health = product.mmctl("health", "strings")
    assert health.returncode == 8 and "warm-up failed" in health.stdout and "served anyway" in health.stdout
