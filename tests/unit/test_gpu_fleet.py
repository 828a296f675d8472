"""A GPU fleet driven by the fake NVML: discovery, one server per GPU / MIG slice, gold
isolation, memory measured after each load, and unloads that count free only once NVML
shows the memory back.  Same code paths as on a GPU; Triton is FakeAdmin (no sockets)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.placement import ModelFacts, Placer, ServerLabels
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.devices import (
    GpuMemoryMeter,
    device_servers,
    discover,
    select_devices,
    server_name,
)
from control_plane.triton.fake_nvml import FakeGpu, FakeMig, FakeNVML, from_spec, from_test_hook
from domain.errors import CapacityExhausted, InvalidInput
from tests.conftest import run
from tests.unit.test_manager_unit import FakeAdmin

GiB = 1 << 30
MiB = 1 << 20
STUB = "/opt/tritonserver/backends/python/triton_python_backend_stub"
PYTHON_CONFIG = 'name: "{name}"\nbackend: "python"\ninstance_group [ {{ kind: KIND_GPU }} ]\n'
ONNX_CONFIG = 'name: "{name}"\nbackend: "onnxruntime"\n'


def two_gpus_and_seven_slices() -> FakeNVML:
    return FakeNVML([
        FakeGpu("GPU-0", "NVIDIA H100 80GB HBM3", 80 * GiB),
        FakeGpu("GPU-1", "NVIDIA H100 80GB HBM3", 80 * GiB),
        FakeGpu("GPU-2", "NVIDIA H100 80GB HBM3", 80 * GiB,
                mig=[FakeMig(f"MIG-2-{i}", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 10 * GiB)
                     for i in range(7)]),
    ], base_used_bytes=512 * MiB)


# --------------------------------------------------------------------------- discovery
def test_discovery_finds_two_gpus_and_seven_isolated_slices_with_budgets():
    devices = discover(two_gpus_and_seven_slices())
    assert [d.id for d in devices] == ["gpu0", "gpu1"] + [f"gpu2/mig{i}" for i in range(7)]
    assert [server_name(d) for d in devices][2] == "gpu2-mig0"
    assert [d.isolated for d in devices] == [False, False] + [True] * 7
    assert devices[2].launch_env() == {"CUDA_VISIBLE_DEVICES": "MIG-2-0"}
    planned = device_servers(devices)
    assert planned[0].budget_bytes == 72 * GiB  # 80 GiB less 10%
    assert planned[2].budget_bytes == 9 * GiB  # 10 GiB less the 1 GiB minimum reserve
    planned = device_servers(devices, overrides={"gpu0": 60 * GiB, "MIG-2-3": 5 * GiB})
    assert planned[0].budget_bytes == 60 * GiB and planned[0].budget_source == "--device-budget"
    assert planned[5].budget_bytes == 5 * GiB and planned[1].budget_bytes == 72 * GiB
    assert {p.budget_bytes for p in device_servers(devices, memory_budget_bytes=GiB)} == {GiB}
    assert {p.budget_bytes for p in device_servers(devices, derive_budget=False)} == {None}


def test_devices_selects_a_subset_by_id_server_name_uuid_or_parent_gpu():
    devices = discover(two_gpus_and_seven_slices())
    assert [d.id for d in select_devices(devices, ["gpu1", "gpu2-mig3", "MIG-2-5"])] == [
        "gpu1", "gpu2/mig3", "gpu2/mig5"]
    assert len(select_devices(devices, ["gpu2"])) == 7  # a MIG-mode GPU: all its slices
    assert select_devices(devices, None) == devices
    with pytest.raises(InvalidInput, match="'gpu9', which is not a device.*gpu0, gpu1, gpu2/mig0"):
        select_devices(devices, ["gpu9"])


@pytest.mark.parametrize("kwargs, message", [
    ({"overrides": {"gpu7": GiB}}, "--device-budget names 'gpu7'"),
    ({"overrides": {"gpu0": 0}}, "must be > 0 bytes"),
])
def test_bad_device_budgets_are_refused(kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        device_servers(discover(two_gpus_and_seven_slices()), **kwargs)


def test_a_device_no_larger_than_the_reserve_needs_an_explicit_budget():
    nvml = FakeNVML([FakeGpu("GPU-s", "tiny", GiB)])
    with pytest.raises(InvalidInput, match="--device-budget gpu0=SIZE"):
        device_servers(discover(nvml))


def test_the_test_hook_builds_a_fake_from_a_json_spec(tmp_path):
    spec = {"gpus": [{"uuid": "GPU-f0", "name": "H100", "memory_bytes": 80 * GiB},
                     {"uuid": "GPU-f1", "memory_bytes": 80 * GiB,
                      "mig": [{"uuid": "MIG-f1-0", "memory_bytes": 10 * GiB}]}],
            "stand_in_instance_kind": "KIND_CPU"}
    nvml = from_spec(spec)
    assert [d.id for d in discover(nvml)] == ["gpu0", "gpu1/mig0"]
    assert nvml.stand_in_instance_kind == "KIND_CPU"
    path = tmp_path / "fake.json"
    path.write_text(__import__("json").dumps(spec))
    assert from_test_hook({}) is None  # production: the variable is never set
    assert len(discover(from_test_hook({"MMS_TEST_FAKE_NVML": str(path)}))) == 2


# --------------------------------------------------------------------------- a fleet
class StubAdmin(FakeAdmin):
    """FakeAdmin whose loads start python-backend stubs on the fake device (NVML lists them
    with ``sizes[model]`` bytes); unloads end them unless the model is in ``lingering``.
    Non-python models add their size to the device total instead (``leaky``: not freed)."""

    pids = itertools.count(1000)

    def __init__(self, models, nvml, uuid, repo, sizes, cmdlines):
        super().__init__(models, load_delay_s=0.01, free_delay_s=0.0)
        self.nvml, self.uuid, self.repo = nvml, uuid, repo
        self.sizes, self.cmdlines = sizes, cmdlines
        self.lingering: set[str] = set()
        self.leaky: set[str] = set()
        self.stubs: dict[str, int] = {}
        self.in_load = 0
        self.max_in_load = 0

    async def load(self, model):
        self.in_load += 1
        self.max_in_load = max(self.max_in_load, self.in_load)
        try:
            await super().load(model)
        finally:
            self.in_load -= 1
        if "python" in (self.repo / model / "config.pbtxt").read_text():
            pid = next(self.pids)
            self.cmdlines[pid] = [STUB, str(self.repo / model / "1" / "model.py"), "shm", "1"]
            self.nvml.set_process(self.uuid, pid, self.sizes[model])
            self.stubs[model] = pid
        else:
            self.nvml.leak(self.uuid, self.sizes[model])

    async def unload(self, model):
        await super().unload(model)
        pid = self.stubs.pop(model, None)
        if pid is not None and model not in self.lingering:
            self.nvml.end_process(pid)
        if pid is None and model not in self.leaky:
            self.nvml.leak(self.uuid, -self.sizes[model])


class Fleet:
    """Servers for the fake devices, a manager with the placer's labels and the meter."""

    def __init__(self, tmp_path, nvml, models, sizes, sla=None, budgets=None, python=True,
                 release_timeout_s=0.2):
        self.repo = tmp_path / "repo"
        for m in models:
            (self.repo / m / "1").mkdir(parents=True)
            (self.repo / m / "config.pbtxt").write_text(
                (PYTHON_CONFIG if python else ONNX_CONFIG).format(name=m))
        self.nvml = nvml
        self.cmdlines: dict[int, list[str]] = {}
        self.recorded: dict[str, int] = {}
        devices = discover(nvml)
        planned = device_servers(devices, overrides=budgets or {})
        self.admins, servers, labels = {}, [], {}
        for p in planned:
            admin = StubAdmin(models, nvml, p.device.uuid, self.repo, sizes, self.cmdlines)
            spec = ServerSpec(p.name, f"{p.name}:1", f"{p.name}:2", device=p.device.id,
                              memory_budget_bytes=p.budget_bytes)
            servers.append(ModelManager.make_server(spec, "lru", admin=admin))
            self.admins[p.name] = admin
            labels[p.name] = ServerLabels.from_device(p.device)
        registry = type("Registry", (), {"record_memory": lambda _s, n, b: self.recorded.__setitem__(n, b)})()
        self.meter = GpuMemoryMeter(nvml, {p.name: p.device for p in planned}, self.repo,
                                    registry=registry, release_timeout_s=release_timeout_s,
                                    poll_s=0.01, cmdline_of=lambda pid: self.cmdlines.get(pid, []))
        sla = sla or {}
        self.mgr = ModelManager(servers, StateStore(tmp_path / "s.db"), repository=self.repo,
                                config=ManagerConfig(policy="lru", unload_timeout_s=0.3),
                                placer=Placer(facts=lambda n: ModelFacts(sla=sla.get(n, "silver")),
                                              labels=labels),
                                memory=self.meter)

    def planner(self, server):
        return self.mgr.servers[server].planner


def test_placement_across_two_gpus_and_seven_slices_keeps_gold_on_slices(tmp_path):
    gold = [f"gold{i}" for i in range(7)]
    silver = [f"silver{i}" for i in range(4)]
    sizes = {m: 2 * GiB for m in gold + silver}
    fleet = Fleet(tmp_path, two_gpus_and_seven_slices(), gold + silver, sizes,
                  sla={m: "gold" for m in gold})

    async def go():
        await fleet.mgr.start()
        for m in gold + silver:
            await fleet.mgr.ensure(m)
        where = {m: fleet.mgr.get(m).server for m in gold + silver}
        assert sorted(where[m] for m in gold) == [f"gpu2-mig{i}" for i in range(7)]  # one each
        assert {where[m] for m in silver} == {"gpu0", "gpu1"}  # shared GPUs while they fit
        table = {s["server"]: s for s in fleet.mgr.fleet()}
        assert len(table) == 9 and table["gpu2-mig4"]["isolated"] is True
        assert table["gpu0"]["isolated"] is False
        assert table["gpu2-mig0"]["memory_budget_bytes"] == 9 * GiB
        assert table["gpu2-mig0"]["measured_bytes"] == 2 * GiB
        assert table["gpu2-mig0"]["device_used_bytes"] == 512 * MiB + 2 * GiB

    run(go())


def test_gold_without_any_isolated_device_says_what_to_do(tmp_path):
    nvml = FakeNVML([FakeGpu("GPU-0", "H100", 80 * GiB), FakeGpu("GPU-1", "H100", 80 * GiB)])
    fleet = Fleet(tmp_path, nvml, ["vip"], {"vip": GiB}, sla={"vip": "gold"})

    async def go():
        await fleet.mgr.start()
        with pytest.raises(CapacityExhausted) as err:
            await fleet.mgr.ensure("vip")
        msg = err.value.message
        assert "SLA gold, which runs only on an isolated device (a MIG slice)" in msg
        assert "gpu0 (gpu0), gpu1 (gpu1) are shared" in msg and "nvidia-smi mig" in msg

    run(go())


def test_measured_memory_overrides_the_artifact_size(tmp_path):
    fleet = Fleet(tmp_path, two_gpus_and_seven_slices(), ["m1"], {"m1": 3 * GiB})

    async def go():
        await fleet.mgr.start()
        rec = await fleet.mgr.ensure("m1")
        assert rec.memory_bytes == 3 * GiB  # the files are a few bytes; the stub holds 3 GiB
        assert fleet.planner(rec.server).used_bytes == 3 * GiB
        assert fleet.recorded == {"m1": 3 * GiB}  # the registry keeps it for the next load

    run(go())


def test_non_python_models_are_measured_by_device_delta_one_load_at_a_time(tmp_path):
    nvml = FakeNVML([FakeGpu("GPU-0", "H100", 80 * GiB)], base_used_bytes=GiB)
    models = ["a", "b", "c"]
    fleet = Fleet(tmp_path, nvml, models, {"a": GiB, "b": 2 * GiB, "c": 4 * GiB}, python=False)

    async def go():
        await fleet.mgr.start()
        await asyncio.gather(*(fleet.mgr.ensure(m) for m in models))
        assert fleet.admins["gpu0"].max_in_load == 1  # deltas of one device never overlap
        assert {m: fleet.mgr.get(m).memory_bytes for m in models} == {"a": GiB, "b": 2 * GiB, "c": 4 * GiB}
        await fleet.mgr.unload("b")  # its memory comes back: counted free at once
        assert fleet.planner("gpu0").used_bytes == 5 * GiB
        assert fleet.meter.held_bytes("gpu0") == 0

    run(go())


def test_a_model_that_measures_larger_than_reserved_evicts_more(tmp_path):
    # Budget 10 GiB: a (4 GiB) and b (4 GiB) fit; c's files say a few bytes, so nothing is
    # evicted to load it, but NVML measures 5 GiB: the least recently used one must go.
    nvml = FakeNVML([FakeGpu("GPU-0", "H100", 80 * GiB)])
    sizes = {"a": 4 * GiB, "b": 4 * GiB, "c": 5 * GiB}
    fleet = Fleet(tmp_path, nvml, list(sizes), sizes, budgets={"gpu0": 10 * GiB})

    async def go():
        await fleet.mgr.start()
        await fleet.mgr.ensure("a")
        await fleet.mgr.ensure("b")
        await fleet.mgr.ensure("c")
        assert fleet.mgr.get("a").state == ModelState.WARM  # evicted after c was measured
        assert fleet.mgr.get("c").state == ModelState.READY
        assert fleet.planner("gpu0").used_bytes == 9 * GiB <= 10 * GiB

    run(go())


def test_a_model_that_cannot_fit_as_measured_is_unloaded_with_a_clear_error(tmp_path):
    nvml = FakeNVML([FakeGpu("GPU-0", "H100", 80 * GiB)])
    sizes = {"p": 6 * GiB, "big": 5 * GiB, "huge": 12 * GiB}
    fleet = Fleet(tmp_path, nvml, list(sizes), sizes, budgets={"gpu0": 10 * GiB})

    async def go():
        await fleet.mgr.start()
        await fleet.mgr.pin("p")
        with pytest.raises(CapacityExhausted, match="big measured 5368709120 bytes.*nothing evictable"):
            await fleet.mgr.ensure("big")
        rec = fleet.mgr.get("big")
        assert rec.state == ModelState.FAILED and "measured" in rec.failure
        assert fleet.admins["gpu0"].states["big"].value == "UNAVAILABLE"  # unloaded again
        assert fleet.planner("gpu0").used_bytes == 6 * GiB  # only the pinned model
        with pytest.raises(CapacityExhausted, match="more than the whole budget"):
            await fleet.mgr.ensure("huge")

    run(go())


def test_memory_that_does_not_come_back_after_unload_stays_counted(tmp_path):
    nvml = FakeNVML([FakeGpu("GPU-0", "H100", 80 * GiB)])
    sizes = {"a": 4 * GiB, "b": 4 * GiB, "c": 4 * GiB}
    fleet = Fleet(tmp_path, nvml, list(sizes), sizes, budgets={"gpu0": 10 * GiB})
    admin = fleet.admins["gpu0"]

    async def go():
        await fleet.mgr.start()
        await fleet.mgr.ensure("a")
        admin.lingering.add("a")  # its stub does not exit: NVML still shows its 4 GiB
        await fleet.mgr.unload("a")
        assert fleet.mgr.get("a").state == ModelState.WARM  # Triton says unloaded...
        assert fleet.meter.held_bytes("gpu0") == 4 * GiB  # ...but the device says otherwise
        assert fleet.planner("gpu0").capacity.max_bytes == 6 * GiB
        assert {s["server"]: s for s in fleet.mgr.fleet()}["gpu0"]["unreturned_bytes"] == 4 * GiB
        await fleet.mgr.ensure("b")
        await fleet.mgr.ensure("c")  # 4 + 4 > 6: b is evicted instead of overfilling the GPU
        assert fleet.mgr.get("b").state == ModelState.WARM
        fleet.meter.step(fleet.mgr.servers.values())
        assert fleet.meter.held_bytes("gpu0") == 4 * GiB  # still there: still counted
        nvml.end_process(admin.stubs.get("a") or next(
            pid for pid, cmd in fleet.cmdlines.items() if "/a/" in cmd[1]))
        fleet.meter.step(fleet.mgr.servers.values())
        assert fleet.meter.held_bytes("gpu0") == 0
        assert fleet.planner("gpu0").capacity.max_bytes == 10 * GiB

    run(go())


def test_device_memory_that_does_not_come_back_is_found_by_the_device_total(tmp_path):
    nvml = FakeNVML([FakeGpu("GPU-0", "H100", 80 * GiB)], base_used_bytes=GiB)
    sizes = {"a": 2 * GiB, "b": 3 * GiB}
    fleet = Fleet(tmp_path, nvml, list(sizes), sizes, python=False)
    admin = fleet.admins["gpu0"]

    async def go():
        await fleet.mgr.start()
        await fleet.mgr.ensure("a")
        await fleet.mgr.ensure("b")
        admin.leaky.add("a")  # the framework keeps a's allocations after the unload
        await fleet.mgr.unload("a")
        assert fleet.meter.held_bytes("gpu0") == 2 * GiB
        assert fleet.planner("gpu0").capacity.max_bytes == 72 * GiB - 2 * GiB
        nvml.leak("GPU-0", -2 * GiB)  # freed later
        fleet.meter.step(fleet.mgr.servers.values())
        assert fleet.meter.held_bytes("gpu0") == 0
        assert fleet.planner("gpu0").capacity.max_bytes == 72 * GiB

    run(go())
