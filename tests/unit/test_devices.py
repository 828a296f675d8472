"""Device discovery through a fake NVML, the config fallback, and measured-memory reconciliation."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from control_plane.eviction import CachePlanner, Capacity, Resident, make_policy
from control_plane.manager.records import ModelRecord, ModelState
from control_plane.triton.devices import (
    Device,
    GpuMemoryProbe,
    MemoryReconciler,
    devices_from_config,
    discover,
    discover_or_config,
)
from domain.errors import InvalidInput

GiB = 1 << 30


class NVMLError(Exception):
    pass


class FakeNVML:
    """pynvml's surface for: one plain GPU, one GPU in MIG mode with slices at indexes 0 and 2."""

    NVMLError = NVMLError

    def __init__(self, processes=None, used_bytes=0):
        self.gpus = [
            {"name": b"NVIDIA H100", "uuid": "GPU-aaa", "mig": None, "total": 80 * GiB},
            {"name": "NVIDIA A100", "uuid": "GPU-bbb", "total": 40 * GiB,
             "mig": {0: ("MIG-s0", "NVIDIA A100 MIG 1g.5gb", 5 * GiB),
                     2: ("MIG-s2", "NVIDIA A100 MIG 3g.20gb", 20 * GiB)}},
        ]
        self.processes = processes or []
        self.used_bytes = used_bytes

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetName(self, h):
        return self.gpus[h[1]]["name"] if h[0] == "gpu" else self.gpus[h[1]]["mig"][h[2]][1]

    def nvmlDeviceGetUUID(self, h):
        return self.gpus[h[1]]["uuid"] if h[0] == "gpu" else self.gpus[h[1]]["mig"][h[2]][0]

    def nvmlDeviceGetMigMode(self, h):
        if self.gpus[h[1]]["mig"] is None:
            raise NVMLError("Not Supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        if i not in self.gpus[h[1]]["mig"]:
            raise NVMLError("Not Found")
        return ("mig", h[1], i)

    def nvmlDeviceGetMemoryInfo(self, h):
        total = self.gpus[h[1]]["total"] if h[0] == "gpu" else self.gpus[h[1]]["mig"][h[2]][2]
        return SimpleNamespace(total=total, used=self.used_bytes, free=total - self.used_bytes)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self.processes


def test_discover_whole_gpus_and_mig_slices():
    devices = discover(FakeNVML())
    assert [(d.id, d.kind, d.memory_bytes, d.uuid, d.isolated) for d in devices] == [
        ("gpu0", "gpu", 80 * GiB, "GPU-aaa", False),
        ("gpu1/mig0", "mig", 5 * GiB, "MIG-s0", True),
        ("gpu1/mig2", "mig", 20 * GiB, "MIG-s2", True),
    ]
    assert devices[1].parent == "gpu1" and "1g.5gb" in devices[1].name
    assert devices[2].launch_env() == {"CUDA_VISIBLE_DEVICES": "MIG-s2"}


def test_config_wins_then_nvml_then_one_cpu():
    cfg = [{"id": "slice-large", "kind": "mig", "memory_bytes": 20 * GiB, "uuid": "MIG-x"},
           {"id": "cpu0", "memory_bytes": 8 * GiB, "tenants": ["acme"], "reserved_for_sla": "silver"}]
    devices = discover_or_config(cfg, nvml=FakeNVML())
    assert [d.id for d in devices] == ["slice-large", "cpu0"]
    assert devices[0].isolated and not devices[1].isolated and devices[1].tenants == frozenset({"acme"})
    assert len(discover_or_config(None, nvml=FakeNVML())) == 3
    assert discover_or_config(None, use_nvml=False) == [Device(id="cpu", kind="cpu")]
    assert Device("cpu").launch_env() == {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("entries, message", [
    ([{"id": "a", "kind": "tpu"}], "kind 'tpu'"),
    ([{"id": "a", "memory_bytes": 0}], "must be > 0 bytes"),
    ([{"id": "a", "memroy_bytes": 5}], "unknown keys"),
    ([{"id": "a"}, {"id": "a"}], "appears twice"),
    ([{"kind": "gpu"}], "has no id"),
])
def test_a_bad_fleet_config_is_refused_with_what_is_wrong(entries, message):
    with pytest.raises(InvalidInput, match=message):
        devices_from_config(entries)


def test_probe_maps_stub_processes_to_models(tmp_path):
    repo = tmp_path / "repo"
    cmdlines = {
        11: ["/x/triton_python_backend_stub", str(repo / "cust001.v1" / "1" / "model.py"), "shm", "1"],
        12: ["/x/triton_python_backend_stub", str(repo / "cust001.v1" / "1" / "model.py"), "shm", "2"],
        13: ["/x/triton_python_backend_stub", str(repo / "cust002.v1" / "1" / "model.py")],
        14: ["/usr/bin/tritonserver", "--model-repository", str(repo)],
        15: ["/x/triton_python_backend_stub", str(repo / "cust003.v1" / "1" / "model.py")],
    }
    nvml = FakeNVML(processes=[SimpleNamespace(pid=11, usedGpuMemory=300), SimpleNamespace(pid=12, usedGpuMemory=200),
                               SimpleNamespace(pid=13, usedGpuMemory=700), SimpleNamespace(pid=14, usedGpuMemory=900),
                               SimpleNamespace(pid=15, usedGpuMemory=None)])
    probe = GpuMemoryProbe(nvml, ("gpu", 0), repo, cmdline_of=lambda pid: cmdlines.get(pid, []))
    assert probe.per_model_bytes() == {"cust001.v1": 500, "cust002.v1": 700}


class FakeProbe:
    def __init__(self, per_model, device_used):
        self.nvml = FakeNVML()
        self.per_model, self.device_used = per_model, device_used

    def per_model_bytes(self):
        return dict(self.per_model)

    def device_used_bytes(self):
        return self.device_used


def test_reconciler_corrects_drift_and_logs_it(caplog):
    planner = CachePlanner(make_policy("lru"), Capacity(10 * GiB, None))
    planner.admit(Resident("a.v1", 1 * GiB), 0)
    planner.admit(Resident("b.v1", 1 * GiB), 0)
    planner.admit(Resident("c.v1", 1 * GiB), 0)
    records = {n: ModelRecord(n) for n in ("a.v1", "b.v1", "c.v1")}
    for name, state in (("a.v1", ModelState.READY), ("b.v1", ModelState.READY),
                        ("c.v1", ModelState.LOADING)):
        records[name].move(state, server="gpu0", memory_bytes=GiB)

    def correct_size(name, size_bytes):  # the manager's own writer of a copy's size
        planner.update(name, size_bytes=size_bytes)
        records[name].memory_bytes = size_bytes

    manager = SimpleNamespace(servers={"gpu0": SimpleNamespace(up=True, planner=planner)},
                              records=records, correct_size=correct_size)
    recorded = {}
    registry = SimpleNamespace(record_memory=lambda n, b: recorded.__setitem__(n, b))
    probe = FakeProbe({"a.v1": 3 * GiB, "b.v1": GiB + (1 << 20), "c.v1": 5 * GiB}, device_used=5 * GiB)
    rec = MemoryReconciler(manager, {"gpu0": probe}, registry)
    with caplog.at_level(logging.WARNING):
        corrections = rec.step()
    assert [(c.model, c.accounted_bytes, c.measured_bytes) for c in corrections] == [("a.v1", GiB, 3 * GiB)]
    assert planner.used_bytes == 5 * GiB  # b within tolerance, c still loading
    assert records["a.v1"].memory_bytes == 3 * GiB and recorded == {"a.v1": 3 * GiB}
    assert "memory accounting of a.v1 on gpu0 corrected" in caplog.text
    # Growth of memory no model holds (a leak) is reported against the first pass's baseline.
    probe.device_used += 2 * GiB
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert rec.step() == []
    assert "belong to no model" in caplog.text


def test_reconciler_skips_cpu_and_down_servers():
    manager = SimpleNamespace(servers={"gpu0": SimpleNamespace(up=False, planner=None)}, records={})
    assert MemoryReconciler(manager, {"gpu0": FakeProbe({}, 0), "gone": FakeProbe({}, 0)}).step() == []


def test_stub_model_ignores_paths_outside_the_repository(tmp_path):
    from control_plane.triton.devices import _stub_model
    assert _stub_model(["/x/triton_python_backend_stub", "/elsewhere/m/1/model.py"], tmp_path) is None
    assert _stub_model([], tmp_path) is None
    assert _stub_model(["/x/triton_python_backend_stub", str(tmp_path / "m" / "1" / "model.py")],
                       Path(tmp_path)) == "m"


def test_probe_for_looks_gpu_and_mig_devices_up_by_uuid(tmp_path):
    nvml = FakeNVML()
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: ("by-uuid", uuid)
    from control_plane.triton.devices import probe_for
    mig = discover(nvml)[1]
    probe = probe_for(mig, nvml, tmp_path)
    assert probe.handle == ("by-uuid", "MIG-s0") and probe.repository == tmp_path
    assert probe_for(Device("cpu"), nvml, tmp_path) is None
    assert probe_for(mig, None, tmp_path) is None


# --------------------------------------------------------------------------- mmctl up options
def test_service_discovers_through_the_injected_nvml_and_checks_devices(tmp_path):
    from control_plane.runtime.service import Service, ServiceConfig
    from control_plane.triton.fake_nvml import FakeGpu, FakeNVML

    fake = FakeNVML([FakeGpu("GPU-0", "H100", 80 * GiB), FakeGpu("GPU-1", "H100", 80 * GiB)])
    assert [d.id for d in Service(ServiceConfig(state_dir=tmp_path, nvml=fake)).tritons.discover_devices()] == [
        "gpu0", "gpu1"]
    picked = Service(ServiceConfig(state_dir=tmp_path, nvml=fake, devices=["GPU-1"])).tritons.discover_devices()
    assert [d.id for d in picked] == ["gpu1"]
    with pytest.raises(InvalidInput, match="'gpu7', which is not a device of this machine"):
        Service(ServiceConfig(state_dir=tmp_path, nvml=fake, devices=["gpu7"])).tritons.discover_devices()
    attach_only = ServiceConfig(state_dir=tmp_path, nvml=fake, triton_servers=0, attach=["h:1"])
    assert Service(attach_only).tritons.discover_devices() == []  # no local Triton at all
    # Without GPUs: CPU as before, and GPU options are refused instead of ignored.
    cpu = ServiceConfig(state_dir=tmp_path, use_nvml=False)
    assert Service(cpu).tritons.discover_devices() == []
    with pytest.raises(InvalidInput, match="NVML finds no GPU"):
        Service(ServiceConfig(state_dir=tmp_path, use_nvml=False, devices=["gpu0"])).tritons.discover_devices()
    with pytest.raises(InvalidInput, match="use --memory-budget for CPU servers"):
        Service(ServiceConfig(state_dir=tmp_path, use_nvml=False,
                              device_budgets={"gpu0": GiB})).tritons.discover_devices()


def test_device_budget_option_parsing(monkeypatch):
    from click.testing import CliRunner

    from mmctl import serve

    seen = []
    monkeypatch.setattr(serve, "_run_service", seen.append)
    result = CliRunner().invoke(serve.up, ["--device-budget", "gpu0=60GiB",
                                           "--device-budget", "gpu1/mig2 = 8GiB"])
    assert result.exit_code == 0, result.output
    assert seen[0].device_budgets == {"gpu0": 60 * GiB, "gpu1/mig2": 8 * GiB}
    for bad in ("gpu0", "=5GiB", "gpu0=", "gpu0=lots"):
        result = CliRunner().invoke(serve.up, ["--device-budget", bad])
        assert result.exit_code == 2 and "--device-budget" in result.output, (bad, result.output)