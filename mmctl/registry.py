"""``mmctl registry ...``: model versions, rollout stages and the warm tier.

A click group that ``mmctl`` adds (``COMMANDS``).  It finds the control
plane through the parent's context object (``.url``, ``.timeout_s``); run on its own it
takes ``MMS_URL`` (or ``MMCTL_URL``).  Exit codes are mmctl's (2 bad input, 3 unreachable, 4 unknown model,
5 no capacity, 6 load/download failed, 7 timeout).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from domain.exit_codes import EXIT_BY_ERROR, EXIT_LOAD_FAILED, EXIT_TIMEOUT
from domain.stages import DEFAULT_SLA, SLA_CLASSES, STAGES
from mmctl.common import _table, current_api, who_am_i
from mmctl.common import fmt_bytes as _size


def _call(method: str, path: str, body: dict | None = None, params: dict | None = None,
          ok: tuple[int, ...] = (200, 201, 202)) -> dict:
    return current_api().call(method, path, ok_statuses=ok, body=body, **(params or {}))[1]


def _when(ts) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


@click.group()
def registry():
    """Model versions, rollout stages (shadow/canary/production) and the warm tier."""


@registry.command("add")
@click.argument("model")
@click.option("--version", "version", type=int, help="Version number (>= 1); default: the next free one.")
@click.option("--from-dir", "source_dir", type=click.Path(exists=True, file_okay=False),
              help="A Triton model folder (config.pbtxt, 1/model.py): copied into the cold store "
              "(the local one by default, or --artifact).")
@click.option("--artifact", "artifact_uri", help="s3://bucket/path/ or file:///path/ of the model folder "
              "(default: the configured cold store's <model>/<version>/).")
@click.option("--sha256", help="Expected folder sha256 (refused if the artifact differs).")
@click.option("--metric", "metrics", multiple=True, help="Validation metric name=value (repeatable).")
@click.option("--data-fingerprint", help="Fingerprint of the training data, e.g. sha256:...")
@click.option("--sla", type=click.Choice(SLA_CLASSES), default=DEFAULT_SLA, show_default=True)
@click.option("--tenant", help="Tenant the model belongs to (placement affinity).")
@click.option("--stage", type=click.Choice(STAGES[:-1]),
              help="Default: production for a model's first version (its logical name serves it "
              "at once), else registered.")
@click.option("--synthetic-warmup/--no-synthetic-warmup", default=True, show_default=True,
              help="After a load of a model with no model_warmup in its config, send one request "
              "of zeros to check it; turn off for a model whose inputs reject zeros.")
@click.option("--family", help="The version is a variant of this model family: its weights go "
              "into a slot of the family's Triton model (mmctl family list).")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False),
              help="With --family: the variant's safetensors file; its tensors must be the "
              "family's (names, shapes, dtypes), checked before anything is stored.")
@click.option("--who", default=who_am_i, help="Recorded as the author of the change.")
@click.option("--json", "as_json", is_flag=True)
def add(model, version, source_dir, artifact_uri, sha256, metrics, data_fingerprint, sla, tenant,
        stage, synthetic_warmup, family, weights, who, as_json):
    """Add a version of MODEL from a model folder (--from-dir), an artifact (--artifact), or
    a family's variant from its weights (--family F --weights FILE).

    \b
    mmctl registry add simple --from-dir ./simple     # simple.v1, production: serve it as "simple"
    mmctl registry add simple --from-dir ./simple2    # simple.v2, registered: promote when ready
    mmctl registry add cust051 --family recommender --weights cust051.safetensors
    """
    body = {"version": version, "artifact_uri": artifact_uri, "sha256": sha256,
            "source_dir": str(Path(source_dir).resolve()) if source_dir else None,
            "metrics": list(metrics), "data_fingerprint": data_fingerprint, "sla": sla,
            "tenant": tenant, "stage": stage, "who": who, "synthetic_warmup": synthetic_warmup,
            "family": family, "weights": str(Path(weights).resolve()) if weights else None}
    mv = _call("POST", f"/v1/registry/models/{model}/versions", body)
    if as_json:
        click.echo(json.dumps(mv, indent=2))
    else:
        click.echo(f"{mv['name']}: {mv['model']} version {mv['version']}, {mv['stage']}, "
                   f"{_size(mv['size_bytes'])}, sha256 {mv['sha256'][:16]}..., {mv['artifact_uri']}")
        if mv.get("serves"):
            click.echo(mv["serves"])


@registry.command("list")
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True)
def list_(model, as_json):
    """Every model version: its concrete NAME (what Triton serves), MODEL and VERSION, stage,
    size and where it is (cold/warm/hot, server).  A client asking for MODEL gets its
    production version."""
    data = _call("GET", "/v1/registry", params={"model": model} if model else None)
    versions = data["versions"]
    if as_json:
        click.echo(json.dumps(versions, indent=2))
        return
    rows = [[v["name"], v["model"], v["version"], v["stage"], v["sla"], _size(v["size_bytes"]),
             _size(v.get("memory_bytes")), v.get("tier") or "-", v.get("server") or "-",
             " ".join(f"{k}={val:g}" for k, val in sorted(v["metrics"].items())) or "-",
             f"{v['stage_changed_by']} {_when(v['stage_changed_at'])}"] for v in versions]
    click.echo(_table(rows, ["NAME", "MODEL", "VERSION", "STAGE", "SLA", "SIZE", "MEASURED", "TIER",
                             "SERVER", "METRICS", "STAGE SET BY"]))


@registry.command("promote")
@click.argument("model")
@click.option("--version", "version", type=int, required=True)
@click.option("--stage", type=click.Choice(STAGES), required=True,
              help="production retires the current production version.")
@click.option("--note", help="Why (kept in the history).")
@click.option("--who", default=who_am_i)
@click.option("--json", "as_json", is_flag=True)
def promote(model, version, stage, note, who, as_json):
    """Move MODEL --version N to --stage (shadow|canary|production|retired)."""
    mv = _call("POST", f"/v1/registry/models/{model}/versions/{version}/stage",
               {"stage": stage, "note": note, "who": who})
    click.echo(json.dumps(mv, indent=2) if as_json else
               f"{mv['name']}: {mv['stage']} (by {mv['stage_changed_by']} at {_when(mv['stage_changed_at'])})")


@registry.command("warmup")
@click.argument("model")
@click.option("--version", "version", type=int, required=True)
@click.argument("setting", type=click.Choice(["on", "off"]))
@click.option("--json", "as_json", is_flag=True)
def warmup(model, version, setting, as_json):
    """Turn MODEL --version N's synthetic warm-up request on or off (from its next load)."""
    mv = _call("POST", f"/v1/registry/models/{model}/versions/{version}/warmup",
               {"synthetic_warmup": setting == "on"})
    click.echo(json.dumps(mv, indent=2) if as_json else
               f"{mv['name']}: synthetic warm-up {'on' if mv['synthetic_warmup'] else 'off'}")


@registry.command("history")
@click.argument("model")
@click.option("--version", "version", type=int)
@click.option("--json", "as_json", is_flag=True)
def history(model, version, as_json):
    """Every stage change of MODEL: from, to, who, when."""
    data = _call("GET", f"/v1/registry/models/{model}/history",
                 params={"version": version} if version is not None else None)["history"]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    rows = [[f"v{c['version']}", c["from_stage"] or "-", c["to_stage"], c["who"], _when(c["at"]),
             c.get("note") or ""] for c in data]
    click.echo(_table(rows, ["VERSION", "FROM", "TO", "WHO", "WHEN", "NOTE"]))


@registry.command("warm")
@click.option("--json", "as_json", is_flag=True)
def warm(as_json):
    """What is in the warm tier (host DRAM) and what is downloading."""
    data = _call("GET", "/v1/warm")
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"warm tier {data['repository']}: {_size(data['used_bytes'])} used of "
               f"{_size(data['budget_bytes']) if data['budget_bytes'] else 'unlimited'}")
    rows = [[m["name"], _size(m["size_bytes"]), "yes" if m["busy"] else "", "" if m["managed"] else "local-only",
             _when(m["last_used"])] for m in data["models"]]
    rows += [[d["name"], f"{_size(d['done_bytes'])}/{_size(d['total_bytes'])}", "", "downloading", "-"]
             for d in data["downloads"]]
    click.echo(_table(rows, ["NAME", "SIZE", "LOADED", "NOTE", "LAST USED"]))


@registry.command("stage")
@click.argument("model")
@click.option("--version", "version", type=int, help="Default: the production version.")
@click.option("--poll-interval", "poll_s", default=0.25, show_default=True, help="Seconds between checks.")
def stage(model, version, poll_s):
    """Copy MODEL --version N from the cold store into the warm tier, showing progress."""
    versions = _call("GET", "/v1/registry", params={"model": model})["versions"]
    match = [v for v in versions if (v["version"] == version if version is not None
                                     else v["stage"] == "production")]
    if not match:
        known = ", ".join(f"{v['version']} ({v['stage']})" for v in versions) or "none"
        what = f"version {version}" if version is not None else "a production version"
        click.echo(f"error: {model} has no {what} in the registry (versions: {known}); "
                   "`mmctl registry list` shows them", err=True)
        sys.exit(EXIT_BY_ERROR["model_not_found"])
    name = match[0]["name"]
    _call("POST", f"/v1/warm/{name}/stage")
    timeout_s = current_api().timeout_s
    deadline = time.monotonic() + timeout_s
    shown = False
    while time.monotonic() < deadline:
        data = _call("GET", "/v1/warm")
        if any(m["name"] == name for m in data["models"]):
            if shown:
                click.echo(err=True)
            click.echo(f"{name}: warm")
            return
        if name in data.get("errors", {}):
            err = data["errors"][name]
            if shown:
                click.echo(err=True)
            click.echo(f"error: {err.get('message', err)}", err=True)
            sys.exit(EXIT_BY_ERROR.get(err.get("error"), EXIT_LOAD_FAILED))
        for d in data["downloads"]:
            if d["name"] == name and d["total_bytes"]:
                pct = 100.0 * d["done_bytes"] / d["total_bytes"]
                click.echo(f"\r{name}: {pct:5.1f}% of {_size(d['total_bytes'])}", nl=False, err=True)
                shown = True
        time.sleep(poll_s)
    click.echo(f"error: {name} was not warm after {timeout_s:.0f}s", err=True)
    sys.exit(EXIT_TIMEOUT)


# The commands this module adds to mmctl (mmctl.main).
COMMANDS = [registry]
