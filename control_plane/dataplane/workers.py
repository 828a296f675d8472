"""Which router workers are alive: when each was last heard from, the version of the
published state it acknowledged, and one condition on which the hub waits for them (an
admin change served by every worker, reports asked for and answered)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from domain.errors import InvalidInput

log = logging.getLogger(__name__)

WORKER_LIVE_S = 10.0  # a worker not heard from for this long no longer counts as live


@dataclass
class WorkerSeen:
    worker: str
    pid: int = 0
    last_seen: float = 0.0
    version: int = -1  # the snapshot version it has
    epoch: str = ""
    # The version the latest ensure's answer brought it to (the changes it carried; this
    # control plane's epoch), -1 when none did: its long-poll has nothing new for it before
    # a later version.
    ensured_version: int = -1
    requests: int = 0  # requests it reported
    samples: int = 0  # canary / experiment outcomes it reported
    shadow: dict = field(default_factory=dict)  # route -> its cumulative ShadowReport counts
    shadow_pid: int = 0  # the process whose counts ``shadow`` holds
    # route -> the counts of its earlier processes (a restarted worker keeps its name and
    # counts from 0 again: its earlier mirrors still happened)
    shadow_before: dict = field(default_factory=dict)
    watching: int = 0  # its snapshot long-polls waiting here now
    report_call: int = 0  # the latest ask for reports it answered (ReportGathering.gather)
    outstanding: dict = field(default_factory=dict)  # model -> its requests on Triton, as reported

    def live(self, now: float) -> bool:
        return now - self.last_seen < WORKER_LIVE_S

    def has(self, version: int, epoch: str) -> bool:
        """Whether it has the published state's ``version`` of ``epoch``: acknowledged by its
        long-poll, or brought by an ensure's answer."""
        return self.epoch == epoch and max(self.version, self.ensured_version) >= version

    def in_touch(self, now: float) -> bool:
        """Live, or waiting in a long-poll: an idle worker's watch (``WATCH_WAIT_S`` of
        router.serving.state_client, longer than ``WORKER_LIVE_S``) is its heartbeat."""
        return self.watching > 0 or self.live(now)

    def to_dict(self, now: float, version: int, epoch: str) -> dict:
        """``current``: it has the published state's ``version`` of ``epoch`` (it serves every
        change made so far)."""
        return {"worker": self.worker, "pid": self.pid, "snapshot_version": self.version,
                "current": self.has(version, epoch),
                "seen_s_ago": round(now - self.last_seen, 3), "live": self.live(now),
                "requests": self.requests, "samples": self.samples}


class WorkerRegistry:
    """The workers that have called, by name.  ``changed`` is notified whenever one of them
    acknowledges something (a version, an answered ask for reports) and whenever there is
    something new for them (a version, an ask, the hub closing)."""

    def __init__(self, expected: int = 0, workers: dict[str, WorkerSeen] | None = None,
                 clock: Callable[[], float] = time.time):
        self.workers: dict[str, WorkerSeen] = {} if workers is None else workers
        self.expected = expected
        self.clock = clock
        self.changed = asyncio.Condition()

    def heard_from(self, worker: str, pid: int) -> WorkerSeen:
        if not worker:
            raise InvalidInput("a data-plane call must name its worker (worker=...)")
        seen = self.workers.get(worker)
        if seen is None:
            seen = self.workers[worker] = WorkerSeen(worker)
            log.info("router worker %s (pid %s) connected", worker, pid)
        seen.pid = pid or seen.pid
        seen.last_seen = self.clock()
        return seen

    def in_touch(self) -> list[WorkerSeen]:
        now = self.clock()
        return [w for w in self.workers.values() if w.in_touch(now)]

    def counts(self) -> tuple[int, int]:
        """(workers in touch now, workers expected): ``mms_router_workers_*``."""
        return len(self.in_touch()), self.expected

    def listing(self, version: int, epoch: str) -> list[dict]:
        now = self.clock()
        return [w.to_dict(now, version, epoch) for w in self.workers.values()]

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, condition: Callable[[], bool], deadline: float,
                         notify: bool = False) -> bool:
        """Wait for ``condition()`` on each change until ``deadline`` (monotonic); whether it
        holds.  ``notify``: wake the waiters first (the long-polls)."""
        async with self.changed:
            if notify:
                self.changed.notify_all()
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except TimeoutError:
                    return condition()
        return True

    async def watch(self, seen: WorkerSeen, done: Callable[[], bool], wait_s: float) -> None:
        """A worker's long-poll: wait up to ``wait_s`` until ``done()``; while it waits the
        worker is in touch however long ago it was last seen."""
        seen.watching += 1
        try:
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait_for(done), wait_s)
                except TimeoutError:
                    pass
        finally:
            seen.watching -= 1
