"""Model-memory budgets: the default per-server budget, and one Triton server per device
with its budget (``--devices``, ``--device-budget``, ``--memory-budget``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from control_plane.triton.devices.discovery import Device
from domain.errors import InvalidInput

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
