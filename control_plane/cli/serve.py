"""Commands that run the product: ``up`` (everything on this machine, supervised),
``control-plane`` (one control plane, for a cluster where Tritons and router workers run
elsewhere) and ``router`` (one router worker)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

import click

from control_plane.cli.common import EXIT_BY_ERROR, EXIT_ERROR
from control_plane.domain.errors import InvalidInput
from control_plane.domain.sizes import parse_size
from control_plane.eviction import DEFAULT_POLICY, POLICIES


def _size(value: str | None) -> int | None:
    """Parse 500000000, 500MB, 2GiB..."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except InvalidInput as exc:
        raise click.BadParameter(exc.message) from None


def _device_budgets(entries: tuple[str, ...]) -> dict[str, int]:
    """``("gpu0=60GiB", "gpu1/mig2=8GiB")`` -> bytes per device."""
    out = {}
    for entry in entries:
        device, sep, size = entry.partition("=")
        if not sep or not device.strip() or not size.strip():
            raise click.BadParameter(f"{entry!r} is not DEVICE=SIZE (example: gpu0=60GiB)",
                                     param_hint="--device-budget")
        out[device.strip()] = _size(size)
    return out



SERVICE_OPTIONS = [
    click.option("--state-dir", type=click.Path(path_type=Path), default=Path(".state"), show_default=True,
                  help="Pins, routes, registry (SQLite), admin token, endpoints.json, Triton logs."),
    click.option("--repository", type=click.Path(path_type=Path), default=None,
                  help="Triton model repository (default: <state-dir>/repository with the demo fleet)."),
    click.option("--max-loaded", type=int, default=None, help="Most models loaded per Triton server."),
    click.option("--memory-budget", default=None,
                  help="Bytes of model memory per server (e.g. 2GiB), or 'unlimited'. Default: "
                       "each GPU's or MIG slice's memory less 10% (at least 1 GiB), else 50% of "
                       "host RAM shared by the local servers (mmctl fleet shows it)."),
    click.option("--fleet-size", type=int, default=50, show_default=True,
                  help="Demo models cust001..custNNN to create if missing (mmctl up's demo)."),
    click.option("--model-size-mb", type=float, default=None,
                  help="Weight size of each demo model (the seed scenario uses 850)."),
    click.option("--fleet-layout", type=click.Choice(["family", "models"]), default="family",
                  show_default=True,
                  help="Demo fleet as one model family (variants swap into the weight slots of "
                       "one Triton model) or as one Triton model per customer."),
    click.option("--admin-host", default="127.0.0.1", show_default=True,
                  help="Address of the admin API (model control: keep it off public networks)."),
    click.option("--admin-port", type=int, default=8090, show_default=True,
                  help="Port of the admin API (0 = any free port; endpoints.json says which)."),
    click.option("--admin-token", envvar="MMCTL_TOKEN", default=None,
                  help="Bearer token the admin API requires (env MMCTL_TOKEN; prefer the env, argv "
                       "is visible to other users). Default: reuse or generate "
                       "<state-dir>/admin.token (mode 0600), where mmctl finds it."),
    click.option("--admin-allowed-host", "admin_allowed_hosts", multiple=True,
                  help="Another Host name the admin API answers to besides loopback and "
                       "--admin-host (repeatable); any other name is refused (DNS rebinding)."),
    click.option("--triton-servers", type=int, default=1, show_default=True,
                  help="Local tritonserver processes to start on a machine without GPUs (with "
                       "GPUs: one per GPU or MIG slice)."),
    click.option("--devices", default=None,
                  help="Only these GPUs / MIG slices, comma-separated: ids as `mmctl fleet` shows "
                       "them (gpu0, gpu1/mig2; a GPU's id selects all its slices) or UUIDs. "
                       "Default: every one NVML finds."),
    click.option("--device-budget", "device_budgets", multiple=True, metavar="DEVICE=SIZE",
                  help="Model memory of one device, e.g. gpu0=60GiB (repeatable). Default: the "
                       "device's memory less a reserve of 10% (at least 1 GiB) for Triton's CUDA "
                       "context, memory pool and fragmentation."),
    click.option("--triton-http-port", type=int, default=8100, show_default=True,
                  help="Triton's internal HTTP port (server i: port + 10*i; 0 = any free port)."),
    click.option("--triton-grpc-port", type=int, default=8101, show_default=True,
                  help="Triton's internal gRPC port (server i: port + 10*i; 0 = any free port)."),
    click.option("--triton-metrics-port", type=int, default=8102, show_default=True,
                  help="Triton's metrics port (server i: port + 10*i; 0 = any free port)."),
    click.option("--attach", multiple=True,
                  help="Already running Triton: GRPC_URL[,HTTP_URL] (repeatable)."),
    click.option("--expose-versions", is_flag=True, default=False,
                  help="Let clients call concrete Triton names (cust017.v3, cust017-faulty) "
                       "directly. Off: only logical names and their registry versions are "
                       "public, so A/B, canaries and limits on a name cannot be skipped."),
    click.option("--warm-budget", default=None,
                  help="Bytes of host DRAM for the warm tier (Triton's repository), e.g. 16GiB."),
    click.option("--cold-dir", type=click.Path(path_type=Path), default=None,
                  help="Local cold store (default <state-dir>/cold). S3 comes from MMS_S3_* env."),
    click.option("--auto-pin-top-k", type=int, default=None,
                  help="Pin the K models with the most traffic automatically."),
    click.option("--prefetch-min-miss-rate", type=float, default=None,
                  help="Prefetch into warm the models missing more often than this per second."),
    click.option("--policy", type=click.Choice(sorted(POLICIES)), default=DEFAULT_POLICY,
                  show_default=True,
                  help="Which unpinned model to evict when a server is full: lru (least recently "
                       "used), wtinylfu (frequency and load cost), wtinylfu-hits (frequency), gdsf "
                       "(frequency, cost and size). README: replayed hit ratios of each."),
    click.option("--headroom-models", type=click.IntRange(min=0), default=None,
                  help="Models' worth of room each server keeps free, so that a miss loads at "
                       "once instead of waiting for an unload; the policy's next victim leaves "
                       "in the background. Default: 1 on servers that hold at least 8 models, "
                       "else 0. 0 turns it off."),
    click.option("--headroom-bytes", default=None,
                  help="Bytes each server with a byte budget keeps free instead (e.g. 2GiB); "
                       "default: --headroom-models times the median loaded model's size."),
    click.option("--reconcile-interval", type=float, default=2.0, show_default=True,
                  help="Seconds between passes that compare with each Triton and repair."),
    click.option("--log-level", default="INFO", show_default=True,
                  help="DEBUG, INFO, WARNING or ERROR."),
]

UP_OPTIONS = [
    click.option("--demo/--no-demo", default=None,
                 help="Write the demo fleet (--fleet-size models, the LoRA demo) where missing. "
                      "Default: when no --repository is given."),
]

ROUTER_OPTIONS = [
    click.option("--router/--no-router", default=True, show_default=True,
                  help="Serve the public Triton-compatible endpoint."),
    click.option("--router-workers", type=click.IntRange(min=0), default=None,
                  help="Router processes sharing the public ports (SO_REUSEPORT), supervised with "
                       "the control plane: a crash of either leaves the other serving. Default: a "
                       "quarter of the cores (1 to 8). 0: the router runs inside the control plane's "
                       "process (one process, no supervisor)."),
    click.option("--router-host", default="127.0.0.1", show_default=True,
                  help="Address of the public endpoint (0.0.0.0 to serve other machines)."),
    click.option("--router-http-port", type=int, default=8000, show_default=True,
                  help="Public KServe v2 HTTP port."),
    click.option("--router-grpc-port", type=int, default=8001, show_default=True,
                  help="Public Triton gRPC port."),
    click.option("--max-request-bytes", default="16MiB", show_default=True,
                  help="Largest inference request the router accepts."),
]

CLUSTER_OPTIONS = [
    click.option("--state-url", envvar="MMCTL_STATE_URL", default=None,
                 help="Where durable state lives: sqlite:///path/state.db or "
                      "postgresql://user:password@host/db (env MMCTL_STATE_URL; prefer the env, "
                      "argv is visible to other users). Default: <state-dir>/state.db. With "
                      "PostgreSQL several control planes share it: one leads, the others stand by."),
    click.option("--leader-election/--no-leader-election", default=None,
                 help="Run for the leader lease in the state store before acting. Default: on "
                      "with PostgreSQL, off with SQLite."),
    click.option("--lease-ttl", "lease_ttl_s", type=float, default=5.0, show_default=True,
                 help="Seconds a leader's lease lasts without renewal: how long a standby waits "
                      "after the leader's death before it takes over."),
    click.option("--instance-name", default=None,
                 help="This control plane's name in the lease (default host:pid:random)."),
    click.option("--advertise-url", envvar="MMCTL_ADVERTISE_URL", default=None,
                 help="How other machines reach this admin API, recorded with the lease so a "
                      "standby can name the leader (default: http://<admin host>:<port>; in a "
                      "pod: http://$(POD_IP):8090)."),
    click.option("--servers-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
                 help="JSON list of Tritons running elsewhere (other nodes), registered by "
                      'address: {"servers": [{"name", "grpc_url", "http_url", "metrics_url", '
                      '"node", "memory_budget"}]}. README: More than one machine.'),
    click.option("--triton-admin-key", envvar="MMCTL_TRITON_ADMIN_KEY", default=None,
                 help="Key of Tritons started with --grpc-restricted-protocol=model-repository:"
                      "admin-key=<key>: sent with load and unload (env MMCTL_TRITON_ADMIN_KEY)."),
    click.option("--server-lost-after", "server_lost_after_s", type=float, default=10.0,
                 show_default=True,
                 help="Seconds a registered Triton may not answer before its models are placed "
                      "on the other servers."),
]


def _options(*groups: list):
    def apply(f):
        for group in reversed(groups):
            for option in reversed(group):
                f = option(f)
        return f
    return apply


def service_config(opts: dict):
    """The ServiceConfig of ``up`` / ``control-plane``'s options."""
    from control_plane.runtime.service import ServiceConfig
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
    memory_budget = opts["memory_budget"]
    unlimited = (memory_budget or "").strip().lower() == "unlimited"
    remote = bool(opts["attach"]) or opts["servers_file"] is not None
    devices = opts["devices"]
    return ServiceConfig(
        state_dir=opts["state_dir"], repository=opts["repository"],
        admin_host=opts["admin_host"], admin_port=opts["admin_port"],
        admin_token=opts["admin_token"] or None,
        admin_allowed_hosts=list(opts["admin_allowed_hosts"]),
        triton_servers=0 if remote and opts["triton_servers"] == 1 else opts["triton_servers"],
        devices=[d.strip() for d in devices.split(",") if d.strip()] if devices else None,
        device_budgets=_device_budgets(opts["device_budgets"]), nvml=fake_nvml,
        triton_http_port=opts["triton_http_port"], triton_grpc_port=opts["triton_grpc_port"],
        triton_metrics_port=opts["triton_metrics_port"], attach=list(opts["attach"]),
        max_loaded=opts["max_loaded"],
        memory_budget_bytes=None if unlimited else _size(memory_budget),
        derive_memory_budget=not unlimited, fleet_size=opts["fleet_size"],
        model_size_mb=opts["model_size_mb"], fleet_layout=opts["fleet_layout"],
        policy=opts["policy"],
        reconcile_interval_s=opts["reconcile_interval"],
        expose_versions=opts["expose_versions"],
        warm_budget_bytes=_size(opts["warm_budget"]), cold_dir=opts["cold_dir"],
        s3=S3Config.from_env(), auto_pin_top_k=opts["auto_pin_top_k"],
        prefetch_min_miss_rate=opts["prefetch_min_miss_rate"],
        headroom_models=opts["headroom_models"], headroom_bytes=_size(opts["headroom_bytes"]),
        state_url=opts["state_url"], leader_election=opts["leader_election"],
        lease_ttl_s=opts["lease_ttl_s"], instance_name=opts["instance_name"],
        advertise_url=opts["advertise_url"],
        servers_file=opts["servers_file"], triton_admin_key=opts["triton_admin_key"],
        server_lost_after_s=opts["server_lost_after_s"])


def _run_service(cfg, log_level: str) -> None:
    from control_plane.domain.errors import ControlPlaneError
    from control_plane.runtime.service import Service

    try:
        if cfg.router and cfg.router_workers > 0:
            cfg.validate()
            sys.exit(supervise(cfg, log_level))
        asyncio.run(Service(cfg).serve_forever())
    except ControlPlaneError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(EXIT_BY_ERROR.get(exc.code, EXIT_ERROR))


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.command()
@_options(SERVICE_OPTIONS, UP_OPTIONS, ROUTER_OPTIONS, CLUSTER_OPTIONS)
def up(**opts):
    """Start tritonserver(s), the control plane and the router in the foreground; Ctrl-C
    stops all."""
    _logging(opts["log_level"])
    cfg = service_config(opts)
    cfg.demo = opts["repository"] is None if opts["demo"] is None else opts["demo"]
    cfg.router = opts["router"]
    cfg.router_host = opts["router_host"]
    cfg.router_http_port, cfg.router_grpc_port = opts["router_http_port"], opts["router_grpc_port"]
    cfg.max_request_bytes = _size(opts["max_request_bytes"])
    if cfg.router:
        from control_plane.runtime.supervisor import default_router_workers

        workers = opts["router_workers"]
        cfg.router_workers = default_router_workers() if workers is None else workers
    _run_service(cfg, opts["log_level"])


@click.command("control-plane")
@_options(SERVICE_OPTIONS, CLUSTER_OPTIONS)
def control_plane_command(**opts):
    """Run one control plane in the foreground, for a cluster: Tritons registered by address
    (--servers-file, --attach), router workers elsewhere (mmctl router) fetching their state
    from its admin API, state in a shared PostgreSQL (--state-url) with leader election."""
    _logging(opts["log_level"])
    cfg = service_config(opts)
    cfg.router, cfg.router_workers, cfg.external_routers = False, 0, True
    _run_service(cfg, opts["log_level"])


@click.command("router")
@click.option("--control-url", envvar="MMCTL_CONTROL_URL", required=True,
              help="The control plane's admin API; several comma-separated (a leader and its "
                   "standbys) are tried in turn (env MMCTL_CONTROL_URL).")
@click.option("--name", default=None, help="This worker's name (default: the host name).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address of the public ports (0.0.0.0 to serve other machines).")
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="Public Triton gRPC port.")
@click.option("--http-port", type=int, default=8000, show_default=True,
              help="Public KServe v2 HTTP port (also /metrics).")
@click.option("--max-request-bytes", default="16MiB", show_default=True,
              help="Largest inference request accepted.")
@click.option("--load-timeout", type=float, default=120.0, show_default=True,
              help="Seconds a request waits for its model to load.")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The admin token (default: env MMCTL_TOKEN).")
@click.option("--log-level", default="INFO", show_default=True)
def router_command(control_url, name, host, grpc_port, http_port, max_request_bytes, load_timeout,
                   token_file, log_level):
    """Run one router worker in the foreground: the public Triton-compatible ports, serving
    from the control plane's state (start as many as the load needs; they share nothing)."""
    from router.serving.worker import main as worker_main

    argv = ["--control-url", control_url, "--worker", name or socket.gethostname(),
            "--host", host, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
            "--max-request-bytes", str(_size(max_request_bytes)),
            "--load-timeout", str(load_timeout), "--log-level", log_level]
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    worker_main(argv)


# The commands this module adds to mmctl (control_plane.cli.main).
COMMANDS = [up, control_plane_command, router_command]


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def supervise(cfg, log_level: str) -> int:
    """Run the control plane and ``cfg.router_workers`` router workers as supervised
    sibling processes (control_plane.runtime.supervisor) until Ctrl-C."""
    from control_plane.admin.api import TOKEN_FILE_NAME, ensure_token_file
    from control_plane.runtime.service import config_to_json
    from control_plane.runtime.supervisor import Child, Supervisor, python_module
    from control_plane.triton.process import free_port

    cfg.state_dir = cfg.state_dir.resolve()
    for attr in ("repository", "cold_dir"):
        if getattr(cfg, attr) is not None:
            setattr(cfg, attr, getattr(cfg, attr).resolve())
    run_dir = cfg.state_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    # Fixed before any child starts: a restarted control plane binds the same admin port,
    # and every worker the same public ports.
    if cfg.admin_port == 0:
        cfg.admin_port = free_port(_connect_host(cfg.admin_host))
    for attr in ("router_grpc_port", "router_http_port"):
        if getattr(cfg, attr) == 0:
            setattr(cfg, attr, free_port(_connect_host(cfg.router_host)))
    token = ensure_token_file(cfg.state_dir / TOKEN_FILE_NAME, cfg.admin_token or None)
    config_file = run_dir / "control-plane.json"
    config_file.write_text(config_to_json(cfg))
    admin_url = f"http://{_connect_host(cfg.admin_host)}:{cfg.admin_port}"
    metrics_dir = run_dir / "metrics"
    # Clients' shared-memory registrations, shared by the workers; a previous run's name
    # memory of clients that have gone (Triton forgets them on a restart too).
    shared_memory_dir = run_dir / "shared-memory"
    shutil.rmtree(shared_memory_dir, ignore_errors=True)
    secrets = {"MMCTL_STATE_URL": cfg.state_url, "MMCTL_TRITON_ADMIN_KEY": cfg.triton_admin_key}
    control_plane = Child("control-plane", "control-plane", python_module(
        "control_plane.runtime.service", "--config", str(config_file), "--log-level", log_level),
        dict(os.environ, **{k: v for k, v in secrets.items() if v}))
    worker_env = dict(os.environ, MMCTL_TOKEN=token, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    workers = [
        Child("router-worker", f"w{i}", python_module(
            "router.serving.worker", "--control-url", admin_url, "--worker", f"w{i}", "--host", cfg.router_host,
            "--grpc-port", str(cfg.router_grpc_port), "--http-port", str(cfg.router_http_port),
            "--max-request-bytes", str(cfg.max_request_bytes), "--load-timeout", str(cfg.load_wait_timeout_s),
            "--shadow-log-dir", str(cfg.state_dir / "shadow" / f"w{i}"),
            "--shared-memory-dir", str(shared_memory_dir),
            "--ready-file", str(run_dir / f"w{i}.ready"), "--log-level", log_level),
            worker_env, ready_file=run_dir / f"w{i}.ready")
        for i in range(cfg.router_workers)]
    line = (f"ready: router gRPC {cfg.router_host}:{cfg.router_grpc_port}, HTTP {cfg.router_host}:"
            f"{cfg.router_http_port} ({cfg.router_workers} worker{'s' if cfg.router_workers > 1 else ''}); "
            f"admin API {admin_url}")
    return Supervisor(cfg.state_dir, control_plane, workers, admin_url, token, line,
                      ready_timeout_s=cfg.triton_ready_timeout_s + 300, metrics_dir=metrics_dir).run()


