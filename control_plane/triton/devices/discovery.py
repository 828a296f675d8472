"""The device model (CPU, whole GPU, MIG slice), the configured fleet, and NVML discovery.

Discovery uses NVML through ``nvidia-ml-py`` (module ``pynvml``) when it is installed and a
driver answers; otherwise the fleet comes from config (``devices_from_config``), which is
also how a CPU-only machine describes "slices" for tests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from domain.errors import InvalidInput

log = logging.getLogger(__package__)  # one logger name for the whole package

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
