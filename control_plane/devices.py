"""Devices the fleet runs on (CPU, whole GPUs, MIG slices) and measured GPU memory.

Discovery uses NVML through ``nvidia-ml-py`` (module ``pynvml``) when it is installed and a
driver answers; otherwise the fleet comes from config (``devices_from_config``), which is
also how a CPU-only machine describes "slices" for tests.  One Triton runs per device; for a
MIG slice it is started with ``CUDA_VISIBLE_DEVICES=<MIG uuid>`` (``launch_env``).

Measured memory: the python backend runs every model instance in its own stub process
(``triton_python_backend_stub <repository>/<model>/<version>/model.py ...``), so NVML's
per-process usage on a device, mapped to models through each stub's command line, is the
model's real footprint.  ``MemoryReconciler.step()`` compares that with what the planner
accounts and corrects (and logs) any drift; on CPU devices the artifact size stays the
estimate and nothing is measured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InvalidInput

log = logging.getLogger(__name__)

DEVICE_KINDS = ("cpu", "gpu", "mig")


@dataclass(frozen=True)
class Device:
    """One place a Triton server can run, with its memory capacity.

    ``isolated``: its memory and compute are not shared with other tenants' servers (a MIG
    slice always; a whole GPU or a CPU only when config says so).  ``reserved_for_sla``: only
    models of that SLA class are placed there.  ``tenants``: if set, only those tenants.
    """

    id: str
    kind: str = "cpu"
    memory_bytes: int | None = None
    uuid: str | None = None  # GPU-... or MIG-...: what CUDA_VISIBLE_DEVICES takes
    parent: str | None = None  # the GPU id of a MIG slice
    name: str = ""  # product name or MIG profile, for people
    isolated: bool = False
    reserved_for_sla: str | None = None
    tenants: frozenset[str] | None = None

    def __post_init__(self):
        if self.kind not in DEVICE_KINDS:
            raise InvalidInput(f"device {self.id!r}: kind {self.kind!r} must be one of {', '.join(DEVICE_KINDS)}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise InvalidInput(f"device {self.id!r}: memory ({self.memory_bytes}) must be > 0 bytes")

    def launch_env(self) -> dict[str, str]:
        """Environment for the Triton bound to this device."""
        if self.kind == "cpu":
            return {"CUDA_VISIBLE_DEVICES": ""}
        if not self.uuid:
            raise InvalidInput(f"device {self.id!r} has no uuid; give one in the fleet config")
        return {"CUDA_VISIBLE_DEVICES": self.uuid}

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "memory_bytes": self.memory_bytes,
                "uuid": self.uuid, "parent": self.parent, "name": self.name,
                "isolated": self.isolated, "reserved_for_sla": self.reserved_for_sla,
                "tenants": sorted(self.tenants) if self.tenants is not None else None}


# --------------------------------------------------------------------------- config
def devices_from_config(entries: Iterable[Mapping[str, Any]]) -> list[Device]:
    """``[{"id": "slice-large", "kind": "mig", "memory_bytes": 20e9, "uuid": "MIG-..."}, ...]``.

    ``isolated`` defaults to True for ``mig``.  Unknown keys are an error (typos must not
    silently drop a constraint).
    """
    allowed = {"id", "kind", "memory_bytes", "uuid", "parent", "name", "isolated",
               "reserved_for_sla", "tenants"}
    devices, seen = [], set()
    for i, entry in enumerate(entries):
        extra = set(entry) - allowed
        if extra:
            raise InvalidInput(f"fleet device #{i}: unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")
        if not entry.get("id"):
            raise InvalidInput(f"fleet device #{i} has no id")
        if entry["id"] in seen:
            raise InvalidInput(f"fleet device id {entry['id']!r} appears twice")
        seen.add(entry["id"])
        kind = entry.get("kind", "cpu")
        tenants = entry.get("tenants")
        memory = entry.get("memory_bytes")
        devices.append(Device(
            id=str(entry["id"]), kind=kind,
            memory_bytes=int(memory) if memory is not None else None,
            uuid=entry.get("uuid"), parent=entry.get("parent"), name=entry.get("name", ""),
            isolated=bool(entry.get("isolated", kind == "mig")),
            reserved_for_sla=entry.get("reserved_for_sla"),
            tenants=frozenset(tenants) if tenants is not None else None))
    return devices


# --------------------------------------------------------------------------- NVML
def load_nvml():
    """The ``pynvml`` module, initialised, or None (not installed / no driver)."""
    try:
        import pynvml  # optional: pip install nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, ...
        log.info("NVML is installed but not usable (%s); using the configured fleet", exc)
        return None
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_error(nvml) -> type[BaseException]:
    return getattr(nvml, "NVMLError", RuntimeError)


def discover(nvml) -> list[Device]:
    """GPUs, and the MIG slices of GPUs in MIG mode (a GPU in MIG mode is not itself a
    device: its memory belongs to the slices)."""
    nvml_error = _nvml_error(nvml)
    devices = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpu_id = f"gpu{index}"
        name = _text(nvml.nvmlDeviceGetName(handle))
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        try:
            current_mig, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml_error:  # NotSupported on GPUs without MIG
            current_mig = 0
        if current_mig:
            slices = []
            for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
                except nvml_error:  # NotFound: no instance at this index
                    continue
                mem = nvml.nvmlDeviceGetMemoryInfo(mig)
                slices.append(Device(
                    id=f"{gpu_id}/mig{mig_index}", kind="mig", memory_bytes=int(mem.total),
                    uuid=_text(nvml.nvmlDeviceGetUUID(mig)), parent=gpu_id,
                    name=_text(nvml.nvmlDeviceGetName(mig)), isolated=True))
            if not slices:
                log.warning("%s (%s) is in MIG mode but has no MIG instances; create some with "
                            "nvidia-smi mig -cgi ... -C", gpu_id, name)
            devices.extend(slices)
        else:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(Device(id=gpu_id, kind="gpu", memory_bytes=int(mem.total), uuid=uuid, name=name))
    return devices


def discover_or_config(config_entries: Iterable[Mapping[str, Any]] | None = None, nvml=None,
                       use_nvml: bool = True) -> list[Device]:
    """Configured devices win (they carry SLA/tenant labels); else NVML; else one CPU."""
    if config_entries:
        return devices_from_config(config_entries)
    if use_nvml:
        nvml = nvml if nvml is not None else load_nvml()
        if nvml is not None:
            found = discover(nvml)
            if found:
                return found
    return [Device(id="cpu", kind="cpu")]


# --------------------------------------------------------------------------- memory
def _stub_model(cmdline: list[str], repository: Path) -> str | None:
    """The model a python-backend stub serves, from its command line (the model.py path)."""
    if not cmdline or not cmdline[0].endswith("triton_python_backend_stub"):
        return None
    for arg in cmdline[1:]:
        try:
            rel = Path(arg).resolve().relative_to(repository)
        except (ValueError, OSError):
            continue
        if rel.parts:
            return rel.parts[0]
    return None


def _proc_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


@dataclass
class GpuMemoryProbe:
    """Per-model GPU bytes on one device from NVML's per-process accounting."""

    nvml: Any
    handle: Any  # NVML handle of the GPU or MIG slice
    repository: Path
    cmdline_of: Callable[[int], list[str]] = _proc_cmdline

    def device_used_bytes(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def per_model_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        repo = self.repository.resolve()
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            used = getattr(proc, "usedGpuMemory", None)
            if used is None:  # not reported (e.g. in some containers): no measurement
                continue
            model = _stub_model(self.cmdline_of(int(proc.pid)), repo)
            if model is not None:
                out[model] = out.get(model, 0) + int(used)
        return out


def probe_for(device: Device, nvml, repository: Path) -> GpuMemoryProbe | None:
    """A probe for a GPU or MIG device (looked up by uuid); None for a CPU device."""
    if device.kind == "cpu" or nvml is None or not device.uuid:
        return None
    return GpuMemoryProbe(nvml, nvml.nvmlDeviceGetHandleByUUID(device.uuid), repository)


@dataclass
class Correction:
    server: str
    model: str
    accounted_bytes: int
    measured_bytes: int


@dataclass
class MemoryReconciler:
    """Correct the planner's accounting from measurements; one ``step()`` per reconcile pass.

    ``probes`` maps server name -> GpuMemoryProbe (CPU servers have none).  A resident whose
    measured bytes differ from its accounted bytes by more than ``tolerance_fraction`` (and
    ``tolerance_bytes``) gets the measured value, logged; the registry stores the footprint
    so the next load reserves the right amount.  Models still LOADING are skipped (their
    memory is still growing).
    """

    manager: Any
    probes: dict[str, GpuMemoryProbe] = field(default_factory=dict)
    registry: Any = None
    tolerance_fraction: float = 0.10
    tolerance_bytes: int = 16 << 20
    _baseline_unaccounted: dict[str, int] = field(default_factory=dict)

    def step(self) -> list[Correction]:
        corrections = []
        for server_name, probe in self.probes.items():
            server = self.manager.servers.get(server_name)
            if server is None or not server.up:
                continue
            try:
                measured = probe.per_model_bytes()
            except Exception:  # one device failing to answer never stops the loop
                log.exception("measuring GPU memory on %s failed", server_name)
                continue
            for name, resident in list(server.planner.residents.items()):
                rec = self.manager.records.get(name)
                if rec is None or rec.state.value != "ready" or name not in measured:
                    continue
                actual = measured[name]
                drift = abs(actual - resident.size_bytes)
                if drift <= max(self.tolerance_bytes, self.tolerance_fraction * resident.size_bytes):
                    continue
                log.warning("memory accounting of %s on %s corrected: %d bytes accounted, %d "
                            "measured by NVML", name, server_name, resident.size_bytes, actual)
                corrections.append(Correction(server_name, name, resident.size_bytes, actual))
                resident.size_bytes = actual
                rec.memory_bytes = actual
                if self.registry is not None:
                    self.registry.record_memory(name, actual)
            accounted = server.planner.used_bytes
            try:
                device_used = probe.device_used_bytes()
            except _nvml_error(probe.nvml) as exc:
                log.warning("reading %s's device memory failed: %s", server_name, exc)
                continue
            # Memory no model process holds (Triton's own CUDA context, allocator caches, leaks):
            # the first pass sets the baseline, growth beyond the tolerance is reported.
            unaccounted = device_used - sum(measured.values())
            baseline = self._baseline_unaccounted.setdefault(server_name, unaccounted)
            if unaccounted - baseline > self.tolerance_bytes + self.tolerance_fraction * max(accounted, 1):
                log.warning("%s: %d bytes more than at start are in use on the device but belong "
                            "to no model (leak or another process); accounted %d, device reports "
                            "%d used", server_name, unaccounted - baseline, accounted, device_used)
        return corrections


# --------------------------------------------------------------------------- default budget
# With no --memory-budget, each local Triton gets a share of what the machine has, so a
# burst of loads cannot take all of the host's RAM (CPU) or run a GPU out of memory.
HOST_MEMORY_FRACTION = 0.5  # of host RAM, for models on CPU; the rest for the OS, stubs, tiers
GPU_RESERVE_FRACTION = 0.10  # of a GPU's memory, for Triton's CUDA context and allocator caches
GPU_RESERVE_MIN_BYTES = 1 << 30


def host_memory_bytes(meminfo: str | None = None, cgroup_max: str | None = None) -> int | None:
    """RAM this process may use: MemTotal of /proc/meminfo, capped by the cgroup v2 limit
    (``memory.max``) when running in a container with one.  None when neither is readable."""
    if meminfo is None:
        meminfo = _read_text("/proc/meminfo")
    if cgroup_max is None:
        cgroup_max = _read_text("/sys/fs/cgroup/memory.max")
    total = None
    for line in (meminfo or "").splitlines():
        key, _, rest = line.partition(":")
        if key == "MemTotal":
            parts = rest.split()
            try:
                total = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
            except (IndexError, ValueError):
                total = None
            break
    limit = (cgroup_max or "").strip()
    if limit.isdigit():
        total = min(total, int(limit)) if total is not None else int(limit)
    return total


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def default_memory_budget(devices: Iterable[Device], servers: int,
                          host_bytes: int | None) -> tuple[int | None, str]:
    """The per-server model-memory budget when the operator gave none, and how it was derived.

    GPUs (or MIG slices) found: the smallest one's memory less a reserve
    (``GPU_RESERVE_FRACTION``, at least ``GPU_RESERVE_MIN_BYTES``), shared by the ``servers``
    local Tritons (a Triton not bound to one device may place models on any of them).
    Otherwise ``HOST_MEMORY_FRACTION`` of host RAM shared by the ``servers``.  (None, why)
    when nothing is known."""
    servers = max(1, servers)
    gpus = [d for d in devices if d.kind in ("gpu", "mig") and d.memory_bytes]
    if gpus:
        smallest = min(gpus, key=lambda d: d.memory_bytes or 0)
        total = smallest.memory_bytes or 0
        usable = total - max(GPU_RESERVE_MIN_BYTES, int(total * GPU_RESERVE_FRACTION))
        if usable > 0:
            return usable // servers, (
                f"{smallest.id} ({smallest.name or smallest.kind}) memory {total} bytes less a "
                f"{GPU_RESERVE_FRACTION:.0%} reserve, shared by {servers} server(s)")
    if host_bytes:
        return int(host_bytes * HOST_MEMORY_FRACTION) // servers, (
            f"{HOST_MEMORY_FRACTION:.0%} of host RAM ({host_bytes} bytes), shared by "
            f"{servers} server(s)")
    return None, "neither GPU memory nor host RAM could be read"
