"""Which Triton servers the control plane manages: one launched per GPU or MIG slice (or N
on CPU), and servers that run elsewhere, registered by address (``--attach`` or a servers
file listing every node's Tritons).  ``Service`` builds one ``TritonFleet`` and asks it for
its servers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ServerSpec, TritonServer
from control_plane.triton.admin import admin_key_headers
from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from domain.errors import InvalidInput
from domain.sizes import parse_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteServer:
    """A Triton that runs elsewhere (another node, a container), registered by address."""

    name: str
    grpc_url: str
    http_url: str
    metrics_url: str | None = None
    node: str | None = None
    memory_budget_bytes: int | None = None
    max_loaded: int | None = None
    concurrency: int | None = None


def load_servers_file(path: Path) -> list[RemoteServer]:
    """``{"servers": [{"name", "grpc_url", "http_url", "metrics_url"?, "node"?,
    "memory_budget"? (bytes or "70GiB"), "max_loaded"?, "concurrency"?}, ...]}`` (JSON)."""
    from domain.names import validate_model_name

    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise InvalidInput(f"cannot read the servers file {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise InvalidInput(f"the servers file {path} is not JSON ({exc})") from exc
    entries = doc.get("servers") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InvalidInput(f"the servers file {path} must hold {{\"servers\": [...]}} with at "
                           "least one server (name, grpc_url, http_url)")
    found: list[RemoteServer] = []
    for i, entry in enumerate(entries):
        where = f"{path}: servers[{i}]"
        if not isinstance(entry, dict):
            raise InvalidInput(f"{where} must be an object with name, grpc_url and http_url")
        unknown = set(entry) - {"name", "grpc_url", "http_url", "metrics_url", "node",
                                "memory_budget", "max_loaded", "concurrency"}
        if unknown:
            raise InvalidInput(f"{where} has unknown fields {sorted(unknown)}; a server has "
                               "name, grpc_url, http_url, metrics_url, node, memory_budget, "
                               "max_loaded, concurrency")
        missing = [k for k in ("name", "grpc_url", "http_url") if not entry.get(k)]
        if missing:
            raise InvalidInput(f"{where} lacks {', '.join(missing)}")
        try:
            validate_model_name(str(entry["name"]))
        except Exception as exc:
            raise InvalidInput(f"{where}: server name {entry['name']!r} is not valid ({exc})") from exc
        budget = entry.get("memory_budget")
        if isinstance(budget, str):
            try:
                budget = parse_size(budget)
            except InvalidInput as exc:
                raise InvalidInput(f"{where}: memory_budget {exc.message}") from None
        max_loaded = entry.get("max_loaded")
        if max_loaded is not None and (not isinstance(max_loaded, int) or max_loaded < 1):
            raise InvalidInput(f"{where}: max_loaded must be a whole number >= 1")
        concurrency = entry.get("concurrency")
        if concurrency is not None and (type(concurrency) is not int or concurrency < 1):
            raise InvalidInput(f"{where}: concurrency must be a whole number >= 1 (requests "
                               "the server takes at once from the router)")
        found.append(RemoteServer(str(entry["name"]), str(entry["grpc_url"]), str(entry["http_url"]),
                                  entry.get("metrics_url"), entry.get("node"),
                                  int(budget) if budget is not None else None, max_loaded,
                                  concurrency))
    names = [s.name for s in found]
    if len(set(names)) != len(names):
        raise InvalidInput(f"the servers file {path} names a server twice: each needs its own name")
    return found


def free_memory_probe(memory=None):
    """The manager's measured-free-memory probe (a load may overlap its victims' unloads
    where it holds the newcomer): MemAvailable for local CPU servers, NVML's free memory for
    a GPU server that ``memory`` (devices.GpuMemoryMeter) measures; None elsewhere (attached
    Tritons: their machine is not this one), so nothing overlaps there."""
    from control_plane.manager.room import host_available_bytes

    def free_memory(server) -> int | None:
        probe = getattr(memory, "probes", {}).get(server.name) if memory is not None else None
        if probe is not None:
            return int(probe.nvml.nvmlDeviceGetMemoryInfo(probe.handle).free)
        if server.spec.device == "cpu" and server.process is not None:
            return host_available_bytes()
        return None

    return free_memory


OPEN_MODEL_CONTROL_WARNING = (
    "%s (%s) takes model control from anyone who reaches its ports: any process or web page "
    "that can connect to it can load a model, and so run code as its user. Start it with "
    "--grpc-restricted-protocol=model-repository,shared-memory,trace,logging:admin-key=<key> and "
    "--http-restricted-api=<the same>, and give the control plane the key with "
    "MMS_TRITON_ADMIN_KEY (docs/operations.md: Security model)")


async def check_model_control(servers: list[TritonServer]) -> None:
    """Ask each server for its repository index without the key: an answer means its model
    control is open to anyone (``server.model_control``); an attached server that is open is
    logged as a warning at start, and ``mmctl fleet`` shows it."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    async def check(server: TritonServer) -> None:
        async with grpc.aio.insecure_channel(server.spec.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                await stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                restricted = "restricted" in (exc.details() or "")
                server.model_control = "restricted" if restricted else "unknown"
                return
        server.model_control = "open"
        log.warning(OPEN_MODEL_CONTROL_WARNING, server.name, server.spec.grpc_url)

    await asyncio.gather(*(check(s) for s in servers))


def _port(base: int, i: int) -> int:
    return 0 if base == 0 else base + 10 * i


class TritonFleet:
    """The Tritons a control plane manages: launched here (one per GPU or MIG slice, or
    ``--triton-servers`` on CPU) or registered by address.  ``start`` launches them and
    returns the manager's servers; ``stop`` stops the ones launched here."""

    def __init__(self, cfg, supervised: bool):
        self.cfg = cfg  # runtime.config.ServiceConfig
        # Router workers run beside the control plane: the Tritons launched here outlive a
        # crash of it, and its next life adopts them.
        self.supervised = supervised
        self.processes: list[TritonProcess] = []
        self.devices: list = []  # devices.Device: the GPUs / MIG slices with a Triton each
        self.nvml = None
        self.labels: dict = {}  # server name -> placement.ServerLabels
        self.repository = Path()  # the warm tier the Tritons serve from
        self.families = None  # families.FamilyCatalog
        # The key Tritons launched here take model control (and their other restricted APIs)
        # with, and every server's model control sends; given to ``start``.
        self.restricted_key: str | None = None
        # Called before each load and unload: raises while this control plane may not act
        # (a leader whose lease may have run out); None: it always may.
        self.guard: Callable[[], None] | None = None

    def start(self, repository: Path, families, restricted_key: str | None = None,
              guard: Callable[[], None] | None = None) -> list[TritonServer]:
        """Discover the devices, launch a Triton per device (or the CPU ones), register the
        attached ones; the servers, in that order."""
        self.repository, self.families = repository, families
        self.restricted_key, self.guard = restricted_key, guard
        self.devices = self.discover_devices()
        if self.devices:
            return self._start_device_tritons() + self._attached_servers()
        return self._start_cpu_tritons() + self._attached_servers()

    def stop(self) -> None:
        """Stop every Triton launched here (blocking: run it off the event loop)."""
        for proc in self.processes:
            proc.stop()

    @property
    def reserved_ports(self) -> tuple[int, ...]:
        """Ports the admin API and the router bind once the Tritons are up: never a Triton's."""
        cfg = self.cfg
        return tuple(p for p in (cfg.admin_port, cfg.router_http_port, cfg.router_grpc_port) if p)

    def discover_devices(self) -> list:
        """The GPUs and MIG slices that get a Triton each ([] without NVML or GPUs)."""
        from control_plane.triton.devices import discover, load_nvml, select_devices

        cfg = self.cfg
        if cfg.triton_servers == 0 and not cfg.devices:
            return []  # --attach only: no local Triton, whatever this machine has
        self.nvml = cfg.nvml if cfg.nvml is not None else (load_nvml() if cfg.use_nvml else None)
        found = discover(self.nvml) if self.nvml is not None else []
        if cfg.devices and not found:
            raise InvalidInput(f"--devices {','.join(cfg.devices)} was given but NVML finds no "
                               "GPU on this machine (is nvidia-ml-py installed and the driver "
                               "loaded?); leave --devices out to run on CPU")
        if cfg.device_budgets and not found:
            raise InvalidInput("--device-budget was given but NVML finds no GPU on this machine; "
                               "use --memory-budget for CPU servers")
        return select_devices(found, cfg.devices)

    def _start_device_tritons(self) -> list[TritonServer]:
        """One Triton per GPU or MIG slice, bound to it by CUDA_VISIBLE_DEVICES=<its UUID>,
        named after it, its instances run there (KIND_GPU through the load API's override)."""
        from control_plane.manager.placement import KIND_GPU, ServerLabels, instance_kind_override
        from control_plane.triton.devices import device_servers

        cfg = self.cfg
        if cfg.triton_servers not in (0, 1):
            log.warning("--triton-servers %d is ignored: one Triton runs per GPU or MIG slice "
                        "(%d); --devices picks which", cfg.triton_servers, len(self.devices))
        # Test hook only (fake_nvml): CPU Tritons standing in for devices run on CPU.
        kind = getattr(self.nvml, "stand_in_instance_kind", None) or KIND_GPU
        servers = []
        work_dir = (cfg.state_dir / "triton").resolve()
        planned = device_servers(self.devices, cfg.memory_budget_bytes, cfg.derive_memory_budget,
                                 cfg.device_budgets)
        for i, plan in enumerate(planned):
            proc = TritonProcess(TritonLaunchConfig(
                repository=self.repository, work_dir=work_dir,
                pid_file=work_dir / f"{plan.name}.pid",  # a restart waits for this one to be gone
                host=cfg.triton_host, http_port=_port(cfg.triton_http_port, i),
                grpc_port=_port(cfg.triton_grpc_port, i),
                metrics_port=_port(cfg.triton_metrics_port, i),
                ready_timeout_s=cfg.triton_ready_timeout_s, env=plan.launch_env(),
                outlive_parent=self.supervised, reserved_ports=self.reserved_ports,
                restricted_key=self.restricted_key))
            log.info("%s: %s %s (%s), budget %s bytes (%s)", plan.name, plan.device.kind,
                     plan.device.name, plan.device.uuid, plan.budget_bytes, plan.budget_source)
            proc.start()
            self.processes.append(proc)
            spec = ServerSpec(plan.name, proc.grpc_url, proc.http_url, proc.metrics_url,
                              device=plan.device.id, memory_budget_bytes=plan.budget_bytes,
                              max_loaded=cfg.max_loaded, concurrency=cfg.server_concurrency)
            admin = self.family_admin(spec, load_config=instance_kind_override(self.repository, kind))
            servers.append(ModelManager.make_server(spec, cfg.policy, process=proc, admin=admin))
            self.labels[plan.name] = ServerLabels.from_device(plan.device)
        return servers

    def _start_cpu_tritons(self) -> list[TritonServer]:
        cfg = self.cfg
        servers = []
        local_budget_bytes = self.local_memory_budget_bytes()
        for i in range(cfg.triton_servers):
            work_dir = (cfg.state_dir / "triton").resolve()
            proc = TritonProcess(TritonLaunchConfig(
                repository=self.repository,
                work_dir=work_dir,
                pid_file=work_dir / f"triton{i}.pid",  # a restart waits for this one to be gone
                host=cfg.triton_host,
                http_port=_port(cfg.triton_http_port, i),
                grpc_port=_port(cfg.triton_grpc_port, i),
                metrics_port=_port(cfg.triton_metrics_port, i),
                ready_timeout_s=cfg.triton_ready_timeout_s,
                outlive_parent=self.supervised,
                reserved_ports=self.reserved_ports,
                restricted_key=self.restricted_key,
            ))
            proc.start()
            self.processes.append(proc)
            spec = ServerSpec(f"triton{i}", proc.grpc_url, proc.http_url, proc.metrics_url,
                              device="cpu", memory_budget_bytes=local_budget_bytes,
                              max_loaded=cfg.max_loaded, concurrency=cfg.server_concurrency)
            servers.append(ModelManager.make_server(spec, cfg.policy, process=proc,
                                                    admin=self.family_admin(spec)))
        return servers

    def remote_servers(self) -> list[RemoteServer]:
        """--attach URLs (attached0, attached1, ...) and the servers file's entries."""
        cfg = self.cfg
        found = [RemoteServer(f"attached{j}", *(urls.partition(",")[::2]))
                 for j, urls in enumerate(cfg.attach)]
        if cfg.servers_file is not None:
            found += load_servers_file(cfg.servers_file)
        return found

    def _attached_servers(self) -> list[TritonServer]:
        cfg = self.cfg
        servers = []
        for remote in self.remote_servers():
            spec = ServerSpec(remote.name, remote.grpc_url, remote.http_url, remote.metrics_url,
                              device=f"node:{remote.node}" if remote.node else "external",
                              memory_budget_bytes=(remote.memory_budget_bytes
                                                   if remote.memory_budget_bytes is not None
                                                   else cfg.memory_budget_bytes),
                              max_loaded=remote.max_loaded or cfg.max_loaded,
                              concurrency=remote.concurrency or cfg.server_concurrency)
            servers.append(ModelManager.make_server(spec, cfg.policy, admin=self.family_admin(spec)))
        return servers

    def family_admin(self, spec: ServerSpec, load_config=None):
        """Model control for one server, with model families' variants in weight slots
        sized from the server's budget (control_plane.families)."""
        from control_plane.families import family_slots
        from control_plane.families.slot_control import FamilyAdmin

        families = self.families

        def slots_for(family) -> int:
            return family_slots(family, spec.max_loaded, spec.memory_budget_bytes,
                                len(families.variants(family.name)))

        return FamilyAdmin(spec.grpc_url, families, slots_for, load_config=load_config,
                           headers=admin_key_headers(self.restricted_key), guard=self.guard)

    def local_memory_budget_bytes(self, devices=None, host_bytes: int | None = None) -> int | None:
        """Each local Triton's byte budget: --memory-budget, else derived from the machine
        (devices.default_memory_budget: GPU memory less a reserve, or a share of host RAM)."""
        cfg = self.cfg
        if cfg.memory_budget_bytes is not None or not cfg.derive_memory_budget:
            return cfg.memory_budget_bytes
        from control_plane.triton.devices import Device, default_memory_budget, host_memory_bytes

        budget, how = default_memory_budget(
            (self.devices or [Device("cpu")]) if devices is None else devices, cfg.triton_servers,
            host_memory_bytes() if host_bytes is None else host_bytes)
        log.info("memory budget per Triton server: %s bytes (%s); --memory-budget overrides",
                 budget, how)
        if cfg.attach:
            log.info("attached Tritons get no byte budget unless --memory-budget is given: their "
                     "device is not visible from here")
        return budget

