"""One ``list`` row per adapter, merged from the registry, the adapter directory, the
manifest and the model's live status.  Pure apart from reading an adapter's files for its
size when nothing else knows it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from control_plane.adapters.base import CONFIG_FILE, WEIGHTS_FILE


def public_tier(tier: str, device: str | None) -> str:
    """The model's tier name for ``list``: a device slot is ``gpu`` on a GPU server."""
    if tier == "device":
        return "gpu" if device and device.startswith("cuda") else "device"
    return tier


def _peft_summary(folder: Path) -> tuple[int | None, int | None]:
    """(rank, tensor bytes) of an adapter folder without loading it: ``r`` from the config
    and the safetensors file's size minus its header (8-byte length + JSON)."""
    rank = nbytes = None
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        r = json.loads((folder / CONFIG_FILE).read_text()).get("r")
        rank = r if isinstance(r, int) and not isinstance(r, bool) else None
    with contextlib.suppress(OSError):
        path = folder / WEIGHTS_FILE
        with open(path, "rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
        nbytes = max(0, path.stat().st_size - 8 - header_bytes)
    return rank, nbytes


def merge_rows(
    base: str,
    registered: Mapping[str, dict],
    on_disk: Iterable[str],
    manifest: Mapping[str, Iterable[str]],
    live: Mapping | None,
    summary: Callable[[str], tuple[int | None, int | None]] = lambda _name: (None, None),
) -> list[dict]:
    """One row per adapter: the registry (``registered``), the adapter directory, the manifest
    (desired pins) and, when the base is loaded, the model's live status (``live``).

    Pinned is the desired state (manifest or registry); the live tier says where the adapter
    is now.  Without live status an adapter on disk is ``cold``; a registered one whose folder
    is gone is ``missing``."""
    on_disk = set(on_disk)
    pinned = set(manifest.get("pinned", ())) | {n for n, r in registered.items() if r.get("pinned")}
    disabled = set(manifest.get("disabled", ()))
    live_rows = {a["name"]: a for a in (live or {}).get("adapters", [])}
    device = (live or {}).get("device")
    names = set(registered) | on_disk | {
        n for n, a in live_rows.items() if a.get("tier") not in ("missing", None)}
    rows = []
    for name in sorted(names):
        reg = registered.get(name, {})
        now = live_rows.get(name)
        if now is not None:
            tier = public_tier(now["tier"], device)
        elif name in disabled:
            tier = "disabled"
        else:
            tier = "cold" if name in on_disk else "missing"
        if now is not None and now.get("tier") == "missing" and name not in on_disk:
            tier = "missing"
        rank, nbytes = (now or {}).get("rank"), (now or {}).get("bytes")
        if rank is None or nbytes is None:
            if reg.get("rank") is not None:
                rank, nbytes = reg.get("rank"), reg.get("bytes")
            elif name in on_disk:
                rank, nbytes = summary(name)
        live_used = (now or {}).get("last_used_unix")
        last_used = max([t for t in (live_used, reg.get("last_used")) if t], default=None)
        device_hits = int((now or {}).get("device_hits") or 0)
        host_hits = int((now or {}).get("host_hits") or 0)
        error = (now or {}).get("error")
        if tier == "missing" and not error:
            error = ("its folder is gone; restored from " + reg["uri"] + " at the next start"
                     if reg.get("uri") else "its folder is gone and it has no cold copy; add it again")
        rows.append({
            "base": base,
            "name": name,
            "label": reg.get("label"),
            "tier": tier,
            "pinned": name in pinned,
            "slot": (now or {}).get("slot"),
            "rank": rank,
            "bytes": nbytes,
            "requests": int((now or {}).get("requests") or 0),
            "hits": device_hits + host_hits,
            "device_hits": device_hits,
            "host_hits": host_hits,
            "misses": int((now or {}).get("misses") or 0),
            "cold_loads": int((now or {}).get("cold_loads") or 0),
            "load_time_s": (now or {}).get("load_time_s"),
            "swap_in_s": (now or {}).get("swap_in_s"),
            "last_used": last_used,
            "error": error,
            "registered": bool(reg),
            "uri": reg.get("uri"),
            "sha256": reg.get("sha256"),
            "added_at": reg.get("added_at"),
            "added_by": reg.get("added_by"),
        })
    return rows

