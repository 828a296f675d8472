"""Registering a version whose artifact lives in a cold store: the checks Triton would make
of its folder and config.pbtxt, made before anything is published or recorded."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from control_plane.families import VARIANT_FILE, WEIGHTS_FILE, check_variant_weights, write_variant
from control_plane.registry.registered_versions import Registry
from control_plane.registry.versions import DEFAULT_SLA, ModelVersion, concrete_name
from control_plane.tiers.cold import inspect, normalize_sha256, publish
from domain import model_config
from domain.errors import InvalidInput
from domain.names import validate_model_name
from model_runtime.family.layout import (
    HEADER_LENGTH_BYTES,
    LayoutError,
    header_bytes,
    layout_of_bytes,
)


def check_model_config(text: str, where: str, names: Iterable[str]) -> None:
    """Refuse a config.pbtxt that Triton would refuse, saying why, before it is registered.

    Triton loads a model only if config.pbtxt parses and its ``name`` (when given) equals
    the folder's name; a mismatch fails with an opaque "failed to poll from model
    repository".  The warm tier writes the concrete name into the staged copy, so a config
    may name the model as the user knows it (one of ``names``) or leave the name out.

    Parsed strictly, as Triton does: staging writes the configuration back from the parsed
    message, which would drop fields this tritonclient's schema does not know."""
    config = model_config.parse_config(text, where)
    allowed = sorted(set(names))
    if config.name and config.name not in allowed:
        raise InvalidInput(
            f'{where} says name: "{config.name}" but the model is added as '
            f"{' or '.join(repr(n) for n in allowed)}; Triton serves a model only under the "
            "name in its config, so fix the name there (or remove the line) or add the model "
            f"under the name {config.name!r}")


def check_model_folder(folder: Path, model: str) -> None:
    """A Triton model folder: config.pbtxt that Triton accepts and a numbered version folder."""
    if not folder.is_absolute():
        raise InvalidInput(f"--from-dir {str(folder)!r} must be an absolute path")
    if not folder.is_dir():
        raise InvalidInput(f"--from-dir {str(folder)!r} is not a folder; give the model's folder "
                           "(config.pbtxt and 1/model.py in it)")
    config = folder / "config.pbtxt"
    if not config.is_file():
        raise InvalidInput(f"{folder} has no config.pbtxt; a Triton model folder holds "
                           "config.pbtxt and a version folder such as 1/model.py")
    try:
        text = config.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read {config}: {exc}") from None
    check_model_config(text, str(config), (model, folder.name))
    if not any(p.is_dir() and p.name.isdigit() for p in folder.iterdir()):
        raise InvalidInput(f"{folder} has no version folder; Triton loads numbered folders such "
                           "as 1/ (with model.py for the python backend) next to config.pbtxt")
    links = _symlinks(folder)
    if links:
        shown = ", ".join(links[:5]) + (f" and {len(links) - 5} more" if len(links) > 5 else "")
        raise InvalidInput(
            f"{folder} holds symbolic links ({shown}); the cold store keeps files, and a "
            "published copy would miss what they point to: copy the folder with its links "
            f"resolved (cp -rL {folder} COPY) and add the copy")


def _symlinks(folder: Path) -> list[str]:
    """The symbolic links in ``folder`` (files or folders), relative to it."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                found.append(path.relative_to(folder).as_posix())
    return sorted(found)


async def register_version(registry: Registry, model: str, version: int | None = None, *,
                           who: str, artifact_uri: str | None = None, sha256: str | None = None,
                           source_dir: str | None = None, sla: str = DEFAULT_SLA,
                           metrics: dict[str, float] | None = None,
                           data_fingerprint: str | None = None, tenant: str | None = None,
                           stage: str | None = None,
                           synthetic_warmup: bool = True, family: str | None = None,
                           weights: str | None = None, families=None) -> ModelVersion:
    """Register a version whose artifact is in the cold store, publishing it first when
    ``source_dir`` is given.  The sha256 recorded is the artifact's (from its manifest, or
    by hashing it); a ``sha256`` given by the caller must match it.

    ``version`` None: the next free one.  ``stage`` None: ``production`` when the model has
    no production version yet (so its logical name serves it at once), else ``registered``.

    ``family``: the version is a variant of that model family (``families``, a
    FamilyCatalog, knows it): its artifact is a variant folder, published from the
    safetensors file ``weights`` or already at ``artifact_uri``, and its tensors must be the
    family's (checked before anything is uploaded or recorded).

    Store I/O runs in a thread; so does the registry write, in the state store's
    (``Database.off_loop``: a slow database never holds up the event loop).
    """
    validate_model_name(model)
    stores = registry.stores
    if stores is None:
        raise InvalidInput("no cold store is configured; the registry cannot reach artifacts")
    if artifact_uri is not None and not isinstance(artifact_uri, str):
        raise InvalidInput(f"artifact_uri must be a string (s3://bucket/path/ or file:///path/), "
                           f"got {type(artifact_uri).__name__}")
    if version is None:
        version = registry.next_version(model)
    if stage is None:
        stage = "registered" if registry.production(model) is not None else "production"
    # Cheap checks before any upload: a refused version must not leave files in the store.
    version, _name = registry.check_new(model, version, sla=sla, stage=stage)
    if registry.find(model, version) is not None:
        raise InvalidInput(f"{model} version {version} is already registered; versions are "
                           "immutable, register the new artifact as a new --version "
                           f"(or leave --version out: the next free one is {registry.next_version(model)})")
    registry._check_names_free(model, concrete_name(model, version))
    uri = artifact_uri or stores.default_uri(model, version)
    publishing = source_dir is not None or weights is not None
    if publishing:
        # Versions are immutable: files a registered version reads are never written again.
        user = registry.artifact_user(uri)
        if user is not None:
            raise InvalidInput(
                f"{uri} holds the artifact of {user.model} version {user.version} (or is in or "
                "above its folder); versions are immutable: publish to another URI, or leave the "
                "artifact URI out (each version gets its own folder)")
    with registry.registering(model, version, uri):
        return await _publish_and_add(
            registry, stores, uri, model, version, who=who, sha256=sha256, source_dir=source_dir,
            sla=sla, metrics=metrics, data_fingerprint=data_fingerprint, tenant=tenant,
            stage=stage, synthetic_warmup=synthetic_warmup, family=family, weights=weights,
            families=families)


async def _publish_and_add(registry: Registry, stores, uri: str, model: str, version: int, *,
                           who: str, sha256: str | None, source_dir: str | None, sla: str,
                           metrics: dict[str, float] | None, data_fingerprint: str | None,
                           tenant: str | None, stage: str, synthetic_warmup: bool,
                           family: str | None, weights: str | None, families) -> ModelVersion:
    store = stores.for_uri(uri)
    if family is not None or weights is not None:
        info = await _register_variant(store, uri, model, family, weights, source_dir, families)
    elif source_dir is not None:
        folder = Path(source_dir)
        await asyncio.to_thread(check_model_folder, folder, model)
        info = await asyncio.to_thread(publish, store, folder, uri)
    else:
        info = await asyncio.to_thread(inspect, store, uri)
        raw = await asyncio.to_thread(store.read_bytes, info.uri, "config.pbtxt")
        if raw is None:
            raise InvalidInput(f"the artifact at {info.uri} has no config.pbtxt; a Triton model "
                               "folder holds config.pbtxt and a version folder such as 1/model.py")
        check_model_config(raw.decode(errors="replace"), f"{info.uri}config.pbtxt", (model,))
    if sha256 is not None and normalize_sha256(sha256) != info.sha256:
        raise InvalidInput(f"the artifact at {info.uri} has sha256 {info.sha256}, not the "
                           f"{normalize_sha256(sha256)} you gave; check the upload")
    return await registry.db.off_loop(
        registry.add, model, version, info.uri, info.sha256, info.size_bytes, who=who,
        sla=sla, metrics=metrics, data_fingerprint=data_fingerprint, tenant=tenant, stage=stage,
        synthetic_warmup=synthetic_warmup, family=family)


async def _register_variant(store, uri: str, model: str, family: str | None, weights: str | None,
                            source_dir: str | None, families):
    """Publish (``weights``) or inspect (an uploaded variant folder at ``uri``) a family's
    variant, refusing tensors that are not the family's before anything is written."""
    if family is None:
        raise InvalidInput("--weights registers a variant of a model family: give --family too "
                           "(mmctl family list shows them)")
    if source_dir is not None:
        raise InvalidInput("a family's variant is its weights: give --weights FILE (or an uploaded "
                           "variant folder with --artifact), not --from-dir")
    found = families.family(family) if families is not None else None
    if found is None:
        known = ", ".join(sorted(families.families)) if families is not None else ""
        raise InvalidInput(f"unknown model family {family!r} ({'known: ' + known if known else 'none is known'}); "
                           "add it first: mmctl family add NAME --from-dir DIR --weights BASE.safetensors")
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise InvalidInput(f"--weights {weights}: no such file")
        await asyncio.to_thread(check_variant_weights, found, path, model)

        def publish_variant():
            with tempfile.TemporaryDirectory(prefix="mms-variant-") as tmp:
                folder = write_variant(Path(tmp), "variant", family, path)
                return publish(store, folder, uri)

        return await asyncio.to_thread(publish_variant)
    info = await asyncio.to_thread(inspect, store, uri)
    marker = await asyncio.to_thread(store.read_bytes, info.uri, VARIANT_FILE)
    try:
        named = json.loads(marker)["family"] if marker is not None else None
    except (ValueError, KeyError, TypeError):
        named = None
    if named != family:
        raise InvalidInput(f"the artifact at {info.uri} is not a variant of {family}: its "
                           f"{VARIANT_FILE} {'names ' + repr(named) if named else 'is missing or unreadable'}")
    # Its header only (the weights may be gigabytes): its first 8 bytes say how long it is.
    first = await asyncio.to_thread(store.read_bytes, info.uri, WEIGHTS_FILE, HEADER_LENGTH_BYTES)
    if first is None:
        raise InvalidInput(f"the artifact at {info.uri} has no {WEIGHTS_FILE}")
    raw = await asyncio.to_thread(store.read_bytes, info.uri, WEIGHTS_FILE, header_bytes(first))
    size = next((f.size_bytes for f in info.files if f.path == WEIGHTS_FILE), len(raw or b""))
    try:
        layout, _offset = layout_of_bytes(raw or b"", f"{info.uri}{WEIGHTS_FILE}", size)
    except LayoutError as exc:
        raise InvalidInput(str(exc)) from None
    why = found.layout.mismatch(layout)
    if why is not None:
        raise InvalidInput(f"{model}'s weights at {info.uri} do not match family {family}: {why}")
    return info
