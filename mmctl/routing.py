"""``mmctl`` commands for routing: experiments, canaries, shadows, rate limits, aliases."""

from __future__ import annotations

import datetime as dt
import json

import click
import requests

from mmctl.common import FINITE, Api, _table, pass_api


def _q(name: str) -> str:
    return requests.utils.quote(name, safe="")


def _send(api: Api, method: str, path: str, body: dict | None = None):
    return api.call(method, path, body=body)[1]


def _ms(v) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


@click.group()
def experiment():
    """A/B experiments with sticky hash assignment."""

@experiment.command("create")
@click.argument("experiment_id")
@click.option("--control", required=True, help="Model that serves the control group.")
@click.option("--treatment", required=True, help="Model that serves the treatment group.")
@click.option("--treatment-percent", type=FINITE, default=50.0, show_default=True,
              help="Share of users (or requests) sent to the treatment.")
@click.option("--sticky/--no-sticky", default=True, show_default=True,
              help="Same user id -> same variant (hash of experiment and user id).")
@click.option("--route", default=None, help="Logical name (default: the control model).")
@pass_api
def create(api, experiment_id, control, treatment, treatment_percent, sticky, route):
    """Split a logical name's traffic between --control and --treatment."""
    body = _send(api, "POST", "/v1/experiments", {
        "id": experiment_id, "control": control, "treatment": treatment,
        "treatment_percent": treatment_percent, "sticky": sticky, "route": route})
    click.echo(f"experiment {body['id']}: {body['treatment_percent']:g}% -> {body['treatment']}, "
               f"rest -> {body['control']} ({'sticky' if body['sticky'] else 'random'})")

@experiment.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def list_(api, as_json):
    """Experiments: route, control, treatment, split, sticky, enabled."""
    body = _send(api, "GET", "/v1/experiments")
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    rows = [[e["id"], e["route"], e["control"], e["treatment"], f"{e['treatment_percent']:g}%",
             "yes" if e["sticky"] else "no", "yes" if e["enabled"] else "no"] for e in body]
    click.echo(_table(rows, ["ID", "ROUTE", "CONTROL", "TREATMENT", "SPLIT", "STICKY", "ENABLED"]))

@experiment.command("stats")
@click.argument("experiment_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def stats(api, experiment_id, as_json):
    """Per variant: requests, errors, p50/p99 latency, requests without a user id."""
    body = _send(api, "GET", f"/v1/experiments/{_q(experiment_id)}")
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    rows = [[v, s["requests"], s["errors"], f"{s['error_rate']:.4f}", _ms(s["p50_ms"]), _ms(s["p99_ms"]),
             s["random_assignments"]] for v, s in sorted(body["variants"].items())]
    click.echo(_table(rows, ["VARIANT", "REQUESTS", "ERRORS", "ERROR RATE", "P50 MS", "P99 MS",
                             "NO USER ID"]))

for action in ("enable", "disable"):
    def make(action=action):
        @experiment.command(action, help={
            "enable": "Enable the experiment: its traffic is split again.",
            "disable": "Disable the experiment: all its traffic goes to the control model.",
        }[action])
        @click.argument("experiment_id")
        @pass_api
        def cmd(api, experiment_id):
            body = _send(api, "POST", f"/v1/experiments/{_q(experiment_id)}/{action}")
            click.echo(f"experiment {body['id']}: {'enabled' if body['enabled'] else 'disabled'}")
    make()

@experiment.command("delete")
@click.argument("experiment_id")
@pass_api
def delete(api, experiment_id):
    """Delete the experiment; its route serves the control model again."""
    _send(api, "DELETE", f"/v1/experiments/{_q(experiment_id)}")
    click.echo(f"experiment {experiment_id} deleted")

@click.group()
def canary():
    """Staged canary rollouts with automatic rollback."""

@canary.command("start")
@click.argument("name")
@click.option("--to", "to", required=True, help="Candidate model.")
@click.option("--stages", default="1,5,10,25,50,100", show_default=True,
              help="Percentages of NAME's traffic the candidate gets, stage by stage.")
@click.option("--stage-seconds", type=FINITE, default=1800, show_default=True,
              help="Time at each stage before moving to the next.")
@click.option("--check-interval", type=FINITE, default=None, help="Seconds between checks.")
@click.option("--max-error-rate", type=FINITE, default=0.05, show_default=True,
              help="A check fails above this canary error rate.")
@click.option("--max-p99-ms", type=FINITE, default=None,
              help="A check fails above this canary p99 latency.")
@click.option("--max-error-ratio", type=FINITE, default=2.0, show_default=True,
              help="Canary error rate vs baseline.")
@click.option("--max-p99-ratio", type=FINITE, default=None, help="Canary p99 vs baseline.")
@click.option("--min-requests", type=int, default=50, show_default=True,
              help="Fewer canary requests in a check is inconclusive: hold, no verdict.")
@click.option("--max-failed-checks", type=int, default=3, show_default=True,
              help="Consecutive failed checks that roll the canary back to 0%.")
@pass_api
def start(api, name, to, stages, stage_seconds, check_interval, max_error_rate, max_p99_ms,
          max_error_ratio, max_p99_ratio, min_requests, max_failed_checks):
    """Shift NAME's traffic to --to in stages; roll back when checks fail."""
    try:
        stage_list = [float(s) for s in stages.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"{stages!r}: give percentages like 1,5,10,25,50,100")
    body = _send(api, "POST", f"/v1/canaries/{_q(name)}", {
        "to": to, "stages": stage_list, "stage_s": stage_seconds,
        "check_interval_s": check_interval if check_interval is not None else min(30.0, stage_seconds / 4),
        "max_error_rate": max_error_rate, "max_p99_ms": max_p99_ms,
        "max_error_rate_ratio": max_error_ratio, "max_p99_ratio": max_p99_ratio,
        "min_requests": min_requests, "max_failed_checks": max_failed_checks})
    click.echo(f"canary {name} -> {body['candidate']}: stage 1/{len(body['stages'])} at "
               f"{body['stages'][0]:g}%")

@canary.command("status")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def status(api, name, as_json):
    """Stage, per-variant health and the last decisions of NAME's canary."""
    body = _send(api, "GET", f"/v1/canaries/{_q(name)}")
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    click.echo(f"{name}: {body['status']}, {body['baseline']} -> {body['candidate']}, stage "
               f"{body['stage_index'] + 1}/{len(body['stages'])} ({body['percent']:g}%), "
               f"serving {body['serving']}, failed checks {body['failed_checks']}")
    for v, s in sorted(body["variants"].items()):
        click.echo(f"  {v:<9} requests {s['requests']}  errors {s['errors']}  "
                   f"p50 {_ms(s['p50_ms'])} ms  p99 {_ms(s['p99_ms'])} ms")
        apart = {what: s.get(key, 0) for what, key in (
            ("client mistakes", "client_errors"), ("deadlines too short", "short_deadlines"),
            ("refused before the model", "refused"))}
        if any(apart.values()):  # the client's or the product's, never judged
            click.echo("            not judged: " + ", ".join(f"{what} {n}" for what, n in apart.items()))
    for h in body["history"][-10:]:
        when = dt.datetime.fromtimestamp(h["at"]).strftime("%H:%M:%S")
        click.echo(f"  {when} {h['decision']:<8} stage {h['stage'] + 1} {h.get('reason', '')}")

for action in ("abort", "promote"):
    def make(action=action):
        @canary.command(action, help=f"{action.title()} the canary by hand.")
        @click.argument("name")
        @pass_api
        def cmd(api, name):
            body = _send(api, "POST", f"/v1/canaries/{_q(name)}/{action}")
            click.echo(f"canary {name}: {body['status']}")
    make()

@click.group()
def shadow():
    """Mirror traffic to a shadow model (never reaches clients)."""

@shadow.command("start")
@click.argument("name")
@click.option("--model", required=True, help="Shadow model.")
@click.option("--percent", type=FINITE, default=100.0, show_default=True,
              help="Share of NAME's requests mirrored to the shadow.")
@pass_api
def shadow_start(api, name, model, percent):
    """Mirror NAME's requests to --model and compare its answers (clients never see them)."""
    _send(api, "POST", f"/v1/shadows/{_q(name)}", {"model": model, "percent": percent})
    click.echo(f"shadowing {percent:g}% of {name} to {model}")

@shadow.command("stop")
@click.argument("name")
@pass_api
def shadow_stop(api, name):
    """Stop mirroring NAME's requests (the report stays)."""
    _send(api, "DELETE", f"/v1/shadows/{_q(name)}")
    click.echo(f"shadow of {name} stopped")

@shadow.command("report")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def shadow_report(api, name, as_json):
    """Mirrored, compared, dropped and shed counts, divergence rate and latency delta."""
    body = _send(api, "GET", f"/v1/shadows/{_q(name)}")
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    rate = body["divergence_rate"]
    click.echo(f"{name}: mirrored {body['mirrored']}, compared {body['compared']}, dropped "
               f"{body['dropped']}, shed {body.get('shed', 0)}, errors {body['errors']}, timeouts {body['timeouts']}, "
               f"divergence {'-' if rate is None else f'{rate:.3f}'}, latency delta "
               f"{_ms(body['mean_latency_delta_ms'])} ms  (log: {body.get('log', '-')})")

@click.group()
def limit():
    """Per-model / per-route rate limits (token bucket)."""

@limit.command("set")
@click.argument("name")
@click.option("--qps", type=FINITE, required=True, help="Requests per second allowed.")
@click.option("--burst", type=FINITE, default=None,
              help="Requests allowed at once above the rate (default: max(1, qps)).")
@pass_api
def limit_set(api, name, qps, burst):
    """Rate-limit NAME: a model, a logical name or BASE:ADAPTER (exit 4 if unknown)."""
    body = _send(api, "PUT", f"/v1/limits/{_q(name)}", {"qps": qps, "burst": burst})
    click.echo(f"{name}: {body['limit']['qps']:g} requests/s, burst {body['limit']['burst']:g}")

@limit.command("clear")
@click.argument("name")
@pass_api
def limit_clear(api, name):
    """Remove NAME's rate limit."""
    _send(api, "DELETE", f"/v1/limits/{_q(name)}")
    click.echo(f"{name}: no limit")

@limit.command("list")
@pass_api
def limit_list(api):
    """Every rate limit: name, requests per second, burst."""
    body = _send(api, "GET", "/v1/limits")
    click.echo(_table([[n, f"{v['qps']:g}", f"{v['burst']:g}"] for n, v in sorted(body.items())],
                      ["NAME", "QPS", "BURST"]))

@click.group()
def share():
    """Weights in a saturated server's fair share (servers with --server-concurrency)."""

def _share_path(name, tenant):
    if (name is None) == (tenant is None):
        raise click.UsageError("name a model, or a tenant with --tenant (one of the two)")
    return f"/v1/shares/models/{_q(name)}" if tenant is None else f"/v1/shares/tenants/{_q(tenant)}"

@share.command("set")
@click.argument("name", required=False)
@click.option("--tenant", default=None, help="Weigh every model registered for this tenant.")
@click.option("--weight", type=FINITE, required=True,
              help="Its share relative to the others' (unset: 1); > 0, at most 1000.")
@pass_api
def share_set(api, name, tenant, weight):
    """Weigh model NAME (a model, a family's variant, or a registry model: all its versions)
    or a tenant's models in the fair share of a saturated server (exit 4 if NAME is unknown).
    A model's own weight beats its tenant's."""
    _send(api, "PUT", _share_path(name, tenant), {"weight": weight})
    click.echo(f"{name or 'tenant ' + tenant}: weight {weight:g}")

@share.command("clear")
@click.argument("name", required=False)
@click.option("--tenant", default=None, help="Clear a tenant's weight.")
@pass_api
def share_clear(api, name, tenant):
    """Weigh NAME (or --tenant) 1 again."""
    _send(api, "DELETE", _share_path(name, tenant))
    click.echo(f"{name or 'tenant ' + tenant}: weight 1")

@share.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@pass_api
def share_list(api, as_json):
    """The weights set, and each server's concurrency (its fair share applies past it)."""
    body = _send(api, "GET", "/v1/shares")
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    rows = [["model", n, f"{w:g}"] for n, w in sorted(body["models"].items())]
    rows += [["tenant", n, f"{w:g}"] for n, w in sorted(body["tenants"].items())]
    click.echo(_table(rows, ["KIND", "NAME", "WEIGHT"]) if rows else "no weights set: every model weighs 1")
    servers = [[n, str(c) if c else "no limit"] for n, c in sorted(body["servers"].items())]
    click.echo(_table(servers, ["SERVER", "CONCURRENCY"]))

@click.command()
@click.argument("name")
@click.argument("target")
@pass_api
def alias(api, name, target):
    """Point logical NAME at concrete model TARGET (exit 4 if TARGET is unknown)."""
    _send(api, "PUT", f"/v1/routes/{_q(name)}", {"target": target})
    click.echo(f"{name} -> {target}")


# The commands this module adds to mmctl (mmctl.main.COMMANDS).
COMMANDS = [experiment, canary, shadow, limit, share, alias]
