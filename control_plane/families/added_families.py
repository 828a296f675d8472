"""Families a user adds (``mmctl family add``): checked, completed, published to the cold
store and recorded in the state store, so every start (a fresh tmpfs warm tier, another
node) puts them back into Triton's repository before any variant is loaded.

The demo family and families in a repository of the user's own (``--repository``) are
found where they are; only added families are recorded here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from control_plane.families.family_catalog import FamilyCatalog
from control_plane.families.folders import write_family
from control_plane.tiers.cold import download_verified, publish
from domain.errors import ControlPlaneError, InvalidInput
from domain.names import validate_model_name

log = logging.getLogger(__name__)

FAMILIES_KEY = "families"  # state store key: {name: {"uri", "sha256", "added_by"}}
STAGING_DIR = ".families-staging"  # under the repository; dot folders are never models


def recorded_families(state) -> dict[str, dict]:
    return json.loads(state.get(FAMILIES_KEY) or "{}")


def restore_families(recorded: dict[str, dict], stores, repository: Path) -> list[str]:
    """Download every ``recorded`` family (``recorded_families``) missing from
    ``repository`` (blocking: call in a thread before the family catalogue is built).  A
    family that cannot be fetched is logged; its variants fail to load with the reason until
    it is added again."""
    restored = []
    for name, entry in recorded.items():
        if (repository / name / "config.pbtxt").is_file():
            continue
        try:
            tmp, _size = download_verified(stores.for_uri(entry["uri"]), entry["uri"],
                                           entry["sha256"], repository / STAGING_DIR, name)
            _move_in(tmp, repository / name)
            restored.append(name)
        except (ControlPlaneError, OSError, KeyError) as exc:
            log.error("model family %s could not be restored from %s: %s", name,
                      entry.get("uri"), getattr(exc, "message", exc))
    if restored:
        log.info("restored model families %s into %s", ", ".join(restored), repository)
    return restored


def _move_in(folder: Path, final: Path) -> None:
    (folder / ".mms-warm.json").unlink(missing_ok=True)
    if final.exists():
        shutil.rmtree(final)
    os.rename(folder, final)


async def add_family(name: str, source_dir: str | None, weights: str | None, *, who: str,
                     state, stores, catalog: FamilyCatalog, registry=None) -> dict:
    """Check, complete, publish and record the family ``name`` from a model folder
    (config.pbtxt, 1/model.py subclassing ``_mms_family.FamilyModel``) and base weights
    (any variant's: their layout is every variant's).  Nothing is written when a check
    fails."""
    validate_model_name(name)
    if not source_dir or not weights:
        raise InvalidInput("a family needs its code and its weights' layout: --from-dir DIR "
                           "(config.pbtxt, 1/model.py) and --weights BASE.safetensors")
    folder, base = Path(source_dir), Path(weights)
    if not (folder / "config.pbtxt").is_file():
        raise InvalidInput(f"{folder} has no config.pbtxt; a family's folder is a Triton python "
                           "model folder (config.pbtxt, 1/model.py)")
    if not base.is_file():
        raise InvalidInput(f"--weights {base}: no such file")
    if catalog.family(name) is not None:
        raise InvalidInput(f"model family {name!r} already exists; a family's code is added once "
                           "(its variants are registered with mmctl registry add --family)")
    if name in catalog.family_of_variant or (registry is not None and registry.versions(name)):
        raise InvalidInput(f"{name!r} is already a model's name; give the family another one")
    uri = stores.default_uri(name, "family")
    store = stores.for_uri(uri)

    def build_and_publish():
        with tempfile.TemporaryDirectory(prefix="mms-family-") as tmp:
            family = write_family(Path(tmp), name, config_text=(folder / "config.pbtxt").read_text(),
                                  version_files=folder / "1", base_weights=base)
            info = publish(store, family.folder, uri)
            staged = catalog.repository / STAGING_DIR / f"{name}.new"
            if staged.exists():
                shutil.rmtree(staged)
            shutil.copytree(family.folder, staged)
            return info, family, staged

    info, family, staged = await asyncio.to_thread(build_and_publish)
    entries = recorded_families(state)
    entries[name] = {"uri": info.uri, "sha256": info.sha256, "added_by": who}
    await state.db.off_loop(state.put, FAMILIES_KEY, json.dumps(entries))  # a slow database holds up this call only
    # The rename and the catalogue's refresh with no await between: a reconcile never sees
    # the family's folder in Triton's repository before it is known as a family.
    _move_in(staged, catalog.repository / name)
    catalog.refresh()
    log.info("model family %s added by %s: %d tensors, %d bytes per slot, %s", name, who,
             len(family.layout.tensors), family.slot_bytes, info.uri)
    return {"family": name, "slot_bytes": family.slot_bytes, "tensors": len(family.layout.tensors),
            "artifact_uri": info.uri, "sha256": info.sha256}
