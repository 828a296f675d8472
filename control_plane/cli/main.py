"""``mmctl``: start the product and drive the control plane's admin API.

Exit codes scripts can rely on:
    0 ok                    4 unknown model              7 timeout
    1 other error           5 no capacity (all pinned)   8 model not healthy
    2 bad usage / input     6 load failed                3 control plane not reachable
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import click
import requests

from control_plane.cli.common import (  # noqa: F401  (exit codes are part of this module's surface)
    DEFAULT_TOKEN_FILE,
    DEFAULT_URL,
    EXIT_BY_ERROR,
    EXIT_ERROR,
    EXIT_LOAD_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNHEALTHY,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Api,
    _table,
    pass_api,
)
from control_plane.cli.common import fmt_ago as _ago
from control_plane.cli.common import fmt_bytes as _bytes
from control_plane.eviction import DEFAULT_POLICY, POLICIES


@click.group(context_settings={"max_content_width": 100})
@click.option("--url", envvar="MMCTL_URL", default=DEFAULT_URL, show_default=True,
              help="Admin API of the control plane (env MMCTL_URL).")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True,
              help="Seconds to wait for an answer (loads can take long).")
@click.option("--token-file", type=click.Path(path_type=Path), envvar="MMCTL_TOKEN_FILE",
              default=DEFAULT_TOKEN_FILE, show_default=True,
              help="The admin token written by `mmctl up` into its --state-dir (env "
                   "MMCTL_TOKEN_FILE); env MMCTL_TOKEN, if set, is used instead.")
@click.pass_context
def cli(ctx: click.Context, url: str, timeout_s: float, token_file: Path):
    """Multi-model serving on Triton: load, pin and inspect models."""
    ctx.obj = Api(url, timeout_s, token_file)


def _emit(body, as_json: bool, text: str) -> None:
    click.echo(json.dumps(body, indent=2) if as_json else text)


def _one_line(rec: dict) -> str:
    extra = f" on {rec['server']}" if rec.get("server") else ""
    pinned = ", pinned" if rec.get("pinned") else ""
    return f"{rec['model']}: {rec['state']}{extra}{pinned}"


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "show_all", is_flag=True, help="Include models that are only warm.")
@pass_api
def status(api: Api, as_json: bool, show_all: bool):
    """Models: state, pinned, last used, load time, memory."""
    _, models = api.call("GET", "/v1/status")
    if as_json:
        _emit(models, True, "")
        return
    shown = [m for m in models if show_all or m["state"] != "warm" or m["pinned"]]
    rows = [[m["model"], m["state"], m.get("tier", "-"), "yes" if m["pinned"] else "", m["server"] or "-",
             _ago(m["last_used"]),
             f"{m['load_time_s']:.2f}s" if m["load_time_s"] else "-", _bytes(m["memory_bytes"]),
             (m["failure"] or "")[:60]] for m in shown]
    click.echo(_table(rows, ["MODEL", "STATE", "TIER", "PINNED", "SERVER", "LAST USED", "LOAD TIME",
                             "MEMORY", "NOTE"]))
    hidden = len(models) - len(shown)
    if hidden:
        click.echo(f"({hidden} more warm models; --all shows them)")


def _model_command(name: str, help_text: str, method: str, path: str):
    @cli.command(name=name, help=help_text)
    @click.argument("model")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @pass_api
    def command(api: Api, model: str, as_json: bool):
        _, body = api.call(method, path.format(model=requests.utils.quote(model, safe="")))
        _emit(body, as_json, _one_line(body))

    return command


_model_command("load", "Load MODEL; if its server is full, first evict unpinned models chosen "
               "by the eviction policy (least recently used, unless `mmctl up --policy` says "
               "otherwise).",
               "POST", "/v1/models/{model}/load")
_model_command("pin", "Pin MODEL: loaded and never evicted, across restarts.",
               "POST", "/v1/models/{model}/pin")
_model_command("unpin", "Unpin MODEL (it stays loaded until evicted).",
               "POST", "/v1/models/{model}/unpin")


@cli.command()
@click.argument("model")
@click.option("--force", is_flag=True,
              help="Unload even if pinned: the pin stays, so the reconcile loads it again "
              "within seconds (a restart of the model); unpin it to keep it unloaded.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def unload(api: Api, model: str, force: bool, as_json: bool):
    """Unload MODEL (waits for in-flight requests and for the memory to be freed)."""
    params = {"force": "1"} if force else {}
    _, body = api.call("POST", f"/v1/models/{requests.utils.quote(model, safe='')}/unload", **params)
    _emit(body, as_json, _one_line(body))


@cli.command()
@click.argument("model")
@click.option("--probe", is_flag=True, help="Run a fresh warm-up inference now.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def health(api: Api, model: str, probe: bool, as_json: bool):
    """Per-model health: state and the result of the warm-up inference (exit 8 if unhealthy)."""
    params = {"probe": "1"} if probe else {}
    code, body = api.call("GET", f"/health/{requests.utils.quote(model, safe='')}",
                          ok_statuses=(200, 503), **params)
    warm = body.get("warmup") or {}
    if warm.get("ok"):
        detail = f"warm-up ok ({warm['latency_ms']:.1f} ms)" if warm.get("latency_ms") else "warm-up ok"
    elif warm:
        detail = f"warm-up failed: {warm.get('error')}"
    else:
        detail = "no warm-up yet" + (f" ({body['failure']})" if body.get("failure") else "")
    verdict = "healthy" if body["healthy"] else "unhealthy"
    _emit(body, as_json, f"{body['model']}: {verdict}, {body['state']}, {detail}")
    if code != 200:
        sys.exit(EXIT_UNHEALTHY)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def fleet(api: Api, as_json: bool):
    """Triton servers: device, capacity, used, models."""
    _, servers = api.call("GET", "/v1/fleet")
    rows = [[s["server"], s["device"] + (" (isolated)" if s.get("isolated") else ""),
             s["grpc_url"], "up" if s["up"] else "DOWN",
             str(s["max_loaded"] or "-"), _bytes(s["memory_budget_bytes"]), _bytes(s["used_bytes"]),
             ",".join(s["loaded"]) or "-"] for s in servers]
    _emit(servers, as_json, _table(rows, ["SERVER", "DEVICE", "GRPC", "STATUS", "MAX MODELS",
                                          "BUDGET", "USED", "LOADED"]))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def endpoints(api: Api, as_json: bool):
    """Where the admin API and each Triton's gRPC/HTTP endpoints listen."""
    _, body = api.call("GET", "/v1/endpoints")
    lines = [f"admin API   {body.get('admin')}"]
    for key in ("router_grpc", "router_http"):
        if body.get(key):
            lines.append(f"{key.replace('_', ' '):<11} {body[key]}")
    for t in body.get("triton", []):
        lines.append(f"{t['server']:<11} grpc {t['grpc']}  http {t['http'] or '-'}  ({t['device']})")
    _emit(body, as_json, "\n".join(lines))


def _size(value: str | None) -> int | None:
    """Parse 500000000, 500MB, 2GiB..."""
    if value is None:
        return None
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
             "MIB": 2**20, "GIB": 2**30}
    text = value.strip().upper().replace(" ", "")
    number = text.rstrip("KMGIB")
    unit = text[len(number):]
    try:
        return int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise click.BadParameter(f"{value!r} is not a size (examples: 500000000, 500MB, 2GiB)")


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


@cli.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=Path(".state"), show_default=True,
              help="Pins, routes, registry (SQLite), admin token, endpoints.json, Triton logs.")
@click.option("--repository", type=click.Path(path_type=Path), default=None,
              help="Triton model repository (default: <state-dir>/repository with the demo fleet).")
@click.option("--max-loaded", type=int, default=None, help="Most models loaded per Triton server.")
@click.option("--memory-budget", default=None,
              help="Bytes of model memory per server (e.g. 2GiB), or 'unlimited'. Default: "
                   "each GPU's or MIG slice's memory less 10% (at least 1 GiB), else 50% of "
                   "host RAM shared by the local servers (mmctl fleet shows it).")
@click.option("--fleet-size", type=int, default=50, show_default=True,
              help="Demo models cust001..custNNN to create if missing.")
@click.option("--model-size-mb", type=float, default=None,
              help="Weight size of each demo model (the seed scenario uses 850).")
@click.option("--admin-host", default="127.0.0.1", show_default=True,
              help="Address of the admin API (model control: keep it off public networks).")
@click.option("--admin-port", type=int, default=8090, show_default=True,
              help="Port of the admin API (0 = any free port; endpoints.json says which).")
@click.option("--admin-token", envvar="MMCTL_TOKEN", default=None,
              help="Bearer token the admin API requires (env MMCTL_TOKEN; prefer the env, argv "
                   "is visible to other users). Default: reuse or generate "
                   "<state-dir>/admin.token (mode 0600), where mmctl finds it.")
@click.option("--admin-allowed-host", "admin_allowed_hosts", multiple=True,
              help="Another Host name the admin API answers to besides loopback and "
                   "--admin-host (repeatable); any other name is refused (DNS rebinding).")
@click.option("--triton-servers", type=int, default=1, show_default=True,
              help="Local tritonserver processes to start on a machine without GPUs (with "
                   "GPUs: one per GPU or MIG slice).")
@click.option("--devices", default=None,
              help="Only these GPUs / MIG slices, comma-separated: ids as `mmctl fleet` shows "
                   "them (gpu0, gpu1/mig2; a GPU's id selects all its slices) or UUIDs. "
                   "Default: every one NVML finds.")
@click.option("--device-budget", "device_budgets", multiple=True, metavar="DEVICE=SIZE",
              help="Model memory of one device, e.g. gpu0=60GiB (repeatable). Default: the "
                   "device's memory less a reserve of 10% (at least 1 GiB) for Triton's CUDA "
                   "context, memory pool and fragmentation.")
@click.option("--triton-http-port", type=int, default=8100, show_default=True,
              help="Triton's internal HTTP port (server i: port + 10*i; 0 = any free port).")
@click.option("--triton-grpc-port", type=int, default=8101, show_default=True,
              help="Triton's internal gRPC port (server i: port + 10*i; 0 = any free port).")
@click.option("--triton-metrics-port", type=int, default=8102, show_default=True,
              help="Triton's metrics port (server i: port + 10*i; 0 = any free port).")
@click.option("--attach", multiple=True,
              help="Already running Triton: GRPC_URL[,HTTP_URL] (repeatable).")
@click.option("--router/--no-router", default=True, show_default=True,
              help="Serve the public Triton-compatible endpoint.")
@click.option("--router-workers", type=click.IntRange(min=0), default=None,
              help="Router processes sharing the public ports (SO_REUSEPORT), supervised with "
                   "the control plane: a crash of either leaves the other serving. Default: a "
                   "quarter of the cores (1 to 8). 0: the router runs inside the control plane's "
                   "process (one process, no supervisor).")
@click.option("--router-host", default="127.0.0.1", show_default=True,
              help="Address of the public endpoint (0.0.0.0 to serve other machines).")
@click.option("--router-http-port", type=int, default=8000, show_default=True,
              help="Public KServe v2 HTTP port.")
@click.option("--router-grpc-port", type=int, default=8001, show_default=True,
              help="Public Triton gRPC port.")
@click.option("--max-request-bytes", default="16MiB", show_default=True,
              help="Largest inference request the router accepts.")
@click.option("--expose-versions", is_flag=True, default=False,
              help="Let clients call concrete Triton names (cust017.v3, cust017-faulty) "
                   "directly. Off: only logical names and their registry versions are "
                   "public, so A/B, canaries and limits on a name cannot be skipped.")
@click.option("--warm-budget", default=None,
              help="Bytes of host DRAM for the warm tier (Triton's repository), e.g. 16GiB.")
@click.option("--cold-dir", type=click.Path(path_type=Path), default=None,
              help="Local cold store (default <state-dir>/cold). S3 comes from MMS_S3_* env.")
@click.option("--auto-pin-top-k", type=int, default=None,
              help="Pin the K models with the most traffic automatically.")
@click.option("--prefetch-min-miss-rate", type=float, default=None,
              help="Prefetch into warm the models missing more often than this per second.")
@click.option("--policy", type=click.Choice(sorted(POLICIES)), default=DEFAULT_POLICY,
              show_default=True,
              help="Which unpinned model to evict when a server is full: lru (least recently "
                   "used), wtinylfu (frequency and load cost), wtinylfu-hits (frequency), gdsf "
                   "(frequency, cost and size). README: replayed hit ratios of each.")
@click.option("--headroom-models", type=click.IntRange(min=0), default=None,
              help="Models' worth of room each server keeps free, so that a miss loads at "
                   "once instead of waiting for an unload; the policy's next victim leaves "
                   "in the background. Default: 1 on servers that hold at least 8 models, "
                   "else 0. 0 turns it off.")
@click.option("--headroom-bytes", default=None,
              help="Bytes each server with a byte budget keeps free instead (e.g. 2GiB); "
                   "default: --headroom-models times the median loaded model's size.")
@click.option("--reconcile-interval", type=float, default=2.0, show_default=True,
              help="Seconds between passes that compare with each Triton and repair.")
@click.option("--log-level", default="INFO", show_default=True,
              help="DEBUG, INFO, WARNING or ERROR.")
def up(state_dir, repository, max_loaded, memory_budget, fleet_size, model_size_mb, admin_host,
       admin_port, admin_token, admin_allowed_hosts, triton_servers, devices, device_budgets,
       triton_http_port,
       triton_grpc_port, triton_metrics_port, attach, router, router_workers, router_host, router_http_port,
       router_grpc_port, max_request_bytes, expose_versions, warm_budget, cold_dir, auto_pin_top_k,
       prefetch_min_miss_rate, policy, headroom_models, headroom_bytes, reconcile_interval,
       log_level):
    """Start tritonserver(s) and the control plane in the foreground; Ctrl-C stops all."""
    from control_plane.domain.errors import ControlPlaneError
    from control_plane.runtime.service import Service, ServiceConfig
    from control_plane.tiers.cold import S3Config

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    unlimited = (memory_budget or "").strip().lower() == "unlimited"
    # TEST HOOK: MMS_TEST_FAKE_NVML names a fake-device spec (control_plane/fake_nvml.py) so
    # that integration tests drive the GPU/MIG paths with CPU Tritons standing in.  Only tests
    # set it; production finds devices through the real NVML.
    from control_plane.triton.fake_nvml import TEST_HOOK_ENV, from_test_hook

    fake_nvml = from_test_hook()
    if fake_nvml is not None:
        logging.getLogger(__name__).warning(
            "TEST HOOK %s is set: devices come from a fake NVML, not from this machine",
            TEST_HOOK_ENV)
    cfg = ServiceConfig(
        state_dir=state_dir, repository=repository, admin_host=admin_host, admin_port=admin_port,
        admin_token=admin_token or None, admin_allowed_hosts=list(admin_allowed_hosts),
        triton_servers=0 if attach and triton_servers == 1 else triton_servers,
        devices=[d.strip() for d in devices.split(",") if d.strip()] if devices else None,
        device_budgets=_device_budgets(device_budgets), nvml=fake_nvml,
        triton_http_port=triton_http_port, triton_grpc_port=triton_grpc_port,
        triton_metrics_port=triton_metrics_port, attach=list(attach), max_loaded=max_loaded,
        memory_budget_bytes=None if unlimited else _size(memory_budget),
        derive_memory_budget=not unlimited, fleet_size=fleet_size,
        model_size_mb=model_size_mb, policy=policy,
        reconcile_interval_s=reconcile_interval, router=router, router_host=router_host,
        router_http_port=router_http_port, router_grpc_port=router_grpc_port,
        max_request_bytes=_size(max_request_bytes), expose_versions=expose_versions,
        warm_budget_bytes=_size(warm_budget),
        cold_dir=cold_dir, s3=S3Config.from_env(), auto_pin_top_k=auto_pin_top_k,
        prefetch_min_miss_rate=prefetch_min_miss_rate, headroom_models=headroom_models,
        headroom_bytes=_size(headroom_bytes))
    if router:
        from control_plane.runtime.supervisor import default_router_workers

        cfg.router_workers = default_router_workers() if router_workers is None else router_workers
    try:
        if cfg.router_workers > 0:
            cfg.validate()
            sys.exit(supervise(cfg, log_level))
        service = Service(cfg)
        asyncio.run(service.serve_forever())
    except ControlPlaneError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(EXIT_BY_ERROR.get(exc.code, EXIT_ERROR))


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
    control_plane = Child("control-plane", "control-plane", python_module(
        "control_plane.runtime.service", "--config", str(config_file), "--log-level", log_level), dict(os.environ))
    worker_env = dict(os.environ, MMCTL_TOKEN=token, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    workers = [
        Child("router-worker", f"w{i}", python_module(
            "router.worker", "--control-url", admin_url, "--worker", f"w{i}", "--host", cfg.router_host,
            "--grpc-port", str(cfg.router_grpc_port), "--http-port", str(cfg.router_http_port),
            "--max-request-bytes", str(cfg.max_request_bytes), "--load-timeout", str(cfg.load_wait_timeout_s),
            "--shadow-log-dir", str(cfg.state_dir / "shadow" / f"w{i}"),
            "--ready-file", str(run_dir / f"w{i}.ready"), "--log-level", log_level),
            worker_env, ready_file=run_dir / f"w{i}.ready")
        for i in range(cfg.router_workers)]
    line = (f"ready: router gRPC {cfg.router_host}:{cfg.router_grpc_port}, HTTP {cfg.router_host}:"
            f"{cfg.router_http_port} ({cfg.router_workers} worker{'s' if cfg.router_workers > 1 else ''}); "
            f"admin API {admin_url}")
    return Supervisor(cfg.state_dir, control_plane, workers, admin_url, token, line,
                      ready_timeout_s=cfg.triton_ready_timeout_s + 300, metrics_dir=metrics_dir).run()


@cli.command("demo-fleet")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Model repository to write into.")
@click.option("--count", type=int, default=50, show_default=True, help="Number of customers.")
@click.option("--size-mb", type=float, default=None, help="Weight size per model.")
@click.option("--overwrite", is_flag=True, help="Rewrite models that are already there.")
def demo_fleet(out: Path, count: int, size_mb: float | None, overwrite: bool):
    """Write the demo fleet cust001..custNNN into a model repository."""
    from control_plane.demo.fleet import (
        FleetSpec,
        default_instance_kind,
        generate_fleet,
        hidden_dim_for_size,
    )

    spec = FleetSpec(count=count, instance_kind=default_instance_kind())
    if size_mb:
        spec = FleetSpec(count=count, instance_kind=spec.instance_kind,
                         hidden_dim=hidden_dim_for_size(size_mb))
    written = generate_fleet(out, spec, overwrite=overwrite)
    click.echo(f"wrote {len(written)} models into {out} ({count - len(written)} already there)")


def _register_subcommands() -> None:
    from control_plane.cli.adapters import adapter
    from control_plane.cli.registry import registry
    from control_plane.cli.routing import register

    register(cli)
    cli.add_command(registry)
    cli.add_command(adapter)


_register_subcommands()


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli(prog_name="mmctl")


if __name__ == "__main__":
    main()
