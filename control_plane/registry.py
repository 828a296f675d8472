"""The model registry: versions, artifacts, metadata and rollout stage, in the state SQLite.

A *logical* model (``cust017``) has numbered versions; each version is deployed to Triton
under a *concrete* name ``<model>.v<version>`` (``cust017.v3``), the folder name in the warm
repository.  Each version records its artifact (URI, folder sha256, bytes), the measured
memory footprint once loaded, the training-data fingerprint, validation metrics, SLA class,
tenant, and its rollout stage:

    registered -> shadow -> canary -> production -> retired   (any order is allowed)

Every stage change is a row in ``registry_history`` with who made it and when.  A logical
model has at most one ``production`` version, the one it serves by default: promoting
another version to production retires the previous one (recorded in the history too).

Stage feeds the cache: ``stage_priority(concrete name)`` is the eviction priority (shadow
before canary before production, see eviction.STAGE_PRIORITY); pins still win over all.

Writes happen on the event-loop thread, like StateStore's.  Tables live in the same SQLite
file as the rest of the control plane's state (``StateStore.db``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .cold_store import inspect, normalize_sha256, publish
from .errors import InvalidInput, ModelNotFound
from .eviction import DEFAULT_PRIORITY, STAGE_PRIORITY
from .names import MAX_NAME_LENGTH, validate_model_name

log = logging.getLogger(__name__)

STAGES = ("registered", "shadow", "canary", "production", "retired")
SLA_CLASSES = ("gold", "silver", "bronze")
DEFAULT_SLA = "silver"
_CONCRETE_RE = re.compile(r"^(?P<model>.+)\.v(?P<version>[0-9]+)$")

SCHEMA = """
CREATE TABLE IF NOT EXISTS registry_versions (
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    artifact_uri TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    memory_bytes INTEGER,
    data_fingerprint TEXT,
    metrics TEXT NOT NULL DEFAULT '{}',
    sla TEXT NOT NULL,
    tenant TEXT,
    stage TEXT NOT NULL,
    created_at REAL NOT NULL,
    created_by TEXT NOT NULL,
    stage_changed_at REAL NOT NULL,
    stage_changed_by TEXT NOT NULL,
    PRIMARY KEY (model, version)
);
CREATE TABLE IF NOT EXISTS registry_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    from_stage TEXT,
    to_stage TEXT NOT NULL,
    who TEXT NOT NULL,
    at REAL NOT NULL,
    note TEXT
);
CREATE INDEX IF NOT EXISTS registry_history_model ON registry_history(model, version);
"""


def concrete_name(model: str, version: int) -> str:
    """The Triton model name of one version: ``cust017.v3``."""
    return validate_model_name(f"{model}.v{int(version)}")


def parse_concrete(name: str) -> tuple[str, int] | None:
    """``cust017.v3`` -> (``cust017``, 3); None for a name without a ``.v<N>`` suffix."""
    m = _CONCRETE_RE.match(name)
    if m is None:
        return None
    return m.group("model"), int(m.group("version"))


@dataclass
class ModelVersion:
    model: str
    version: int
    artifact_uri: str
    sha256: str
    size_bytes: int
    sla: str = DEFAULT_SLA
    stage: str = "registered"
    memory_bytes: int | None = None
    data_fingerprint: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tenant: str | None = None
    created_at: float = 0.0
    created_by: str = ""
    stage_changed_at: float = 0.0
    stage_changed_by: str = ""

    @property
    def name(self) -> str:
        return concrete_name(self.model, self.version)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


@dataclass(frozen=True)
class StageChange:
    model: str
    version: int
    from_stage: str | None
    to_stage: str
    who: str
    at: float
    note: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _validate_who(who: str) -> str:
    if not isinstance(who, str) or not who.strip() or len(who) > 200:
        raise InvalidInput("say who made the change (1-200 characters), e.g. --who alice")
    return who.strip()


def parse_metrics(items: Iterable[str]) -> dict[str, float]:
    """``["auc=0.781", "ndcg=0.4"]`` -> ``{"auc": 0.781, "ndcg": 0.4}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise InvalidInput(f"metric {item!r} must look like name=number, e.g. auc=0.781") from None
    return out


class Registry:
    """Versions and rollout stages in SQLite.  ``clock`` is injectable for tests."""

    def __init__(self, db: sqlite3.Connection, clock: Callable[[], float] = time.time, stores=None):
        self.db = db
        self.clock = clock
        self.stores = stores  # ColdStores, used by the admin API to inspect/publish artifacts
        self.db.executescript(SCHEMA)
        self._listeners: list[Callable[[str, str], None]] = []

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """All-or-nothing (the connection is in autocommit mode, so BEGIN explicitly)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def on_stage_change(self, listener: Callable[[str, str], None]) -> None:
        """``listener(concrete name, new stage)`` after each committed change."""
        self._listeners.append(listener)

    # -- reads --------------------------------------------------------------------------
    _COLUMNS = ("model", "version", "artifact_uri", "sha256", "size_bytes", "memory_bytes",
                "data_fingerprint", "metrics", "sla", "tenant", "stage", "created_at",
                "created_by", "stage_changed_at", "stage_changed_by")

    def _rows(self, where: str = "", args: tuple = ()) -> list[ModelVersion]:
        cur = self.db.execute(
            f"SELECT {', '.join(self._COLUMNS)} FROM registry_versions {where} "
            "ORDER BY model, version", args)
        out = []
        for row in cur:
            d = dict(zip(self._COLUMNS, row))
            d["metrics"] = json.loads(d["metrics"] or "{}")
            out.append(ModelVersion(**d))
        return out

    def versions(self, model: str | None = None) -> list[ModelVersion]:
        if model is None:
            return self._rows()
        return self._rows("WHERE model = ?", (model,))

    def find(self, model: str, version: int) -> ModelVersion | None:
        rows = self._rows("WHERE model = ? AND version = ?", (model, int(version)))
        return rows[0] if rows else None

    def get(self, model: str, version: int) -> ModelVersion:
        mv = self.find(model, version)
        if mv is None:
            known = [v.version for v in self.versions(model)]
            hint = f"known versions: {known}" if known else "register it with `mmctl registry add`"
            raise ModelNotFound(f"{model} version {version} is not in the registry; {hint}")
        return mv

    def by_name(self, name: str) -> ModelVersion | None:
        """The version deployed under a concrete Triton name, or None."""
        parsed = parse_concrete(name)
        return self.find(*parsed) if parsed else None

    def production(self, model: str) -> ModelVersion | None:
        rows = self._rows("WHERE model = ? AND stage = 'production'", (model,))
        return rows[0] if rows else None

    def resolve(self, name: str) -> ModelVersion | None:
        """A concrete name's version, or a logical name's production version."""
        return self.by_name(name) or self.production(name)

    def concrete_names(self, include_retired: bool = False) -> set[str]:
        where = "" if include_retired else "WHERE stage != 'retired'"
        return {concrete_name(m, v) for m, v in self.db.execute(
            f"SELECT model, version FROM registry_versions {where}")}

    def history(self, model: str | None = None, version: int | None = None) -> list[StageChange]:
        sql = "SELECT model, version, from_stage, to_stage, who, at, note FROM registry_history"
        args: tuple = ()
        if model is not None:
            sql += " WHERE model = ?"
            args = (model,)
            if version is not None:
                sql += " AND version = ?"
                args += (int(version),)
        return [StageChange(*row) for row in self.db.execute(sql + " ORDER BY id", args)]

    def stage_priority(self, name: str) -> int:
        """Eviction priority of a concrete name (lower goes first); unknown names: default."""
        mv = self.by_name(name)
        if mv is None:
            return DEFAULT_PRIORITY
        return STAGE_PRIORITY.get(mv.stage, DEFAULT_PRIORITY)

    # -- writes -------------------------------------------------------------------------
    def add(self, model: str, version: int, artifact_uri: str, sha256: str, size_bytes: int, *,
            who: str, sla: str = DEFAULT_SLA, metrics: dict[str, float] | None = None,
            data_fingerprint: str | None = None, tenant: str | None = None,
            stage: str = "registered") -> ModelVersion:
        """Register one version.  Re-adding an existing version is refused (versions are
        immutable: a different artifact is a new version)."""
        validate_model_name(model)
        if parse_concrete(model) is not None:
            raise InvalidInput(
                f"model name {model!r} ends in '.v<N>', which is reserved for versions; "
                "register the logical name and pass --version")
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise InvalidInput(f"version ({version!r}) must be a whole number >= 1") from None
        if version < 1:
            raise InvalidInput(f"version ({version}) must be >= 1")
        name = f"{model}.v{version}"
        if len(name) > MAX_NAME_LENGTH:
            raise InvalidInput(f"{name!r} is longer than {MAX_NAME_LENGTH} characters; use a shorter model name")
        if sla not in SLA_CLASSES:
            raise InvalidInput(f"SLA class {sla!r} is unknown; choose one of {', '.join(SLA_CLASSES)}")
        if stage not in STAGES or stage == "retired":
            raise InvalidInput(f"initial stage {stage!r} must be one of {', '.join(STAGES[:-1])}")
        if not artifact_uri or "://" not in artifact_uri:
            raise InvalidInput(f"artifact URI {artifact_uri!r} must look like s3://bucket/path/ or file:///path/")
        if size_bytes is None or int(size_bytes) < 0:
            raise InvalidInput(f"artifact size ({size_bytes}) must be >= 0 bytes")
        sha256 = normalize_sha256(sha256)
        who = _validate_who(who)
        if self.find(model, version) is not None:
            raise InvalidInput(
                f"{model} version {version} is already registered; versions are immutable, "
                "register the new artifact as a new --version")
        now = self.clock()
        with self._transaction():
            if stage == "production":
                self._retire_production(model, who, now, f"replaced by v{version}")
            self.db.execute(
                "INSERT INTO registry_versions (model, version, artifact_uri, sha256, size_bytes, "
                "memory_bytes, data_fingerprint, metrics, sla, tenant, stage, created_at, created_by, "
                "stage_changed_at, stage_changed_by) VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (model, version, artifact_uri, sha256, int(size_bytes), data_fingerprint,
                 json.dumps(metrics or {}), sla, tenant, stage, now, who, now, who))
            self.db.execute(
                "INSERT INTO registry_history (model, version, from_stage, to_stage, who, at, note) "
                "VALUES (?, ?, NULL, ?, ?, ?, ?)", (model, version, stage, who, now, "registered"))
        log.info("registry: %s v%d added by %s (stage %s, %s)", model, version, who, stage, artifact_uri)
        self._notify(name, stage)
        return self.get(model, version)

    def _retire_production(self, model: str, who: str, now: float, note: str) -> list[str]:
        """Move the current production version (if any) to retired; inside a transaction."""
        retired = []
        for old in self._rows("WHERE model = ? AND stage = 'production'", (model,)):
            self.db.execute(
                "UPDATE registry_versions SET stage = 'retired', stage_changed_at = ?, "
                "stage_changed_by = ? WHERE model = ? AND version = ?", (now, who, model, old.version))
            self.db.execute(
                "INSERT INTO registry_history (model, version, from_stage, to_stage, who, at, note) "
                "VALUES (?, ?, 'production', 'retired', ?, ?, ?)", (model, old.version, who, now, note))
            retired.append(old.name)
        return retired

    def promote(self, model: str, version: int, stage: str, *, who: str,
                note: str | None = None) -> ModelVersion:
        """Move a version to ``stage``, recording who and when.  A no-op if it is there already."""
        if stage not in STAGES:
            raise InvalidInput(f"stage {stage!r} is unknown; choose one of {', '.join(STAGES)}")
        who = _validate_who(who)
        mv = self.get(model, version)
        if mv.stage == stage:
            return mv
        now = self.clock()
        with self._transaction():
            retired = []
            if stage == "production":
                retired = self._retire_production(model, who, now, f"replaced by v{mv.version}")
            self.db.execute(
                "UPDATE registry_versions SET stage = ?, stage_changed_at = ?, stage_changed_by = ? "
                "WHERE model = ? AND version = ?", (stage, now, who, model, mv.version))
            self.db.execute(
                "INSERT INTO registry_history (model, version, from_stage, to_stage, who, at, note) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)", (model, mv.version, mv.stage, stage, who, now, note))
        log.info("registry: %s v%d %s -> %s by %s", model, mv.version, mv.stage, stage, who)
        for name in retired:
            self._notify(name, "retired")
        self._notify(mv.name, stage)
        return self.get(model, mv.version)

    def record_memory(self, name: str, memory_bytes: int) -> None:
        """Store a measured footprint for a concrete name (ignored for unregistered names)."""
        parsed = parse_concrete(name)
        if parsed is None:
            return
        self.db.execute("UPDATE registry_versions SET memory_bytes = ? WHERE model = ? AND version = ?",
                        (int(memory_bytes), parsed[0], parsed[1]))

    def _notify(self, name: str, stage: str) -> None:
        for listener in self._listeners:
            try:
                listener(name, stage)
            except Exception:  # a listener's bug must not undo a committed change
                log.exception("stage-change listener failed for %s", name)


def resident_priority_updater(manager) -> Callable[[str, str], None]:
    """A stage-change listener that re-prioritises a loaded model in its server's planner.

    ``registry.on_stage_change(resident_priority_updater(manager))``: promoting a loaded
    shadow to production stops it being the first to go, without a reload.
    """

    def update(name: str, stage: str) -> None:
        priority = STAGE_PRIORITY.get(stage, DEFAULT_PRIORITY)
        for server in manager.servers.values():
            resident = server.planner.residents.get(name)
            if resident is not None:
                resident.priority = priority

    return update


def apply_stage_priorities(manager, registry: Registry) -> None:
    """Set every loaded model's eviction priority from its stage.

    For models adopted from Triton's index at start, which the manager admits with the
    default priority; call after ``manager.start()``.
    """
    update = resident_priority_updater(manager)
    for server in manager.servers.values():
        for name in list(server.planner.residents):
            mv = registry.by_name(name)
            if mv is not None:
                update(name, mv.stage)


async def register_version(registry: Registry, model: str, version: int, *, who: str,
                           artifact_uri: str | None = None, sha256: str | None = None,
                           source_dir: str | None = None, sla: str = DEFAULT_SLA,
                           metrics: dict[str, float] | None = None,
                           data_fingerprint: str | None = None, tenant: str | None = None,
                           stage: str = "registered") -> ModelVersion:
    """Register a version whose artifact is in the cold store, publishing it first when
    ``source_dir`` is given.  The sha256 recorded is the artifact's (from its manifest, or
    by hashing it); a ``sha256`` given by the caller must match it.

    Store I/O runs in a thread; the registry write happens on the caller's (loop) thread.
    """
    validate_model_name(model)
    stores = registry.stores
    if stores is None:
        raise InvalidInput("no cold store is configured; the registry cannot reach artifacts")
    if registry.find(model, int(version)) is not None:
        raise InvalidInput(f"{model} version {version} is already registered; versions are "
                           "immutable, register the new artifact as a new --version")
    uri = artifact_uri or stores.default_uri(model, int(version))
    store = stores.for_uri(uri)
    if source_dir is not None:
        folder = Path(source_dir)
        if not folder.is_absolute() or not (folder / "config.pbtxt").is_file():
            raise InvalidInput(f"--from-dir {source_dir!r} must be an absolute path to a model "
                               "folder with config.pbtxt")
        info = await asyncio.to_thread(publish, store, folder, uri)
    else:
        info = await asyncio.to_thread(inspect, store, uri)
    if sha256 is not None and normalize_sha256(sha256) != info.sha256:
        raise InvalidInput(f"the artifact at {info.uri} has sha256 {info.sha256}, not the "
                           f"{normalize_sha256(sha256)} you gave; check the upload")
    return registry.add(model, int(version), info.uri, info.sha256, info.size_bytes, who=who,
                        sla=sla, metrics=metrics, data_fingerprint=data_fingerprint,
                        tenant=tenant, stage=stage)
