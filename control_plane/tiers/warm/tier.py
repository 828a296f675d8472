"""``WarmTier``: the host-DRAM model repository with its byte budget and LRU order; the
story of staging, eviction and recovery is in the package docstring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from control_plane.tiers.cold import ColdStore, ColdStores, download_verified
from control_plane.tiers.warm.entries import Download, WarmEntry
from control_plane.tiers.warm.location import folder_bytes, staging_dir_for
from domain import tracing
from domain.errors import (
    CapacityExhausted,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
)
from domain.model_config import set_name_in_file
from domain.names import validate_model_name

log = logging.getLogger(__package__)  # one logger name for the whole package

WARM_MANIFEST = ".mms-warm.json"
VARIANT_FILE = "variant.json"  # families.VARIANT_FILE: a variant's folder has no config.pbtxt
LARGE_DOWNLOAD_BYTES = 64 << 20


class RegisteredVersion(Protocol):
    """What the warm tier reads of a registered version (``registry.ModelVersion``)."""

    model: str
    version: int
    stage: str
    artifact_uri: str
    sha256: str
    size_bytes: int

    @property
    def in_repository(self) -> bool: ...


class Versions(Protocol):
    """The registry as the warm tier asks it (``registry.Registry``): the tier sits below
    the registry, which publishes to the cold store beside it, so it takes this instead of
    importing the registry back."""

    def by_name(self, name: str) -> RegisteredVersion | None: ...

    def concrete_names(self) -> set[str]: ...


class WarmTier:
    """Host-DRAM model repository with a byte budget and LRU eviction (see the package doc)."""

    def __init__(self, repository: Path, registry: Versions | None = None,
                 stores: ColdStores | None = None, budget_bytes: int | None = None,
                 clock: Callable[[], float] = time.time, attempts: int = 2):
        if budget_bytes is not None and budget_bytes <= 0:
            raise InvalidInput(f"warm budget ({budget_bytes}) must be > 0 bytes")
        if attempts < 1:
            raise InvalidInput(f"download attempts ({attempts}) must be >= 1")
        self.repository = repository.resolve()
        self.registry = registry
        self.stores = stores or ColdStores()
        self.budget_bytes = budget_bytes
        self.clock = clock
        self.attempts = attempts
        self.entries: OrderedDict[str, WarmEntry] = OrderedDict()  # least recently used first
        self.busy: set[str] = set()
        self.downloads: dict[str, Download] = {}
        # Extra guard set by the service: True for a model some Triton has loaded.
        self.in_use: Callable[[str], bool] | None = None
        self._reserved: dict[str, int] = {}
        self._staging: dict[str, asyncio.Task] = {}
        self._deleting: set[asyncio.Task] = set()  # evicted folders being deleted off the loop
        self.repository.mkdir(parents=True, exist_ok=True)
        self.staging_dir = staging_dir_for(self.repository)

    # ------------------------------------------------------------------ accounting
    @property
    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries.values()) + sum(self._reserved.values())

    def is_warm(self, name: str) -> bool:
        return name in self.entries

    def _protected(self, name: str) -> bool:
        if name in self.busy or name in self._staging:
            return True
        return bool(self.in_use is not None and self.in_use(name))

    def _touch(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.last_used = self.clock()
            self.entries.move_to_end(name)

    # ------------------------------------------------------------------ Stager protocol
    def set_busy(self, model: str, busy: bool) -> None:
        if busy:
            self.busy.add(model)
        else:
            self.busy.discard(model)
            self._touch(model)  # just unloaded from the GPU: recently used

    def known(self) -> set[str]:
        names = set(self.entries) | set(self._staging)
        if self.registry is not None:
            names |= self.registry.concrete_names()
        return names

    async def stage(self, model: str) -> int:
        """Bytes of ``model`` once its folder is complete in the repository.

        Raises ModelNotFound (not registered, not in the repository), InvalidInput (retired
        version), CapacityExhausted (the warm budget is held by busy or local-only models) or
        ModelLoadFailed (download/verification failed twice).
        """
        validate_model_name(model)
        task = self._staging.get(model)
        if task is None:
            size = self._current_size(model)
            if size is not None:  # warm and current, the common miss: no task to wait a turn for
                return size
            task = asyncio.get_running_loop().create_task(self._stage(model))
            self._staging[model] = task
            task.add_done_callback(lambda _t, n=model: self._staging.pop(n, None))
        with tracing.span("stage", model=model):  # a miss's wait for its files (or a prefetch's)
            return await asyncio.shield(task)

    prefetch = stage  # same path; the caller simply does not mark the model busy

    def _current_size(self, name: str) -> int | None:
        """Bytes of ``name`` when its warm files are what the registry deploys (or local),
        now the most recently used; None when they must be fetched or checked first."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        mv = self.registry.by_name(name) if self.registry is not None else None
        if mv is None or not entry.managed or entry.sha256 == mv.sha256:
            self._touch(name)
            return entry.size_bytes
        return None

    async def _stage(self, name: str) -> int:
        size = self._current_size(name)
        if size is not None:
            return size
        mv = self.registry.by_name(name) if self.registry is not None else None
        entry = self.entries.get(name)
        if entry is not None:
            if name in self.busy:  # keep serving what is loaded; replaced once released
                log.warning("%s is warm with sha256 %s but the registry now says %s; it stays "
                            "until unloaded", name, entry.sha256, mv.sha256)
                return entry.size_bytes
            log.warning("%s is warm with sha256 %s but the registry says %s; fetching again",
                        name, entry.sha256, mv.sha256)
            self._drop(name, "registry sha256 changed")
        if mv is not None and mv.stage == "retired":
            raise InvalidInput(
                f"{name} is retired; promote it again before loading it "
                f"(mmctl registry promote {mv.model} --version {mv.version} --stage canary)")
        if mv is None or mv.in_repository:
            local = self.repository / name
            # A repository folder, served as it is: a model, or a family's variant.
            if (local / "config.pbtxt").is_file() or (local / VARIANT_FILE).is_file():
                size = await asyncio.to_thread(folder_bytes, local)  # a file walk: off the loop
                self.entries[name] = WarmEntry(name, size, False, None, self.clock())
                return size
            if mv is not None:
                raise ModelNotFound(
                    f"{name} ({mv.model} version {mv.version}) was registered from the folder "
                    f"{local}, which is gone and has no copy in the cold store; put the folder "
                    f"back, or add the model again: mmctl registry add {mv.model} --from-dir DIR")
            raise ModelNotFound(
                f"{name} is neither in the warm repository {self.repository} nor in the registry; "
                "add it from its folder (mmctl registry add MODEL --from-dir DIR) and ask for MODEL")
        store = self.stores.for_uri(mv.artifact_uri)
        # Reserve before the first await so two concurrent stages cannot claim the same room.
        self._make_room(name, mv.size_bytes)
        self._reserved[name] = mv.size_bytes
        download = self.downloads[name] = Download(name, mv.artifact_uri, mv.size_bytes,
                                                   started_at=self.clock())
        try:
            size = await asyncio.get_running_loop().run_in_executor(
                None, self._fetch_into_place, name, mv, store, download)
        except OSError as exc:
            # A full tmpfs, a read-only or cross-device repository...: a staging failure like
            # any other (the manager backs off), not a crash that retries on every request.
            log.warning("staging %s into %s failed: %s", name, self.repository, exc)
            raise ModelLoadFailed(
                f"staging {name} into the warm tier {self.repository} failed: "
                f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}; check its "
                "free space and permissions") from exc
        finally:
            self._reserved.pop(name, None)
            self.downloads.pop(name, None)
        self.entries[name] = WarmEntry(name, size, True, mv.sha256, self.clock())
        self.entries.move_to_end(name)
        return size

    # ------------------------------------------------------------------ blocking part
    def _fetch_into_place(self, name: str, mv: RegisteredVersion, store: ColdStore, download: Download) -> int:
        """Runs in an executor thread: download, verify, fix the config name, rename in."""
        started = time.monotonic()
        next_log = [0.1]

        def progress(done: int, total: int) -> None:
            download.done_bytes, download.total_bytes = done, total
            if total >= LARGE_DOWNLOAD_BYTES and done >= next_log[0] * total:
                next_log[0] += 0.1
                log.info("downloading %s: %.0f%% of %d bytes", name, 100.0 * done / total, total)

        tmp, _ = download_verified(store, mv.artifact_uri, mv.sha256, self.staging_dir, name,
                                   progress, self.attempts)
        try:
            _set_config_name(tmp, name)
            files = {p.relative_to(tmp).as_posix(): p.stat().st_size
                     for p in tmp.rglob("*") if p.is_file()}
            (tmp / WARM_MANIFEST).write_text(json.dumps(
                {"name": name, "sha256": mv.sha256, "uri": mv.artifact_uri, "files": files}))
            final = self.repository / name
            if final.exists():
                self._move_out(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        size = folder_bytes(final)
        elapsed_s = time.monotonic() - started
        log.info("staged %s into %s: %d bytes in %.2fs (%.0f MB/s)", name, self.repository, size,
                 elapsed_s, size / 1e6 / max(elapsed_s, 1e-6))
        return size

    def _move_out(self, folder: Path) -> None:
        """Take a folder out of Triton's view in one rename, then delete it.

        The rename is one cheap syscall; the delete of a large model is not (~0.2 s for
        400 MB in tmpfs), so on the event loop it goes to a worker thread.  The entry is
        already gone from the budget by then: its RAM is given back a moment later, while the
        download that needed the room is still running."""
        trash = self.staging_dir / f"{folder.name}.{uuid.uuid4().hex[:8]}.trash"
        os.rename(folder, trash)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a worker thread or start-up: nothing to keep responsive
            shutil.rmtree(trash, ignore_errors=True)
            return
        task = loop.create_task(asyncio.to_thread(shutil.rmtree, trash, ignore_errors=True))
        self._deleting.add(task)
        task.add_done_callback(self._deleting.discard)

    async def deletions_done(self) -> None:
        """Wait for the deletes that evictions handed to worker threads (tests, shutdown)."""
        while self._deleting:
            await asyncio.gather(*self._deleting, return_exceptions=True)

    # ------------------------------------------------------------------ eviction
    def _make_room(self, name: str | None, size_bytes: int) -> list[str]:
        """Evict least recently used, unprotected, re-fetchable models until ``size_bytes``
        fits; raise CapacityExhausted (evicting nothing) if it cannot."""
        if self.budget_bytes is None:
            return []
        label = name or "the warm tier"
        if size_bytes > self.budget_bytes:
            raise CapacityExhausted(
                f"{label} needs {size_bytes} bytes but the whole warm budget is "
                f"{self.budget_bytes} bytes; raise the warm budget")
        need = self.used_bytes + size_bytes - self.budget_bytes
        if need <= 0:
            return []
        victims, freed = [], 0
        for entry in self.entries.values():
            if freed >= need:
                break
            if entry.managed and entry.name != name and not self._protected(entry.name):
                victims.append(entry.name)
                freed += entry.size_bytes
        if freed < need:
            held = sorted(n for n, e in self.entries.items() if self._protected(n))
            local = sorted(n for n, e in self.entries.items() if not e.managed)
            raise CapacityExhausted(
                f"{label} needs {size_bytes} bytes in the warm tier ({self.repository}) but only "
                f"{self.budget_bytes - self.used_bytes + freed} of its {self.budget_bytes} bytes can be "
                f"freed: loaded or loading {held or 'none'}, local-only {local or 'none'}; raise the "
                "warm budget or unload models")
        for victim in victims:
            self._drop(victim, f"making room for {label}")
        return victims

    def _drop(self, name: str, reason: str) -> None:
        entry = self.entries.pop(name, None)
        folder = self.repository / name
        if folder.exists():
            self._move_out(folder)
        log.info("evicted %s from the warm tier (%s, %d bytes)", name, reason,
                 entry.size_bytes if entry else 0)

    def evict(self, name: str) -> bool:
        """Drop ``name`` from warm now; refused (InvalidInput) while it is loaded/loading."""
        entry = self.entries.get(name)
        if entry is None:
            return False
        if self._protected(name):
            raise InvalidInput(f"{name} is loaded or loading; unload it before evicting it from warm")
        if not entry.managed:
            raise InvalidInput(f"{name} has no copy in the cold store; delete {self.repository / name} "
                               "by hand if you mean it")
        self._drop(name, "requested")
        return True

    # ------------------------------------------------------------------ restart
    def recover(self) -> dict:
        """Start-up reconciliation of the directory; call before Triton starts using it.

        Empties the staging directory (partial downloads, half-deleted evictions), removes
        dot-folders from the repository, drops folders whose warm manifest is missing a file,
        has the wrong sizes, or names a different sha256 than the registry, and rebuilds the
        LRU from folder modification times.  Loaded models (``in_use``) are never removed.
        """
        report: dict[str, list] = {"removed_partial": [], "dropped": [], "warm": [], "local": []}
        for child in list(self.staging_dir.iterdir()):
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
            report["removed_partial"].append(child.name)
        self.entries.clear()
        found = []
        for child in self.repository.iterdir():
            if not child.is_dir():
                continue
            if child == self.staging_dir:
                continue
            if child.name.startswith("."):
                self._move_out(child)
                report["removed_partial"].append(child.name)
                continue
            found.append((child.stat().st_mtime, child))
        for mtime, child in sorted(found):
            name = child.name
            verdict, sha = self._check_folder(child)
            if verdict == "ok":
                self.entries[name] = WarmEntry(name, folder_bytes(child), True, sha, mtime)
                report["warm"].append(name)
            elif verdict == "local":
                self.entries[name] = WarmEntry(name, folder_bytes(child), False, None, mtime)
                report["local"].append(name)
            elif self.in_use is not None and self.in_use(name):
                log.warning("%s in the warm tier failed its check (%s) but is loaded; kept until "
                            "unloaded", name, verdict)
                self.entries[name] = WarmEntry(name, folder_bytes(child), True, sha, mtime)
            else:
                self._move_out(child)
                report["dropped"].append(f"{name}: {verdict}")
        if report["removed_partial"] or report["dropped"]:
            log.warning("warm tier recovery in %s: removed partial %s, dropped %s", self.repository,
                        report["removed_partial"], report["dropped"])
        with contextlib.suppress(CapacityExhausted):
            self._make_room(None, 0)  # the budget may have shrunk since the last run
        return report

    def _check_folder(self, folder: Path) -> tuple[str, str | None]:
        """("ok", sha) / ("local", None) / (reason to drop, sha)."""
        mv = self.registry.by_name(folder.name) if self.registry is not None else None
        manifest_path = folder / WARM_MANIFEST
        if not manifest_path.is_file():
            if mv is None or mv.in_repository:
                return "local", None
            return "registered model without a warm manifest (not staged by the control plane)", None
        try:
            doc = json.loads(manifest_path.read_text())
            sha, files = doc["sha256"], doc["files"]
        except (OSError, ValueError, KeyError) as exc:
            return f"unreadable warm manifest ({exc})", None
        if mv is None:
            return "no longer in the registry", sha
        if sha != mv.sha256:
            return f"sha256 {sha} differs from the registry's {mv.sha256}", sha
        for rel, size in files.items():
            path = folder / rel
            try:
                actual = path.stat().st_size
            except OSError:
                return f"{rel} is missing", sha
            if actual != size:
                return f"{rel} has {actual} bytes, expected {size}", sha
        return "ok", sha

    # ------------------------------------------------------------------ views
    def tier_of(self, name: str) -> str | None:
        if name in self.entries:
            return "warm"
        if name in self._staging:
            return "staging"
        if self.registry is not None and self.registry.by_name(name) is not None:
            return "cold"
        return None

    def status(self) -> dict:
        return {
            "repository": str(self.repository),
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes,
            "models": [dict(e.to_dict(), busy=self._protected(e.name))
                       for e in self.entries.values()],
            "downloads": [d.to_dict() for d in self.downloads.values()],
        }

    def locator(self, manager) -> Callable[[str], dict]:
        """``name -> {"tier", "server", "state"}`` for ``registry list`` (hot/warm/cold)."""

        def locate(name: str) -> dict:
            rec = manager.records.get(name)
            if rec is not None and rec.server is not None:
                return {"tier": "hot", "server": rec.server, "state": rec.state.value}
            return {"tier": self.tier_of(name) or "cold", "server": None,
                    "state": rec.state.value if rec is not None else None}

        return locate


def _set_config_name(folder: Path, name: str) -> None:
    """Triton requires config.pbtxt's ``name`` to equal the folder name (``cust017.v3``)."""
    config = folder / "config.pbtxt"
    if config.is_file():
        set_name_in_file(config, name)
