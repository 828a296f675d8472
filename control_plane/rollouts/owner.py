"""The one owner of rollout state on the control plane, built once by the service and given
to whoever judges: the data-plane hub when router workers serve, or the in-process router.

It holds the registry's public names, the route table (saved through its own writer
thread, so a route change never waits on the database in the event loop), the per-variant
statistics of experiments and canaries, and the canary controller that judges them and
promotes through the registry (one source of truth).  Its judging loop is the only canary
loop: whoever serves from the table starts it and listens for its verdicts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from control_plane.rollouts.canary import CanaryController, registry_promoter
from control_plane.rollouts.shares import ShareWeights
from control_plane.rollouts.stats import StatsBook
from control_plane.state.background import BackgroundStore
from domain.periodic import run_periodically
from domain.public_names import PublicNames
from domain.routes import RouteTable

CANARY_INTERVAL_S = 1.0  # how often running canaries are judged


class Rollouts:
    def __init__(self, registry, store, expose_versions: bool = False,
                 clock: Callable[[], float] = time.time):
        """``registry``: the model registry (names, and where promotions go); ``store``: the
        state store the route table and the canaries' windows are saved in."""
        self.names = PublicNames(registry.versions, expose_concrete=expose_versions)
        registry.on_stage_change(self.names.refresh)
        self.route_store = BackgroundStore(store)
        self.table = RouteTable(self.route_store, default_target=self.names.production.get,
                                unrouted=self.names.unrouted)
        # Fair-share weights (mmctl share): saved beside the table, by the same writer.
        self.shares = ShareWeights(self.route_store, registry.versions, self.names)
        self.stats = StatsBook(clock=clock)
        self.canaries = CanaryController(self.table, self.stats, clock=clock,
                                         on_promote=registry_promoter(registry))
        self._judged: list[Callable[[], None]] = []
        self._judging: asyncio.Task | None = None

    def on_judged(self, listener: Callable[[], None]) -> None:
        """``listener()`` after each pass of the canary checks (a route's stage may have
        moved: the hub publishes the table again)."""
        self._judged.append(listener)

    def judge(self) -> None:
        self.canaries.step()
        for listener in self._judged:
            listener()

    def start_judging(self, interval_s: float = CANARY_INTERVAL_S,
                      loop_failures=None) -> asyncio.Task:
        """The canary loop, started once (a second call returns the running one); a failing
        pass is counted in ``loop_failures`` under "canary" and the loop goes on."""
        if self._judging is None or self._judging.done():
            self._judging = asyncio.get_running_loop().create_task(
                run_periodically("canary", self.judge, interval_s, loop_failures))
        return self._judging

    async def close(self) -> None:
        """Stop judging and write what the route table has not written yet."""
        if self._judging is not None:
            self._judging.cancel()
        await asyncio.to_thread(self.route_store.close)
