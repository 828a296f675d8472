"""The model registry: versions, artifacts, metadata and rollout stage, in the state SQLite.

A *logical* model (``cust017``) has numbered versions; each version is deployed to Triton
under a *concrete* name, the folder name in Triton's repository: ``<model>.v<version>``
(``cust017.v3``) unless the version was registered with its own (the demo fleet's folders
``cust017`` and ``cust017-v2`` are versions 1 and 2 of ``cust017``).  Clients and ``mmctl``
may use either name: a logical name means its production version (``resolve_name``).

A version's artifact lives in a cold store (``s3://``, ``file://``) and is staged into the
warm tier on demand, or it *is* a folder of Triton's repository (``repository://<folder>/``:
the demo fleet and the models found in a user's ``--repository``, registered at start by
``register_repository``), served as it is and never evicted from warm.  Each version records its artifact (URI, folder sha256, bytes), the measured
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

from . import model_config
from .cold_store import inspect, normalize_sha256, publish
from .errors import ControlPlaneError, InvalidInput, ModelNotFound
from .eviction import DEFAULT_PRIORITY, STAGE_PRIORITY
from .names import MAX_NAME_LENGTH, validate_model_name

log = logging.getLogger(__name__)

STAGES = ("registered", "shadow", "canary", "production", "retired")
SLA_CLASSES = ("gold", "silver", "bronze")
DEFAULT_SLA = "silver"
_CONCRETE_RE = re.compile(r"^(?P<model>.+)\.v(?P<version>[0-9]+)$")
# Artifacts that are folders of Triton's repository itself (no cold copy).
REPOSITORY_SCHEME = "repository"
# warm_tier.WARM_MANIFEST (that module imports this one): marks a folder the warm tier staged.
_WARM_MANIFEST = ".mms-warm.json"

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
    triton_name TEXT,
    synthetic_warmup INTEGER NOT NULL DEFAULT 1,
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
# State files written before versions had their own Triton name get the default one.
MIGRATIONS = """
UPDATE registry_versions SET triton_name = model || '.v' || version WHERE triton_name IS NULL;
CREATE UNIQUE INDEX IF NOT EXISTS registry_triton_name ON registry_versions(triton_name);
"""


def concrete_name(model: str, version: int) -> str:
    """The Triton model name of one version: ``cust017.v3``."""
    return validate_model_name(f"{model}.v{int(version)}")


def repository_uri(folder: str) -> str:
    """The artifact URI of a version that is the repository folder ``folder`` itself."""
    return f"{REPOSITORY_SCHEME}://{validate_model_name(folder)}/"


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
    triton_name: str | None = None  # None: the default <model>.v<version>
    # False: the control plane sends no synthetic warm-up request after a load (a model
    # whose own inputs reject zeros); Triton still runs the config's model_warmup.
    synthetic_warmup: bool = True

    @property
    def name(self) -> str:
        """The concrete name: Triton's model name and the folder in its repository."""
        return self.triton_name or concrete_name(self.model, self.version)

    @property
    def in_repository(self) -> bool:
        """True when the artifact is a folder of Triton's repository (no cold copy)."""
        return self.artifact_uri.startswith(REPOSITORY_SCHEME + "://")

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
        self._migrate()
        self._listeners: list[Callable[[str, str], None]] = []

    def _migrate(self) -> None:
        """Bring a state file from an older release up to this schema (idempotent)."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(registry_versions)")}
        with self._transaction():
            if "triton_name" not in columns:
                self.db.execute("ALTER TABLE registry_versions ADD COLUMN triton_name TEXT")
            if "synthetic_warmup" not in columns:
                self.db.execute("ALTER TABLE registry_versions "
                                "ADD COLUMN synthetic_warmup INTEGER NOT NULL DEFAULT 1")
            for statement in MIGRATIONS.strip().split(";\n"):
                self.db.execute(statement)

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
                "created_by", "stage_changed_at", "stage_changed_by", "triton_name",
                "synthetic_warmup")

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
        rows = self._rows("WHERE triton_name = ?", (name,))
        return rows[0] if rows else None

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
        """The next free version number of ``model`` (1 for a new model)."""
        row = self.db.execute("SELECT MAX(version) FROM registry_versions WHERE model = ?",
                              (model,)).fetchone()
        return (row[0] or 0) + 1

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
            synthetic_warmup: bool = True) -> ModelVersion:
        """Register one version.  Re-adding an existing version is refused (versions are
        immutable: a different artifact is a new version).  ``triton_name`` is the
        concrete name when it is not ``<model>.v<version>`` (a repository folder's name)."""
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
                "stage_changed_at, stage_changed_by, triton_name, synthetic_warmup) "
                "VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (model, version, artifact_uri, sha256, int(size_bytes), data_fingerprint,
                 json.dumps(metrics or {}), sla, tenant, stage, now, who, now, who, name,
                 int(bool(synthetic_warmup))))
            self.db.execute(
                "INSERT INTO registry_history (model, version, from_stage, to_stage, who, at, note) "
                "VALUES (?, ?, NULL, ?, ?, ?, ?)", (model, version, stage, who, now, "registered"))
        log.info("registry: %s v%d added by %s (stage %s, %s)", model, version, who, stage, artifact_uri)
        self._notify(name, stage)
        return self.get(model, version)

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
        row = self.db.execute("SELECT synthetic_warmup FROM registry_versions WHERE triton_name = ?",
                              (name,)).fetchone()
        return row is None or bool(row[0])

    def set_synthetic_warmup(self, model: str, version: int, enabled: bool) -> ModelVersion:
        mv = self.get(model, version)
        self.db.execute("UPDATE registry_versions SET synthetic_warmup = ? WHERE model = ? AND version = ?",
                        (int(bool(enabled)), model, int(version)))
        log.info("registry: %s v%d synthetic warm-up %s", model, int(version), "on" if enabled else "off")
        return self.get(mv.model, mv.version)

    def record_memory(self, name: str, memory_bytes: int) -> None:
        """Store a measured footprint for a concrete name (ignored for unregistered names)."""
        self.db.execute("UPDATE registry_versions SET memory_bytes = ? WHERE triton_name = ?",
                        (int(memory_bytes), name))

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


async def register_version(registry: Registry, model: str, version: int | None = None, *,
                           who: str, artifact_uri: str | None = None, sha256: str | None = None,
                           source_dir: str | None = None, sla: str = DEFAULT_SLA,
                           metrics: dict[str, float] | None = None,
                           data_fingerprint: str | None = None, tenant: str | None = None,
                           stage: str | None = None,
                           synthetic_warmup: bool = True) -> ModelVersion:
    """Register a version whose artifact is in the cold store, publishing it first when
    ``source_dir`` is given.  The sha256 recorded is the artifact's (from its manifest, or
    by hashing it); a ``sha256`` given by the caller must match it.

    ``version`` None: the next free one.  ``stage`` None: ``production`` when the model has
    no production version yet (so its logical name serves it at once), else ``registered``.

    Store I/O runs in a thread; the registry write happens on the caller's (loop) thread.
    """
    validate_model_name(model)
    stores = registry.stores
    if stores is None:
        raise InvalidInput("no cold store is configured; the registry cannot reach artifacts")
    if version is None:
        version = registry.next_version(model)
    if registry.find(model, int(version)) is not None:
        raise InvalidInput(f"{model} version {version} is already registered; versions are "
                           "immutable, register the new artifact as a new --version "
                           f"(or leave --version out: the next free one is {registry.next_version(model)})")
    if stage is None:
        stage = "registered" if registry.production(model) is not None else "production"
    # Cheap checks before any upload: a refused name must not leave files in the store.
    registry._check_names_free(model, concrete_name(model, int(version)))
    uri = artifact_uri or stores.default_uri(model, int(version))
    store = stores.for_uri(uri)
    if source_dir is not None:
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
    return registry.add(model, int(version), info.uri, info.sha256, info.size_bytes, who=who,
                        sla=sla, metrics=metrics, data_fingerprint=data_fingerprint,
                        tenant=tenant, stage=stage, synthetic_warmup=synthetic_warmup)


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


def collect_repository(registry: Registry, repository: Path,
                       versions: dict[str, tuple[str, int]] | None = None) -> list[FoundFolder]:
    """The unregistered model folders of ``repository`` with their sha256 (blocking: reads
    every new file once).  Reads the registry only, so it may run in a thread."""
    from .cold_store import folder_manifest, manifest_digest

    versions = versions or {}
    known = registry.concrete_names(include_retired=True)
    started = time.monotonic()
    found = []
    for child in sorted(repository.iterdir()) if repository.is_dir() else []:
        name = child.name
        if name in known or name.startswith(".") or not child.is_dir():
            continue
        if not (child / "config.pbtxt").is_file() or (child / _WARM_MANIFEST).exists():
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
                                 sum(e.size_bytes for e in entries)))
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
                stage=stage, triton_name=f.folder))
        except ControlPlaneError as exc:
            log.warning("not registering repository folder %s as %s version %d: %s",
                        f.folder, f.model, version, exc.message)
    if added:
        log.info("registered %d model folders of the repository (%d bytes): %s", len(added),
                 sum(mv.size_bytes for mv in added), ", ".join(mv.name for mv in added))
    return added
