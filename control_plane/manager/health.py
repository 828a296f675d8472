"""Whether each Triton answers: up, suspect, down or lost (``records.ServerHealth``), one
writer.

A probe is Triton's ServerLive, which its front end answers even while every model instance
computes: a busy server answers, a frozen one (SIGSTOP, a hung GPU, a stuck backend) does
not.  ``run_forever`` probes every server every ``probe_interval_s``, one task per server,
each probe with its own ``probe_timeout_s``: a frozen server never holds up the probes of
the others, a reconcile pass or the event loop.  A missed probe makes a server suspect (it
still serves); ``probe_failures`` missed in a row make it down; one answer makes it up.
Evidence beyond a probe makes it down at once (``unreachable``): a request that could not
reach it, or a read of its index that failed, confirmed by a probe.

What follows a change belongs to the reconciler (``on_down``, ``on_up``): a local Triton
that is down is killed and started again, the models of a down server are placed on the
others, and the copies it kept are unloaded when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.records import (
    HEALTH_TRANSITIONS,
    ServerHealth,
    TritonServer,
)
from control_plane.metrics import ControlPlaneMetrics

log = logging.getLogger(__name__)


class Health:
    """The only writer of ``TritonServer.health`` and of what goes with it: missed probes,
    ``down_since`` and a managed Triton's restart back-off.  ``clock``: monotonic seconds."""

    def __init__(self, servers: dict[str, TritonServer], config: ManagerConfig,
                 metrics: ControlPlaneMetrics, clock: Callable[[], float] = time.monotonic,
                 on_down: Callable[[TritonServer, str], None] = lambda _server, _why: None,
                 on_up: Callable[[TritonServer], None] = lambda _server: None):
        self.servers = servers
        self.config = config
        self.metrics = metrics
        self.clock = clock
        # Called after a server became down / up again (the reconciler's consequences).
        self.on_down = on_down
        self.on_up = on_up
        self._probes: dict[str, asyncio.Task] = {}  # server name -> the probe in flight
        self._probe_faults: set[str] = set()  # servers whose probe raised (logged once)

    # ------------------------------------------------------------------ the one writer
    def answered(self, server: TritonServer) -> None:
        """``server`` answered: it is up."""
        server.missed_probes = 0
        self._move(server, ServerHealth.UP, "it answers")
        self.metrics.server_up.labels(server.name).set(1)

    def missed(self, server: TritonServer, why: str) -> None:
        """A probe of ``server`` failed: suspect, or down after ``probe_failures`` in a row."""
        server.missed_probes += 1
        failures = self.config.probe_failures
        if server.missed_probes >= failures:
            self._move(server, ServerHealth.DOWN, f"{why} ({server.missed_probes} probes in a row)")
        elif server.health is ServerHealth.UP:
            self._move(server, ServerHealth.SUSPECT, why)

    def unreachable(self, server: TritonServer, why: str) -> None:
        """``server`` failed more than a probe (a request or an index read, and a probe):
        down at once."""
        server.missed_probes = max(server.missed_probes, self.config.probe_failures)
        self._move(server, ServerHealth.DOWN, why)

    def lost_now(self, server: TritonServer) -> bool:
        """Whether ``server`` has just become lost: down for ``server_lost_after_s``.  The
        caller places what it held on the others."""
        if server.health is not ServerHealth.DOWN or server.down_since is None:
            return False
        if self.clock() - server.down_since < self.config.server_lost_after_s:
            return False
        self._move(server, ServerHealth.LOST, "it has not answered for "
                   f"{self.clock() - server.down_since:.0f}s")
        return True

    def restart_failed(self, server: TritonServer) -> float:
        """A restart of a managed Triton failed: the next waits (2 s doubling to 60 s);
        returns the wait."""
        server.restart_failures += 1
        delay_s = min(60.0, 2.0 ** server.restart_failures)
        server.next_restart_at = self.clock() + delay_s
        return delay_s

    def restarted(self, server: TritonServer) -> None:
        server.restart_failures = 0

    def may_restart(self, server: TritonServer) -> bool:
        return self.clock() >= server.next_restart_at

    def _move(self, server: TritonServer, to: ServerHealth, why: str) -> None:
        was = server.health
        if to is was:
            return
        if to not in HEALTH_TRANSITIONS[was]:  # the callers above never ask for one
            raise RuntimeError(f"{server.name}: illegal health change {was.value} -> {to.value}")
        server.health = to
        self.metrics.server_up.labels(server.name).set(
            0 if to in (ServerHealth.DOWN, ServerHealth.LOST) else 1)
        if to is ServerHealth.LOST:
            log.error("Triton %s at %s is lost: %s", server.name, server.spec.grpc_url, why)
        elif to is ServerHealth.DOWN:
            server.down_since = self.clock()
            log.error("Triton %s at %s is down: %s", server.name, server.spec.grpc_url, why)
            self.on_down(server, why)
        elif was in (ServerHealth.DOWN, ServerHealth.LOST):
            log.warning("Triton %s at %s answers again after %.1fs; it takes models again",
                        server.name, server.spec.grpc_url,
                        self.clock() - (server.down_since if server.down_since is not None else self.clock()))
            server.down_since = None
            self.on_up(server)
        elif to is ServerHealth.SUSPECT:
            log.info("Triton %s at %s is suspect: %s", server.name, server.spec.grpc_url, why)

    # ------------------------------------------------------------------ probes
    async def probe(self, server: TritonServer) -> bool | None:
        """Ask ``server`` once whether it is live and record the answer; callers asking
        while a probe is in flight share it.  True: it answered; False: it did not (within
        ``probe_timeout_s``) or refused; None: the probe itself failed (logged, no evidence
        either way)."""
        task = self._probes.get(server.name)
        if task is None:
            task = self._probes[server.name] = asyncio.get_running_loop().create_task(self._probe(server))
            task.add_done_callback(lambda _t, name=server.name: self._probes.pop(name, None))
        return await asyncio.shield(task)

    async def _probe(self, server: TritonServer) -> bool | None:
        timeout_s = self.config.probe_timeout_s
        try:
            live = await asyncio.wait_for(server.admin.is_live(), timeout_s)
            why = "it refused a liveness probe"
        except TimeoutError:
            live, why = False, f"no answer to a liveness probe within {timeout_s:g}s"
        except Exception:  # a fault of ours, not Triton's answer: never taken for a down server
            if server.name not in self._probe_faults:
                self._probe_faults.add(server.name)
                log.exception("the liveness probe of %s failed", server.name)
            return None
        if live:
            self.answered(server)
        else:
            self.missed(server, why)
        return live

    def close(self) -> None:
        """Cancel the probes in flight (``run_forever`` is cancelled by its owner)."""
        for task in list(self._probes.values()):
            task.cancel()

    async def run_forever(self) -> None:
        """Probe every server every ``probe_interval_s`` (0: never), each in its own loop,
        until cancelled."""
        if self.config.probe_interval_s <= 0:
            return
        await asyncio.gather(*(self._watch(s) for s in list(self.servers.values())))

    async def _watch(self, server: TritonServer) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.probe(server)
            # Start to start: a probe that waits out its timeout does not stretch the interval.
            await asyncio.sleep(max(0.0, self.config.probe_interval_s - (loop.time() - started)))
