"""Commands that run the product: ``up`` (everything on this machine, supervised),
``control-plane`` (one control plane, for a cluster where Tritons and router workers run
elsewhere) and ``router`` (one router worker)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from pathlib import Path

import click

from control_plane.runtime.config import ServiceConfig
from domain.exit_codes import EXIT_BY_ERROR, EXIT_ERROR
from domain.worker_settings import WorkerConfig
from mmctl import settings


def service_config(opts: dict, command: str) -> ServiceConfig:
    """The ServiceConfig of ``up`` / ``control-plane``'s options: the settings as parsed
    (mmctl/settings.py), then what follows from them together."""
    from control_plane.tiers.cold import S3Config

    # TEST HOOK: MMS_TEST_FAKE_NVML names a fake-device spec (control_plane/fake_nvml.py) so
    # that integration tests drive the GPU/MIG paths with CPU Tritons standing in.  Only tests
    # set it; production finds devices through the real NVML.
    from control_plane.triton.fake_nvml import TEST_HOOK_ENV, from_test_hook

    fake_nvml = from_test_hook()
    if fake_nvml is not None:
        logging.getLogger(__name__).warning(
            "TEST HOOK %s is set: devices come from a fake NVML, not from this machine",
            TEST_HOOK_ENV)
    values = settings.values(ServiceConfig, command, opts)
    # Tritons elsewhere (--attach, --servers-file): no local one unless asked for.
    if (values["attach"] or values["servers_file"] is not None) and values["triton_servers"] == 1:
        values["triton_servers"] = 0
    return ServiceConfig(**values, nvml=fake_nvml, s3=S3Config.from_env())


def _run_service(cfg: ServiceConfig) -> None:
    from control_plane.runtime.service import Service
    from domain.errors import ControlPlaneError

    try:
        if cfg.router and cfg.router_workers:
            cfg.validate()
            sys.exit(supervise(cfg))
        from mmctl.in_process_router import start_in_process_router

        asyncio.run(Service(cfg, start_router=start_in_process_router).serve_forever())
    except ControlPlaneError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(EXIT_BY_ERROR.get(exc.code, EXIT_ERROR))


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.command()
@settings.options(ServiceConfig, "up")
def up(**opts):
    """Start tritonserver(s), the control plane and the router in the foreground; Ctrl-C
    stops all."""
    _logging(opts["log_level"])
    cfg = service_config(opts, "up")
    if cfg.demo is None:  # the demo fleet where no repository is given
        cfg.demo = cfg.repository is None
    if cfg.router and cfg.router_workers is None:
        from control_plane.runtime.supervisor import default_router_workers

        cfg.router_workers = default_router_workers()
    _run_service(cfg)


@click.command("control-plane")
@settings.options(ServiceConfig, "control-plane")
def control_plane_command(**opts):
    """Run one control plane in the foreground, for a cluster: Tritons registered by address
    (--servers-file, --attach), router workers elsewhere (mmctl router) fetching their state
    from its admin API, state in a shared PostgreSQL (--state-url) with leader election."""
    _logging(opts["log_level"])
    cfg = service_config(opts, "control-plane")
    cfg.demo, cfg.router, cfg.router_workers, cfg.external_routers = False, False, 0, True
    _run_service(cfg)


@click.command("router")
@settings.options(WorkerConfig, "router")
def router_command(**opts):
    """Run one router worker in the foreground: the public Triton-compatible ports, serving
    from the control plane's state (start as many as the load needs; they share nothing)."""
    from domain.settings import to_argv
    from router.worker import main as worker_main

    worker_main(to_argv(WorkerConfig(**settings.values(WorkerConfig, "router", opts))))


# The commands this module adds to mmctl (mmctl.main).
COMMANDS = [up, control_plane_command, router_command]


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def worker_config(cfg: ServiceConfig, name: str, admin_url: str, dataplane_token: str,
                  run_dir: Path, shared_memory_dir: Path) -> WorkerConfig:
    """What one router worker of ``mmctl up`` is started with: every setting the worker
    shares with ``cfg`` (its public ports, request size, load timeout, log level: one
    declaration, ``shared_values``), and the supervisor's plumbing."""
    from domain.settings import shared_values

    return WorkerConfig(**{**shared_values(cfg, WorkerConfig), "admin_token": None,
                           "dataplane_token": dataplane_token},
                        control_url=admin_url, worker=name,
                        shadow_log_dir=cfg.state_dir / "shadow" / name,
                        shared_memory_dir=shared_memory_dir, ready_file=run_dir / f"{name}.ready")


def supervise(cfg: ServiceConfig) -> int:
    """Run the control plane and ``cfg.router_workers`` router workers as supervised
    sibling processes (control_plane.runtime.supervisor) until Ctrl-C."""
    from control_plane.admin.access import (
        DATAPLANE_TOKEN_FILE_NAME,
        TOKEN_FILE_NAME,
        ensure_dataplane_token_file,
        ensure_token_file,
    )
    from control_plane.runtime.config import SECRETS, config_to_json
    from control_plane.runtime.supervisor import Child, Supervisor, python_module
    from control_plane.state.secret_files import ensure_private_dir
    from control_plane.tiers.cold import S3Config
    from control_plane.triton.launch import hold_port
    from domain.settings import (
        ADMIN_TOKEN,
        env_names,
        secret_env,
        secret_env_names,
        to_argv,
    )

    cfg.state_dir = cfg.state_dir.resolve()
    for attr in ("repository", "cold_dir"):
        if getattr(cfg, attr) is not None:
            setattr(cfg, attr, getattr(cfg, attr).resolve())
    ensure_private_dir(cfg.state_dir)  # its secrets, the state database, clients' regions
    run_dir = cfg.state_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    # Fixed before any child starts: a restarted control plane binds the same admin port,
    # and every worker the same public ports.  Held from here to the end, so that nothing
    # else on the machine (a Triton started meanwhile, another product) is handed one of
    # them before its server binds it, or while a restarted one binds it again.
    held = []
    for attr, host in (("admin_port", cfg.admin_host), ("router_grpc_port", cfg.router_host),
                       ("router_http_port", cfg.router_host)):
        held.append(hold_port(host, getattr(cfg, attr), option="--" + attr.replace("_", "-")))
        setattr(cfg, attr, held[-1].getsockname()[1])
    token = ensure_token_file(cfg.state_dir / TOKEN_FILE_NAME, cfg.admin_token or None)
    # Router workers parse untrusted input: they get a token that opens /v1/dataplane/* only.
    dataplane_token = ensure_dataplane_token_file(cfg.state_dir / DATAPLANE_TOKEN_FILE_NAME,
                                                  cfg.dataplane_token or None)
    config_file = run_dir / "control-plane.json"
    config_file.write_text(config_to_json(cfg))
    admin_url = f"http://{_connect_host(cfg.admin_host)}:{cfg.admin_port}"
    metrics_dir = run_dir / "metrics"
    # Clients' shared-memory registrations, shared by the workers; a previous run's name
    # memory of clients that have gone (Triton forgets them on a restart too).
    shared_memory_dir = run_dir / "shared-memory"
    shutil.rmtree(shared_memory_dir, ignore_errors=True)
    # Secrets go in the children's environment, under their MMS_ names (which win over an
    # old name the children inherit), never in argv or the config file.
    control_plane = Child("control-plane", "control-plane", python_module(
        "control_plane.runtime.service", "--config", str(config_file)),
        dict(os.environ, **secret_env(cfg, sorted(SECRETS - {"admin_token"}))))
    workers = []
    # Nothing of the control plane's secrets reaches a worker through this environment.
    kept_back = {*ADMIN_TOKEN.env_names, *secret_env_names(ServiceConfig), *env_names(S3Config)}
    worker_env = {k: v for k, v in os.environ.items()
                  if k not in kept_back and not k.startswith("AWS_")}
    for i in range(cfg.router_workers):
        worker = worker_config(cfg, f"w{i}", admin_url, dataplane_token, run_dir, shared_memory_dir)
        workers.append(Child(
            "router-worker", worker.worker, python_module("router.worker", *to_argv(worker)),
            dict(worker_env, **secret_env(worker), PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)),
            ready_file=worker.ready_file))
    line = (f"ready: router gRPC {cfg.router_host}:{cfg.router_grpc_port}, HTTP {cfg.router_host}:"
            f"{cfg.router_http_port} ({cfg.router_workers} worker{'s' if cfg.router_workers > 1 else ''}); "
            f"admin API {admin_url}")
    try:
        return Supervisor(cfg.state_dir, control_plane, workers, admin_url, token, line,
                          ready_timeout_s=cfg.triton_ready_timeout_s + 300, metrics_dir=metrics_dir).run()
    finally:
        for sock in held:
            sock.close()


