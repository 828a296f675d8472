"""A reconcile pass acts only on what its index read can know: a model whose state changed
after Triton's index was read is left to the next pass.

The soak (bench/soak.py) lost requests in two ways that both came from one race: a pass read
the index while a variant was still in its slot, the variant's unload completed meanwhile,
and the pass then adopted it as loaded.  The manager then answered "ready" for a model Triton
no longer held (requests failed with "its weights left their slot" after every resend), and
counted room nobody held (a load waiting for its victim's room failed with "its room ... is
held by models whose unload did not complete").  Each test pauses a pass between its index
read and its decisions, and makes the change in between."""

from __future__ import annotations

import asyncio

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import IndexEntry, TritonModelState
from tests.conftest import run
from tests.unit.test_manager_unit import MODELS, FakeAdmin


class PausedIndexAdmin(FakeAdmin):
    """Triton whose index answer is read at once but arrives when ``deliver`` is set."""

    def __init__(self, models, **kwargs):
        super().__init__(models, **kwargs)
        self.read = asyncio.Event()  # the index was read (its answer is on its way)
        self.deliver = asyncio.Event()
        self.paused = False
        self.load_delays: dict[str, float] = {}
        self.free_delays: dict[str, float] = {}

    async def index(self, ready_only=False):
        answer = {m: IndexEntry(m, s) for m, s in self.states.items()
                  if not ready_only or s == TritonModelState.READY}
        if self.paused:
            self.read.set()
            await self.deliver.wait()
        return answer

    async def load(self, model):
        self.load_delay_s = self.load_delays.get(model, 0.01)
        await super().load(model)

    async def unload(self, model):
        self.free_delay_s = self.free_delays.get(model, 0.01)
        await super().unload(model)


def manager(tmp_path, max_loaded=2):
    admin = PausedIndexAdmin(MODELS)
    server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=max_loaded),
                                      "lru", admin=admin)
    mgr = ModelManager([server], StateStore(tmp_path / "s.db"),
                       config=ManagerConfig(policy="lru", unload_timeout_s=2.0, headroom_models=0,
                                            capacity_wait_s=2.0, probe_interval_s=0))
    return mgr, admin


async def paused_pass(mgr: ModelManager, admin: PausedIndexAdmin) -> asyncio.Task:
    """A reconcile pass that has read the index and waits for ``admin.deliver``."""
    admin.paused, admin.read, admin.deliver = True, asyncio.Event(), asyncio.Event()
    task = asyncio.get_running_loop().create_task(mgr.step())
    await admin.read.wait()
    return task


def test_a_model_unloaded_while_the_index_was_read_is_not_adopted_back(tmp_path):
    async def go():
        mgr, admin = manager(tmp_path)
        await mgr.start()
        await mgr.ensure("m1")
        reconcile = await paused_pass(mgr, admin)  # its index says m1 READY
        await mgr.unload("m1")
        assert admin.states["m1"] == TritonModelState.UNAVAILABLE
        admin.deliver.set()
        await reconcile
        # Not "ready" for a model Triton does not hold: a request would fail on it.
        assert mgr.get("m1").state == ModelState.WARM
        assert mgr.ready_server_of("m1") is None
        assert set(mgr.servers["s0"].planner.residents) == set()
        await mgr.close()

    run(go())


def test_a_load_waiting_for_its_victims_room_is_not_refused_by_a_stale_adoption(tmp_path):
    async def go():
        mgr, admin = manager(tmp_path, max_loaded=2)
        await mgr.start()
        await mgr.ensure("m1")
        await mgr.ensure("m2")
        reconcile = await paused_pass(mgr, admin)  # its index says m1 and m2 READY
        await mgr.unload("m1")  # one slot free
        admin.load_delays["m3"] = 0.3
        loading_m3 = asyncio.get_running_loop().create_task(mgr.ensure("m3"))  # takes it
        while mgr.get("m3").state != ModelState.LOADING:
            await asyncio.sleep(0.001)
        admin.free_delays["m2"] = 0.3
        loading_m4 = asyncio.get_running_loop().create_task(mgr.ensure("m4"))  # evicts m2
        while mgr.get("m2").state != ModelState.UNLOADING:
            await asyncio.sleep(0.001)
        admin.deliver.set()
        await reconcile
        # m4 gets the room m2 frees: nothing else holds it.
        assert (await loading_m4).state == ModelState.READY
        assert (await loading_m3).state == ModelState.READY
        held = {m for m, s in admin.states.items() if s == TritonModelState.READY}
        assert held == {"m3", "m4"}
        assert set(mgr.servers["s0"].planner.residents) == held
        assert mgr.get("m1").state == ModelState.WARM
        await mgr.close()

    run(go())
