"""Blocking file work in a LoRA base's adapter directory: stage an adapter (copy or
download, validate against the base, publish a cold copy), rename it into place, restore
one whose folder is gone, and read or write the manifest the model follows.

Everything here blocks; the manager runs it on executor threads (the manifest, a small
JSON file, excepted).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from control_plane.adapters.base import (
    CONFIG_FILE,
    PEFT_FILES,
    WEIGHTS_FILE,
    LoraBase,
    describe_base,
)
from control_plane.tiers.cold import (
    ColdStore,
    ColdStores,
    LocalDirStore,
    S3Store,
    download_verified,
    folder_sha256,
    inspect,
    publish,
)
from domain.errors import ControlPlaneError, InvalidInput, ModelNotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedAdapter:
    path: Path  # <adapter_dir>/.<name>.tmp, validated
    uri: str | None
    sha256: str
    rank: int
    nbytes: int


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def keep_only_peft_files(folder: Path) -> None:
    """Training leftovers (README.md, optimizer state, pickles) are not served."""
    for entry in folder.iterdir():
        if entry.name not in PEFT_FILES:
            if entry.is_dir():
                remove_tree(entry)
            else:
                entry.unlink()


def install(base: LoraBase, name: str, staged: Path) -> None:
    """Rename the staged folder into place; a replaced folder is moved aside first."""
    final = base.adapter_dir / name
    if final.exists():
        old = base.adapter_dir / f".{name}.old.{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(staged, final)
        remove_tree(old)
    else:
        os.rename(staged, final)


RUNTIME_FOLDER = "_lora"  # the LoRA runtime's copy in a base's version folder


def refresh_runtime(base: LoraBase) -> bool:
    """Replace the base's copy of the LoRA runtime (``<version>/_lora``) with this product's
    when they differ, so that a base written by an earlier version follows what the control
    plane writes (its manifest's fields, the control socket) from its next load; True when it
    was replaced.  A base without such a copy (its own code) is left alone."""
    import model_runtime.lora
    from model_runtime import refresh_runtime as refresh

    return refresh(Path(model_runtime.lora.__file__).parent, base.weights.parent / RUNTIME_FOLDER)


def read_base_manifest(base: LoraBase):
    """The manifest in the base's adapter directory; InvalidInput when it is malformed."""
    from model_runtime.lora import LoraError, read_manifest

    try:
        return read_manifest(base.adapter_dir)
    except LoraError as exc:
        raise InvalidInput(f"{base.name}: {exc.message}; fix or delete the file") from None


def write_base_manifest(base: LoraBase, *, pinned: Iterable[str], preload: Iterable[str],
                        disabled: Iterable[str]):
    """The next generation of the base's manifest, written atomically by ``lora``; the control
    plane decides which adapters hold the base's slots (``AdapterSlots``)."""
    from model_runtime.lora import RESIDENCY_CONTROL_PLANE, Manifest, write_manifest

    current = read_base_manifest(base)
    manifest = Manifest(generation=current.generation + 1, pinned=tuple(sorted(set(pinned))),
                        preload=tuple(sorted(set(preload))), disabled=tuple(sorted(set(disabled))),
                        residency=RESIDENCY_CONTROL_PLANE)
    write_manifest(base.adapter_dir, manifest)
    return manifest


class AdapterFiles:
    """Staging and restoring adapters for every base, with the cold stores they come from
    and go to.  Keeps each base's linear layers, read from its weights file, until the file
    changes."""

    def __init__(self, stores: ColdStores):
        self.stores = stores
        self._targets: dict[str, tuple[tuple, dict, tuple]] = {}

    def targets_of(self, base: LoraBase) -> tuple[dict, tuple]:
        """``module -> (out, in)`` of the base's linear layers and the modules excluded from
        ``all-linear``, from its weights file (cached until the file changes)."""
        from safetensors import SafetensorError

        from model_runtime.lora.base_layers import OUTPUT_LAYERS, linear_layers

        try:
            st = base.weights.stat()
        except FileNotFoundError:
            raise InvalidInput(f"{base.name} has no base weights at {base.weights}") from None
        signature = (str(base.weights), st.st_mtime_ns, st.st_size)
        cached = self._targets.get(base.name)
        if cached is not None and cached[0] == signature:
            return cached[1], cached[2]
        try:
            targets = linear_layers(base.weights)
        except (SafetensorError, OSError, ValueError) as exc:
            raise InvalidInput(f"{base.name}'s base weights {base.weights} are not a readable "
                               f"safetensors file: {exc}") from None
        excluded = OUTPUT_LAYERS[base.kind]
        self._targets[base.name] = (signature, targets, excluded)
        return targets, excluded

    def default_uri(self, base: str, name: str) -> str | None:
        """Where a locally added adapter is published: ``adapters/<base>/<name>/`` in the
        default cold store (None when there is none)."""
        store: ColdStore | None = self.stores.default
        if isinstance(store, LocalDirStore):
            return (store.root / "adapters" / base / name).as_uri() + "/"
        if isinstance(store, S3Store) and store.config.bucket:
            prefix = store.config.prefix.strip("/")
            key = "/".join(p for p in (prefix, "adapters", base, name) if p)
            return f"s3://{store.config.bucket}/{key}/"
        return None

    def stage(self, base: LoraBase, name: str, source: str) -> StagedAdapter:
        """Copy or download into ``.<name>.tmp``, validate, publish."""
        from model_runtime.lora import AdapterRefused
        from model_runtime.lora.peft_files import check_adapter

        targets, excluded = self.targets_of(base)
        base.adapter_dir.mkdir(parents=True, exist_ok=True)
        tmp = base.adapter_dir / f".{name}.tmp"
        remove_tree(tmp)
        uri = sha256 = None
        try:
            if "://" in source:
                store = self.stores.for_uri(source)
                try:
                    info = inspect(store, source)
                except ModelNotFound:
                    raise ModelNotFound(f"no adapter at {source} ({store.describe()}): nothing is "
                                        "stored under that prefix") from None
                folder, _size = download_verified(store, source, info.sha256, base.adapter_dir, f".{name}")
                os.replace(folder, tmp)
                keep_only_peft_files(tmp)
                uri, sha256 = info.uri, info.sha256
            else:
                src = Path(source)
                if not src.is_dir():
                    raise InvalidInput(f"{source} is not a directory: give a PEFT adapter folder "
                                       f"({CONFIG_FILE} + {WEIGHTS_FILE}) or a file:// or s3:// URI")
                tmp.mkdir()
                for file in PEFT_FILES:
                    if (src / file).is_file():
                        shutil.copy2(src / file, tmp / file)
            try:
                adapter = check_adapter(tmp, targets, name=name, max_rank=base.max_rank,
                                        all_linear_excluded=excluded, base_name=base.name)
            except AdapterRefused as exc:
                raise InvalidInput(exc.message) from None
            if uri is None:
                sha256 = folder_sha256(tmp)
                uri = self.default_uri(base.name, name)
                if uri is not None:
                    sha256 = publish(self.stores.for_uri(uri), tmp, uri).sha256
            return StagedAdapter(tmp, uri, sha256, adapter.rank, adapter.nbytes)
        except BaseException:
            remove_tree(tmp)
            raise

    def restore(self, base: LoraBase, row: dict) -> bool:
        """Download a registered adapter whose folder is gone."""
        store = self.stores.for_uri(row["uri"])
        folder, _ = download_verified(store, row["uri"], row["sha256"], base.adapter_dir, f".{row['name']}")
        keep_only_peft_files(folder)
        os.replace(folder, base.adapter_dir / f".{row['name']}.tmp")
        install(base, row["name"], base.adapter_dir / f".{row['name']}.tmp")
        return True


def hand_slots_to_control_plane(repository: Path) -> None:
    """Every LoRA base's manifest says the control plane decides which adapters hold its
    slots (a manifest written before that said nothing, and its model decided), and its
    copy of the LoRA runtime is this version's (an earlier one refuses that manifest).
    The control plane's start runs it before Triton can load a base (a base loaded first
    would decide on its own until its next load)."""
    from model_runtime.lora import RESIDENCY_CONTROL_PLANE

    if not repository.is_dir():
        return
    for folder in sorted(repository.iterdir()):
        if not (folder / "config.pbtxt").is_file():
            continue
        try:
            base = describe_base(repository, folder.name)
        except ControlPlaneError:
            continue  # not a LoRA base
        try:
            if refresh_runtime(base):  # one written by an earlier version
                log.info("%s: its copy of the LoRA runtime is this version's now (from its "
                         "next load)", base.name)
            manifest = read_base_manifest(base)
            if manifest.residency != RESIDENCY_CONTROL_PLANE:
                write_base_manifest(base, pinned=manifest.pinned, preload=manifest.preload,
                                    disabled=manifest.disabled)
                log.info("%s: the control plane decides which adapters hold its slots now",
                         base.name)
        except (ControlPlaneError, OSError) as exc:
            log.error("adapters of %s: could not write its manifest: %s", base.name, exc)
