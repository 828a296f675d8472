"""The adapter manifest: the control plane's desired adapter state, read by the model.

``<adapter_dir>/manifest.json``::

    {"generation": 7,                 # bumped by every write; echoed in the model's status
     "pinned":   ["acme"],            # kept in a device slot, never evicted
     "preload":  ["globex"],          # loaded into a device slot when the manifest changes
     "disabled": ["initech"],         # evicted; requests for it get NOT_FOUND
     "residency": "control_plane"}    # who decides which adapters hold the device slots

The control plane is the only writer (``write_manifest``: temp file + rename, so a reader
never sees half a file).  Every model instance re-reads it when it changes
(``ManifestWatcher``), at load, and on an ``ADAPTER_CONTROL {"op": "sync"}`` request, so the
state survives model reloads and reaches every instance, which per-request control alone
would not.

``residency``: ``"model"`` (the default, a model served by Triton alone) loads adapters on
demand from the directory and evicts the least recently used; ``"control_plane"`` (written by
the control plane, which decides with its model manager's policy) puts an adapter into a
device slot only when told (``load``, with the adapters to ``evict``), never evicts one on its
own, and answers a request for an adapter not in a slot NOT_FOUND, as Triton answers a model
that is not loaded (the router loads it and sends the request again).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InvalidRequest, LoraError
from .names import validate_adapter_name

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
RESIDENCY_MODEL = "model"
RESIDENCY_CONTROL_PLANE = "control_plane"
RESIDENCIES = (RESIDENCY_MODEL, RESIDENCY_CONTROL_PLANE)


@dataclass(frozen=True)
class Manifest:
    generation: int = 0
    pinned: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    disabled: tuple[str, ...] = field(default_factory=tuple)
    residency: str = RESIDENCY_MODEL

    @classmethod
    def from_dict(cls, raw: object) -> Manifest:
        if not isinstance(raw, dict):
            raise InvalidRequest(f"{MANIFEST_FILE} must hold a JSON object, got {type(raw).__name__}")
        unknown = set(raw) - {"generation", "pinned", "preload", "disabled", "residency"}
        if unknown:
            raise InvalidRequest(f"{MANIFEST_FILE} has unknown fields {sorted(unknown)}")
        generation = raw.get("generation", 0)
        if isinstance(generation, bool) or not isinstance(generation, int):
            raise InvalidRequest(f"'generation' must be an integer, got {generation!r}")
        lists = {}
        for key in ("pinned", "preload", "disabled"):
            value = raw.get(key, [])
            if not isinstance(value, list):
                raise InvalidRequest(f"{key!r} must be a list of adapter names, got {value!r}")
            lists[key] = tuple(validate_adapter_name(v) for v in value)
        both = set(lists["pinned"]) & set(lists["disabled"])
        if both:
            raise InvalidRequest(f"adapters {sorted(both)} are both pinned and disabled")
        residency = raw.get("residency", RESIDENCY_MODEL)
        if residency not in RESIDENCIES:
            raise InvalidRequest(f"'residency' must be one of {list(RESIDENCIES)}, got {residency!r}")
        return cls(generation=generation, residency=residency, **lists)

    def to_dict(self) -> dict:
        return {
            "generation": self.generation,
            "pinned": list(self.pinned),
            "preload": list(self.preload),
            "disabled": list(self.disabled),
            "residency": self.residency,
        }


def read_manifest(adapter_dir: Path | str) -> Manifest:
    """The manifest in ``adapter_dir``; an empty one when there is none.  Raises
    InvalidRequest for a malformed file (the caller keeps its previous state)."""
    path = Path(adapter_dir) / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Manifest()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{path} is not valid JSON: {exc}") from None
    return Manifest.from_dict(raw)


def write_manifest(adapter_dir: Path | str, manifest: Manifest) -> Path:
    adapter_dir = Path(adapter_dir)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    path = adapter_dir / MANIFEST_FILE
    tmp = adapter_dir / f".{MANIFEST_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


class ManifestWatcher:
    """Re-reads the manifest when its file changes and hands it to ``apply``.

    ``step()`` does one check (tests call it directly); ``start()`` runs it every
    ``interval_s`` on a daemon thread.  A malformed manifest is reported through
    ``on_error`` and skipped: the model keeps the last good state.
    """

    def __init__(
        self,
        adapter_dir: Path | str,
        apply: Callable[[Manifest], Any],
        on_error: Callable[[LoraError | None], None] = lambda err: None,
        interval_s: float = 0.5,
    ):
        self.path = Path(adapter_dir) / MANIFEST_FILE
        self.adapter_dir = Path(adapter_dir)
        self.apply = apply
        self.on_error = on_error
        self.interval_s = interval_s
        self._seen: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_lock = threading.Lock()  # the poll thread and a "sync" request may race

    def _signature(self) -> tuple:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return ("missing",)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def step(self, force: bool = False) -> bool:
        """Apply the manifest if it changed since the last step (or ``force``)."""
        with self._step_lock:
            signature = self._signature()
            if signature == self._seen and not force:
                return False
            self._seen = signature
            try:
                manifest = read_manifest(self.adapter_dir)
            except LoraError as exc:
                log.error("ignoring manifest: %s", exc.message)
                self.on_error(exc)
                return False
            self.on_error(None)
            self.apply(manifest)
            return True

    def sync(self) -> Any:
        """Read and apply the manifest now; return what ``apply`` returned.  Raises the
        LoraError of a malformed manifest (after reporting it through ``on_error``)."""
        with self._step_lock:
            self._seen = self._signature()
            try:
                manifest = read_manifest(self.adapter_dir)
            except LoraError as exc:
                self.on_error(exc)
                raise
            self.on_error(None)
            return self.apply(manifest)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lora-manifest", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # a bad pass is logged; the next one retries
                log.exception("manifest watcher step failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
