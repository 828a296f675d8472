"""LoRA adapters of the base models: add, list, pin/unpin, load/unload, remove.

A LoRA base (``model_repository/tinylm``, ``recommender_lora``) is an ordinary model folder in
Triton's repository whose config has an ``ADAPTER_CONTROL`` input.  Its adapters live in its
adapter directory (``<folder>/adapters/<name>/``, PEFT files); the model serves whatever is
there, loading adapters on demand.  This module is the control plane's side:

* **add** copies a PEFT adapter from a local folder or a cold-store URI into
  ``<adapter_dir>/.<name>.tmp``, validates it against the base's linear layers
  (``lora.read_adapter``: a malformed file or an adapter for another base is refused with the
  reason and nothing is left behind), publishes a local one to the default cold store (so it
  survives a wiped tmpfs repository), and renames it into place: the model never sees half an
  adapter.
* **durable state** is the ``adapters`` table in the control plane's SQLite (who added what,
  from where, sha256, pins) and the manifest the model reads (``lora.manifest``).  The table is
  the truth: ``recover()`` re-downloads adapters whose folder is gone and rewrites the pins.
* **confirmed operations** go to the model as a control inference (``TritonAdmin.
  adapter_control``): ``sync`` after a manifest change (answered once the pins are loaded),
  ``load``/``unload`` of one adapter, ``status`` for listing and metrics.  A control request
  reaches one model instance; the others follow the manifest within ``manifest_poll_s``.
* **metrics** (requests, cache hits/misses, load time per adapter) come from the model's status
  and are exposed on the control plane's registry by a collector; ``step()`` refreshes them
  for every loaded base, ``run_forever()`` repeats it.

Status polls are not use: after a poll the base model's Triton ``last_inference`` is marked as
seen so the eviction policy does not count the control plane's own requests.

Tiers in ``list``: ``gpu`` (a device slot of a model on a GPU; ``device`` on a CPU server),
``host``, ``loading``, ``cold`` (only in the adapter directory), ``refused``, ``disabled``,
``missing`` (registered, folder gone, not restorable yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import model_config
from .cold_store import (
    ColdStore,
    ColdStores,
    LocalDirStore,
    S3Store,
    download_verified,
    folder_sha256,
    inspect,
    publish,
)
from .errors import (
    CapacityExhausted,
    ControlPlaneError,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
)
from .names import validate_model_name

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    base TEXT NOT NULL,
    name TEXT NOT NULL,
    label TEXT,
    uri TEXT,
    sha256 TEXT,
    rank INTEGER,
    bytes INTEGER,
    pinned INTEGER NOT NULL DEFAULT 0,
    added_at REAL NOT NULL,
    added_by TEXT,
    last_used REAL,
    PRIMARY KEY (base, name)
);
"""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_FILES = (CONFIG_FILE, WEIGHTS_FILE)
MANIFEST_FILE = "manifest.json"
CONTROL_INPUT = "ADAPTER_CONTROL"
DEFAULT_ADAPTER_DIR = "adapters"
DEFAULT_MAX_RANK = 16
LABEL_SEPARATOR = "/"


# --------------------------------------------------------------------------- pure parts
def adapter_name(name: object) -> str:
    """``name`` if it is a valid adapter name (the model-name alphabet), else InvalidInput."""
    try:
        return validate_model_name(name)
    except InvalidInput as exc:
        raise InvalidInput(exc.message.replace("model name", "adapter name")) from None


def parse_adapter_ref(ref: object) -> tuple[str, str | None]:
    """``"acme"`` -> ``("acme", None)``; ``"support-bot/acme"`` -> ``("acme", "support-bot/acme")``.

    An adapter is served, pinned and selected (``adapter=acme``, ``tinylm:acme``) by a plain
    name, because the name becomes a directory and a request parameter.  A reference with
    ``/`` is a display label whose last segment is that name; every segment must be valid."""
    if not isinstance(ref, str) or not ref:
        raise InvalidInput("adapter name must be a non-empty string")
    if LABEL_SEPARATOR not in ref:
        return adapter_name(ref), None
    segments = ref.split(LABEL_SEPARATOR)
    for segment in segments:
        if not segment:
            raise InvalidInput(f"adapter label {ref!r} has an empty segment; write owner/name, e.g. "
                               "support-bot/acme")
        try:
            adapter_name(segment)
        except InvalidInput:
            raise InvalidInput(
                f"adapter label {ref!r} is invalid: each '/'-separated part must use letters, digits, "
                "'_', '-' and '.'; the last part is the adapter's name (support-bot/acme is served "
                "as acme)") from None
    return segments[-1], ref


def parse_model_config(text: str, where: str = model_config.CONFIG_FILE) -> tuple[set[str], dict[str, str]]:
    """Input names and string parameters of a config.pbtxt (the subset this module needs);
    InvalidInput naming ``where`` when Triton could not parse it either.

    Only read, never written back: fields a newer Triton added may stay unknown here."""
    config = model_config.parse_config(text, where, allow_unknown_fields=True)
    return model_config.input_names(config), model_config.string_parameters(config)


@dataclass(frozen=True)
class LoraBase:
    """A LoRA base model folder in Triton's repository."""

    name: str
    folder: Path
    kind: str  # "tinylm" | "recommender"
    adapter_dir: Path
    max_rank: int
    weights: Path


def describe_base(repository: Path, name: str) -> LoraBase:
    """Raise ModelNotFound for a missing folder, InvalidInput for a model that is not a
    LoRA base (no ADAPTER_CONTROL input), with what to do instead."""
    validate_model_name(name)
    folder = repository / name
    config = folder / "config.pbtxt"
    try:
        text = config.read_text()
    except FileNotFoundError:
        raise ModelNotFound(f"unknown base model {name!r}: no {config}; `mmctl status --all` "
                            "lists the models") from None
    inputs, params = parse_model_config(text, str(config))
    if CONTROL_INPUT not in inputs:
        raise InvalidInput(f"{name} is not a LoRA base model (its config has no {CONTROL_INPUT} "
                           "input); adapters go to a LoRA base such as tinylm or recommender_lora")
    kind = "tinylm" if "TEXT" in inputs else "recommender" if "FEATURES" in inputs else None
    if kind is None:
        raise InvalidInput(f"{name} has an {CONTROL_INPUT} input but neither TEXT nor FEATURES: "
                           "this control plane does not know its layers")
    adapter_dir = Path(params.get("adapter_dir") or DEFAULT_ADAPTER_DIR)
    if not adapter_dir.is_absolute():
        adapter_dir = folder / adapter_dir
    try:
        max_rank = int(params.get("max_lora_rank") or DEFAULT_MAX_RANK)
    except ValueError:
        raise InvalidInput(f"{config}: max_lora_rank={params['max_lora_rank']!r} is not an integer") from None
    versions = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()),
                      key=lambda p: int(p.name))
    if not versions:
        raise InvalidInput(f"{name} has no version folder (e.g. {folder / '1'})")
    return LoraBase(name, folder, kind, adapter_dir, max_rank, versions[-1] / "weights.safetensors")


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


# --------------------------------------------------------------------------- state
class AdapterStore:
    """The ``adapters`` table in the control plane's SQLite (one connection, event-loop thread)."""

    COLUMNS = ("base", "name", "label", "uri", "sha256", "rank", "bytes", "pinned", "added_at",
               "added_by", "last_used")

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.db.executescript(SCHEMA)

    def rows(self, base: str | None = None) -> list[dict]:
        sql = f"SELECT {', '.join(self.COLUMNS)} FROM adapters"
        cur = self.db.execute(sql + (" WHERE base = ? ORDER BY name" if base else " ORDER BY base, name"),
                              (base,) if base else ())
        return [self._row(r) for r in cur]

    def get(self, base: str, name: str) -> dict | None:
        cur = self.db.execute(f"SELECT {', '.join(self.COLUMNS)} FROM adapters WHERE base = ? AND name = ?",
                              (base, name))
        row = cur.fetchone()
        return self._row(row) if row else None

    def _row(self, values) -> dict:
        row = dict(zip(self.COLUMNS, values))
        row["pinned"] = bool(row["pinned"])
        return row

    def put(self, base: str, name: str, *, label: str | None, uri: str | None, sha256: str | None,
            rank: int | None, nbytes: int | None, added_by: str | None, added_at: float,
            pinned: bool = False) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO adapters(base, name, label, uri, sha256, rank, bytes, pinned, "
            "added_at, added_by, last_used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "(SELECT last_used FROM adapters WHERE base = ? AND name = ?))",
            (base, name, label, uri, sha256, rank, nbytes, int(pinned), added_at, added_by, base, name))

    def set_pinned(self, base: str, name: str, pinned: bool, now: float) -> None:
        if self.get(base, name) is None:  # an adapter found in the directory: registered now
            self.put(base, name, label=None, uri=None, sha256=None, rank=None, nbytes=None,
                     added_by=None, added_at=now, pinned=pinned)
        else:
            self.db.execute("UPDATE adapters SET pinned = ? WHERE base = ? AND name = ?",
                            (int(pinned), base, name))

    def touch(self, base: str, used: Mapping[str, float]) -> None:
        for name, when in used.items():
            self.db.execute("UPDATE adapters SET last_used = ? WHERE base = ? AND name = ? "
                            "AND (last_used IS NULL OR last_used < ?)", (when, base, name, when))

    def delete(self, base: str, name: str) -> None:
        self.db.execute("DELETE FROM adapters WHERE base = ? AND name = ?", (base, name))


class AdapterMetrics:
    """Per-adapter Prometheus metrics from the latest status of each base.

    The values are the model's own counters (they restart at zero when the base is reloaded,
    which Prometheus treats as a counter reset).  The last status of a base that was unloaded
    stays exposed until the base answers again."""

    def __init__(self, registry: CollectorRegistry | None):
        self._status: dict[str, dict] = {}
        if registry is not None:
            registry.register(self)

    def update(self, base: str, status: dict) -> None:
        self._status[base] = status

    def describe(self):
        return []

    def collect(self):
        labels = ["base", "adapter"]
        requests = CounterMetricFamily("mms_adapter_requests", "Requests that named the adapter", labels=labels)
        hits = CounterMetricFamily("mms_adapter_cache_hits",
                                   "Requests that found the adapter in a device slot or host memory",
                                   labels=[*labels, "tier"])
        misses = CounterMetricFamily("mms_adapter_cache_misses",
                                     "Requests that had to load the adapter from its directory", labels=labels)
        cold_loads = CounterMetricFamily("mms_adapter_cold_loads", "Adapter loads from the directory",
                                         labels=labels)
        load_s = GaugeMetricFamily("mms_adapter_load_seconds", "Duration of the adapter's last load from "
                                   "its directory", labels=labels)
        swap_s = GaugeMetricFamily("mms_adapter_swap_in_seconds", "Duration of the adapter's last swap-in "
                                   "from host memory into a device slot", labels=labels)
        resident = GaugeMetricFamily("mms_adapter_resident", "1 for the tier the adapter is in now",
                                     labels=[*labels, "tier"])
        slots = GaugeMetricFamily("mms_adapter_device_slots_used", "Device slots in use per base", labels=["base"])
        for base, status in sorted(self._status.items()):
            slots.add_metric([base], float(status.get("device_slots_used") or 0))
            for a in status.get("adapters", []):
                key = [base, a["name"]]
                requests.add_metric(key, float(a.get("requests") or 0))
                hits.add_metric([*key, "device"], float(a.get("device_hits") or 0))
                hits.add_metric([*key, "host"], float(a.get("host_hits") or 0))
                misses.add_metric(key, float(a.get("misses") or 0))
                cold_loads.add_metric(key, float(a.get("cold_loads") or 0))
                if a.get("load_time_s") is not None:
                    load_s.add_metric(key, float(a["load_time_s"]))
                if a.get("swap_in_s") is not None:
                    swap_s.add_metric(key, float(a["swap_in_s"]))
                if a.get("tier") not in (None, "missing"):  # removed adapters keep their counters
                    resident.add_metric([*key, a["tier"]], 1.0)
        yield from (requests, hits, misses, cold_loads, load_s, swap_s, resident, slots)


@dataclass(frozen=True)
class StagedAdapter:
    path: Path  # <adapter_dir>/.<name>.tmp, validated
    uri: str | None
    sha256: str
    rank: int
    nbytes: int


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _keep_only_peft_files(folder: Path) -> None:
    """Training leftovers (README.md, optimizer state, pickles) are not served."""
    for entry in folder.iterdir():
        if entry.name not in PEFT_FILES:
            if entry.is_dir():
                _remove_tree(entry)
            else:
                entry.unlink()


# --------------------------------------------------------------------------- manager
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
        self.store = AdapterStore(db if db is not None else manager.store.db)
        metrics_registry = registry if registry is not None else getattr(
            getattr(manager, "metrics", None), "registry", None)
        self.metrics = AdapterMetrics(metrics_registry)
        self.clock = clock
        self.refresh_interval_s = refresh_interval_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._targets: dict[str, tuple[tuple, dict, tuple]] = {}
        self._bases: dict[str, bool] = {}  # model name -> is a LoRA base (for step())

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

    def _targets_of(self, base: LoraBase) -> tuple[dict, tuple]:
        """``module -> (out, in)`` of the base's linear layers and the modules excluded from
        ``all-linear``, from its weights file (cached until the file changes)."""
        from .lora.models import linear_targets, load_recommender, load_tinylm

        try:
            st = base.weights.stat()
        except FileNotFoundError:
            raise InvalidInput(f"{base.name} has no base weights at {base.weights}") from None
        signature = (str(base.weights), st.st_mtime_ns, st.st_size)
        cached = self._targets.get(base.name)
        if cached is not None and cached[0] == signature:
            return cached[1], cached[2]
        model = load_tinylm(base.weights) if base.kind == "tinylm" else load_recommender(base.weights)
        targets, excluded = linear_targets(model), tuple(getattr(model, "output_layers", ()))
        self._targets[base.name] = (signature, targets, excluded)
        return targets, excluded

    def _known(self, base: LoraBase, name: str) -> dict | None:
        """The registry row (None for an adapter only in the directory); ModelNotFound if
        neither knows ``name``."""
        row = self.store.get(base.name, name)
        if row is None and not (base.adapter_dir / name).is_dir():
            raise ModelNotFound(f"unknown adapter {name!r} for {base.name}; `mmctl adapter list "
                                f"{base.name}` shows them, `mmctl adapter add` adds one")
        return row

    def _manifest(self, base: LoraBase):
        from .lora import LoraError, read_manifest

        try:
            return read_manifest(base.adapter_dir)
        except LoraError as exc:
            raise InvalidInput(f"{base.name}: {exc.message}; fix or delete the file") from None

    def _write_manifest(self, base: LoraBase, *, pinned: Iterable[str], preload: Iterable[str],
                        disabled: Iterable[str]):
        from .lora import Manifest, write_manifest

        current = self._manifest(base)
        manifest = Manifest(generation=current.generation + 1, pinned=tuple(sorted(set(pinned))),
                            preload=tuple(sorted(set(preload))), disabled=tuple(sorted(set(disabled))))
        write_manifest(base.adapter_dir, manifest)
        return manifest

    def _default_uri(self, base: str, name: str) -> str | None:
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

    async def _control(self, base: str, command: dict, quiet: bool = False) -> dict | None:
        """The model's answer, or None when the base is not loaded.  ``quiet``: a status
        poll, not use (see the module docstring)."""
        server = self.manager.ready_server_of(base)
        if server is None:
            return None
        status = await server.admin.adapter_control(base, command)
        if quiet:
            rec = self.manager.records.get(base)
            if rec is not None:
                rec.last_inference_ms = max(rec.last_inference_ms, int(time.time() * 1000))
        self._absorb(base, status)
        return status

    def _absorb(self, base: str, status: dict) -> None:
        self.metrics.update(base, status)
        used = {a["name"]: a["last_used_unix"] for a in status.get("adapters", [])
                if a.get("last_used_unix")}
        if used:
            self.store.touch(base, used)

    @staticmethod
    def _entry(status: dict | None, name: str) -> dict | None:
        for a in (status or {}).get("adapters", []):
            if a["name"] == name:
                return a
        return None

    # ------------------------------------------------------------------ add
    def _stage(self, base: LoraBase, name: str, source: str) -> StagedAdapter:
        """Copy or download into ``.<name>.tmp``, validate, publish.  Blocking."""
        from .lora import AdapterRefused, read_adapter

        targets, excluded = self._targets_of(base)
        base.adapter_dir.mkdir(parents=True, exist_ok=True)
        tmp = base.adapter_dir / f".{name}.tmp"
        _remove_tree(tmp)
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
                _keep_only_peft_files(tmp)
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
                adapter = read_adapter(tmp, targets, name=name, max_rank=base.max_rank,
                                       all_linear_excluded=excluded, base_name=base.name)
            except AdapterRefused as exc:
                raise InvalidInput(exc.message) from None
            if uri is None:
                sha256 = folder_sha256(tmp)
                uri = self._default_uri(base.name, name)
                if uri is not None:
                    sha256 = publish(self.stores.for_uri(uri), tmp, uri).sha256
            return StagedAdapter(tmp, uri, sha256, adapter.rank, adapter.nbytes)
        except BaseException:
            _remove_tree(tmp)
            raise

    @staticmethod
    def _install(base: LoraBase, name: str, staged: Path) -> None:
        """Rename the staged folder into place; a replaced folder is moved aside first."""
        final = base.adapter_dir / name
        if final.exists():
            old = base.adapter_dir / f".{name}.old.{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(staged, final)
            _remove_tree(old)
        else:
            os.rename(staged, final)

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
            manifest = self._manifest(base)
            if exists and name in manifest.pinned:
                raise InvalidInput(f"adapter {name!r} is pinned on {base.name}; unpin it before "
                                   "replacing it")
            staged = await self._blocking(self._stage, base, name, source)
            await self._blocking(self._install, base, name, staged.path)
            self.store.put(base.name, name, label=label, uri=staged.uri, sha256=staged.sha256,
                           rank=staged.rank, nbytes=staged.nbytes, added_by=who, added_at=self.clock(),
                           pinned=False)
            if exists:  # the model may hold the old weights in memory
                with contextlib.suppress(ControlPlaneError):
                    await self._control(base.name, {"op": "unload", "adapter": name})
            log.info("added adapter %s to %s from %s (rank %d, %d bytes)", name, base.name, source,
                     staged.rank, staged.nbytes)
        return await self.describe(base.name, name)

    # ------------------------------------------------------------------ list
    async def list(self, base_name: str, refresh: bool = True) -> dict:
        """Registry + directory + manifest, and the live status when the base is loaded.
        Never loads the base."""
        from .lora.cache import AdapterSource

        base = self.base(base_name)
        live, live_error = None, None
        if refresh:
            try:
                live = await self._control(base.name, {"op": "status"}, quiet=True)
            except ControlPlaneError as exc:
                live_error = exc.message
                log.warning("status of %s failed: %s", base.name, exc.message)
        manifest = self._manifest(base)
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
        from .lora.cache import AdapterSource

        base = self.base(base_name)
        if status is None:
            with contextlib.suppress(ControlPlaneError):
                status = await self._control(base.name, {"op": "status"}, quiet=True)
        manifest = self._manifest(base)
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
            before = self._manifest(base)
            self._write_manifest(base, pinned=[*before.pinned, name], preload=before.preload,
                                 disabled=[d for d in before.disabled if d != name])
            self.store.set_pinned(base.name, name, True, self.clock())
            try:
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
                self._write_manifest(base, pinned=before.pinned, preload=before.preload,
                                     disabled=before.disabled)
                self.store.set_pinned(base.name, name, name in before.pinned, self.clock())
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
            before = self._manifest(base)
            self._write_manifest(base, pinned=[p for p in before.pinned if p != name],
                                 preload=before.preload, disabled=before.disabled)
            if self.store.get(base.name, name) is not None:
                self.store.set_pinned(base.name, name, False, self.clock())
            status = await self._control(base.name, {"op": "sync"})
        return await self.describe(base.name, name, status)

    # ------------------------------------------------------------------ load / unload
    async def load(self, base_name: str, ref: str) -> dict:
        """Into a device slot now; loads the base first if it is not loaded (like a request)."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        self._known(base, name)
        await self.manager.ensure(base.name)
        status = await self._control(base.name, {"op": "load", "adapter": name})
        if status is None:
            raise ModelLoadFailed(f"{base.name} was unloaded before {name!r} could be loaded; retry")
        return await self.describe(base.name, name, status)

    async def unload(self, base_name: str, ref: str) -> dict:
        """Out of device and host memory (the folder stays).  Refused for a pinned adapter."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        self._known(base, name)
        if name in self._manifest(base).pinned:
            raise InvalidInput(f"adapter {name!r} is pinned on {base.name}; unpin it first "
                               f"(mmctl adapter unpin {base.name} {name})")
        status = await self._control(base.name, {"op": "unload", "adapter": name})
        return await self.describe(base.name, name, status)

    # ------------------------------------------------------------------ remove
    async def remove(self, base_name: str, ref: str) -> dict:
        """Delete the adapter's folder and registry row (a cold-store copy is kept).

        While the files go, the adapter is ``disabled`` in the manifest so no request reloads
        it from a half-deleted folder; afterwards requests for it get NOT_FOUND."""
        name, _ = parse_adapter_ref(ref)
        base = self.base(base_name)
        async with self._lock(base.name):
            row = self._known(base, name)
            before = self._manifest(base)
            if name in before.pinned or (row or {}).get("pinned"):
                raise InvalidInput(f"adapter {name!r} is pinned on {base.name}; unpin it first "
                                   f"(mmctl adapter unpin {base.name} {name})")
            self._write_manifest(base, pinned=before.pinned, preload=before.preload,
                                 disabled=[*before.disabled, name])
            with contextlib.suppress(ControlPlaneError):
                await self._control(base.name, {"op": "sync"})
            folder = base.adapter_dir / name
            if folder.exists():
                doomed = base.adapter_dir / f".{name}.removed.{uuid.uuid4().hex[:8]}"
                os.rename(folder, doomed)
                await self._blocking(_remove_tree, doomed)
            self.store.delete(base.name, name)
            self._write_manifest(base, pinned=before.pinned,
                                 preload=[p for p in before.preload if p != name],
                                 disabled=[d for d in before.disabled if d != name])
            with contextlib.suppress(ControlPlaneError):
                await self._control(base.name, {"op": "sync"})
        log.info("removed adapter %s from %s", name, base.name)
        return {"base": base.name, "name": name, "removed": True, "uri": (row or {}).get("uri")}

    # ------------------------------------------------------------------ restarts / loop
    def _restore(self, base: LoraBase, row: dict) -> bool:
        """Download a registered adapter whose folder is gone.  Blocking."""
        store = self.stores.for_uri(row["uri"])
        folder, _ = download_verified(store, row["uri"], row["sha256"], base.adapter_dir, f".{row['name']}")
        _keep_only_peft_files(folder)
        os.replace(folder, base.adapter_dir / f".{row['name']}.tmp")
        self._install(base, row["name"], base.adapter_dir / f".{row['name']}.tmp")
        return True

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
                    await self._blocking(_remove_tree, leftover)
        for row in rows:
            if (base.adapter_dir / row["name"]).is_dir() or not row["uri"] or not row["sha256"]:
                continue
            key = f"{base.name}:{row['name']}"
            try:
                base.adapter_dir.mkdir(parents=True, exist_ok=True)
                await self._blocking(self._restore, base, row)
                report["restored"].append(key)
                log.info("restored adapter %s from %s", key, row["uri"])
            except ControlPlaneError as exc:
                report["failed"][key] = exc.message
                log.error("could not restore adapter %s from %s: %s", key, row["uri"], exc.message)
        try:
            manifest = self._manifest(base)
        except ControlPlaneError as exc:
            report["failed"][base.name] = exc.message
            return
        pinned = {r["name"] for r in rows if r["pinned"]}
        if pinned != set(manifest.pinned):
            self._write_manifest(base, pinned=pinned, preload=manifest.preload,
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

    async def run_forever(self) -> None:
        try:
            await self.recover()
        except Exception:
            log.exception("adapter recovery failed")
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.step()
            except Exception:
                log.exception("adapter refresh failed")

