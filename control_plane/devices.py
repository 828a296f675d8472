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

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
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
        if Path("/dev/nvidiactl").exists():  # a driver is there: the GPUs would go unused
            log.warning("this machine has an NVIDIA driver but nvidia-ml-py is not installed: "
                        "no GPU is discovered and models run on CPU; pip install nvidia-ml-py")
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
        for (model, _pid), used in self.stub_processes().items():
            out[model] = out.get(model, 0) + used
        return out

    def stub_processes(self) -> dict[tuple[str, int], int]:
        """(model, pid) -> GPU bytes of every python-backend stub on the device."""
        out: dict[tuple[str, int], int] = {}
        repo = self.repository.resolve()
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            used = getattr(proc, "usedGpuMemory", None)
            if used is None:  # not reported (e.g. in some containers): no measurement
                continue
            model = _stub_model(self.cmdline_of(int(proc.pid)), repo)
            if model is not None:
                out[(model, int(proc.pid))] = int(used)
        return out


def probe_for(device: Device, nvml, repository: Path,
              cmdline_of: Callable[[int], list[str]] = _proc_cmdline) -> GpuMemoryProbe | None:
    """A probe for a GPU or MIG device (looked up by uuid); None for a CPU device."""
    if device.kind == "cpu" or nvml is None or not device.uuid:
        return None
    return GpuMemoryProbe(nvml, nvml.nvmlDeviceGetHandleByUUID(device.uuid), repository, cmdline_of)


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


def gpu_reserve_bytes(total_bytes: int) -> int:
    """Memory of a GPU or MIG slice that models never get: the Triton process's own CUDA
    context, its CUDA memory pool and pinned staging, allocator caches and fragmentation
    headroom.  ``GPU_RESERVE_FRACTION`` of the device, at least ``GPU_RESERVE_MIN_BYTES``
    (a small MIG slice still needs a whole context).  Each python-backend model's own CUDA
    context is part of the model's measured size, not of this reserve."""
    return max(GPU_RESERVE_MIN_BYTES, int(total_bytes * GPU_RESERVE_FRACTION))


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
        usable = total - gpu_reserve_bytes(total)
        if usable > 0:
            return usable // servers, (
                f"{smallest.id} ({smallest.name or smallest.kind}) memory {total} bytes less a "
                f"{GPU_RESERVE_FRACTION:.0%} reserve, shared by {servers} server(s)")
    if host_bytes:
        return int(host_bytes * HOST_MEMORY_FRACTION) // servers, (
            f"{HOST_MEMORY_FRACTION:.0%} of host RAM ({host_bytes} bytes), shared by "
            f"{servers} server(s)")
    return None, "neither GPU memory nor host RAM could be read"


# --------------------------------------------------------------------------- one Triton per device
def server_name(device: Device) -> str:
    """The Triton server of a device is named after it: ``gpu0``, ``gpu1-mig2``."""
    return device.id.replace("/", "-")


def _matches(device: Device, key: str) -> bool:
    return key in (device.id, server_name(device), device.uuid)


def select_devices(found: Sequence[Device], wanted: Sequence[str] | None) -> list[Device]:
    """The devices ``--devices`` names: ids (``gpu0``, ``gpu1/mig2``), server names
    (``gpu1-mig2``) or UUIDs; the id of a GPU in MIG mode selects all its slices.  In
    discovery order (ports follow it); an unknown name is an error listing what exists."""
    if not wanted:
        return list(found)
    chosen: set[str] = set()
    for key in wanted:
        hits = [d for d in found if _matches(d, key) or d.parent == key]
        if not hits:
            have = ", ".join(d.id for d in found) or "none (NVML found no GPU)"
            raise InvalidInput(f"--devices names {key!r}, which is not a device of this machine; "
                               f"devices: {have}")
        chosen.update(d.id for d in hits)
    return [d for d in found if d.id in chosen]


def device_budget_bytes(device: Device) -> int | None:
    """A GPU or MIG slice's model-memory budget: its memory less ``gpu_reserve_bytes``."""
    if device.kind == "cpu" or not device.memory_bytes:
        return None
    usable = device.memory_bytes - gpu_reserve_bytes(device.memory_bytes)
    if usable <= 0:
        raise InvalidInput(
            f"device {device.id} has {device.memory_bytes} bytes, no more than the "
            f"{gpu_reserve_bytes(device.memory_bytes)}-byte reserve for Triton's CUDA context; "
            f"give it a budget (--device-budget {device.id}=SIZE) or leave it out (--devices)")
    return usable


@dataclass(frozen=True)
class DeviceServer:
    """The Triton server to start for one device, with its byte budget and why."""

    name: str
    device: Device
    budget_bytes: int | None
    budget_source: str

    def launch_env(self) -> dict[str, str]:
        return self.device.launch_env()


def device_servers(devices: Sequence[Device], memory_budget_bytes: int | None = None,
                   derive_budget: bool = True,
                   overrides: Mapping[str, int] | None = None) -> list[DeviceServer]:
    """One server per device.  Budget: the device's own override (``--device-budget ID=SIZE``,
    keyed by id, server name or UUID), else ``--memory-budget`` for every device, else none
    with ``--memory-budget unlimited``, else the device's memory less the reserve."""
    overrides = dict(overrides or {})
    for key in overrides:
        if not any(_matches(d, key) for d in devices):
            have = ", ".join(d.id for d in devices) or "none"
            raise InvalidInput(f"--device-budget names {key!r}, which is not a device this "
                               f"fleet runs on; devices: {have}")
    out = []
    for d in devices:
        own = next((b for k, b in overrides.items() if _matches(d, k)), None)
        if own is not None:
            if own < 1:
                raise InvalidInput(f"--device-budget for {d.id} ({own}) must be > 0 bytes")
            budget, why = own, "--device-budget"
        elif memory_budget_bytes is not None:
            budget, why = memory_budget_bytes, "--memory-budget"
        elif not derive_budget:
            budget, why = None, "--memory-budget unlimited"
        else:
            budget = device_budget_bytes(d)
            why = (f"{d.memory_bytes} bytes of {d.name or d.kind} less a "
                   f"{gpu_reserve_bytes(d.memory_bytes or 0)}-byte reserve")
        out.append(DeviceServer(server_name(d), d, budget, why))
    return out


# --------------------------------------------------------------------------- measuring loads
@dataclass
class Measurement:
    """What a load took on its device, filled in when the load succeeded (None: unmeasured)."""

    bytes: int | None = None
    how: str = ""  # "stub process" (NVML per-process) or "device delta" (NVML used memory)


class NoMemoryMeter:
    """CPU servers: a model's bytes are its artifact size; nothing is measured."""

    @contextlib.asynccontextmanager
    async def measuring(self, server, model: str) -> AsyncIterator[Measurement]:
        yield Measurement()

    async def released(self, server, model: str) -> bool:
        return True

    def describe(self, server) -> dict:
        return {}

    def step(self, servers: Iterable) -> None:
        return None


@dataclass
class _Held:
    """GPU memory of an unloaded model that NVML does not show back yet."""

    model: str
    bytes: int
    pids: frozenset[int] | None  # stubs still holding it; None: seen only in the device total


def is_python_backend(config_text: str) -> bool:
    """Whether a config.pbtxt is a python-backend model (one stub process per instance)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(config_text, config)
    except text_format.ParseError:
        return False
    return config.backend == "python"


class GpuMemoryMeter:
    """Measures each load's GPU memory through NVML and keeps unreturned memory counted.

    * A python-backend model runs in its own stub processes: its size is what NVML's process
      list says those stubs hold (CUDA context, weights, allocator cache), after the load
      and its warm-up.  Loads of such models on one device run side by side.
    * Any other model shares Triton's process: its size is the device's used-memory delta
      across load and warm-up, so such loads on one device take turns (``_lock``) and a
      concurrent python-backend load on the same device can inflate the delta.
    * An unload counts as free only once NVML shows the memory back: the model's stubs gone
      from the process list, or the device's used memory down to what the remaining models
      account for.  Memory not back after ``release_timeout_s`` stays counted: it is taken
      off the server's budget (``unreturned_bytes`` in ``mmctl fleet``) until a later
      ``step`` sees it back, and the reconcile evicts down to the smaller budget.

    Every measurement goes to the registry (``record_memory``), so the next load of the model
    reserves what it really takes.  ``devices`` maps server name -> Device; servers without
    a GPU device are not measured.
    """

    def __init__(self, nvml, devices: Mapping[str, Device], repository: Path, registry=None,
                 release_timeout_s: float = 30.0, poll_s: float = 0.1,
                 tolerance_bytes: int = 64 << 20,
                 cmdline_of: Callable[[int], list[str]] = _proc_cmdline,
                 clock: Callable[[], float] = time.monotonic):
        self.nvml = nvml
        self.devices = dict(devices)
        self.repository = Path(repository)
        self.registry = registry
        self.release_timeout_s = release_timeout_s
        self.poll_s = poll_s
        self.tolerance_bytes = tolerance_bytes
        self.clock = clock
        self.probes: dict[str, GpuMemoryProbe] = {}
        for name, device in self.devices.items():
            probe = probe_for(device, nvml, self.repository, cmdline_of)
            if probe is not None:
                self.probes[name] = probe
        # Used memory of each device before any model: the Triton process's own share.
        self.baseline_bytes = {name: self._used(name) or 0 for name in self.probes}
        self.measured: dict[str, dict[str, int]] = {}  # server -> model -> bytes, resident
        self.held: dict[str, list[_Held]] = {}  # server -> unreturned memory
        self._locks: dict[str, asyncio.Lock] = {}

    # -- helpers ------------------------------------------------------------------------
    def _used(self, server_name: str) -> int | None:
        try:
            return self.probes[server_name].device_used_bytes()
        except _nvml_error(self.nvml) as exc:
            log.warning("NVML could not read the memory of %s's device: %s", server_name, exc)
            return None

    def _lock(self, server_name: str) -> asyncio.Lock:
        lock = self._locks.get(server_name)
        if lock is None:
            lock = self._locks[server_name] = asyncio.Lock()
        return lock

    def _python_backend(self, model: str) -> bool:
        try:
            return is_python_backend((self.repository / model / "config.pbtxt").read_text())
        except OSError:
            return False

    def _stubs_of(self, server_name: str, model: str) -> dict[int, int]:
        """pid -> GPU bytes of ``model``'s stubs on the server's device."""
        return {pid: used for (name, pid), used in self.probes[server_name].stub_processes().items()
                if name == model}

    def held_bytes(self, server_name: str) -> int:
        return sum(h.bytes for h in self.held.get(server_name, ()))

    def _apply_budget(self, server) -> None:
        """The planner's byte budget is the server's budget less its unreturned memory."""
        budget = server.spec.memory_budget_bytes
        if budget is not None:
            server.planner.capacity.max_bytes = max(0, budget - self.held_bytes(server.name))

    # -- the manager's hooks ------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def measuring(self, server, model: str) -> AsyncIterator[Measurement]:
        """Wraps a load and its warm-up; on success ``Measurement.bytes`` is the model's GPU
        memory (None on a server without a GPU, or when NVML reports no process memory)."""
        m = Measurement()
        if server.name not in self.probes:
            yield m
            return
        if await asyncio.to_thread(self._python_backend, model):
            yield m
            stubs = await asyncio.to_thread(self._stubs_of, server.name, model)
            if not stubs:
                log.warning("NVML lists no GPU memory of %s's stub on %s (no per-process "
                            "accounting here, or the stub runs in another PID namespace); its "
                            "size stays the estimate", model, server.name)
                return
            m.bytes, m.how = sum(stubs.values()), "stub process"
        else:
            async with self._lock(server.name):  # the delta must be this load's alone
                before = await asyncio.to_thread(self._used, server.name)
                yield m
                after = await asyncio.to_thread(self._used, server.name)
            if before is None or after is None:
                return
            m.bytes, m.how = max(0, after - before), "device delta"
        self.measured.setdefault(server.name, {})[model] = m.bytes
        if self.registry is not None:
            self.registry.record_memory(model, m.bytes)
        log.info("%s on %s takes %d bytes of GPU memory (%s, NVML)", model, server.name,
                 m.bytes, m.how)

    async def released(self, server, model: str) -> bool:
        """Wait until NVML shows ``model``'s memory back after Triton unloaded it.  False when
        it is not back in ``release_timeout_s``: that memory then stays counted (see class)."""
        measured = self.measured.get(server.name, {}).pop(model, None)
        if server.name not in self.probes:
            return True
        deadline = self.clock() + self.release_timeout_s
        if await asyncio.to_thread(self._python_backend, model):
            while True:
                stubs = await asyncio.to_thread(self._stubs_of, server.name, model)
                if not stubs:
                    return True
                if self.clock() >= deadline:
                    self._hold(server, _Held(model, sum(stubs.values()), frozenset(stubs)))
                    return False
                await asyncio.sleep(self.poll_s)
        resident = server.planner.residents.get(model)
        others = server.planner.used_bytes - (resident.size_bytes if resident is not None else 0)
        async with self._lock(server.name):  # no other delta-measured load moves the total
            while True:
                used = await asyncio.to_thread(self._used, server.name)
                if used is None:
                    return True  # NVML is not answering: Triton's word is all there is
                excess = used - (self.baseline_bytes[server.name] + others + self.held_bytes(server.name))
                if excess <= self.tolerance_bytes:
                    return True
                if self.clock() >= deadline:
                    self._hold(server, _Held(model, min(excess, measured or excess), None))
                    return False
                await asyncio.sleep(self.poll_s)

    def _hold(self, server, held: _Held) -> None:
        self.held.setdefault(server.name, []).append(held)
        self._apply_budget(server)
        log.warning("%s: %d bytes of GPU memory of %s are not back %.0fs after Triton unloaded "
                    "it (NVML%s); they stay counted as used, so the budget for models is %s "
                    "bytes until they are", server.name, held.bytes, held.model,
                    self.release_timeout_s,
                    f": stub pids {sorted(held.pids)} still hold it" if held.pids else "",
                    server.planner.capacity.max_bytes)

    def step(self, servers: Iterable) -> None:
        """One reconcile pass: give back to the budget what NVML now shows free again."""
        for server in servers:
            held = self.held.get(server.name)
            if not held or server.name not in self.probes:
                continue
            try:
                live = {pid for _model, pid in self.probes[server.name].stub_processes()}
                used = self.probes[server.name].device_used_bytes()
            except _nvml_error(self.nvml) as exc:
                log.warning("NVML could not read %s's device: %s", server.name, exc)
                continue
            by_pids = [h for h in held if h.pids is not None and h.pids & live]
            # Device-level leftovers are back as far as the device total says.
            excess = (used - self.baseline_bytes[server.name] - server.planner.used_bytes
                      - sum(h.bytes for h in by_pids))
            by_total: list[_Held] = []
            for h in reversed([h for h in held if h.pids is None]):  # newest kept first
                if excess > self.tolerance_bytes:
                    by_total.append(h)
                    excess -= h.bytes
            kept = by_pids + by_total
            for h in held:
                if h not in kept:
                    log.info("%s: the %d bytes of GPU memory that %s held are back (NVML)",
                             server.name, h.bytes, h.model)
            self.held[server.name] = kept
            self._apply_budget(server)

    def describe(self, server) -> dict:
        """What ``mmctl fleet`` shows about the server's device (NVML read now)."""
        device = self.devices.get(server.name)
        if device is None:
            return {}
        out = {"device_kind": device.kind, "device_uuid": device.uuid,
               "device_name": device.name, "isolated": device.isolated,
               "device_memory_bytes": device.memory_bytes,
               "measured_bytes": sum(self.measured.get(server.name, {}).values()),
               "unreturned_bytes": self.held_bytes(server.name)}
        if server.name in self.probes:
            out["device_used_bytes"] = self._used(server.name)
        return out


def reserve_measured(stager, registry):
    """The stager a GPU fleet's manager uses: ``stage`` returns the model's measured size
    from the registry when it is larger than its files, so a load reserves what the model
    took last time rather than its artifact size."""
    return _MeasuredStager(stager, registry)


@dataclass
class _MeasuredStager:
    stager: Any
    registry: Any

    async def stage(self, model: str) -> int:
        size = await self.stager.stage(model)
        mv = self.registry.by_name(model)
        measured = getattr(mv, "memory_bytes", None) or 0
        return max(size, measured)

    def set_busy(self, model: str, busy: bool) -> None:
        self.stager.set_busy(model, busy)

    def known(self) -> set[str]:
        return self.stager.known()
