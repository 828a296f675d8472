"""Background loops survive a failing step: logged, counted in ``*_loop_failures_total``,
and the next step runs.  A failure is injected into each of the product's loops."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from control_plane.adapters.manager import AdapterManager
from control_plane.admin.dataplane import DataPlaneHub
from control_plane.metrics import ControlPlaneMetrics
from control_plane.registry import Registry
from control_plane.runtime.service import Service
from control_plane.state.state_store import StateStore
from domain.periodic import loop_failures_counter, run_periodically
from domain.routes import RouteTable
from router.assembly import Router, RouterConfig
from tests.conftest import run


class FailsOnce:
    """A step that raises on its first call only; counts its calls."""

    def __init__(self, is_async: bool = False):
        self.calls = 0
        self.is_async = is_async

    def _step(self):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected failure")

    def __call__(self):
        if not self.is_async:
            return self._step()

        async def step():
            self._step()
        return step()


def failures(counter, loop: str) -> float:
    return counter.labels(loop)._value.get()


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "the loop stopped stepping"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("is_async", [False, True])
def test_a_failing_step_is_counted_and_the_next_one_runs(is_async):
    async def go():
        counter = loop_failures_counter("t", CollectorRegistry())
        step = FailsOnce(is_async)
        task = asyncio.create_task(run_periodically("job", step, 0.01, counter))
        await until(lambda: step.calls >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # cancellation ends the loop; it is not swallowed as a failure
        assert failures(counter, "job") == 1

    run(go())


def test_the_routers_canary_loop_survives_a_failing_judgement():
    async def go():
        step = FailsOnce()
        router = Router(SimpleNamespace(ready_server=lambda m: None, carrier_of=lambda m: None),
                        RouteTable(), RouterConfig(canary_interval_s=0.01),
                        canaries=SimpleNamespace(step=step))
        await router.start()
        await until(lambda: step.calls >= 3)
        await router.stop()
        assert failures(router.metrics.loop_failures, "canary") == 1

    run(go())


def test_the_data_plane_hubs_publish_and_canary_loops_survive_failures(tmp_path, monkeypatch):
    monkeypatch.setattr("control_plane.admin.dataplane.CANARY_INTERVAL_S", 0.01)

    async def go():
        store = StateStore(tmp_path / "state.db")
        metrics = ControlPlaneMetrics()
        manager = SimpleNamespace(metrics=metrics, records={}, servers={}, repository=None,
                                  on_state_change=lambda listener: None)
        hub = DataPlaneHub(manager, Registry(store.db), store)
        hub.publish = lambda: None  # what a snapshot holds is not this test's
        await hub.start()
        hub.publish = publish = FailsOnce()
        hub.canaries.step = judge = FailsOnce()
        await until(lambda: publish.calls >= 3 and judge.calls >= 3)
        await hub.release_watchers()
        assert failures(metrics.loop_failures, "publish") == 1
        assert failures(metrics.loop_failures, "canary") == 1

    run(go())


def test_the_control_loop_runs_every_part_whatever_one_raises(tmp_path):
    """Reconcile, the GPU memory pass and promotion are separate guarded steps."""
    async def go():
        service = Service.__new__(Service)
        metrics = ControlPlaneMetrics()
        reconcile, memory, promote = FailsOnce(is_async=True), FailsOnce(), FailsOnce(is_async=True)
        service.manager = SimpleNamespace(metrics=metrics, step=reconcile, servers={})
        service.memory = SimpleNamespace(step=lambda servers: memory())
        service.reconciler = SimpleNamespace(step=lambda: None)
        service.promoter = SimpleNamespace(step=promote)
        service.cfg = SimpleNamespace(reconcile_interval_s=0.01, auto_pin_top_k=1, prefetch_min_miss_rate=0)
        task = asyncio.create_task(service._control_loop())
        await until(lambda: min(reconcile.calls, memory.calls, promote.calls) >= 3)
        task.cancel()
        for loop in ("reconcile", "gpu-memory", "promotion"):
            assert failures(metrics.loop_failures, loop) == 1, loop

    run(go())


def test_the_adapter_refresh_survives_a_failing_recovery_and_refresh(tmp_path):
    async def go():
        manager = SimpleNamespace(config=SimpleNamespace(policy="lru", on_its_way_s=1.0),
                                  on_state_change=lambda _listener: None)
        adapters = AdapterManager(manager, tmp_path, db=StateStore(tmp_path / "s.db").db)
        adapters.refresh_interval_s = 0.01
        adapters.recover = FailsOnce(is_async=True)
        adapters.step = refresh = FailsOnce(is_async=True)
        counter = loop_failures_counter("t", CollectorRegistry())
        task = asyncio.create_task(adapters.run_forever(counter))
        await until(lambda: refresh.calls >= 3)
        task.cancel()
        assert failures(counter, "adapter-recovery") == 1
        assert failures(counter, "adapter-refresh") == 1

    run(go())


def test_a_router_workers_watch_survives_a_bad_snapshot(monkeypatch):
    from router.serving import state_client
    from router.serving.state_client import RemoteState

    monkeypatch.setattr(state_client, "RETRY_MAX_S", 0.01)

    async def go():
        counter = loop_failures_counter("t", CollectorRegistry())
        state = RemoteState("http://127.0.0.1:1", "tok", "w0", loop_failures=counter)
        polls = FailsOnce()

        async def poll(wait_s):  # a long poll that answers at once, once a bad snapshot
            await asyncio.sleep(0.01)
            polls()
        state._poll = poll
        task = asyncio.create_task(state._watch())
        await until(lambda: polls.calls >= 3)
        task.cancel()
        assert failures(counter, "watch") == 1

    run(go())


def test_a_shadow_worker_survives_a_failing_mirror():
    from router.rollouts.shadow import ShadowItem, ShadowMirror
    from router.serving.metrics import RouterMetrics
    from tests.unit.test_shadow import NEVER_SHED

    async def go():
        metrics = RouterMetrics()
        sent = []

        async def send(model, request, timeout_s):
            sent.append(model)
            return b""

        mirror = ShadowMirror(send, None, metrics=metrics, workers=1, shed_lag_ms=NEVER_SHED)
        fails, real = FailsOnce(), mirror._mirror

        async def mirror_once(item):
            fails()
            await real(item)
        mirror._mirror = mirror_once
        mirror.start()
        for _ in range(3):
            mirror.offer(ShadowItem("r", "shadow", b"", b"", 1.0))
            await asyncio.sleep(0.05)
        await until(lambda: len(sent) >= 2)
        await mirror.stop()
        assert failures(metrics.loop_failures, "shadow-mirror") == 1

    run(go())
