"""Route-table writes off the serving event loop.

``RouteTable.save()`` runs on the event loop that serves requests (admin changes, canary
verdicts) and writes its JSON through ``store.put``.  ``BackgroundStore`` stands in for the
``StateStore``: ``put`` only records the value, and one writer thread with its own
connection writes it, so the loop never waits on the state store (a busy database, a slow
disk, a checkpoint, a PostgreSQL on the network).  A newer value of a key replaces one not yet written: only the last state of
the table matters.  ``get`` sees values not yet written.

Failure: a write that fails is logged and retried (the newest value wins) after a pause;
``close()`` writes what is pending before it returns.  A process killed before the thread
wrote loses at most the last change, as a crash just after a synchronous write would lose
the request that caused it.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 1.0


class BackgroundStore:
    """``get``/``put`` of a ``StateStore``'s key-value table, written by one thread."""

    def __init__(self, store):  # a control_plane.state.state_store.StateStore
        self.store = store
        self._pending: dict[str, str] = {}
        self._writing = False
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="route-table-writer", daemon=True)
        self._thread.start()

    def get(self, key: str, default: str | None = None) -> str | None:
        with self._changed:
            if key in self._pending:
                return self._pending[key]
        return self.store.get(key, default)

    def put(self, key: str, value: str) -> None:
        with self._changed:
            if self._closed:
                raise RuntimeError("route-table store is closed")
            self._pending[key] = value
            self._changed.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything put so far is written; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending and not self._writing, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is pending, then stop the thread."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("route-table writer did not finish within %.0fs; unsaved keys: %s",
                      timeout_s, sorted(self._pending))

    def _run(self) -> None:
        # Its own connection: the loop's connection runs multi-statement transactions
        # (registry) that a write from this thread must not land inside.
        writer = self.store.clone()
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._pending or self._closed)
                    if not self._pending:
                        return  # closed, nothing left
                    batch, self._pending = self._pending, {}
                    self._writing = True
                try:
                    for key, value in batch.items():
                        writer.put(key, value)
                    failed = False
                except Exception:
                    log.exception("writing the route table failed; retrying in %.0fs", RETRY_PAUSE_S)
                    failed = True
                with self._changed:
                    self._writing = False
                    if failed:
                        for key, value in batch.items():
                            self._pending.setdefault(key, value)  # a newer value wins
                        if self._closed:
                            return  # nothing will make the next try succeed sooner
                    self._changed.notify_all()
                if failed:
                    with self._changed:
                        self._changed.wait_for(lambda: self._closed, RETRY_PAUSE_S)
        finally:
            writer.close()
