"""What the router workers serve from, as versioned sections of keys, and the changes
between versions: ``Publisher`` finds what changed (a model's placement, a route, a
server's address) and sets those keys in a ``PublishedState``; each batch of changes is
one version.  A
worker that has version ``v`` of this epoch gets only the changes made since ``v``; one that
is new, of another epoch, or further behind than the log reaches gets the whole state.  So
the bytes and the work of one change do not depend on how many models there are.

Wire format (JSON):

* whole state: ``{"version", "epoch", "sections": {section: {key: value}}}``
* changes: ``{"version", "epoch", "changes": [[section, key, value or null], ...]}``, in the
  order they were made; null removes the key.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

log = logging.getLogger(__name__)

# placement: model -> server holding it READY; carriers: family variant -> its family's
# Triton model; routes: name -> Route (asdict); limits: name -> {qps, burst}; production:
# model -> concrete name of its production version; versions: model -> {number: concrete};
# public: concrete -> [model, number]; models: registry model -> true; servers: name ->
# [grpc_url, http_url, up]; meta: repository, workers, expose_concrete; miss_ms: model ->
# milliseconds its last load took (what a miss of it costs); copies: model -> the servers of
# its READY extra copies (mmctl scale), beside its placement (a worker that does not know the
# section serves from placement alone); concurrency: server -> requests it takes at once from
# the router (set ones only); shares: concrete model -> its fair-share weight (not 1 only).
SECTIONS = ("placement", "carriers", "routes", "limits", "production", "versions", "public",
            "models", "servers", "meta", "miss_ms", "copies", "concurrency", "shares")
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


class Publisher:
    """Finds what changed since the last publish where it is cheap (the models whose state
    changed, the few servers, the tables whose generation moved) and publishes it as one
    version; ``on_version()`` after each new one (the hub wakes the long-polls).  Nothing
    here walks every model unless the registry or the families changed."""

    def __init__(self, epoch: str, manager, rollouts, families=None,
                 workers: Callable[[], int] = lambda: 0,
                 on_version: Callable[[], None] = lambda: None):
        """``manager``: where models are (None: no models, as in tests of the canaries);
        ``rollouts``: the route table and the registry's public names
        (``control_plane.rollouts.owner.Rollouts``); ``families``: variants re-addressed to
        their family's model; ``workers()``: how many workers the others should expect."""
        self.manager = manager
        self.rollouts = rollouts
        self.families = families
        self.workers = workers
        self.on_version = on_version
        self.published = PublishedState(epoch)
        self._generation = {"table": -1, "names": -1, "families": -1, "shares": (-1, -1)}
        self._routes_judged = False  # a canary pass may have changed a route's stage
        self._moved: set[str] = set()  # models whose state changed since the last publish
        self._publish_soon = False
        self.failed: Callable[[], None] = lambda: None  # a publish outside the loop failed
        if manager is not None:
            self._moved.update(manager.records)
            manager.on_state_change(self.model_moved)

    def routes_judged(self) -> None:
        """The canaries were judged: publish the route table at once (a rollback must reach
        the workers before anyone reads the verdict, not with the next publish pass)."""
        self._routes_judged = True
        self._publish_after_this_turn()

    def model_moved(self, name: str) -> None:
        """A model's state changed: publish where it is READY now, once the change that
        moved it is complete (the same event-loop turn may set its server too)."""
        self._moved.add(name)
        self._publish_after_this_turn()

    def _publish_after_this_turn(self) -> None:
        if not self._publish_soon:
            self._publish_soon = True
            asyncio.get_running_loop().call_soon(self._publish_moved)

    def _publish_moved(self) -> None:
        self._publish_soon = False
        try:
            self.publish()
        except Exception:  # counted like a failed pass of the publish loop; the next pass retries
            log.exception("publishing a model's placement failed")
            self.failed()

    def publish(self) -> int:
        """Publish what changed since the last publish; a new version when anything did."""
        if self.published.apply(self._changes()):
            self.on_version()
        return self.published.version

    def _changes(self) -> list[Change]:
        manager, published = self.manager, self.published
        moved, self._moved = self._moved, set()
        changes: list[Change] = []
        if manager is not None:
            for name in moved:
                server = manager.ready_server_of(name)
                changes.append(("placement", name, None if server is None else server.name))
                extra = manager.copy_servers_of(name)[1:]
                changes.append(("copies", name, extra or None))
                # What a miss of it takes (its last load): a request whose deadline is
                # shorter is refused at once by the router instead of timing out.
                rec = manager.records.get(name)
                load_s = None if rec is None else rec.load_time_s
                changes.append(("miss_ms", name, None if not load_s else round(load_s * 1000, 1)))
            changes += [("servers", s.name, [s.spec.grpc_url, s.spec.http_url, bool(s.up)])
                        for s in manager.servers.values()]
            # A section of its own: a worker of the previous version reads "servers" as
            # exactly three fields.
            changes += [("concurrency", s.name, s.spec.concurrency)
                        for s in manager.servers.values()]
            repository = manager.repository
            changes.append(("meta", "repository", str(repository) if repository is not None else None))
        names, table = self.rollouts.names, self.rollouts.table
        # An ensure call may carry the holds it ends ("answered", admin.dataplane.ensure) and
        # the worker's uses since its last report ("uses").
        changes += [("meta", "workers", self.workers()), ("meta", "answered_with_ensure", True),
                    ("meta", "uses_with_ensure", True),
                    ("meta", "expose_concrete", names.expose_concrete)]
        if table.version != self._generation["table"] or self._routes_judged:
            self._routes_judged = False
            self._generation["table"] = table.version
            changes += published.diff("routes", {n: asdict(r) for n, r in table.routes.items()})
            changes += published.diff("limits", {k: dict(v) for k, v in table.limits.items()})
        shares = self.rollouts.shares
        if (shares.generation, names.generation) != self._generation["shares"]:
            self._generation["shares"] = (shares.generation, names.generation)
            changes += published.diff("shares", shares.resolved())
        if names.generation != self._generation["names"]:
            self._generation["names"] = names.generation
            versions: dict[str, dict[str, str]] = {}
            for (model, number), concrete in names.by_version.items():
                versions.setdefault(model, {})[number] = concrete
            changes += published.diff("production", dict(names.production))
            changes += published.diff("versions", versions)
            changes += published.diff("public", {c: list(v) for c, v in names.public.items()})
            changes += published.diff("models", dict.fromkeys(names.models, True))
        families = self.families
        if families is not None and families.generation != self._generation["families"]:
            self._generation["families"] = families.generation
            changes += published.diff("carriers", families.carriers())
        return changes
