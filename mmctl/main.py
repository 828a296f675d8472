"""``mmctl``: start the product and drive the control plane's admin API.

Exit codes scripts can rely on:
    0 ok                    4 unknown model              7 timeout
    1 other error           5 no capacity (all pinned)   8 model not healthy
    2 bad usage / input     6 load failed                3 control plane not reachable
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from control_plane.client import ClientSettings
from domain.errors import ControlPlaneError
from domain.exit_codes import EXIT_UNHEALTHY
from mmctl import settings
from mmctl.common import Api, _table, pass_api
from mmctl.common import fmt_ago as _ago
from mmctl.common import fmt_bytes as _bytes


@click.group(context_settings={"max_content_width": 100})
@settings.options(ClientSettings, "mmctl", config_file=False)
@click.pass_context
def cli(ctx: click.Context, **opts):
    """Multi-model serving on Triton: load, pin and inspect models."""
    client = ClientSettings(**settings.values(ClientSettings, "mmctl", opts))
    ctx.obj = Api(client.url, client.timeout_s, client.token_file)


def _emit(body, as_json: bool, text: str) -> None:
    click.echo(json.dumps(body, indent=2) if as_json else text)


def _one_line(rec: dict) -> str:
    extra = f" on {rec['server']}" if rec.get("server") else ""
    pinned = ", pinned" if rec.get("pinned") else ""
    return f"{rec['model']}: {rec['state']}{extra}{pinned}"


def _servers(rec: dict) -> str:
    """Where a model is: its copies' servers (the first is its own), or -."""
    copies = rec.get("copies") or []
    if len(copies) <= 1:
        return rec.get("server") or "-"
    return ",".join(c["server"] + ("" if c["state"] == "ready" else f"({c['state']})")
                    for c in copies)


@click.command()
@click.argument("pattern", required=False)
@click.option("--state", type=click.Choice(["warm", "loading", "ready", "unloading", "failed", "unload_failed"]),
              help="Only models in this state.")
@click.option("--tier", type=click.Choice(["hot", "staging", "warm", "cold"]),
              help="Only models in this tier.")
@click.option("--server", help="Only models on this Triton server (mmctl fleet lists them).")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output, streamed as it arrives (thousands of models).")
@click.option("--all", "show_all", is_flag=True, help="Include models that are only warm.")
@pass_api
def status(api: Api, pattern: str | None, state: str | None, tier: str | None, server: str | None,
           as_json: bool, show_all: bool):
    """Models: state, pinned, last used, load time, memory.  PATTERN: one model's name, or a
    glob (cust0*); the control plane filters, so one model answers at once among thousands."""
    filtered = any(v is not None for v in (pattern, state, tier, server))
    if as_json:
        for chunk in api.stream("/v1/status", match=pattern, state=state, tier=tier, server=server):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.write(b"\n")
        return
    if filtered or show_all:
        shown, hidden = api.status(pattern, state, tier, server), 0
    else:
        shown, hidden = api.status_without_warm()
    rows = [[m["model"], m["state"], m.get("tier", "-"), "yes" if m["pinned"] else "", _servers(m),
             f"{len([c for c in m.get('copies') or [] if c['state'] == 'ready'])}/{m['replicas']}"
             + (" auto" if m.get("autoscale") else "")
             if m.get("replicas", 1) > 1 or m.get("autoscale") else "",
             _ago(m["last_used"]),
             f"{m['load_time_s']:.2f}s" if m["load_time_s"] else "-", _bytes(m["memory_bytes"]),
             (m["failure"] or m.get("copies_note") or "")[:60]] for m in shown]
    click.echo(_table(rows, ["MODEL", "STATE", "TIER", "PINNED", "SERVER", "COPIES", "LAST USED",
                             "LOAD TIME", "MEMORY", "NOTE"]))
    if hidden:
        click.echo(f"({hidden} more warm models; --all shows them)")


def _model_command(name: str, help_text: str) -> click.Command:
    """``mmctl NAME MODEL``: the admin client's method of that name (load, pin, unpin)."""
    @click.command(name=name, help=help_text)
    @click.argument("model")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @pass_api
    def command(api: Api, model: str, as_json: bool):
        body = getattr(api, name)(model)
        _emit(body, as_json, _one_line(body))

    return command


load = _model_command("load", "Load MODEL; if its server is full, first evict unpinned models chosen "
               "by the eviction policy (least recently used, unless `mmctl up --policy` says "
               "otherwise).")
pin = _model_command("pin", "Pin MODEL: loaded and never evicted, across restarts.")
unpin = _model_command("unpin", "Unpin MODEL (it stays loaded until evicted).")


@click.command()
@click.argument("model")
@click.option("--force", is_flag=True,
              help="Unload even if pinned: the pin stays, so the reconcile loads it again "
              "within seconds (a restart of the model); unpin it to keep it unloaded.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def unload(api: Api, model: str, force: bool, as_json: bool):
    """Unload MODEL (waits for in-flight requests and for the memory to be freed)."""
    body = api.unload(model, force=force)
    _emit(body, as_json, _one_line(body))


@click.command()
@click.argument("model")
@click.option("--replicas", required=True, metavar="N|auto",
              help="Copies to keep, each on its own server (1: the model's own copy only), or "
              "auto: as many as its outstanding requests need, between --min and --max.")
@click.option("--min", "minimum", type=click.IntRange(min=1), help="auto: the fewest copies (default 1).")
@click.option("--max", "maximum", type=click.IntRange(min=1),
              help="auto: the most copies (default: one per server).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def scale(api: Api, model: str, replicas: str, minimum: int | None, maximum: int | None,
          as_json: bool):
    """Keep REPLICAS copies of MODEL on as many servers; the router sends each request to the
    copy with the fewest outstanding.  Kept across restarts; copies follow the model's own
    (none while it is not loaded) and are the first to be evicted when room is needed."""
    if replicas != "auto":
        try:
            replicas = int(replicas)
        except ValueError:
            raise click.BadParameter(f"{replicas!r}: a whole number >= 1, or auto",
                                     param_hint="--replicas") from None
        if replicas < 1:
            raise click.BadParameter(f"{replicas} is below 1 (1: the model's own copy only)",
                                     param_hint="--replicas")
    body = api.scale(model, replicas, minimum, maximum)
    ready = [c["server"] for c in body.get("copies", []) if c["state"] == "ready"]
    note = f" ({body['copies_note']})" if body.get("copies_note") else ""
    auto = body.get("autoscale")
    bounds = f" (auto, {auto['min']} to {auto['max']})" if auto else ""
    _emit(body, as_json, f"{body['model']}: {len(ready)} of {body['replicas']} copies ready"
          f"{' on ' + ', '.join(ready) if ready else ''}{bounds}{note}")


@click.command()
@click.argument("model")
@click.option("--probe", is_flag=True, help="Run a fresh warm-up inference now.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def health(api: Api, model: str, probe: bool, as_json: bool):
    """Per-model health: state and the result of the warm-up inference (exit 8 if unhealthy)."""
    body = api.health(model, probe=probe)
    warm = body.get("warmup") or {}
    if warm.get("ok"):
        detail = f"warm-up ok ({warm['latency_ms']:.1f} ms)" if warm.get("latency_ms") else "warm-up ok"
    elif warm:
        detail = f"warm-up failed: {warm.get('error')}" + (f" ({warm['note']})" if warm.get("note") else "")
    else:
        detail = "no warm-up yet" + (f" ({body['failure']})" if body.get("failure") else "")
    verdict = "healthy" if body["healthy"] else "unhealthy"
    _emit(body, as_json, f"{body['model']}: {verdict}, {body['state']}, {detail}")
    if not body["healthy"]:
        sys.exit(EXIT_UNHEALTHY)


def _server_state(server: dict) -> str:
    """up, suspect (a probe missed: still serving) or DOWN."""
    health = server.get("health") or ("up" if server["up"] else "down")
    return "DOWN" if health == "down" else health


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def fleet(api: Api, as_json: bool):
    """Triton servers: device, capacity, used, models."""
    servers = api.fleet()
    rows = [[s["server"], s["device"] + (" (isolated)" if s.get("isolated") else ""),
             s["grpc_url"], _server_state(s),
             str(s["max_loaded"] or "-"), _bytes(s["memory_budget_bytes"]), _bytes(s["used_bytes"]),
             ",".join(s["loaded"]) or "-"] for s in servers]
    _emit(servers, as_json, _table(rows, ["SERVER", "DEVICE", "GRPC", "STATUS", "MAX MODELS",
                                          "BUDGET", "USED", "LOADED"]))
    for s in servers:
        if s.get("model_control") == "open":
            click.echo(f"warning: {s['server']} ({s['grpc_url']}) takes model control without a key: "
                       "anyone who reaches its ports can load a model and run its code; start it "
                       "with Triton's restricted-API options and give the control plane the key "
                       "(docs/operations.md: Security model)", err=True)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def endpoints(api: Api, as_json: bool):
    """Where the admin API and each Triton's gRPC/HTTP endpoints listen."""
    body = api.endpoints()
    lines = [f"admin API   {body.get('admin')}"]
    for key in ("router_grpc", "router_http"):
        if body.get(key):
            lines.append(f"{key.replace('_', ' '):<11} {body[key]}")
    for t in body.get("triton", []):
        lines.append(f"{t['server']:<11} grpc {t['grpc']}  http {t['http'] or '-'}  ({t['device']})")
    _emit(body, as_json, "\n".join(lines))


@click.command("demo-fleet")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Model repository to write into.")
@click.option("--count", type=int, default=50, show_default=True, help="Number of customers.")
@click.option("--size-mb", type=float, default=None, help="Weight size per model.")
@click.option("--layout", type=click.Choice(["family", "models"]), default=None,
              help="The whole demo `mmctl up` serves (customers as one family or one model "
                   "each, the rollout and LoRA demos); without it, the customers only, one "
                   "model each.")
@click.option("--overwrite", is_flag=True, help="Rewrite models that are already there.")
def demo_fleet(out: Path, count: int, size_mb: float | None, layout: str | None, overwrite: bool):
    """Write the demo fleet cust001..custNNN into a model repository."""
    from control_plane.demo import require_weights_writer, write_demo_repository

    try:
        require_weights_writer()
    except ControlPlaneError as exc:
        raise click.ClickException(exc.message) from None
    if layout is not None:
        if overwrite:
            raise click.UsageError("--overwrite writes the customers only: leave out --layout")
        write_demo_repository(out, count, size_mb, layout)
        click.echo(f"wrote the demo ({layout} layout, {count} customers) into {out}")
        return
    from control_plane.demo.fleet import demo_spec, generate_fleet

    written = generate_fleet(out, demo_spec(count, size_mb), overwrite=overwrite)
    click.echo(f"wrote {len(written)} models into {out} ({count - len(written)} already there)")


def _add_commands() -> None:
    """Every mmctl command, added one way: each module of this package defines its
    commands and groups with click and lists them in ``COMMANDS``; this adds them all."""
    from mmctl import adapters, families, registry, routing, serve, settings

    own = [status, load, pin, unpin, unload, scale, health, fleet, endpoints, demo_fleet]
    for command in (*own, *routing.COMMANDS, *serve.COMMANDS, *registry.COMMANDS,
                    *adapters.COMMANDS, *families.COMMANDS, *settings.COMMANDS):
        cli.add_command(command)


_add_commands()


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli(prog_name="mmctl")


if __name__ == "__main__":
    main()
