"""``Registry``: versions and rollout stages in the control plane's state store (its tables
are created by ``control_plane.state.migrations``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable

from control_plane.eviction import DEFAULT_PRIORITY, STAGE_PRIORITY
from control_plane.registry.versions import (
    DEFAULT_SLA,
    SLA_CLASSES,
    STAGES,
    ModelVersion,
    StageChange,
    _validate_who,
    parse_concrete,
)
from control_plane.state import Database, as_database, migrate
from control_plane.tiers.cold import normalize_sha256
from domain.errors import InvalidInput, ModelNotFound
from domain.names import MAX_NAME_LENGTH, validate_model_name

log = logging.getLogger(__name__)

# Concrete names whose versions ``by_name`` keeps in memory (each miss asks several times:
# its warm tier's check, its eviction priority, its placement facts).
MAX_REMEMBERED_NAMES = 10_000


class Registry:
    """Versions and rollout stages in the state store.  ``clock`` is injectable for tests."""

    def __init__(self, db: Database | sqlite3.Connection, clock: Callable[[], float] = time.time,
                 stores=None):
        self.db = as_database(db)
        migrate(self.db)  # a no-op where the state store already migrated it
        self.clock = clock
        self.stores = stores  # ColdStores, used by the admin API to inspect/publish artifacts
        self._listeners: list[Callable[[str, str], None]] = []
        # The event loop the listeners belong to (they change what it serves from): a
        # change written in the state store's thread (Database.off_loop) is announced there.
        self._listeners_loop: asyncio.AbstractEventLoop | None = None
        # ``by_name`` answers from memory: every write goes through this object (one active
        # control plane writes the store, see runtime.leadership), and each write forgets
        # them all.  ``_generation`` counts the writes, so that an answer read from the
        # database while a write ran (in the state store's thread) is not remembered.
        self._named: dict[str, ModelVersion | None] = {}
        self._generation = 0
        self._named_lock = threading.Lock()
        # Registrations under way (model, version) -> artifact URI: their files are being
        # published, their row not written yet (``registering``).
        self._registering: dict[tuple[str, int], str] = {}

    @contextlib.contextmanager
    def _transaction(self):
        """All-or-nothing (and, on a leader, fenced)."""
        self._forget_names()
        try:
            with self.db.transaction():
                yield
        finally:
            self._forget_names()

    def _forget_names(self) -> None:
        with self._named_lock:
            self._generation += 1
            self._named = {}

    def on_stage_change(self, listener: Callable[[str, str], None]) -> None:
        """``listener(concrete name, new stage)`` after each committed change, on the event
        loop it was added from (if any)."""
        self._listeners.append(listener)
        with contextlib.suppress(RuntimeError):  # added outside a loop: called where it happens
            self._listeners_loop = asyncio.get_running_loop()

    # -- reads --------------------------------------------------------------------------
    _COLUMNS = ("model", "version", "artifact_uri", "sha256", "size_bytes", "memory_bytes",
                "data_fingerprint", "metrics", "sla", "tenant", "stage", "created_at",
                "created_by", "stage_changed_at", "stage_changed_by", "triton_name",
                "synthetic_warmup", "family")

    def _rows(self, where: str = "", args: tuple = ()) -> list[ModelVersion]:
        cur = self.db.execute(
            f"SELECT {', '.join(self._COLUMNS)} FROM registry_versions {where} "
            "ORDER BY model, version", args)
        out = []
        for row in cur:
            d = dict(zip(self._COLUMNS, row))
            d["metrics"] = json.loads(d["metrics"] or "{}")
            d["synthetic_warmup"] = bool(d["synthetic_warmup"])
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
        named = self._named
        if name in named:
            return named[name]
        generation = self._generation
        rows = self._rows("WHERE triton_name = ?", (name,))
        found = rows[0] if rows else None
        with self._named_lock:
            if generation == self._generation:
                if len(self._named) >= MAX_REMEMBERED_NAMES:
                    self._named = {}
                self._named[name] = found
        return found

    def production(self, model: str) -> ModelVersion | None:
        rows = self._rows("WHERE model = ? AND stage = 'production'", (model,))
        return rows[0] if rows else None

    def resolve(self, name: str) -> ModelVersion | None:
        """A logical name's production version, else the version of a concrete name.

        Logical first, as the router does: once ``cust017`` v2 is production, ``cust017``
        means v2 even though v1's folder is also called ``cust017``."""
        return self.production(name) or self.by_name(name)

    def resolve_name(self, name: str) -> str:
        """The concrete name to load/pin/unload for what a person typed.

        ``simple`` -> ``simple.v1`` (its production version); a concrete name or a name the
        registry does not know is returned as it is (the manager decides whether Triton's
        repository has it).  A logical model without a production version is refused with
        the versions it has."""
        mv = self.resolve(name)
        if mv is not None:
            return mv.name
        versions = self.versions(name)
        if versions:
            listed = ", ".join(f"{v.name} ({v.stage})" for v in versions)
            raise ModelNotFound(
                f"{name} has no production version, so its logical name serves nothing; name a "
                f"version ({listed}) or promote one: mmctl registry promote {name} "
                f"--version {versions[-1].version} --stage production")
        return name

    def next_version(self, model: str) -> int:
        """The next free version number of ``model`` (1 for a new model), past any being
        registered now."""
        row = self.db.execute("SELECT MAX(version) FROM registry_versions WHERE model = ?",
                              (model,)).fetchone()
        under_way = [v for m, v in self._registering if m == model]
        return max([row[0] or 0, *under_way]) + 1

    def artifact_user(self, uri: str) -> ModelVersion | None:
        """A registered version whose artifact is at ``uri``, in a folder above it or under
        it: publishing there would change that version's files."""
        for version in self._rows():
            if _overlap(version.artifact_uri, uri):
                return version
        return None

    @contextlib.contextmanager
    def registering(self, model: str, version: int, uri: str):
        """Hold ``model`` ``version`` and its artifact URI while its files are published and
        its row written: a second registration of the same version, or one publishing into
        the same place, is refused meanwhile instead of writing over its files.  Taken on
        the event loop, before the first await."""
        for (other, number), other_uri in self._registering.items():
            if (other, number) == (model, version) or _overlap(other_uri, uri):
                raise InvalidInput(
                    f"{other} version {number} is being registered now, at {other_uri}; wait "
                    "until it is (mmctl registry list) and register this one as another version "
                    "or at another URI")
        self._registering[(model, version)] = uri
        try:
            yield
        finally:
            del self._registering[(model, version)]

    def concrete_names(self, include_retired: bool = False) -> set[str]:
        where = "" if include_retired else "WHERE stage != 'retired'"
        return {name for (name,) in self.db.execute(
            f"SELECT triton_name FROM registry_versions {where}")}

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
            stage: str = "registered", triton_name: str | None = None,
            synthetic_warmup: bool = True, family: str | None = None) -> ModelVersion:
        """Register one version.  Re-adding an existing version is refused (versions are
        immutable: a different artifact is a new version).  ``triton_name`` is the
        concrete name when it is not ``<model>.v<version>`` (a repository folder's name)."""
        version, name = self.check_new(model, version, sla=sla, stage=stage,
                                       triton_name=triton_name)
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
        self._check_names_free(model, name)
        now = self.clock()
        with self._transaction():
            if stage == "production":
                self._retire_production(model, who, now, f"replaced by v{version}")
            self.db.execute(
                "INSERT INTO registry_versions (model, version, artifact_uri, sha256, size_bytes, "
                "memory_bytes, data_fingerprint, metrics, sla, tenant, stage, created_at, created_by, "
                "stage_changed_at, stage_changed_by, triton_name, synthetic_warmup, family) "
                "VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (model, version, artifact_uri, sha256, int(size_bytes), data_fingerprint,
                 json.dumps(metrics or {}), sla, tenant, stage, now, who, now, who, name,
                 int(bool(synthetic_warmup)), family))
            self.db.execute(
                "INSERT INTO registry_history (model, version, from_stage, to_stage, who, at, note) "
                "VALUES (?, ?, NULL, ?, ?, ?, ?)", (model, version, stage, who, now, "registered"))
        log.info("registry: %s v%d added by %s (stage %s, %s)", model, version, who, stage, artifact_uri)
        self._notify(name, stage)
        return self.get(model, version)

    def check_new(self, model: str, version, *, sla: str = DEFAULT_SLA, stage: str = "registered",
                  triton_name: str | None = None) -> tuple[int, str]:
        """The checks of a new version that need no artifact: (its number, its concrete
        name), or InvalidInput saying what is wrong.  Made before anything is uploaded, so
        that a refused version leaves no files in the store."""
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
        name = triton_name or f"{model}.v{version}"
        if len(name) > MAX_NAME_LENGTH:
            raise InvalidInput(f"{name!r} is longer than {MAX_NAME_LENGTH} characters; use a shorter model name")
        validate_model_name(name)
        if sla not in SLA_CLASSES:
            raise InvalidInput(f"SLA class {sla!r} is unknown; choose one of {', '.join(SLA_CLASSES)}")
        if stage not in STAGES or stage == "retired":
            raise InvalidInput(f"initial stage {stage!r} must be one of {', '.join(STAGES[:-1])}")
        return version, name

    def _check_names_free(self, model: str, name: str) -> None:
        """One name, one meaning: a concrete name is used by one version, and a logical name
        is never another model's concrete name (``cust017-v2`` is cust017's version 2, so it
        cannot also be a model of its own)."""
        owner = self.by_name(name)
        if owner is not None:
            raise InvalidInput(
                f"{name} is already the name of {owner.model} version {owner.version}; "
                "choose another name or version")
        owner = self.by_name(model)
        if owner is not None and owner.model != model:
            raise InvalidInput(
                f"{model} is already the name of {owner.model} version {owner.version}; add a "
                f"new version of it with `mmctl registry add {owner.model}` or choose another name")
        if name != model and self.versions(name):
            raise InvalidInput(
                f"{name} is already a model of its own in the registry; choose another name")

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

    def warmup_enabled(self, name: str) -> bool:
        """Whether the control plane may send ``name`` (a concrete name) a synthetic warm-up
        after a load; models the registry does not know get one."""
        mv = self.by_name(name)
        return mv is None or mv.synthetic_warmup

    def set_synthetic_warmup(self, model: str, version: int, enabled: bool) -> ModelVersion:
        mv = self.get(model, version)
        with self._transaction():
            self.db.execute("UPDATE registry_versions SET synthetic_warmup = ? WHERE model = ? "
                            "AND version = ?", (int(bool(enabled)), model, int(version)))
        log.info("registry: %s v%d synthetic warm-up %s", model, int(version), "on" if enabled else "off")
        return self.get(mv.model, mv.version)

    def record_memory(self, name: str, memory_bytes: int) -> None:
        """Store a measured footprint for a concrete name (ignored for unregistered names)."""
        with self._transaction():
            self.db.execute("UPDATE registry_versions SET memory_bytes = ? WHERE triton_name = ?",
                            (int(memory_bytes), name))

    def _notify(self, name: str, stage: str) -> None:
        loop = self._listeners_loop
        if loop is not None and loop.is_running() and not _in_a_loop():
            # Written in another thread (the state store's).  Queued before the write's own
            # result: the loop runs the listeners before the caller that awaits the write
            # goes on, so its answer sees the change served.
            loop.call_soon_threadsafe(self._call_listeners, name, stage)
            return
        self._call_listeners(name, stage)

    def _call_listeners(self, name: str, stage: str) -> None:
        for listener in self._listeners:
            try:
                listener(name, stage)
            except Exception:  # a listener's bug must not undo a committed change
                log.exception("stage-change listener failed for %s", name)


def _overlap(first: str, second: str) -> bool:
    """Whether two artifact URIs are one folder, or one is inside the other."""
    first, second = first.rstrip("/") + "/", second.rstrip("/") + "/"
    return first.startswith(second) or second.startswith(first)


def _in_a_loop() -> bool:
    """Whether this thread runs an event loop (else it is a worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
