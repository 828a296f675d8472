"""Wire the control plane together: Triton servers, the model manager, the registry and
tiers, the rollouts, the admin API, and the data-plane hub when router workers serve.

A router in this same process is not assembled here: the control plane imports nothing of
the router.  ``mmctl up`` (the composition root, ``mmctl.in_process_router``) hands in
``start_router``, which builds it on the parts this service gives (``RouterParts``) and
returns what the service needs of it (``InProcessRouter``).

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
from pathlib import Path

from aiohttp import web

from control_plane.admin.access import (
    DATAPLANE_TOKEN_FILE_NAME,
    TOKEN_FILE_NAME,
    SessionRevocations,
    access_for,
    ensure_dataplane_token_file,
    ensure_token_file,
)
from control_plane.admin.api import make_app
from control_plane.admin.rollout_routes import RolloutAdmin
from control_plane.demo import DEMO_MARKER, DEMO_VERSIONS, write_demo_repository
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.runtime.config import ServiceConfig, config_from_json, config_to_json  # noqa: F401  (their import path)
from control_plane.runtime.router_parts import InProcessRouter, RouterParts, StartRouter
from control_plane.runtime.supervisor import PROCESSES_FILE
from control_plane.runtime.tritons import TritonFleet, check_model_control, free_memory_probe
from control_plane.state.secret_files import ensure_private_dir, ensure_secret_file
from control_plane.state.state_store import StateStore
from domain import tracing
from domain.periodic import guarded_step, run_periodically
from domain.settings import shared_values

log = logging.getLogger(__name__)

TRITON_KEY_FILE_NAME = "triton.key"  # in the state directory, mode 0600


class Service:
    def __init__(self, cfg: ServiceConfig, start_router: StartRouter | None = None):
        """``start_router``: how a router in this process is started (mmctl up with
        ``--router-workers 0``); None where none runs here."""
        cfg.validate()
        self.cfg = cfg
        self.start_router = start_router
        self.tritons = TritonFleet(cfg, supervised=self.supervised)
        self.manager: ModelManager | None = None
        self.runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task | None = None
        self.repository: Path = Path()
        self.registry = None
        self.warm = None
        self.promoter = None
        self.admin_url = ""
        self.router: InProcessRouter | None = None
        self.rollouts = None  # rollouts.owner.Rollouts: built once when anything routes
        self.rollout_admin: RolloutAdmin | None = None
        self.memory = None  # devices.GpuMemoryMeter on a GPU fleet
        self.reconciler = None  # devices.MemoryReconciler on a GPU fleet
        self.hub = None  # dataplane_hub.DataPlaneHub when router workers serve
        self.adapters = None  # adapters.AdapterManager, built with the model manager
        self.database = None  # control_plane.state.Database, opened by open_state
        self.leadership = None  # runtime.leadership.Leadership with leader election
        self.families = None  # families.FamilyCatalog: the repository's model families

    @property
    def supervised(self) -> bool:
        """Router workers run beside this process, under mmctl up's supervisor: Tritons
        outlive a crash of this process and its next life adopts them."""
        return bool(self.cfg.router and self.cfg.router_workers)

    @property
    def serves_workers(self) -> bool:
        """Router workers in other processes get their state from here (the data-plane hub)."""
        return self.supervised or self.cfg.external_routers

    def prepare_repository(self) -> None:
        self.repository.mkdir(parents=True, exist_ok=True)
        if self.cfg.demo and self.cfg.fleet_size:
            write_demo_repository(self.repository, self.cfg.fleet_size, self.cfg.model_size_mb,
                                  self.cfg.fleet_layout)

    async def register_repository(self) -> None:
        """One catalogue: every model folder of Triton's repository (the demo fleet, or what
        the user's --repository holds) is in the registry, at first start and for folders
        added since.  Hashing new folders runs in a thread; registry writes on the loop."""
        from control_plane.registry import add_repository_versions, collect_repository

        found = await asyncio.get_running_loop().run_in_executor(
            None, collect_repository, self.registry, self.repository,
            DEMO_VERSIONS if (self.repository / DEMO_MARKER).is_file() else {})
        add_repository_versions(self.registry, found)

    def open_state(self):
        """The state store (opened and migrated once, before the election)."""
        if self.database is None:
            from control_plane.state import migrate, open_database

            self.database = open_database(self.cfg.state_url or self.cfg.state_dir / "state.db")
            migrate(self.database)
        return self.database

    @property
    def elects_leader(self) -> bool:
        cfg = self.cfg
        if cfg.leader_election is not None:
            return cfg.leader_election
        return self.open_state().dialect == "postgresql"

    def refresh_family_runtimes(self) -> None:
        """Families written by an earlier version run this version's runtime from their next
        load (``families.refresh_family_runtime``); one that cannot be refreshed keeps its."""
        from control_plane.families import refresh_family_runtime

        for family in self.families.families.values():
            try:
                if refresh_family_runtime(family):
                    log.info("family %s: its copy of the family runtime is now this version's "
                             "(used from its next load)", family.name)
            except OSError as exc:
                log.error("family %s: could not refresh its copy of the family runtime (%s); "
                          "it runs the one it has", family.name, exc)

    async def become_leader(self, stop: asyncio.Event) -> bool:
        """With leader election: standby until this control plane leads (False: stopped
        first).  Without: at once."""
        db = await asyncio.to_thread(self.open_state)
        if not self.elects_leader:
            return True
        from control_plane.runtime.leadership import Leadership

        cfg = self.cfg
        self.leadership = Leadership(db, host=cfg.admin_host, port=cfg.admin_port,
                                     identity=cfg.instance_name, ttl_s=cfg.lease_ttl_s,
                                     advertise_url=cfg.advertise_url)
        return await self.leadership.acquire(stop)

    async def start(self) -> None:
        from control_plane.manager.placement import Placer, registry_facts
        from control_plane.registry import (
            Registry,
            apply_stage_priorities,
            resident_priority_updater,
        )
        from control_plane.runtime.promotion import Promoter
        from control_plane.tiers.cold import ColdStores, LocalDirStore, S3Store
        from control_plane.tiers.warm import WarmTier

        cfg = self.cfg
        tracing.configure(cfg.trace_exporter, "mms-control-plane")
        ensure_private_dir(cfg.state_dir)
        self.repository = cfg.repository_dir
        store = StateStore(self.open_state())
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
        from control_plane.families import FamilyCatalog
        from control_plane.families.added_families import recorded_families, restore_families

        await asyncio.to_thread(restore_families, recorded_families(store), self.registry.stores,
                                self.repository)
        registry = self.registry
        self.families = FamilyCatalog(
            self.repository, lambda: ((v.name, v.family) for v in registry.versions() if v.family))
        registry.on_stage_change(self.families.refresh)  # a variant registered, or retired
        await asyncio.to_thread(self.refresh_family_runtimes)
        from control_plane.adapters import hand_slots_to_control_plane

        # Before Triton can load a LoRA base: one loaded first would decide on its own.
        await asyncio.to_thread(hand_slots_to_control_plane, self.repository)
        # Popen runs on the loop thread: PR_SET_PDEATHSIG fires when the *thread* that
        # forked exits, and executor threads can exit while Triton should live on.
        # Triton's restricted APIs (model control first) take this key, given or kept in the
        # state directory: Tritons adopted after a restart were started with the same one.
        triton_key = ensure_secret_file(cfg.state_dir / TRITON_KEY_FILE_NAME,
                                        cfg.triton_admin_key, what="Triton key")
        # Model control: with Triton's key, and only while leading.
        servers = self.tritons.start(
            self.repository, self.families, restricted_key=triton_key,
            guard=self.leadership.check if self.leadership is not None else None)
        await check_model_control(servers)
        stager = self.warm
        devices = self.tritons.devices
        if devices:
            from control_plane.triton.devices import GpuMemoryMeter, reserve_measured, server_name

            self.memory = GpuMemoryMeter(self.tritons.nvml, {server_name(d): d for d in devices},
                                         self.repository, registry=self.registry)
            stager = reserve_measured(self.warm, self.registry)  # a load reserves what it took
        self.manager = ModelManager(
            servers, store, repository=self.repository,
            config=ManagerConfig(**shared_values(cfg, ManagerConfig)),
            free_memory=free_memory_probe(self.memory),
            stager=stager, priority_of=self.registry.stage_priority,
            placer=Placer(facts=registry_facts(self.registry), labels=self.tritons.labels),
            warmup_enabled=self.registry.warmup_enabled, memory=self.memory,
            load_of=self._requests_on_triton, adapters=self._adapter_slots)
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
        dataplane_token = ensure_dataplane_token_file(cfg.state_dir / DATAPLANE_TOKEN_FILE_NAME,
                                                      cfg.dataplane_token or None)
        endpoints = {"admin": self.admin_url, "state_dir": str(cfg.state_dir.resolve()),
                     "repository": str(self.repository), "admin_token_file": str(token_file),
                     "processes_file": str((cfg.state_dir / PROCESSES_FILE).resolve())}
        admin_app = make_app(self.manager, {"endpoints": endpoints,
                                            "locate": self.warm.locator(self.manager),
                                            "resolve_name": self.registry.resolve_name},
                             access=access_for(cfg.admin_host, token, cfg.admin_allowed_hosts,
                                               dataplane_token=dataplane_token,
                                               revocations=SessionRevocations(store.get, store.put)))
        from control_plane.admin.registry_routes import add_registry_routes

        add_registry_routes(admin_app, self.registry, warm=self.warm,
                            locate=self.warm.locator(self.manager), families=self.families)
        from control_plane.admin.adapter_routes import add_adapter_routes

        add_adapter_routes(admin_app, self.adapters)
        from control_plane.admin.family_routes import add_family_routes

        add_family_routes(admin_app, catalog=self.families, manager=self.manager, state=store,
                          stores=self.registry.stores, registry=self.registry)
        if self.serves_workers or cfg.router:
            from control_plane.admin.rollout_routes import add_rollout_routes
            from control_plane.rollouts.owner import Rollouts

            self.rollouts = Rollouts(self.registry, store, expose_versions=cfg.expose_versions)
            if self.serves_workers:
                served = await self._start_hub(admin_app, endpoints)
            else:
                served = await self._start_router(endpoints)
            self.rollout_admin = RolloutAdmin(self.rollouts, self.manager, served)
            add_rollout_routes(admin_app, self.rollout_admin)
        self._add_observability(admin_app, endpoints)
        self.runner = web.AppRunner(admin_app, access_log=None)
        await self.runner.setup()
        # SO_REUSEPORT: mmctl up holds the admin port while its children run (hold_port)
        site = web.TCPSite(self.runner, cfg.admin_host, cfg.admin_port, reuse_port=True)
        await site.start()
        if cfg.admin_port == 0:
            port = self.runner.addresses[0][1]
            self.admin_url = endpoints["admin"] = f"http://{cfg.admin_host}:{port}"
        endpoints["pid"] = os.getpid()
        (cfg.state_dir / "endpoints.json").write_text(json.dumps(endpoints, indent=2))
        log.info("control plane ready: admin API %s", self.admin_url)

    def _add_observability(self, admin_app: web.Application, endpoints: dict) -> None:
        """The gauges read from state at each scrape, and the status page at ``/``."""
        from control_plane.admin.status_page import StatusSources, add_status_page
        from control_plane.admin.status_page.overview import (
            HttpMetricsReader,
            local_url,
            registry_reader,
        )
        from control_plane.metrics import StateCollector

        rollouts = self.rollout_admin
        metrics = self.manager.metrics
        metrics.declare_servers(self.manager.servers)
        metrics.registry.register(StateCollector(self.manager, rollouts=rollouts, workers=self.hub))
        if self.router is not None:
            router_metrics = registry_reader(self.router.metrics)
        elif endpoints.get("router_http") and not self.cfg.external_routers:
            router_metrics = HttpMetricsReader(local_url(endpoints["router_http"], "/metrics"))
        else:  # routers elsewhere (--external-routers): the page shows what is here
            router_metrics = None
        add_status_page(admin_app, StatusSources(
            self.manager, locate=self.warm.locator(self.manager), rollouts=rollouts,
            workers=self.hub, router_metrics=router_metrics))

    async def _control_loop(self) -> None:
        """Reconcile Triton state, then the GPU memory pass and promotion (auto-pin /
        prefetch) when configured; each is its own guarded step, so one failing never
        skips the others or ends the loop (``domain.periodic``)."""
        await run_periodically("control", self._control_step, self.cfg.reconcile_interval_s,
                               self.manager.metrics.loop_failures)

    async def _control_step(self) -> None:
        failures = self.manager.metrics.loop_failures
        await guarded_step("reconcile", self.manager.step, failures)
        if self.memory is not None:  # unreturned GPU memory back in the budget; drifted sizes
            await guarded_step("gpu-memory", self._memory_step, failures)
        if self.cfg.auto_pin_top_k or self.cfg.prefetch_min_miss_rate:
            await guarded_step("promotion", self.promoter.step, failures)

    def _memory_step(self) -> None:
        self.memory.step(self.manager.servers.values())
        self.reconciler.step()

    async def _start_router(self, endpoints: dict) -> InProcessRouter:
        """The router in this process, judged here: the rollouts' canary loop runs beside it."""
        from domain.errors import InvalidInput

        if self.start_router is None:
            raise InvalidInput("a router in the control plane's process is started by mmctl up "
                               "(--router-workers 0); this control plane was given none")
        self.router = await self.start_router(
            RouterParts(self.manager, self.rollouts, self.families, self.cfg), endpoints)
        self.rollouts.start_judging(loop_failures=self.manager.metrics.loop_failures)
        return self.router

    def _adapter_slots(self, manager: ModelManager):
        """The LoRA adapters' part, built with the manager that routes BASE:ADAPTER names
        to its slots (ModelManager's ``adapters``); the admin API's adapter routes use it."""
        from control_plane.adapters import AdapterManager

        self.adapters = AdapterManager(manager, self.repository, stores=self.registry.stores)
        return self.adapters.slots

    def _requests_on_triton(self) -> dict[str, int]:
        """Requests outstanding per model over every router (mmctl scale --replicas auto):
        the router workers' reports, or the queues of the router in this process."""
        if self.hub is not None:
            return self.hub.reports.outstanding()
        if self.router is not None:
            return self.router.outstanding_by_model()
        return {}

    async def _start_hub(self, admin_app: web.Application, endpoints: dict):
        """Serve the router workers: snapshot, watch, ensure, reports, tokens; the hub
        judges the rollouts on every worker's outcomes."""
        from control_plane.admin.dataplane import DataPlaneHub, add_dataplane_routes

        cfg = self.cfg
        self.hub = DataPlaneHub(self.manager, self.registry, self.manager.store,
                                shadow_log_dir=str((cfg.state_dir / "shadow").resolve()),
                                workers_expected=cfg.router_workers or 0, families=self.families,
                                rollouts=self.rollouts)
        await self.hub.start()
        add_dataplane_routes(admin_app, self.hub)
        endpoints["router_grpc"] = f"{cfg.router_host}:{cfg.router_grpc_port}"
        endpoints["router_http"] = f"{cfg.router_host}:{cfg.router_http_port}"
        endpoints["router_workers"] = cfg.router_workers or 0
        return self.hub

    async def stop(self) -> None:
        if self.hub is not None:
            await self.hub.release_watchers()
        if self.router is not None:
            await self.router.close()
        if self.rollouts is not None:
            await self.rollouts.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.leadership is not None:  # a standby takes over now, not at the lease's end
            await asyncio.to_thread(self.leadership.release)
        if self.manager is not None:
            await self.manager.close()
            self.manager.store.close()
            self.database = None
        elif self.database is not None:
            self.database.close()
            self.database = None
        await asyncio.get_running_loop().run_in_executor(None, self.tritons.stop)
        if (self.cfg.repository is None and not self.cfg.attach and self.cfg.servers_file is None
                and self.warm is not None):
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
            if not await self.become_leader(stop):
                return
            await self.start()
            print(f"control plane ready: admin API {self.admin_url} (Ctrl-C stops)", flush=True)
            await stop.wait()
        finally:
            print("stopping...", flush=True)
            await self.stop()


def main(argv: list[str] | None = None) -> None:
    """The control plane as its own process (started by mmctl up's supervisor): its settings
    from the file mmctl wrote, the secrets (the state URL, Triton's admin key) and S3's from
    its environment; the admin token from its file, which the supervisor wrote."""
    from control_plane.runtime.config import SECRETS
    from control_plane.tiers.cold import S3Config
    from control_plane.triton.fake_nvml import from_test_hook
    from domain.errors import ControlPlaneError
    from domain.settings import env_values

    parser = argparse.ArgumentParser(prog="python -m control_plane.runtime.service")
    parser.add_argument("--config", type=Path, required=True, help="Settings written by mmctl up.")
    args = parser.parse_args(argv)
    cfg = config_from_json(args.config.read_text())
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in env_values(ServiceConfig, names=sorted(SECRETS - {"admin_token"})).items():
        setattr(cfg, name, value)
    cfg.s3 = S3Config.from_env()
    cfg.nvml = from_test_hook()  # TEST HOOK (fake_nvml); None in production
    try:
        asyncio.run(Service(cfg).serve_forever())
    except ControlPlaneError as exc:
        from domain.exit_codes import (  # mmctl up's exit codes
            EXIT_BY_ERROR,
            EXIT_ERROR,
        )

        print(f"error: {exc.message}", file=sys.stderr)
        sys.exit(EXIT_BY_ERROR.get(exc.code, EXIT_ERROR))


if __name__ == "__main__":
    main()
