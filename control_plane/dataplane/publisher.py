"""What the router workers serve from, as versioned sections of keys, and the changes
between versions.

The data-plane hub (``control_plane.admin.dataplane``) sets keys where things change (a
model's placement, a route, a server's address); each batch of changes is one version.  A
worker that has version ``v`` of this epoch gets only the changes made since ``v``; one that
is new, of another epoch, or further behind than the log reaches gets the whole state.  So
the bytes and the work of one change do not depend on how many models there are.

Wire format (JSON):

* whole state: ``{"version", "epoch", "sections": {section: {key: value}}}``
* changes: ``{"version", "epoch", "changes": [[section, key, value or null], ...]}``, in the
  order they were made; null removes the key.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable
from typing import Any

# placement: model -> server holding it READY; carriers: family variant -> its family's
# Triton model; routes: name -> Route (asdict); limits: name -> {qps, burst}; production:
# model -> concrete name of its production version; versions: model -> {number: concrete};
# public: concrete -> [model, number]; models: registry model -> true; servers: name ->
# [grpc_url, http_url, up]; meta: repository, workers, expose_concrete.
SECTIONS = ("placement", "carriers", "routes", "limits", "production", "versions", "public",
            "models", "servers", "meta")
LOG_CHANGES = 20_000  # changes kept for workers that are behind; older: the whole state
_ABSENT = object()

Change = tuple[str, str, Any]  # (section, key, value); None: the key is removed


class PublishedState:
    def __init__(self, epoch: str, log_changes: int = LOG_CHANGES):
        self.epoch = epoch
        self.sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        self.version = 0
        self.log_changes = log_changes
        # (version, its changes, when it was published: time.monotonic())
        self._log: collections.deque[tuple[int, list[list], float]] = collections.deque()
        self._logged = 0  # changes in _log
        self._whole: tuple[int, bytes] = (-1, b"")

    def apply(self, changes: Iterable[Change]) -> bool:
        """Set the keys that differ; one new version when any did."""
        applied = []
        for section, key, value in changes:
            keys = self.sections[section]
            if value is None:
                if key in keys:
                    del keys[key]
                    applied.append([section, key, None])
            elif keys.get(key, _ABSENT) != value:
                keys[key] = value
                applied.append([section, key, value])
        if not applied:
            return False
        self.version += 1
        self._log.append((self.version, applied, time.monotonic()))
        self._logged += len(applied)
        while self._logged > self.log_changes and len(self._log) > 1:
            self._logged -= len(self._log.popleft()[1])
        return True

    def diff(self, section: str, current: dict[str, Any]) -> list[Change]:
        """The changes that make ``section`` equal ``current`` (a whole section recomputed:
        for the sections that change rarely, such as the registry's names)."""
        keys = self.sections[section]
        changes: list[Change] = [(section, k, v) for k, v in current.items() if keys.get(k, _ABSENT) != v]
        changes += [(section, k, None) for k in keys if k not in current]
        return changes

    def changes_since(self, version: int) -> list[list] | None:
        """The changes made after ``version``, oldest first, or None when the log no longer
        reaches back that far."""
        if version >= self.version:
            return []
        if not self._log or self._log[0][0] > version + 1:
            return None
        batches = []
        for v, changes, _at in reversed(self._log):
            if v <= version:
                break
            batches.append(changes)
        return [change for batch in reversed(batches) for change in batch]

    def age_of(self, version: int) -> float | None:
        """Seconds since ``version`` was published; None when the log no longer has it.
        Recent versions are at the end of the log: what workers acknowledge is found at once."""
        for v, _changes, at in reversed(self._log):
            if v == version:
                return time.monotonic() - at
            if v < version:
                return None
        return None

    def answer(self, since: int, epoch: str) -> bytes:
        """What a worker at version ``since`` of ``epoch`` needs: changes, or the whole state."""
        if epoch == self.epoch:
            changes = self.changes_since(since)
            if changes is not None:
                return json.dumps({"version": self.version, "epoch": self.epoch, "changes": changes},
                                  separators=(",", ":")).encode()
        return self.whole()

    def whole(self) -> bytes:
        """The whole state, encoded once per version (new workers after a change share it)."""
        version, encoded = self._whole
        if version != self.version:
            encoded = json.dumps({"version": self.version, "epoch": self.epoch,
                                  "sections": self.sections}, separators=(",", ":")).encode()
            self._whole = (self.version, encoded)
        return encoded
