"""TEST ONLY: a fake NVML with the surface of ``pynvml`` that the control plane uses.

Production code takes its NVML module by injection (``ServiceConfig.nvml``, ``discover``,
``GpuMemoryMeter``); tests pass a ``FakeNVML`` instead, so the GPU and MIG code paths run
on machines without a GPU.  Two ways in:

* unit tests build one in code (``FakeNVML([FakeGpu(...)])``) and script its processes
  and leaks (``set_process``, ``end_process``, ``leak``);
* integration tests start ``mmctl up`` with the environment variable
  ``MMS_TEST_FAKE_NVML=<spec.json>`` (``TEST_HOOK_ENV``), the one test hook that puts a fake
  into the product.  Real CPU tritonservers then stand in for the fake devices: each gets
  ``CUDA_VISIBLE_DEVICES`` set to its fake UUID, its models' instances run as
  ``stand_in_instance_kind`` (KIND_CPU: the stand-ins have no GPU), and the fake's process
  list holds the real python-backend stubs running with that UUID, each reported with
  ``stub_bytes`` of GPU memory.  Spec::

      {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-fake-0", "memory_bytes": 85899345920},
                {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-fake-1", "memory_bytes": 85899345920,
                 "mig": [{"name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "uuid": "MIG-fake-1-0",
                          "memory_bytes": 10737418240}]}],
       "stub_bytes": 314572800, "base_used_bytes": 536870912,
       "stand_in_instance_kind": "KIND_CPU"}

Nothing here talks to a driver; nothing in production imports this module except through
that hook.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

TEST_HOOK_ENV = "MMS_TEST_FAKE_NVML"
_MAX_MIG = 7  # an H100/A100 has at most 7 MIG instances


class NVMLError(Exception):
    """pynvml.NVMLError's stand-in (NotFound, NotSupported...)."""


@dataclass
class FakeMig:
    uuid: str
    name: str
    memory_bytes: int


@dataclass
class FakeGpu:
    uuid: str
    name: str
    memory_bytes: int
    mig: list[FakeMig] | None = None  # None: MIG off (or unsupported); a list: MIG mode


@dataclass
class FakeNVML:
    """One fake driver: GPUs, MIG slices, processes on each device and memory in use.

    A device's used memory is ``base_used_bytes`` + its processes' bytes + what ``leak``
    added (memory that no process holds, as after a framework leak)."""

    gpus: list[FakeGpu]
    base_used_bytes: int = 0
    stand_in_instance_kind: str | None = None  # set for CPU Tritons standing in for devices
    # uuid -> {pid: bytes}: live processes (e.g. scanned from /proc), on top of the scripted
    process_source: Callable[[str], dict[int, int]] | None = None
    processes: dict[str, dict[int, int]] = field(default_factory=dict)
    leaked: dict[str, int] = field(default_factory=dict)
    initialised: bool = False

    NVMLError = NVMLError

    # -- scripting (tests) --------------------------------------------------------------
    def set_process(self, uuid: str, pid: int, used_bytes: int) -> None:
        self.processes.setdefault(uuid, {})[pid] = used_bytes

    def end_process(self, pid: int) -> None:
        for procs in self.processes.values():
            procs.pop(pid, None)

    def leak(self, uuid: str, used_bytes: int) -> None:
        self.leaked[uuid] = self.leaked.get(uuid, 0) + used_bytes

    # -- pynvml's surface ---------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int):
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return ("gpu", index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return ("gpu", i)
            for j, mig in enumerate(gpu.mig or []):
                if mig.uuid == uuid:
                    return ("mig", i, j)
        raise NVMLError("Not Found")

    def _device(self, handle) -> FakeGpu | FakeMig:
        gpu = self.gpus[handle[1]]
        return gpu if handle[0] == "gpu" else (gpu.mig or [])[handle[2]]

    def nvmlDeviceGetName(self, handle) -> str:
        return self._device(handle).name

    def nvmlDeviceGetUUID(self, handle) -> str:
        return self._device(handle).uuid

    def nvmlDeviceGetMigMode(self, handle) -> tuple[int, int]:
        gpu = self.gpus[handle[1]]
        if gpu.mig is None:
            raise NVMLError("Not Supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle) -> int:
        return _MAX_MIG

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index: int):
        migs = self.gpus[handle[1]].mig or []
        if index >= len(migs):
            raise NVMLError("Not Found")
        return ("mig", handle[1], index)

    def _processes(self, uuid: str) -> dict[int, int]:
        procs = dict(self.process_source(uuid)) if self.process_source is not None else {}
        procs.update(self.processes.get(uuid, {}))
        return procs

    def nvmlDeviceGetComputeRunningProcesses(self, handle) -> list:
        uuid = self._device(handle).uuid
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in sorted(self._processes(uuid).items())]

    def nvmlDeviceGetMemoryInfo(self, handle):
        device = self._device(handle)
        used = (self.base_used_bytes + sum(self._processes(device.uuid).values())
                + self.leaked.get(device.uuid, 0))
        return SimpleNamespace(total=device.memory_bytes, used=used,
                               free=max(0, device.memory_bytes - used))


# --------------------------------------------------------------------------- the test hook
def stub_processes_on(uuid: str, stub_bytes: int) -> dict[int, int]:
    """Real python-backend stubs of this machine whose CUDA_VISIBLE_DEVICES is ``uuid`` (the
    stand-in Triton of that device started them), each reported with ``stub_bytes``."""
    out = {}
    want = f"CUDA_VISIBLE_DEVICES={uuid}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
            if not argv0.endswith(b"triton_python_backend_stub"):
                continue
            if want in (entry / "environ").read_bytes().split(b"\0"):
                out[int(entry.name)] = stub_bytes
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return out


def from_spec(spec: dict) -> FakeNVML:
    """A FakeNVML from the JSON spec described in the module docstring."""
    gpus = [FakeGpu(g["uuid"], g.get("name", "Fake GPU"), int(g["memory_bytes"]),
                    None if g.get("mig") is None else
                    [FakeMig(m["uuid"], m.get("name", "Fake MIG"), int(m["memory_bytes"]))
                     for m in g["mig"]])
            for g in spec.get("gpus", [])]
    stub_bytes = int(spec.get("stub_bytes", 0))
    return FakeNVML(gpus, base_used_bytes=int(spec.get("base_used_bytes", 0)),
                    stand_in_instance_kind=spec.get("stand_in_instance_kind"),
                    process_source=(lambda uuid: stub_processes_on(uuid, stub_bytes))
                    if stub_bytes else None)


def from_test_hook(environ: dict[str, str] | None = None) -> FakeNVML | None:
    """The fake named by ``MMS_TEST_FAKE_NVML``, or None when the variable is not set."""
    path = (environ if environ is not None else os.environ).get(TEST_HOOK_ENV)
    if not path:
        return None
    return from_spec(json.loads(Path(path).read_text()))
