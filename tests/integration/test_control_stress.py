"""Conflicting control calls against a real tritonserver: 16 threads of random load, unload,
pin and unpin on a handful of models while the reconcile loop runs, then the control
plane's view must equal Triton's.

The manager runs on its own event loop in a thread (as in the service); the workers call
it the way admin API handlers do.  Every answer must be a ControlPlaneError or success,
none may hang, and once the calls stop: the models the control plane calls ready are
exactly Triton's READY models, every pinned model is loaded, and capacity is counted for
exactly those models.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time

import pytest
import tritonclient.grpc as grpcclient

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.state.state_store import StateStore
from domain.errors import ControlPlaneError
from domain.periodic import run_periodically

pytestmark = pytest.mark.integration

MODELS = ["identity", "cust001", "cust002", "cust003", "cust004"]
THREADS = 16
DURATION_S = 12.0
MAX_LOADED = 3
OP_TIMEOUT_S = 180.0  # one call may wait for loads/unloads ahead of it on a busy machine
SETTLE_TIMEOUT_S = 120.0
SEED = 9


def triton_ready(url: str) -> set[str]:
    client = grpcclient.InferenceServerClient(url)
    try:
        index = client.get_model_repository_index(as_json=True).get("models", [])
    finally:
        client.close()
    return {m["name"] for m in index if m.get("state") == "READY"}


class LoopThread:
    """An event loop in a thread; ``call`` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="manager-loop", daemon=True)
        self.thread.start()

    def call(self, coro, timeout_s: float = OP_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def settle(mgr: ModelManager) -> None:
    """Wait until no load, unload or background task of the manager is running."""
    while True:
        tasks = [t for t in (*mgr.state.tasks.loads.values(), *mgr.state.tasks.unloads.values(), *mgr.state.tasks.background)
                 if not t.done()]
        if not tasks:
            return
        await asyncio.wait(tasks)


def test_random_control_calls_leave_the_control_plane_equal_to_triton(triton, repository, tmp_path):
    spec = ServerSpec("triton0", triton.grpc_url, triton.http_url, triton.metrics_url,
                      max_loaded=MAX_LOADED)
    mgr = ModelManager([ModelManager.make_server(spec, "lru")],
                       StateStore(tmp_path / "state.db"), repository=repository,
                       config=ManagerConfig(policy="lru", failure_backoff_s=1.0,
                                            drain_timeout_s=5.0))
    runner = LoopThread()
    outcomes: collections.Counter = collections.Counter()
    unexpected: list[str] = []
    lock = threading.Lock()
    try:
        runner.call(mgr.start())
        reconcile = runner.call(_start_reconcile(mgr))
        ops = {
            "load": lambda m: mgr.ensure(m, retry_failed=True),
            "unload": mgr.unload,
            "pin": mgr.pin,
            "unpin": mgr.unpin,
        }
        deadline = time.monotonic() + DURATION_S

        def worker(i: int) -> None:
            rng = random.Random(SEED * 100 + i)
            while time.monotonic() < deadline:
                op = rng.choices(list(ops), weights=[4, 3, 2, 2])[0]
                model = rng.choice(MODELS)
                try:
                    runner.call(ops[op](model))
                    result = "ok"
                except ControlPlaneError as exc:
                    result = type(exc).__name__
                except TimeoutError:
                    result = "hang"
                    with lock:
                        unexpected.append(f"{op} {model}: no answer within {OP_TIMEOUT_S:.0f}s")
                except Exception as exc:  # noqa: BLE001 - anything else is a bug: recorded, asserted below
                    result = "crash"
                    with lock:
                        unexpected.append(f"{op} {model}: {type(exc).__name__}: {exc}")
                with lock:
                    outcomes[(op, result)] += 1
                time.sleep(rng.uniform(0.0, 0.2))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DURATION_S + OP_TIMEOUT_S + 30)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        assert unexpected == [], unexpected
        for op in ops:  # the run exercised every call, not only refusals
            assert outcomes[(op, "ok")] > 0, dict(outcomes)

        # Calls stopped: let the reconcile repair what it must, then compare with Triton.
        runner.call(_stop(reconcile))
        give_up = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            runner.call(_pass(mgr))
            ready = {n for n, r in mgr.records.items() if r.state == ModelState.READY}
            pinned = {n for n, r in mgr.records.items() if r.pinned}
            in_triton = triton_ready(triton.grpc_url)
            if (ready == in_triton and pinned <= ready) or time.monotonic() > give_up:
                break
            time.sleep(0.5)
        states = {n: (r.state.value, r.pinned, r.failure) for n, r in mgr.records.items()}
        assert ready == in_triton, (ready, in_triton, states)
        assert pinned <= ready, (pinned, states)
        assert mgr.store.pins() == pinned
        planner = mgr.servers["triton0"].planner
        assert set(planner.residents) == ready, (set(planner.residents), states)
        assert planner.used_slots <= MAX_LOADED
        assert {k for k, r in planner.residents.items() if r.pinned} == pinned
        assert all(r.evictable for k, r in planner.residents.items() if k not in pinned)
    finally:
        try:
            runner.call(mgr.close(), timeout_s=30)
        finally:
            runner.stop()


async def _start_reconcile(mgr: ModelManager) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(run_periodically("reconcile", mgr.step, 0.5,
                                                                  mgr.metrics.loop_failures))


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _pass(mgr: ModelManager) -> None:
    """One reconcile pass and everything it started."""
    await settle(mgr)
    await mgr.step()
    await settle(mgr)
