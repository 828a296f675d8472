"""One catalogue: the model folders of Triton's repository registered as versions whose
artifact is the folder itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from control_plane.families import VARIANT_FILE
from control_plane.registry.registered_versions import Registry
from control_plane.registry.versions import ModelVersion, parse_concrete, repository_uri
from control_plane.tiers.warm import WARM_MANIFEST
from domain.errors import ControlPlaneError
from domain.names import validate_model_name
from model_runtime.family.protocol import LAYOUT_FILE

log = logging.getLogger(__name__)


def variant_family(folder: Path) -> str | None:
    """The family a variant folder belongs to, from its variant.json; None for other folders."""
    import json

    try:
        family = json.loads((folder / VARIANT_FILE).read_text())["family"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return family if isinstance(family, str) else None


def register_repository(registry: Registry, repository: Path, *, who: str = "mmctl up",
                        versions: dict[str, tuple[str, int]] | None = None) -> list[ModelVersion]:
    """Register every model folder of Triton's repository the registry does not know yet.

    One catalogue: what Triton can serve is what the registry lists.  Each folder becomes a
    version whose artifact is the folder itself (``repository://<folder>/``), served as it
    is.  ``versions`` maps a folder to (model, version) (the demo's ``cust017-v2`` is
    ``cust017`` version 2); any other folder is version 1 of a model of its own name, or
    ``<model>.v<N>`` version N.  A model's first version registered becomes production.
    Idempotent: folders already registered (by concrete name) are skipped, so running it
    at every start also picks up folders added since.  Folders staged by the warm tier, dot
    folders, folders without config.pbtxt and unsafe names are left alone.

    Hashes each new folder (once): call from the event-loop thread; the hashing of a large
    fleet is worth an executor (``collect_repository`` + ``add_repository_versions``).
    """
    return add_repository_versions(registry, collect_repository(registry, repository, versions),
                                   who=who)


@dataclass(frozen=True)
class FoundFolder:
    folder: str
    model: str
    version: int
    sha256: str
    size_bytes: int
    family: str | None = None


def collect_repository(registry: Registry, repository: Path,
                       versions: dict[str, tuple[str, int]] | None = None) -> list[FoundFolder]:
    """The unregistered model folders of ``repository`` with their sha256 (blocking: reads
    every new file once).  Reads the registry only, so it may run in a thread."""
    from control_plane.tiers.cold import folder_manifest, manifest_digest

    versions = versions or {}
    known = registry.concrete_names(include_retired=True)
    started = time.monotonic()
    found = []
    for child in sorted(repository.iterdir()) if repository.is_dir() else []:
        name = child.name
        if name in known or name.startswith(".") or not child.is_dir():
            continue
        if (child / WARM_MANIFEST).exists() or (child / LAYOUT_FILE).exists():
            continue
        family = variant_family(child)
        if family is None and not (child / "config.pbtxt").is_file():
            continue
        try:
            validate_model_name(name)
            entries = folder_manifest(child)
        except ControlPlaneError as exc:
            log.warning("not registering repository folder %s: %s", child, exc.message)
            continue
        model, version = versions.get(name) or parse_concrete(name) or (name, 1)
        found.append(FoundFolder(name, model, version,
                                 manifest_digest({e.path: e.sha256 for e in entries}),
                                 sum(e.size_bytes for e in entries), family))
    elapsed_s = time.monotonic() - started
    if elapsed_s > 5:  # big fleets (--model-size-mb): say where the first start's time went
        log.info("hashed %d new model folders of %s (%d bytes) in %.1fs", len(found), repository,
                 sum(f.size_bytes for f in found), elapsed_s)
    return found


def add_repository_versions(registry: Registry, found: Iterable[FoundFolder], *,
                            who: str = "mmctl up") -> list[ModelVersion]:
    """Register what ``collect_repository`` found: models' own folders first, so that a
    model's base folder (``cust017``) becomes its production version, not a variant."""
    added = []
    for f in sorted(found, key=lambda f: (f.folder != f.model, f.model, f.version)):
        version = f.version if registry.find(f.model, f.version) is None else registry.next_version(f.model)
        stage = "registered" if registry.production(f.model) is not None else "production"
        if f.folder != f.model and stage == "production" and f.version != 1:
            stage = "registered"  # a variant (cust017-v2) never takes over its model by default
        try:
            added.append(registry.add(
                f.model, version, repository_uri(f.folder), f.sha256, f.size_bytes, who=who,
                stage=stage, triton_name=f.folder, family=f.family))
        except ControlPlaneError as exc:
            log.warning("not registering repository folder %s as %s version %d: %s",
                        f.folder, f.model, version, exc.message)
    if added:
        log.info("registered %d model folders of the repository (%d bytes): %s", len(added),
                 sum(mv.size_bytes for mv in added), ", ".join(mv.name for mv in added))
    return added
