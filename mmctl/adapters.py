"""``mmctl adapter ...``: LoRA adapters of a base model (tinylm, recommender_lora).

A click group that ``mmctl`` adds (``COMMANDS``).  Exit codes are mmctl's
(2 bad input or a refused adapter, 3 unreachable, 4 unknown base or adapter, 5 every device
slot pinned, 6 load failed, 7 timeout).

Adapter names follow the model-name rules (letters, digits, ``_``, ``-``, ``.``) because a
name becomes a folder and the ``adapter`` request parameter.  ``add`` also takes a display
label such as ``support-bot/acme``: it is kept for ``list`` and the adapter is served as its
last segment (``acme``: ``tinylm:acme`` through the router, ``adapter=acme`` on Triton).
"""

from __future__ import annotations

import json
import os

import click
import requests

from mmctl.common import Api, _table, pass_api
from mmctl.common import fmt_ago as _ago
from mmctl.common import fmt_bytes as _bytes
from mmctl.common import who_am_i as _who


def _q(name: str) -> str:
    return requests.utils.quote(name, safe="")


def _name(ref: str) -> str:
    """The served name of ``ref`` (a label's last segment)."""
    return ref.rsplit("/", 1)[-1]


def _path(base: str, name: str | None = None, action: str | None = None) -> str:
    path = f"/v1/adapters/{_q(base)}"
    if name is not None:
        path += f"/{_q(_name(name))}"
    if action is not None:
        path += f"/{action}"
    return path


def _one_line(row: dict) -> str:
    label = f" ({row['label']})" if row.get("label") else ""
    pinned = ", pinned" if row.get("pinned") else ""
    rank = f", rank {row['rank']}" if row.get("rank") else ""
    error = f"; {row['error']}" if row.get("error") else ""
    return f"{row['base']}:{row['name']}{label}: {row['tier']}{pinned}{rank}, {_bytes(row.get('bytes'))}{error}"


def _emit(body, as_json: bool, text: str) -> None:
    click.echo(json.dumps(body, indent=2) if as_json else text)


@click.group()
def adapter():
    """LoRA adapters of a base model: add, list, pin, load, remove.

    Through the router a request selects an adapter with the model name BASE:ADAPTER
    (tinylm:acme); on Triton with request parameter adapter=ADAPTER.  `mmctl limit set
    tinylm:acme --qps 5` rate-limits one adapter."""


@adapter.command("add")
@click.argument("name")
@click.option("--base", required=True, help="The LoRA base model (e.g. tinylm).")
@click.option("--path", "source", required=True,
              help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors), or a "
                   "cold-store URI: s3://bucket/prefix/ or file:///path/.")
@click.option("--replace", is_flag=True, help="Replace an existing adapter of that name.")
@click.option("--who", default=_who, help="Recorded as who added it.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def add(api: Api, name: str, base: str, source: str, replace: bool, who: str, as_json: bool):
    """Add adapter NAME to --base, validated against the base's layers.

    NAME is a plain name (acme) or a label whose last '/'-segment is the name
    (support-bot/acme is served as acme).  A malformed adapter or one made for another base
    is refused with the reason (exit 2)."""
    if "://" not in source and os.path.exists(source):
        source = os.path.abspath(source)  # the control plane resolves paths, not this shell
    body = {"name": name, "path": source, "replace": replace, "who": who}
    _, row = api.call("POST", _path(base), ok_statuses=(200, 201), body=body)
    _emit(row, as_json, "added " + _one_line(row))


@adapter.command("list")
@click.argument("base")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_api
def list_(api: Api, base: str, as_json: bool):
    """Adapters of BASE: tier (gpu/device, host, cold), pinned, last used, rank, bytes, traffic."""
    _, body = api.call("GET", _path(base))
    if as_json:
        _emit(body, True, "")
        return
    rows = [[a["name"] + (f" ({a['label']})" if a.get("label") else ""), a["tier"],
             "yes" if a["pinned"] else "", _ago(a["last_used"]), a["rank"] or "-", _bytes(a["bytes"]),
             a["requests"], a["hits"], a["misses"], (a.get("error") or "")[:60]] for a in body["adapters"]]
    click.echo(_table(rows, ["ADAPTER", "TIER", "PINNED", "LAST USED", "RANK", "BYTES", "REQUESTS",
                             "HITS", "MISSES", "NOTE"]))
    if body.get("loaded"):
        click.echo(f"{body['base']} on {body['server']} ({body.get('device')}): "
                   f"{body.get('device_slots_used')}/{body.get('max_device_adapters')} device slots used")
    else:
        note = f" ({body['status_error']})" if body.get("status_error") else ""
        click.echo(f"{body['base']} is not loaded: adapters are cold until it is{note}")


def _action(name: str, help_text: str, method: str = "POST"):
    @adapter.command(name=name, help=help_text)
    @click.argument("base")
    @click.argument("adapter_name", metavar="NAME")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @pass_api
    def command(api: Api, base: str, adapter_name: str, as_json: bool):
        if name == "remove":
            _, body = api.call("DELETE", _path(base, adapter_name))
            _emit(body, as_json, f"removed {body['base']}:{body['name']}"
                  + (f" (its cold copy stays at {body['uri']})" if body.get("uri") else ""))
            return
        _, row = api.call(method, _path(base, adapter_name, name))
        _emit(row, as_json, _one_line(row))

    return command


_action("pin", "Pin NAME on BASE: in a device slot whenever BASE is loaded, never evicted.")
_action("unpin", "Unpin NAME (it stays in its slot until evicted).")
_action("load", "Load NAME into a device slot now (loads BASE first if needed).")
_action("unload", "Drop NAME from device and host memory (its files stay).")
_action("remove", "Delete NAME's files and registry entry (refused while pinned).")


# The commands this module adds to mmctl (mmctl.main).
COMMANDS = [adapter]
