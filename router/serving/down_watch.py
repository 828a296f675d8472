"""Requests waiting on a server that the control plane declared down: cut short, so that
they are sent where their model is placed now instead of waiting out their deadline on a
server that may never answer (a frozen Triton neither answers nor refuses)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from domain.router_errors import BackendUnavailable
from router.serving.serving_state import ServerAddress

# How often requests waiting on a server look whether the control plane declared it down.
DOWN_CHECK_S = 0.1


class ServerDown(BackendUnavailable):
    """The control plane declared down the server a request was waiting on."""

    def __init__(self, server: ServerAddress):
        # Which server and where are the operators' to know (mmctl fleet), not a client's.
        super().__init__("the server of this request stopped answering and is down; retry shortly")
        self.server = server


class DownWatch:
    """Requests waiting on a server, cut short when ``servers()`` (the control plane's
    published view) reports that server down: they are sent where their model is placed
    now, within their deadline, instead of waiting on a server that may never answer.

    Looks every ``interval_s`` while any request waits; nothing runs when none does."""

    def __init__(self, servers: Callable[[], Iterable[ServerAddress]], interval_s: float = DOWN_CHECK_S):
        self._servers = servers
        self.interval_s = interval_s
        self._waiting: dict[asyncio.Task, str] = {}  # a waiting request's task -> its server's name
        self._cut: set[asyncio.Task] = set()  # those _watch cancelled: their server is down
        self._task: asyncio.Task | None = None

    async def wait(self, server: ServerAddress, answer: Awaitable):
        """``await answer``; raises ServerDown when ``server`` is declared down first.

        The request's own task is cancelled when its server is declared down (which cancels
        its send) and the cancellation, known by the task being in ``_cut``, becomes
        ServerDown: what ``asyncio.timeout`` would do, without a timeout object and its
        context per request on the hot path."""
        task = asyncio.current_task()
        self._waiting[task] = server.name
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())
        try:
            return await answer
        except asyncio.CancelledError:
            if task not in self._cut:
                raise  # the client went away, or its deadline passed
            raise ServerDown(server) from None
        finally:
            del self._waiting[task]
            if self._cut and task in self._cut:  # this cut is over: its cancellation is spent
                self._cut.discard(task)
                task.uncancel()

    async def _watch(self) -> None:
        try:
            while self._waiting:
                await asyncio.sleep(self.interval_s)
                down = {s.name for s in self._servers() if not s.up}
                if not down:
                    continue
                for task, name in list(self._waiting.items()):
                    if name in down and task not in self._cut:
                        # Cancelled in a step of its own: it is still awaiting its answer
                        # (``wait`` removes it from _waiting in the step that resumes it).
                        self._cut.add(task)
                        task.cancel()
        finally:
            self._task = None
