"""The GPU / MIG paths of `mmctl up` on a machine without a GPU: the fake NVML (test hook
MMS_TEST_FAKE_NVML) describes one whole GPU and one GPU split into two MIG slices, and real
CPU tritonservers stand in for the three devices.  Models run where they are placed through
Triton's load API config override; the fake lists the real python-backend stubs of each
stand-in as that device's processes, so memory is measured the way it is on a GPU."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from control_plane.manager.placement import instance_kind_override
from control_plane.triton.admin import TritonAdmin
from domain.errors import ModelLoadFailed
from tests.conftest import run
from tests.product import Product

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "simple"
GiB = 1 << 30
MiB = 1 << 20
STUB_BYTES = 300 * MiB
BASE_BYTES = 512 * MiB
SPEC = {
    "gpus": [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-fake-0", "memory_bytes": 80 * GiB},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-fake-1", "memory_bytes": 80 * GiB,
         "mig": [{"name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "uuid": f"MIG-fake-1-{i}",
                  "memory_bytes": 10 * GiB} for i in range(2)]},
    ],
    "stub_bytes": STUB_BYTES,
    "base_used_bytes": BASE_BYTES,
    "stand_in_instance_kind": "KIND_CPU",
}


def gpu_written(dest: Path) -> Path:
    """The add_sub fixture as it would be written for a GPU server (KIND_GPU)."""
    shutil.copytree(FIXTURE, dest)
    config = dest / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
    assert "KIND_GPU" in config.read_text()
    return dest


def test_the_load_override_runs_a_gpu_config_on_a_cpu_server(triton, repository):
    gpu_written(repository / "simple")
    plain = TritonAdmin(triton.grpc_url)
    placed = TritonAdmin(triton.grpc_url, load_config=instance_kind_override(repository, "KIND_CPU"))

    async def go():
        try:
            with pytest.raises(ModelLoadFailed, match="KIND_GPU but no GPUs"):
                await plain.load("simple")  # the config as written cannot load here
            await placed.load("simple")  # the same file, overridden at load time
            assert (await placed.index())["simple"].state.value == "READY"
            config = (await placed.client.get_model_config("simple", as_json=True))["config"]
            assert [g["kind"] for g in config["instance_group"]] == ["KIND_CPU"]
        finally:
            await plain.close()
            await placed.close()

    run(go())
    assert "KIND_GPU" in (repository / "simple" / "config.pbtxt").read_text()  # one copy, unchanged


@pytest.fixture
def gpu_product(tmp_path, monkeypatch):
    spec = tmp_path / "fake-nvml.json"
    spec.write_text(json.dumps(SPEC))
    monkeypatch.setenv("MMS_TEST_FAKE_NVML", str(spec))  # the test hook; `mmctl up` inherits it
    p = Product(tmp_path / "state", None, "--fleet-size", "2").start()
    yield p
    p.stop()
    p.assert_no_triton_left()


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_mmctl_up_runs_one_triton_per_fake_device_and_gold_goes_to_a_slice(gpu_product, tmp_path):
    p = gpu_product
    assert "TEST HOOK MMS_TEST_FAKE_NVML is set" in p.log_text()
    fleet = {s["server"]: s for s in p.json("fleet")}
    assert set(fleet) == {"gpu0", "gpu1-mig0", "gpu1-mig1"}
    assert fleet["gpu0"]["device"] == "gpu0" and fleet["gpu1-mig1"]["device"] == "gpu1/mig1"
    assert [fleet[s]["isolated"] for s in ("gpu0", "gpu1-mig0", "gpu1-mig1")] == [False, True, True]
    assert fleet["gpu0"]["memory_budget_bytes"] == 72 * GiB  # 80 GiB less the 10% reserve
    assert fleet["gpu1-mig0"]["memory_budget_bytes"] == 9 * GiB  # 10 GiB less 1 GiB
    assert fleet["gpu1-mig0"]["device_uuid"] == "MIG-fake-1-0"
    assert fleet["gpu1-mig0"]["device_used_bytes"] == BASE_BYTES  # nothing loaded yet

    # A gold model, written for a GPU (KIND_GPU): it may run only on a MIG slice.
    out = p.mmctl("registry", "add", "simple", "--from-dir", str(gpu_written(tmp_path / "simple")),
                  "--sla", "gold")
    assert out.returncode == 0, out.stderr
    out = p.mmctl("load", "simple")
    assert out.returncode == 0, out.stderr + p.log_text()[-3000:]
    status = {m["model"]: m for m in p.json("status")}
    gold_server = status["simple.v1"]["server"]
    assert gold_server in ("gpu1-mig0", "gpu1-mig1")
    # Measured, not assumed: the stub's memory (as the fake NVML reports it), not 2.5 KiB of files.
    assert status["simple.v1"]["memory_bytes"] == STUB_BYTES
    out = p.mmctl("health", "simple")
    assert out.returncode == 0, out.stdout + out.stderr
    registry = {v["name"]: v for v in p.json("registry", "list")}
    assert registry["simple.v1"]["memory_bytes"] == STUB_BYTES

    # A silver model stays off the isolated slices while the shared GPU has room.
    out = p.mmctl("load", "cust001")
    assert out.returncode == 0, out.stderr
    assert {m["model"]: m for m in p.json("status")}["cust001"]["server"] == "gpu0"

    fleet = {s["server"]: s for s in p.json("fleet")}
    assert fleet[gold_server]["loaded"] == ["simple.v1"]
    assert fleet[gold_server]["used_bytes"] == fleet[gold_server]["measured_bytes"] == STUB_BYTES
    assert fleet[gold_server]["device_used_bytes"] == BASE_BYTES + STUB_BYTES

    # Unloaded: free once the fake NVML no longer lists the stub, nothing left unreturned.
    out = p.mmctl("unload", "simple")
    assert out.returncode == 0, out.stderr
    fleet = {s["server"]: s for s in p.json("fleet")}
    assert fleet[gold_server]["used_bytes"] == 0 and fleet[gold_server]["unreturned_bytes"] == 0
    assert fleet[gold_server]["device_used_bytes"] == BASE_BYTES
