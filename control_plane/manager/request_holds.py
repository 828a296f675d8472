"""``RequestHolds``: the entries (models, adapters in their bases' slots) loaded for requests
that are on their way to Triton, one hold per ensure.  A hold ends when the router worker
that asked says the request has its answer, or after ``expire_s`` at most (a worker that died
meanwhile); one worker's answers never end another's holds, whose requests may still be on
their way.  The manager's leases and the adapters' slots each keep one ledger of these."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def _nothing(_key: str) -> None:
    pass


class RequestHolds:
    """``on_first(key)``: ``key`` was not held and is now; ``on_end(key)``: one of its holds
    ended (answered, expired or dropped); ``on_last(key)``: its last hold ended."""

    def __init__(self, expire_s: float, on_first: Callable[[str], None] = _nothing,
                 on_end: Callable[[str], None] = _nothing,
                 on_last: Callable[[str], None] = _nothing):
        self.expire_s = expire_s
        self.on_first, self.on_end, self.on_last = on_first, on_end, on_last
        self._holds: dict[str, list[asyncio.TimerHandle]] = {}  # key -> its holds, oldest first
        self._owners: dict[asyncio.TimerHandle, str | None] = {}  # hold -> the worker whose it is

    def __contains__(self, key: str) -> bool:
        return key in self._holds

    def __len__(self) -> int:
        return len(self._holds)

    def count(self, key: str) -> int:
        return len(self._holds.get(key, ()))

    def hold(self, key: str, owner: str | None = None) -> asyncio.TimerHandle:
        """One more hold of ``key`` for ``owner``'s request; it ends by itself after ``expire_s``."""
        holds = self._holds.setdefault(key, [])
        handle = asyncio.get_running_loop().call_later(self.expire_s, lambda: self.end(key, handle))
        holds.append(handle)
        self._owners[handle] = owner
        if len(holds) == 1:
            self.on_first(key)
        return handle

    def end(self, key: str, handle: asyncio.TimerHandle) -> None:
        """End the hold ``handle`` of ``key`` now (nothing if it has ended already)."""
        holds = self._holds.get(key)
        if not holds or handle not in holds:
            return
        handle.cancel()
        holds.remove(handle)
        del self._owners[handle]
        if not holds:
            del self._holds[key]
        self.on_end(key)
        if not holds:
            self.on_last(key)

    def answered(self, key: str, count: int, owner: str | None) -> int:
        """``owner``'s requests that ensured ``key`` have their answers: up to ``count`` of
        its holds, oldest first, end now.  Returns the holds ended."""
        ended = [h for h in self._holds.get(key, ()) if self._owners.get(h) == owner][:max(0, count)]
        for handle in ended:
            self.end(key, handle)
        return len(ended)
