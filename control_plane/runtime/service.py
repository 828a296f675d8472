"""Wire the product together: Triton servers + model manager + admin API (+ router).

``ServiceConfig`` is parsed once by ``mmctl up`` and validated here; nothing reads argv or
the environment at import time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from aiohttp import web

from control_plane.admin.api import TOKEN_FILE_NAME, access_for, ensure_token_file, make_app
from control_plane.demo.fleet import (
    DEMO_VERSIONS,
    FleetSpec,
    default_instance_kind,
    generate_extras,
    generate_fleet,
    hidden_dim_for_size,
)
from control_plane.domain.errors import InvalidInput
from control_plane.eviction import DEFAULT_POLICY, POLICIES
from control_plane.manager import ManagerConfig, ModelManager, ServerSpec, TritonServer
from control_plane.runtime.supervisor import PROCESSES_FILE
from control_plane.state_store import StateStore
from control_plane.triton.process import TritonLaunchConfig, TritonProcess

log = logging.getLogger(__name__)


@dataclass
class ServiceConfig:
    state_dir: Path = Path(".state")
    repository: Path | None = None  # Triton's repository = the warm tier; default below
    warm_budget_bytes: int | None = None
    cold_dir: Path | None = None  # local cold store; default <state_dir>/cold
    s3: object | None = None  # cold_store.S3Config when an S3 bucket is configured
    auto_pin_top_k: int | None = None
    prefetch_min_miss_rate: float | None = None
    admin_host: str = "127.0.0.1"
    admin_port: int = 8090
    admin_token: str | None = None  # None: reuse or generate <state_dir>/admin.token
    admin_allowed_hosts: list[str] = field(default_factory=list)  # extra Host names
    triton_host: str = "127.0.0.1"
    triton_servers: int = 1  # CPU Tritons to start where no GPU is found
    # GPUs / MIG slices: one Triton each, found by NVML.  ``devices``: only these (ids such as
    # gpu0 or gpu1/mig2, server names, UUIDs); ``device_budgets``: bytes per device id.
    devices: list[str] | None = None
    device_budgets: dict[str, int] = field(default_factory=dict)
    nvml: object | None = None  # an NVML module (pynvml's surface); None: pynvml if usable
    use_nvml: bool = True
    triton_http_port: int = 8100  # server i uses port + 10 * i; 0 = any free port
    triton_grpc_port: int = 8101
    triton_metrics_port: int = 8102
    attach: list[str] = field(default_factory=list)  # gRPC URLs of running Tritons
    max_loaded: int | None = None
    memory_budget_bytes: int | None = None  # None: derived from the device (local servers)
    derive_memory_budget: bool = True  # False (--memory-budget unlimited): no byte budget
    fleet_size: int = 50
    model_size_mb: float | None = None
    policy: str = DEFAULT_POLICY
    reconcile_interval_s: float = 2.0
    drain_timeout_s: float = 30.0
    unload_timeout_s: float = 60.0
    triton_ready_timeout_s: float = 120.0
    router: bool = True
    # Router worker processes (control_plane.runtime.supervisor); 0: the router runs in this process.
    # With workers this process serves them (dataplane_hub) and binds no public port.
    router_workers: int = 0
    router_host: str = "127.0.0.1"
    router_http_port: int = 8000
    router_grpc_port: int = 8001
    max_request_bytes: int = 16 * 1024 * 1024
    expose_versions: bool = False  # concrete Triton names callable on the public port
    load_wait_timeout_s: float = 120.0
    # Room each server keeps free for the next miss (ManagerConfig): None = one model where
    # at least 8 fit, 0 = off; headroom_bytes: explicit bytes under a byte budget.
    headroom_models: int | None = None
    headroom_bytes: int | None = None

    def validate(self) -> None:
        if self.max_loaded is not None and self.max_loaded < 1:
            raise InvalidInput(f"max_loaded ({self.max_loaded}) must be >= 1")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise InvalidInput(f"memory budget ({self.memory_budget_bytes}) must be > 0 bytes")
        if self.triton_servers < 0 or (self.triton_servers == 0 and not self.attach):
            raise InvalidInput(
                f"triton_servers ({self.triton_servers}) must be >= 1 unless --attach is given")
        if self.headroom_models is not None and self.headroom_models < 0:
            raise InvalidInput(f"--headroom-models ({self.headroom_models}) must be >= 0 (0 turns "
                               "the headroom off)")
        if self.headroom_bytes is not None and self.headroom_bytes < 0:
            raise InvalidInput(f"--headroom-bytes ({self.headroom_bytes}) must be >= 0 (0 turns "
                               "the byte headroom off)")
        if self.fleet_size < 0:
            raise InvalidInput(f"fleet_size ({self.fleet_size}) must be >= 0")
        if self.policy not in POLICIES:
            raise InvalidInput(
                f"unknown eviction policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")
        if self.admin_host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("admin API binds %s: it can load and unload models; keep it off public "
                        "networks", self.admin_host)

    @property
    def repository_dir(self) -> Path:
        """The warm tier, which Triton serves from: host DRAM (tmpfs) when there is room
        for the demo fleet and the warm budget, else a folder in the state directory."""
        if self.repository is not None:
            return self.repository.resolve()
        from control_plane.tiers.warm import default_warm_repository

        need = (self.warm_budget_bytes or 0) + int(self.fleet_size * (self.model_size_mb or 1) * 1e6)
        return default_warm_repository(self.state_dir, need)


def free_memory_probe(memory=None):
    """The manager's measured-free-memory probe (a load may overlap its victims' unloads
    where it holds the newcomer): MemAvailable for local CPU servers, NVML's free memory for
    a GPU server that ``memory`` (devices.GpuMemoryMeter) measures; None elsewhere (attached
    Tritons: their machine is not this one), so nothing overlaps there."""
    from control_plane.manager import host_available_bytes

    def free_memory(server) -> int | None:
        probe = getattr(memory, "probes", {}).get(server.name) if memory is not None else None
        if probe is not None:
            return int(probe.nvml.nvmlDeviceGetMemoryInfo(probe.handle).free)
        if server.spec.device == "cpu" and server.process is not None:
            return host_available_bytes()
        return None

    return free_memory


def _port(base: int, i: int) -> int:
    return 0 if base == 0 else base + 10 * i


class Service:
    def __init__(self, cfg: ServiceConfig):
        cfg.validate()
        self.cfg = cfg
        self.processes: list[TritonProcess] = []
        self.manager: ModelManager | None = None
        self.runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task | None = None
        self.repository: Path = Path()
        self.registry = None
        self.warm = None
        self.promoter = None
        self.admin_url = ""
        self.router = None
        self.route_store = None  # router.state_writer.BackgroundStore
        self.grpc_server = None
        self.router_runner: web.AppRunner | None = None
        self.devices: list = []  # devices.Device: the GPUs / MIG slices with a Triton each
        self.nvml = None
        self.labels: dict = {}  # server name -> placement.ServerLabels
        self.memory = None  # devices.GpuMemoryMeter on a GPU fleet
        self.reconciler = None  # devices.MemoryReconciler on a GPU fleet
        self.hub = None  # dataplane_hub.DataPlaneHub when router workers serve

    @property
    def supervised(self) -> bool:
        """Router workers run beside this process, under mmctl up's supervisor: Tritons
        outlive a crash of this process and its next life adopts them."""
        return self.cfg.router and self.cfg.router_workers > 0

    def prepare_repository(self) -> None:
        repo = self.repository
        repo.mkdir(parents=True, exist_ok=True)
        if self.cfg.fleet_size and self.cfg.repository is None:
            spec = FleetSpec(count=self.cfg.fleet_size, instance_kind=default_instance_kind())
            if self.cfg.model_size_mb:
                spec = FleetSpec(count=self.cfg.fleet_size, instance_kind=spec.instance_kind,
                                 hidden_dim=hidden_dim_for_size(self.cfg.model_size_mb))
            written = generate_fleet(repo, spec) + generate_extras(repo, spec)
            if written:
                log.info("wrote %d demo models into %s", len(written), repo)
            from control_plane.demo.lora import BASES, LoraDemoSpec, generate_lora_demo

            if not all((repo / base).is_dir() for base in BASES):  # LoRA bases + demo adapters
                lora = generate_lora_demo(repo, LoraDemoSpec(adapters=4, instance_kind=spec.instance_kind))
                log.info("wrote LoRA bases %s with %d demo adapters each", ", ".join(lora), 4)

    async def register_repository(self) -> None:
        """One catalogue: every model folder of Triton's repository (the demo fleet, or what
        the user's --repository holds) is in the registry, at first start and for folders
        added since.  Hashing new folders runs in a thread; registry writes on the loop."""
        from control_plane.registry import add_repository_versions, collect_repository

        found = await asyncio.get_running_loop().run_in_executor(
            None, collect_repository, self.registry, self.repository, DEMO_VERSIONS)
        add_repository_versions(self.registry, found)

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
        from control_plane.placement import KIND_GPU, ServerLabels, instance_kind_override
        from control_plane.triton.admin import TritonAdmin
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
                outlive_parent=self.supervised))
            log.info("%s: %s %s (%s), budget %s bytes (%s)", plan.name, plan.device.kind,
                     plan.device.name, plan.device.uuid, plan.budget_bytes, plan.budget_source)
            proc.start()
            self.processes.append(proc)
            spec = ServerSpec(plan.name, proc.grpc_url, proc.http_url, proc.metrics_url,
                              device=plan.device.id, memory_budget_bytes=plan.budget_bytes,
                              max_loaded=cfg.max_loaded)
            admin = TritonAdmin(proc.grpc_url, load_config=instance_kind_override(self.repository, kind))
            servers.append(ModelManager.make_server(spec, cfg.policy, process=proc, admin=admin))
            self.labels[plan.name] = ServerLabels.from_device(plan.device)
        return servers

    def _start_tritons(self) -> list[TritonServer]:
        cfg = self.cfg
        if self.devices:
            return self._start_device_tritons() + self._attached_servers()
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
            ))
            proc.start()
            self.processes.append(proc)
            spec = ServerSpec(f"triton{i}", proc.grpc_url, proc.http_url, proc.metrics_url,
                              device="cpu", memory_budget_bytes=local_budget_bytes,
                              max_loaded=cfg.max_loaded)
            servers.append(ModelManager.make_server(spec, cfg.policy, process=proc))
        return servers + self._attached_servers()

    def _attached_servers(self) -> list[TritonServer]:
        cfg = self.cfg
        servers = []
        for j, urls in enumerate(cfg.attach):
            grpc_url, _, http_url = urls.partition(",")
            spec = ServerSpec(f"attached{j}", grpc_url, http_url, None, device="external",
                              memory_budget_bytes=cfg.memory_budget_bytes, max_loaded=cfg.max_loaded)
            servers.append(ModelManager.make_server(spec, cfg.policy))
        return servers

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

    async def start(self) -> None:
        from control_plane.placement import Placer, registry_facts
        from control_plane.promotion import Promoter
        from control_plane.registry import (
            Registry,
            apply_stage_priorities,
            resident_priority_updater,
        )
        from control_plane.tiers.cold import ColdStores, LocalDirStore, S3Store
        from control_plane.tiers.warm import WarmTier

        cfg = self.cfg
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.repository = cfg.repository_dir
        store = StateStore(cfg.state_dir / "state.db")
        stores = [LocalDirStore((cfg.cold_dir or cfg.state_dir / "cold").resolve())]
        if cfg.s3 is not None and getattr(cfg.s3, "bucket", None):
            stores.append(S3Store(cfg.s3))
        self.registry = Registry(store.db, stores=ColdStores(stores))
        self.warm = WarmTier(self.repository, self.registry, ColdStores(stores),
                             budget_bytes=cfg.warm_budget_bytes)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.prepare_repository)
        self.warm.recover()  # partial downloads from a crash never reach Triton
        await self.register_repository()
        self.devices = self.discover_devices()
        # Popen runs on the loop thread: PR_SET_PDEATHSIG fires when the *thread* that
        # forked exits, and executor threads can exit while Triton should live on.
        servers = self._start_tritons()
        stager = self.warm
        if self.devices:
            from control_plane.triton.devices import GpuMemoryMeter, reserve_measured, server_name

            self.memory = GpuMemoryMeter(self.nvml, {server_name(d): d for d in self.devices},
                                         self.repository, registry=self.registry)
            stager = reserve_measured(self.warm, self.registry)  # a load reserves what it took
        self.manager = ModelManager(
            servers, store, repository=self.repository,
            config=ManagerConfig(drain_timeout_s=cfg.drain_timeout_s,
                                 unload_timeout_s=cfg.unload_timeout_s, policy=cfg.policy,
                                 headroom_models=cfg.headroom_models,
                                 headroom_bytes=cfg.headroom_bytes),
            free_memory=free_memory_probe(self.memory),
            stager=stager, priority_of=self.registry.stage_priority,
            placer=Placer(facts=registry_facts(self.registry), labels=self.labels),
            warmup_enabled=self.registry.warmup_enabled, memory=self.memory)
        manager = self.manager
        if self.memory is not None:
            from control_plane.triton.devices import MemoryReconciler

            self.reconciler = MemoryReconciler(manager, self.memory.probes, self.registry)
        self.warm.in_use = lambda n: (r := manager.records.get(n)) is not None and r.server is not None
        self.registry.on_stage_change(resident_priority_updater(manager))
        await manager.start()
        apply_stage_priorities(manager, self.registry)
        self.promoter = Promoter(manager, self.warm, top_k_pin=cfg.auto_pin_top_k,
                                 prefetch_min_miss_rate=cfg.prefetch_min_miss_rate)
        self._loop_task = loop.create_task(self._control_loop())
        self.admin_url = f"http://{cfg.admin_host}:{cfg.admin_port}"
        token_file = (cfg.state_dir / TOKEN_FILE_NAME).resolve()
        token = ensure_token_file(token_file, cfg.admin_token or None)
        endpoints = {"admin": self.admin_url, "state_dir": str(cfg.state_dir.resolve()),
                     "repository": str(self.repository), "admin_token_file": str(token_file),
                     "processes_file": str((cfg.state_dir / PROCESSES_FILE).resolve())}
        admin_app = make_app(self.manager, {"endpoints": endpoints,
                                            "locate": self.warm.locator(self.manager),
                                            "resolve_name": self.registry.resolve_name},
                             access=access_for(cfg.admin_host, token, cfg.admin_allowed_hosts))
        from control_plane.admin.registry_routes import add_registry_routes

        add_registry_routes(admin_app, self.registry, warm=self.warm,
                            locate=self.warm.locator(self.manager))
        from control_plane.adapters import AdapterManager
        from control_plane.admin.adapter_routes import add_adapter_routes

        add_adapter_routes(admin_app, AdapterManager(self.manager, self.repository,
                                                     stores=self.registry.stores))
        if self.supervised:
            await self._start_hub(admin_app, endpoints)
        elif cfg.router:
            await self._start_router(admin_app, endpoints)
        self.runner = web.AppRunner(admin_app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, cfg.admin_host, cfg.admin_port)
        await site.start()
        if cfg.admin_port == 0:
            port = self.runner.addresses[0][1]
            self.admin_url = endpoints["admin"] = f"http://{cfg.admin_host}:{port}"
        endpoints["pid"] = os.getpid()
        (cfg.state_dir / "endpoints.json").write_text(json.dumps(endpoints, indent=2))
        log.info("control plane ready: admin API %s", self.admin_url)

    async def _control_loop(self) -> None:
        """Reconcile Triton state, then promotion (auto-pin / prefetch) when configured."""
        while True:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
            await self.manager.step()
            if self.memory is not None:
                try:  # unreturned GPU memory back in the budget; measured sizes that drifted
                    self.memory.step(self.manager.servers.values())
                    self.reconciler.step()
                except Exception:  # one failing subsystem never stops the loop
                    log.exception("GPU memory pass failed")
            if self.cfg.auto_pin_top_k or self.cfg.prefetch_min_miss_rate:
                try:
                    await self.promoter.step()
                except Exception:  # one failing subsystem never stops the loop
                    log.exception("promotion step failed")

    async def _start_router(self, admin_app: web.Application, endpoints: dict) -> None:
        from control_plane.admin.rollout_routes import add_router_routes
        from router.canary import registry_promoter
        from router.core import Router, RouterConfig
        from router.grpc_frontend import start_grpc
        from router.http_frontend import make_http_app
        from router.public_names import PublicNames
        from router.routes import RouteTable
        from router.state_writer import BackgroundStore

        cfg = self.cfg
        registry = self.registry
        # The hot path reads its dicts; SQLite is read only when the registry changes.
        names = PublicNames(registry.versions, expose_concrete=cfg.expose_versions)
        registry.on_stage_change(names.refresh)
        self.route_store = BackgroundStore(self.manager.store)  # route-table writes off the loop
        table = RouteTable(self.route_store, default_target=names.production.get,
                           unrouted=names.unrouted)
        self.router = Router(self.manager, table, RouterConfig(
            load_timeout_s=cfg.load_wait_timeout_s, max_request_bytes=cfg.max_request_bytes,
            shadow_log_dir=(cfg.state_dir / "shadow").resolve()), names=names)
        self.router.canaries.on_promote = registry_promoter(registry)  # one source of truth
        await self.router.start()
        add_router_routes(admin_app, self.router)
        self.grpc_server, grpc_port = await start_grpc(
            self.router, cfg.router_host, cfg.router_grpc_port, cfg.max_request_bytes)
        self.router_runner = web.AppRunner(make_http_app(self.router), access_log=None)
        await self.router_runner.setup()
        await web.TCPSite(self.router_runner, cfg.router_host, cfg.router_http_port).start()
        http_port = self.router_runner.addresses[0][1]
        endpoints["router_grpc"] = f"{cfg.router_host}:{grpc_port}"
        endpoints["router_http"] = f"{cfg.router_host}:{http_port}"
        log.info("router: gRPC %s, HTTP %s", endpoints["router_grpc"], endpoints["router_http"])

    async def _start_hub(self, admin_app: web.Application, endpoints: dict) -> None:
        """Serve the router workers: snapshot, watch, ensure, reports, tokens; the admin
        routes for routes, experiments, canaries, shadows and limits act on the hub."""
        from control_plane.admin.dataplane import DataPlaneHub, add_dataplane_routes
        from control_plane.admin.rollout_routes import add_router_routes

        cfg = self.cfg
        self.hub = DataPlaneHub(self.manager, self.registry, self.manager.store,
                                expose_versions=cfg.expose_versions,
                                shadow_log_dir=str((cfg.state_dir / "shadow").resolve()),
                                workers_expected=cfg.router_workers)
        self.route_store = self.hub.route_store
        await self.hub.start()
        add_router_routes(admin_app, self.hub)
        add_dataplane_routes(admin_app, self.hub)
        endpoints["router_grpc"] = f"{cfg.router_host}:{cfg.router_grpc_port}"
        endpoints["router_http"] = f"{cfg.router_host}:{cfg.router_http_port}"
        endpoints["router_workers"] = cfg.router_workers

    async def stop(self) -> None:
        if self.hub is not None:
            await self.hub.release_watchers()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=2)
        if self.router_runner is not None:
            await self.router_runner.cleanup()
        if self.router is not None:
            await self.router.stop()
        if self.route_store is not None:
            await asyncio.to_thread(self.route_store.close)
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.manager is not None:
            await self.manager.close()
            self.manager.store.close()
        loop = asyncio.get_running_loop()
        for proc in self.processes:
            await loop.run_in_executor(None, proc.stop)
        if self.cfg.repository is None and not self.cfg.attach and self.warm is not None:
            # The default warm tier in tmpfs is host RAM; only Tritons launched here read it,
            # and they are stopped.  A crash keeps it for a warm restart.
            from control_plane.tiers.warm import remove_tmpfs_warm_tier

            await asyncio.to_thread(remove_tmpfs_warm_tier, self.cfg.state_dir, self.warm.repository)

    async def serve_forever(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            print(f"control plane ready: admin API {self.admin_url} (Ctrl-C stops)", flush=True)
            await stop.wait()
        finally:
            print("stopping...", flush=True)
            await self.stop()


# Not carried in the config file: the S3 settings and a fake NVML come from the environment
# of the control plane's process, the admin token from its file.
_NOT_IN_FILE = frozenset({"s3", "nvml", "admin_token"})
_PATH_FIELDS = frozenset({"state_dir", "repository", "cold_dir"})


def config_to_json(cfg: ServiceConfig) -> str:
    """The control plane's settings, for the process the supervisor starts."""
    body = {}
    for f in fields(cfg):
        if f.name not in _NOT_IN_FILE:
            value = getattr(cfg, f.name)
            body[f.name] = str(value) if isinstance(value, Path) else value
    return json.dumps(body, indent=2)


def config_from_json(text: str) -> ServiceConfig:
    body = json.loads(text)
    for name in _PATH_FIELDS:
        if body.get(name) is not None:
            body[name] = Path(body[name])
    return ServiceConfig(**body)


def main(argv: list[str] | None = None) -> None:
    """The control plane as its own process (started by mmctl up's supervisor)."""
    from control_plane.domain.errors import ControlPlaneError
    from control_plane.tiers.cold import S3Config
    from control_plane.triton.fake_nvml import from_test_hook

    parser = argparse.ArgumentParser(prog="python -m control_plane.runtime.service")
    parser.add_argument("--config", type=Path, required=True, help="Settings written by mmctl up.")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_json(args.config.read_text())
    cfg.s3 = S3Config.from_env()
    cfg.nvml = from_test_hook()  # TEST HOOK (fake_nvml); None in production
    try:
        asyncio.run(Service(cfg).serve_forever())
    except ControlPlaneError as exc:
        from control_plane.cli.common import EXIT_BY_ERROR, EXIT_ERROR  # mmctl up's exit codes

        print(f"error: {exc.message}", file=sys.stderr)
        sys.exit(EXIT_BY_ERROR.get(exc.code, EXIT_ERROR))


if __name__ == "__main__":
    main()
