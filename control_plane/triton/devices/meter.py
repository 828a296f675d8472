"""Measuring each load's GPU memory (``GpuMemoryMeter``; ``NoMemoryMeter`` on CPU) and the
stager that reserves a model's measured size."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from control_plane.triton.devices.discovery import Device, _nvml_error
from control_plane.triton.devices.probe import GpuMemoryProbe, _proc_cmdline, probe_for

log = logging.getLogger(__package__)  # one logger name for the whole package


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
