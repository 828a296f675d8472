"""``mmctl`` commands for routing: experiments, canaries, shadows, rate limits, aliases."""

from __future__ import annotations

import datetime as dt
import json

import click
import requests

from control_plane.cli_common import Api, _table, pass_api


def _q(name: str) -> str:
    return requests.utils.quote(name, safe="")


def _send(api: Api, method: str, path: str, body: dict | None = None):
    return api.call(method, path, body=body)[1]


def _ms(v) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


def register(cli: click.Group) -> None:
    @cli.group()
    def experiment():
        """A/B experiments with sticky hash assignment."""

    @experiment.command("create")
    @click.argument("experiment_id")
    @click.option("--control", required=True)
    @click.option("--treatment", required=True)
    @click.option("--treatment-percent", type=float, default=50.0, show_default=True)
    @click.option("--sticky/--no-sticky", default=True, show_default=True)
    @click.option("--route", default=None, help="Logical name (default: the control model).")
    @pass_api
    def create(api, experiment_id, control, treatment, treatment_percent, sticky, route):
        body = _send(api, "POST", "/v1/experiments", {
            "id": experiment_id, "control": control, "treatment": treatment,
            "treatment_percent": treatment_percent, "sticky": sticky, "route": route})
        click.echo(f"experiment {body['id']}: {body['treatment_percent']:g}% -> {body['treatment']}, "
                   f"rest -> {body['control']} ({'sticky' if body['sticky'] else 'random'})")

    @experiment.command("list")
    @click.option("--json", "as_json", is_flag=True)
    @pass_api
    def list_(api, as_json):
        body = _send(api, "GET", "/v1/experiments")
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return
        rows = [[e["id"], e["route"], e["control"], e["treatment"], f"{e['treatment_percent']:g}%",
                 "yes" if e["sticky"] else "no", "yes" if e["enabled"] else "no"] for e in body]
        click.echo(_table(rows, ["ID", "ROUTE", "CONTROL", "TREATMENT", "SPLIT", "STICKY", "ENABLED"]))

    @experiment.command("stats")
    @click.argument("experiment_id")
    @click.option("--json", "as_json", is_flag=True)
    @pass_api
    def stats(api, experiment_id, as_json):
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
            @experiment.command(action, help=f"{action.title()} the experiment (disabled -> control).")
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
        _send(api, "DELETE", f"/v1/experiments/{_q(experiment_id)}")
        click.echo(f"experiment {experiment_id} deleted")

    @cli.group()
    def canary():
        """Staged canary rollouts with automatic rollback."""

    @canary.command("start")
    @click.argument("name")
    @click.option("--to", "to", required=True, help="Candidate model.")
    @click.option("--stages", default="1,5,10,25,50,100", show_default=True)
    @click.option("--stage-seconds", type=float, default=1800, show_default=True)
    @click.option("--check-interval", type=float, default=None, help="Seconds between checks.")
    @click.option("--max-error-rate", type=float, default=0.05, show_default=True)
    @click.option("--max-p99-ms", type=float, default=None)
    @click.option("--max-error-ratio", type=float, default=2.0, show_default=True,
                  help="Canary error rate vs baseline.")
    @click.option("--max-p99-ratio", type=float, default=None, help="Canary p99 vs baseline.")
    @click.option("--min-requests", type=int, default=50, show_default=True)
    @click.option("--max-failed-checks", type=int, default=3, show_default=True)
    @pass_api
    def start(api, name, to, stages, stage_seconds, check_interval, max_error_rate, max_p99_ms,
              max_error_ratio, max_p99_ratio, min_requests, max_failed_checks):
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
    @click.option("--json", "as_json", is_flag=True)
    @pass_api
    def status(api, name, as_json):
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

    @cli.group()
    def shadow():
        """Mirror traffic to a shadow model (never reaches clients)."""

    @shadow.command("start")
    @click.argument("name")
    @click.option("--model", required=True, help="Shadow model.")
    @click.option("--percent", type=float, default=100.0, show_default=True)
    @pass_api
    def shadow_start(api, name, model, percent):
        _send(api, "POST", f"/v1/shadows/{_q(name)}", {"model": model, "percent": percent})
        click.echo(f"shadowing {percent:g}% of {name} to {model}")

    @shadow.command("stop")
    @click.argument("name")
    @pass_api
    def shadow_stop(api, name):
        _send(api, "DELETE", f"/v1/shadows/{_q(name)}")
        click.echo(f"shadow of {name} stopped")

    @shadow.command("report")
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True)
    @pass_api
    def shadow_report(api, name, as_json):
        body = _send(api, "GET", f"/v1/shadows/{_q(name)}")
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return
        rate = body["divergence_rate"]
        click.echo(f"{name}: mirrored {body['mirrored']}, compared {body['compared']}, dropped "
                   f"{body['dropped']}, errors {body['errors']}, timeouts {body['timeouts']}, "
                   f"divergence {'-' if rate is None else f'{rate:.3f}'}, latency delta "
                   f"{_ms(body['mean_latency_delta_ms'])} ms  (log: {body.get('log', '-')})")

    @cli.group()
    def limit():
        """Per-model / per-route rate limits (token bucket)."""

    @limit.command("set")
    @click.argument("name")
    @click.option("--qps", type=float, required=True)
    @click.option("--burst", type=float, default=None)
    @pass_api
    def limit_set(api, name, qps, burst):
        body = _send(api, "PUT", f"/v1/limits/{_q(name)}", {"qps": qps, "burst": burst})
        click.echo(f"{name}: {body['limit']['qps']:g} requests/s, burst {body['limit']['burst']:g}")

    @limit.command("clear")
    @click.argument("name")
    @pass_api
    def limit_clear(api, name):
        _send(api, "DELETE", f"/v1/limits/{_q(name)}")
        click.echo(f"{name}: no limit")

    @limit.command("list")
    @pass_api
    def limit_list(api):
        body = _send(api, "GET", "/v1/limits")
        click.echo(_table([[n, f"{v['qps']:g}", f"{v['burst']:g}"] for n, v in sorted(body.items())],
                          ["NAME", "QPS", "BURST"]))

    @cli.command()
    @click.argument("name")
    @click.argument("target")
    @pass_api
    def alias(api, name, target):
        """Point logical NAME at concrete model TARGET."""
        _send(api, "PUT", f"/v1/routes/{_q(name)}", {"target": target})
        click.echo(f"{name} -> {target}")
