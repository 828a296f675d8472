"""Leader election through the state store: a lease row with a fencing token.

One control plane holds the lease at a time and renews it every ``ttl_s / 3``; the others
(standbys) try to take it every ``retry_s``.  The lease's clock is the database's, so the
machines' clocks do not matter.  Taking the lease over adds one to its token; the new
leader writes with that token as its fence (``Database.fence``), so a deposed leader that
has not noticed yet cannot change the state, and it stops acting as soon as a renewal fails
or its lease may have run out.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.state.database import LEADER_LEASE, STORE_ERRORS, Database, Fence

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 5.0


@dataclass(frozen=True)
class LeaseHolder:
    holder: str
    address: str | None
    token: int
    expires_in_s: float


def default_identity() -> str:
    """Unique per process life: a restarted control plane is a new candidate."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaderLease:
    def __init__(self, db: Database, *, identity: str | None = None, address: str | None = None,
                 ttl_s: float = DEFAULT_TTL_S, name: str = LEADER_LEASE,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError("the lease's ttl_s must be > 0")
        # Its own connection, never fenced: the lease's statements check the token themselves.
        self.db = db.clone()
        self.db.fence = None
        self.identity = identity or default_identity()
        self.address = address
        self.ttl_s = ttl_s
        self.name = name
        self.clock = clock
        self.token: int | None = None
        self._valid_until = 0.0  # our own clock: when we stop trusting the lease we hold
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one attempt each ---------------------------------------------------------------
    def try_acquire(self) -> int | None:
        """Take the lease if it is free or has run out; the new token, or None."""
        started = self.clock()
        now = self.db.now_sql()
        with self.db.transaction():
            self.db.execute("INSERT INTO leader_lease(name, holder, address, token, expires_at) "
                            "VALUES (?, '', NULL, 0, 0) ON CONFLICT (name) DO NOTHING", (self.name,))
            row = self.db.execute(
                f"UPDATE leader_lease SET holder = ?, address = ?, token = token + 1, "
                f"expires_at = {now} + ? WHERE name = ? AND (expires_at < {now} OR holder = '') "
                "RETURNING token", (self.identity, self.address, self.ttl_s, self.name)).fetchone()
        if row is None:
            return None
        self.token = int(row[0])
        self._valid_until = started + self.ttl_s
        log.warning("leader: %s holds the lease (token %d)", self.identity, self.token)
        return self.token

    def renew(self) -> bool:
        """Extend the lease we hold; False once it is someone else's."""
        if self.token is None:
            return False
        started = self.clock()
        now = self.db.now_sql()
        row = self.db.execute(
            f"UPDATE leader_lease SET expires_at = {now} + ? WHERE name = ? AND token = ? "
            "AND holder = ? RETURNING token", (self.ttl_s, self.name, self.token,
                                               self.identity)).fetchone()
        if row is None:
            return False
        self._valid_until = started + self.ttl_s
        return True

    def release(self) -> None:
        """Give the lease up at a clean stop, so a standby takes over at once."""
        if self.token is None:
            return
        try:
            self.db.execute("UPDATE leader_lease SET expires_at = 0, holder = '' "
                            "WHERE name = ? AND token = ?", (self.name, self.token))
        except STORE_ERRORS:  # the store is away: the lease runs out by itself
            log.warning("could not release the leader lease; it runs out in %.0fs", self.ttl_s)
        self.token = None
        self._valid_until = 0.0

    def holds(self) -> bool:
        """Whether this process may act as the leader now (its lease has not run out)."""
        return self.token is not None and self.clock() < self._valid_until

    def fence(self) -> Fence:
        if self.token is None:
            raise RuntimeError("no lease held")
        return Fence(self.name, self.token)

    def current(self) -> LeaseHolder | None:
        row = self.db.execute(
            f"SELECT holder, address, token, expires_at - {self.db.now_sql()} FROM leader_lease "
            "WHERE name = ?", (self.name,)).fetchone()
        if row is None or not row[0] or float(row[3]) <= 0:
            return None
        return LeaseHolder(row[0], row[1], int(row[2]), float(row[3]))

    # -- the loops ----------------------------------------------------------------------
    def wait_until_leader(self, retry_s: float = 1.0) -> bool:
        """Try every ``retry_s`` until the lease is ours (True) or ``stop()`` (False)."""
        while not self._stop.is_set():
            try:
                if self.try_acquire() is not None:
                    return True
            except STORE_ERRORS as exc:  # the store is away: keep trying
                log.warning("leader election: %s", exc)
            self._stop.wait(retry_s)
        return False

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew in a thread every ttl/3; call ``on_lost(reason)`` once when leadership ends:
        another holder, or no renewal before the lease could have run out."""
        def run() -> None:
            interval_s = self.ttl_s / 3
            while not self._stop.wait(interval_s):
                try:
                    if self.renew():
                        continue
                    reason = "another control plane holds the lease"
                except Exception as exc:  # the renewal thread must not die silently
                    if not isinstance(exc, STORE_ERRORS):
                        log.exception("leader lease renewal raised")
                    if self.holds():
                        log.warning("leader lease renewal failed (%s); retrying", exc)
                        continue
                    reason = f"the lease could not be renewed before it ran out ({exc})"
                self.token = None
                on_lost(reason)
                return

        self._thread = threading.Thread(target=run, name="leader-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def close(self) -> None:
        self.stop()
        self.db.close()
