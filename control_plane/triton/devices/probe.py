"""Per-model GPU memory from NVML's per-process accounting, and the reconcile pass that
corrects the planner's accounting from it.

The python backend runs every model instance in its own stub process
(``triton_python_backend_stub <repository>/<model>/<version>/model.py ...``), so NVML's
per-process usage on a device, mapped to models through each stub's command line, is the
model's real footprint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from control_plane.triton.devices.discovery import Device, _nvml_error

log = logging.getLogger(__package__)  # one logger name for the whole package


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
                self.manager.correct_size(name, actual)
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
