"""The control plane's adapter operations (``AdapterManager``): add, list, pin/unpin,
load/unload, remove, recovery at start and the status refresh loop.  See the package
docstring for how they reach the model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from control_plane.adapters.adapter_table import AdapterStore
from control_plane.adapters.base import LoraBase, describe_base, parse_adapter_ref
from control_plane.adapters.files import (
    AdapterFiles,
    install,
    read_base_manifest,
    remove_tree,
    write_base_manifest,
)
from control_plane.adapters.metrics import AdapterMetrics
from control_plane.adapters.rows import _peft_summary, merge_rows
from control_plane.adapters.slots import AdapterSlots
from control_plane.tiers.cold import ColdStores
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
)
from domain.periodic import guarded_step, run_periodically
from domain.routes import split_adapter

log = logging.getLogger(__name__)


class AdapterManager:
    """The control plane's adapter operations; one per service.

    ``manager`` is the ModelManager (``ready_server_of``, ``ensure``, ``records``); nothing
    here loads or unloads a base model except ``load`` of an adapter, which ensures its base
    like a request would.  Mutations of one base are serialized by a per-base lock; file work
    runs on executor threads."""

    def __init__(self, manager, repository: Path, stores: ColdStores | None = None,
                 db: sqlite3.Connection | None = None, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time, refresh_interval_s: float = 10.0):
        self.manager = manager
        self.repository = Path(repository)
        self.stores = stores or ColdStores()
        self.files = AdapterFiles(self.stores)
        self.store = AdapterStore(db if db is not None else manager.store.db)
        metrics_registry = registry if registry is not None else getattr(
            getattr(manager, "metrics", None), "registry", None)
        self.metrics = AdapterMetrics(metrics_registry)
        self.clock = clock
        self.refresh_interval_s = refresh_interval_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._bases: dict[str, bool] = {}  # model name -> is a LoRA base (for step())
        # Which adapters hold the bases' device slots: entries of the model manager.
        # The model manager routes BASE:ADAPTER names to them: it builds this part with
        # itself (ModelManager's ``adapters``) and takes ``slots``.
        self.slots = AdapterSlots(manager, self.repository, on_status=self._absorb,
                                  evictions=self.metrics.evictions)

    # ------------------------------------------------------------------ helpers
    def base(self, name: str) -> LoraBase:
        return describe_base(self.repository, name)

    def _lock(self, base: str) -> asyncio.Lock:
        lock = self._locks.get(base)
        if lock is None:
            lock = self._locks[base] = asyncio.Lock()
        return lock

    @staticmethod
    async def _blocking(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _write(self, fn, *args, **kwargs) -> asyncio.Future:
        """An adapter-table write (``AdapterStore``) in the state store's thread, in the order
        asked for: a slow database holds up the caller, never the event loop."""
        return self.store.db.off_loop(fn, *args, **kwargs)

    def _known(self, base: LoraBase, name: str) -> dict | None:
        """The registry row (None for an adapter only in the directory); ModelNotFound if
        neither knows ``name``."""
        row = self.store.get(base.name, name)
        if row is None and not (base.adapter_dir / name).is_dir():
            raise ModelNotFound(f"unknown adapter {name!r} for {base.name}; `mmctl adapter list "
                                f"{base.name}` shows them, `mmctl adapter add` adds one")
        return row

    async def _control(self, base: str, command: dict, quiet: bool = False) -> dict | None:
        """The model's answer, or None when the base is not loaded.  ``quiet``: a status
        poll, not use (see the module docstring)."""
        server = self.manager.ready_server_of(base)
        if server is None:
            return None
        status = await server.admin.adapter_control(base, command, key=self.slots.key)
        if quiet:
            self.manager.not_use(base, int(time.time() * 1000))
        self.slots.observe(base, server.name, status)  # metrics and recency too (_absorb)
        return status

    async def _on_every_copy(self, base: str, command: dict) -> None:
        """``command`` on each server the base is loaded on (one that fails is logged: its
        next load of the adapter compares the files and reads them again)."""
        for where in self.manager.copy_servers_of(base):
            server = self.manager.servers.get(where)
            if server is None or not server.up:
                continue
            try:
                status = await server.admin.adapter_control(base, command, key=self.slots.key)
            except ControlPlaneError as exc:
                log.warning("%s of adapter %s on %s (%s) failed: %s", command["op"],
                            command.get("adapter"), base, where, exc.message)
                continue
            self.slots.observe(base, server.name, status)

    def _absorb(self, base: str, status: dict) -> None:
        self.metrics.update(base, status)
        used = {a["name"]: a["last_used_unix"] for a in status.get("adapters", [])
                if a.get("last_used_unix")}
        if used:  # recency for the listing: nothing waits for it
            self._write(self.store.touch, base, used).add_done_callback(_log_failed_touch)

    @staticmethod
    def _entry(status: dict | None, name: str) -> dict | None:
        for a in (status or {}).get("adapters", []):
            if a["name"] == name:
                return a
        return None

    # ------------------------------------------------------------------ add
    async def add(self, base_name: str, ref: str, source: str, who: str | None = None,
                  replace: bool = False) -> dict:
        """Add adapter ``ref`` (``acme`` or a label ``support-bot/acme``) to ``base_name`` from
        ``source`` (a local folder or a cold-store URI).  Refused (InvalidInput, the reason in
        the message) when malformed or made for another base; nothing is left behind then."""
        name, label = parse_adapter_ref(ref)
        if not isinstance(source, str) or not source:
            raise InvalidInput("say where the adapter is: a PEFT folder or a file:// / s3:// URI")
        base = self.base(base_name)
        async with self._lock(base.name):
            row = self.store.get(base.name, name)
            exists = row is not None or (base.adapter_dir / name).is_dir()
            if exists and not replace:
                raise InvalidInput(f"adapter {name!r} already exists for {base.name}; remove it first "
                                   "(mmctl adapter remove) or add it with --replace")
            manifest = read_base_manifest(base)
            if exists and name in manifest.pinned:
                raise InvalidInput(f"adapter {name!r} is pinned on {base.name}; unpin it before "
                                   "replacing it")
            staged = await self._blocking(self.files.stage, base, name, source)
            await self._blocking(install, base, name, staged.path)
            await self._write(self.store.put, base.name, name, label=label, uri=staged.uri,
                              sha256=staged.sha256, rank=staged.rank, nbytes=staged.nbytes,
                              added_by=who, added_at=self.clock(), pinned=False)
            if exists:  # every copy of the model may hold the old weights in memory
                await self._on_every_copy(base.name, {"op": "unload", "adapter": name})
            log.info("added adapter %s to %s from %s (rank %d, %d bytes)", name, base.name, source,
                     staged.rank, staged.nbytes)
        return await self.describe(base.name, name)

    # ------------------------------------------------------------------ list
    async def list(self, base_name: str, refresh: bool = True) -> dict:
        """Registry + directory + manifest, and the live status when the base is loaded.
        Never loads the base."""
        from model_runtime.lora.source import AdapterSource

        base = self.base(base_name)
        live, live_error = None, None
        if refresh:
            try:
                live = await self._control(base.name, {"op": "status"}, quiet=True)
            except ControlPlaneError as exc:
                live_error = exc.message
                log.warning("status of %s failed: %s", base.name, exc.message)
        manifest = read_base_manifest(base)
        on_disk = AdapterSource(base.adapter_dir).names()
        registered = {r["name"]: r for r in self.store.rows(base.name)}
        rows = merge_rows(base.name, registered, on_disk, manifest.to_dict(), live,
                          summary=lambda n: _peft_summary(base.adapter_dir / n))
        server = self.manager.ready_server_of(base.name)
        out = {
            "base": base.name,
            "loaded": live is not None,
            "server": server.name if server is not None else None,
            "adapter_dir": str(base.adapter_dir),
            "max_lora_rank": base.max_rank,
            "manifest_generation": manifest.generation,
            "adapters": rows,
        }
        if live is not None:
            for key in ("device", "max_device_adapters", "max_host_adapters", "device_slots_used",
                        "host_adapters", "manifest_error"):
                out[key] = live.get(key)
        if live_error:
            out["status_error"] = live_error
        return out

    async def describe(self, base_name: str, name: str, status: dict | None = None) -> dict:
        """One adapter's row (``list``'s), from ``status`` when the caller just got one."""
        from model_runtime.lora.source import AdapterSource

        base = self.base(base_name)
        if status is None:
            with contextlib.suppress(ControlPlaneError):
                status = await self._control(base.name, {"op": "status"}, quiet=True)
        manifest = read_base_manifest(base)
        registered = {r["name"]: r for r in self.store.rows(base.name) if r["name"] == name}
        on_disk = [n for n in AdapterSource(base.adapter_dir).names() if n == name]
        live = None
        if status is not None:
            live = dict(status, adapters=[a for a in status.get("adapters", []) if a["name"] == name])
        rows = merge_rows(base.name, registered, on_disk, manifest.to_dict(), live,
                          summary=lambda n: _peft_summary(base.adapter_dir / n))
        if not rows:
            raise ModelNotFound(f"unknown adapter {name!r} for {base.name}")
        return rows[0]

    # ------------------------------------------------------------------ pins
    async def pin(self, base_name: str, ref: str) -> dict:
        """Pin: in a device slot whenever the base is loaded, never evicted, across restarts.
        With the base loaded, the pin is confirmed by the model (``sync``) and undone if the
        model could not pin it (all slots pinned, adapter refused)."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        async with self._lock(base.name):
            self._known(base, name)
            before = read_base_manifest(base)
            write_base_manifest(base, pinned=[*before.pinned, name], preload=before.preload,
                                 disabled=[d for d in before.disabled if d != name])
            await self._write(self.store.set_pinned, base.name, name, True, self.clock())
            try:
                server = self.manager.ready_server_of(base.name)
                if server is not None:  # into a slot first, evicting by the policy if need be
                    await self.slots.place(server, base.name, name)
                status = await self._control(base.name, {"op": "sync"})
                entry = self._entry(status, name)
                if status is not None and (entry is None or not entry.get("pinned")):
                    reason = (entry or {}).get("error") or "the model did not report it pinned"
                    if "slot" in reason:
                        raise CapacityExhausted(f"cannot pin {name!r} on {base.name}: {reason}")
                    if "not found" in reason:
                        raise ModelNotFound(f"cannot pin {name!r} on {base.name}: {reason}")
                    raise InvalidInput(f"cannot pin {name!r} on {base.name}: {reason}")
            except BaseException:
                write_base_manifest(base, pinned=before.pinned, preload=before.preload,
                                     disabled=before.disabled)
                await self._write(self.store.set_pinned, base.name, name, name in before.pinned,
                                  self.clock())
                with contextlib.suppress(ControlPlaneError):
                    await self._control(base.name, {"op": "sync"})
                raise
        return await self.describe(base.name, name, status)

    async def unpin(self, base_name: str, ref: str) -> dict:
        """Unpin (it stays in its slot until evicted)."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        async with self._lock(base.name):
            self._known(base, name)
            before = read_base_manifest(base)
            write_base_manifest(base, pinned=[p for p in before.pinned if p != name],
                                 preload=before.preload, disabled=before.disabled)
            if self.store.get(base.name, name) is not None:
                await self._write(self.store.set_pinned, base.name, name, False, self.clock())
            status = await self._control(base.name, {"op": "sync"})
        return await self.describe(base.name, name, status)

    # ------------------------------------------------------------------ load / unload
    async def load(self, base_name: str, ref: str) -> dict:
        """Into a device slot now; loads the base first if it is not loaded (like a request)."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        self._known(base, name)
        await self.manager.ensure(base.name)
        server = self.manager.ready_server_of(base.name)
        if server is None:
            raise ModelLoadFailed(f"{base.name} was unloaded before {name!r} could be loaded; retry")
        status = await self.slots.place(server, base.name, name)
        return await self.describe(base.name, name, status)

    async def unload(self, base_name: str, ref: str) -> dict:
        """Out of device and host memory (the folder stays).  Refused for a pinned adapter."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        self._known(base, name)
        if name in read_base_manifest(base).pinned:
            raise InvalidInput(f"adapter {name!r} is pinned on {base.name}; unpin it first "
                               f"(mmctl adapter unpin {base.name} {name})")
        status = await self._control(base.name, {"op": "unload", "adapter": name})
        return await self.describe(base.name, name, status)

    # ------------------------------------------------------------------ as a manager entry
    async def entry_action(self, action: str, entry: str) -> dict:
        """``load``, ``unload``, ``pin`` or ``unpin`` of the entry ``BASE:ADAPTER`` (what
        ``mmctl load/unload/pin/unpin`` send for it); its ``mmctl status`` row."""
        base, name = split_adapter(entry)
        op = {"load": self.load, "unload": self.unload, "pin": self.pin, "unpin": self.unpin}[action]
        row = await op(base, name)
        for listed in self.slots.rows():
            if listed["model"] == entry and (listed["state"] == "ready" or action == "unload"):
                return listed
        return {"model": entry, "kind": "adapter", "base": base,
                "state": "ready" if row["tier"] in ("device", "gpu") else "warm", "server": None,
                "pinned": row["pinned"], "tier": row["tier"]}

    # ------------------------------------------------------------------ remove
    async def remove(self, base_name: str, ref: str) -> dict:
        """Delete the adapter's folder and registry row (a cold-store copy is kept).

        While the files go, the adapter is ``disabled`` in the manifest so no request reloads
        it from a half-deleted folder; afterwards requests for it get NOT_FOUND."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        async with self._lock(base.name):
            row = self._known(base, name)
            before = read_base_manifest(base)
            if name in before.pinned or (row or {}).get("pinned"):
                raise InvalidInput(f"adapter {name!r} is pinned on {base.name}; unpin it first "
                                   f"(mmctl adapter unpin {base.name} {name})")
            write_base_manifest(base, pinned=before.pinned, preload=before.preload,
                                 disabled=[*before.disabled, name])
            with contextlib.suppress(ControlPlaneError):
                await self._control(base.name, {"op": "sync"})
            folder = base.adapter_dir / name
            if folder.exists():
                doomed = base.adapter_dir / f".{name}.removed.{uuid.uuid4().hex[:8]}"
                os.rename(folder, doomed)
                await self._blocking(remove_tree, doomed)
            await self._write(self.store.delete, base.name, name)
            write_base_manifest(base, pinned=before.pinned,
                                 preload=[p for p in before.preload if p != name],
                                 disabled=[d for d in before.disabled if d != name])
            with contextlib.suppress(ControlPlaneError):
                await self._control(base.name, {"op": "sync"})
        log.info("removed adapter %s from %s", name, base.name)
        return {"base": base.name, "name": name, "removed": True, "uri": (row or {}).get("uri")}

    # ------------------------------------------------------------------ restarts / loop
    async def recover(self) -> dict:
        """At start: bring back registered adapters whose folder is gone (a wiped tmpfs
        repository) from their cold copy, drop staging leftovers, and rewrite the manifest's
        pins from the registry.  Failures are logged and reported, never raised."""
        report: dict = {"restored": [], "failed": {}}
        by_base: dict[str, list[dict]] = {}
        for row in self.store.rows():
            by_base.setdefault(row["base"], []).append(row)
        for base_name, rows in sorted(by_base.items()):
            try:
                base = self.base(base_name)
            except ControlPlaneError as exc:
                log.error("adapters of %s: %s", base_name, exc.message)
                report["failed"][base_name] = exc.message
                continue
            async with self._lock(base_name):
                await self._recover_base(base, rows, report)
        return report

    async def _recover_base(self, base: LoraBase, rows: list[dict], report: dict) -> None:
        if base.adapter_dir.is_dir():
            for leftover in base.adapter_dir.glob(".*.tmp"):
                if leftover.is_dir():
                    await self._blocking(remove_tree, leftover)
        for row in rows:
            if (base.adapter_dir / row["name"]).is_dir() or not row["uri"] or not row["sha256"]:
                continue
            key = f"{base.name}:{row['name']}"
            try:
                base.adapter_dir.mkdir(parents=True, exist_ok=True)
                await self._blocking(self.files.restore, base, row)
                report["restored"].append(key)
                log.info("restored adapter %s from %s", key, row["uri"])
            except ControlPlaneError as exc:
                report["failed"][key] = exc.message
                log.error("could not restore adapter %s from %s: %s", key, row["uri"], exc.message)
        try:
            manifest = read_base_manifest(base)
        except ControlPlaneError as exc:
            report["failed"][base.name] = exc.message
            return
        pinned = {r["name"] for r in rows if r["pinned"]}
        if pinned != set(manifest.pinned):
            write_base_manifest(base, pinned=pinned, preload=manifest.preload,
                                 disabled=[d for d in manifest.disabled if d not in pinned])

    def _is_base(self, name: str) -> bool:
        known = self._bases.get(name)
        if known is None:
            try:
                self.base(name)
                known = True
            except ControlPlaneError:
                known = False
            self._bases[name] = known
        return known

    async def step(self) -> None:
        """Refresh the status (metrics, last used) of every loaded LoRA base."""
        ready = [n for n in list(self.manager.records) if self.manager.ready_server_of(n) is not None]
        for name in ready:
            if not self._is_base(name):
                continue
            try:
                await self._control(name, {"op": "status"}, quiet=True)
            except ControlPlaneError as exc:  # one failing base never stops the loop
                log.warning("adapter status of %s failed: %s", name, exc.message)

    async def run_forever(self, failures=None) -> None:
        """Recover once, then refresh every ``refresh_interval_s`` (a failing pass is logged
        and counted in ``failures``; the next one runs)."""
        await guarded_step("adapter-recovery", self.recover, failures)
        await run_periodically("adapter-refresh", self.step, lambda: self.refresh_interval_s, failures)


def _log_failed_touch(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("recording when adapters were last used failed: %s", done.exception())
