"""``mmctl family ...``: model families, whose variants share one Triton model's weight slots.

A click group that ``mmctl`` adds (``COMMANDS``).  Exit codes are mmctl's
(2 bad input, 3 unreachable).  Variants are registered with ``mmctl registry add NAME
--family FAMILY --weights FILE`` and then loaded, pinned and served by name like any model.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from mmctl.common import _table, current_api, who_am_i
from mmctl.common import fmt_bytes as _bytes


@click.group()
def family():
    """Model families: fine-tuned variants of one architecture in one model's weight slots."""


@family.command("add")
@click.argument("name")
@click.option("--from-dir", "source_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The family's Triton model folder: config.pbtxt and 1/model.py, whose "
              "TritonPythonModel subclasses _mms_family.FamilyModel.")
@click.option("--weights", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Any variant's safetensors file: its tensors (names, shapes, dtypes) are the "
              "family's slot layout.")
@click.option("--who", default=who_am_i, help="Recorded as the author.")
@click.option("--json", "as_json", is_flag=True)
def add(name, source_dir, weights, who, as_json):
    """Add the family NAME (its code once, and its weights' layout).

    \b
    mmctl family add scaler --from-dir ./scaler --weights ./base.safetensors
    mmctl registry add acme --family scaler --weights ./acme.safetensors   # then: a model
    """
    row = current_api().call("POST", f"/v1/families/{name}", ok_statuses=(201,), body={
        "source_dir": str(Path(source_dir).resolve()), "weights": str(Path(weights).resolve()),
        "who": who})[1]
    if as_json:
        click.echo(json.dumps(row, indent=2))
    else:
        click.echo(f"{row['family']}: {row['tensors']} tensors, {_bytes(row['slot_bytes'])} per "
                   f"slot, {row['artifact_uri']}; register variants with `mmctl registry add NAME "
                   f"--family {row['family']} --weights FILE`")


@family.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_(as_json):
    """Every family: slot size, variants, and per server its slots and resident variants."""
    families = current_api().call("GET", "/v1/families")[1]["families"]
    if as_json:
        click.echo(json.dumps(families, indent=2))
        return
    rows = []
    for f in families:
        where = "; ".join(f"{s}: {len(v['resident'])}/{v['slots']} slots ({', '.join(v['resident']) or '-'})"
                          # the instance's state when it is not simply serving (dead, growing...)
                          + (f" {v['state']}" if v.get("state", "serving") != "serving" else "")
                          for s, v in sorted(f["servers"].items())) or "not loaded"
        rows.append([f["family"], _bytes(f["slot_bytes"]), len(f["variants"]), where])
    click.echo(_table(rows, ["FAMILY", "SLOT", "VARIANTS", "SERVERS"]))


# The commands this module adds to mmctl (mmctl.main).
COMMANDS = [family]
