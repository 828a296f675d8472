"""Eviction off a miss's critical path: headroom, committed room, overlap (fake Triton)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from control_plane.eviction import STAGE_PRIORITY
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.manager.room import host_available_bytes
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import TritonModelState
from domain.errors import CapacityExhausted, InvalidInput
from tests.conftest import run
from tests.unit.test_manager_unit import FakeAdmin

GiB = 1 << 30
MODELS = [f"m{i}" for i in range(1, 13)]


class FakeClock:
    """Wall clock the test moves: recency (LRU order) follows it, not the real time."""

    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds


def make(tmp_path, max_loaded=8, free_delay_s=0.3, load_delay_s=0.05, free_memory=None,
         priority_of=None, **cfg):
    admin = FakeAdmin(MODELS, load_delay_s=load_delay_s, free_delay_s=free_delay_s)
    server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=max_loaded),
                                      "lru", admin=admin)
    clock = FakeClock()
    mgr = ModelManager([server], StateStore(tmp_path / "s.db"), clock=clock,
                       config=ManagerConfig(**{"policy": "lru", "unload_timeout_s": 2.0, **cfg}),
                       free_memory=free_memory, priority_of=priority_of)
    return mgr, admin, clock


async def load_in_order(mgr, clock, names):
    for n in names:
        clock.tick()
        await mgr.ensure(n)


async def settle(mgr, until, timeout_s=3.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not until():
        assert loop.time() < deadline, "timed out waiting for the background unloads"
        await asyncio.sleep(0.01)


def loaded(admin):
    return {m for m, s in admin.states.items() if s == TritonModelState.READY}


def states_at_load(admin, models):
    """Triton's states of ``models`` at the moment each load is sent, by the model loaded:
    what had freed, and what had loaded, before it (the order, not the time it took)."""
    seen: dict[str, dict[str, TritonModelState]] = {}
    real_load = admin.load

    async def load(model):
        seen[model] = {m: admin.states[m] for m in models}
        await real_load(model)

    admin.load = load
    return seen


# --------------------------------------------------------------------------- headroom
def test_a_miss_takes_the_headroom_at_once_and_the_lru_model_leaves_in_the_background(tmp_path):
    async def go():
        # Triton frees an unloaded model only when the test says (``free_gate``): a miss
        # with an unload on its path cannot end before that.
        mgr, admin, clock = make(tmp_path, unload_timeout_s=30)
        await mgr.start()
        await load_in_order(mgr, clock, MODELS[:7])  # 7 of 8: the headroom is free
        assert loaded(admin) == set(MODELS[:7])
        admin.free_gate = asyncio.Event()
        clock.tick()
        await asyncio.wait_for(mgr.ensure("m8"), 10)  # the load only: no unload on its path
        assert mgr.get("m8").state == ModelState.READY
        assert mgr.get("m1").state == ModelState.UNLOADING  # the policy's next victim, still
        assert admin.states["m1"] == TritonModelState.UNLOADING  # in Triton, not freed yet
        admin.free_gate.set()
        await settle(mgr, lambda: mgr.get("m1").state == ModelState.WARM)
        assert loaded(admin) == set(MODELS[1:8])
        assert mgr.metrics.unloads.labels("s0", "headroom")._value.get() == 1
        # The next miss finds the headroom free again: no wait either.
        admin.free_gate.clear()
        clock.tick()
        await asyncio.wait_for(mgr.ensure("m9"), 10)
        assert mgr.get("m9").state == ModelState.READY
        assert admin.states["m2"] == TritonModelState.UNLOADING  # the next victim, not freed yet
        admin.free_gate.set()
        await settle(mgr, lambda: mgr.get("m2").state == ModelState.WARM)

    run(go())


def test_without_headroom_a_miss_waits_for_its_victim(tmp_path):
    async def go():
        mgr, admin, clock = make(tmp_path, headroom_models=0)
        await mgr.start()
        await load_in_order(mgr, clock, MODELS[:8])  # full, nothing evicted in advance
        assert loaded(admin) == set(MODELS[:8])
        at_load = states_at_load(admin, ["m1"])
        clock.tick()
        await mgr.ensure("m9")
        # The victim's unload was on the miss's path: its load was sent once Triton had freed m1.
        assert at_load["m9"] == {"m1": TritonModelState.UNAVAILABLE}

    run(go())


def test_headroom_never_touches_pinned_models_or_models_in_use(tmp_path):
    async def go():
        mgr, admin, clock = make(tmp_path)
        await mgr.start()
        for n in MODELS[:6]:
            clock.tick()
            await mgr.pin(n)
        clock.tick()
        held = await mgr.acquire("m7")  # a request waits for m7, then holds it
        await mgr.ensure("m7")
        clock.tick()
        await mgr.ensure("m8")  # 8 of 8, and the only evictable model is the newcomer
        await mgr.step()
        await asyncio.sleep(0.05)
        assert loaded(admin) == set(MODELS[:8])  # nothing left: headroom yields
        mgr.release(held)  # m7 is free again, and older than m8
        await mgr.step()
        await settle(mgr, lambda: mgr.get("m7").state == ModelState.WARM)
        assert loaded(admin) == set(MODELS[:6]) | {"m8"}
        assert all(mgr.get(n).pinned and mgr.get(n).state == ModelState.READY for n in MODELS[:6])

    run(go())


def test_a_model_just_loaded_is_not_the_headrooms_victim(tmp_path):
    """The policy heard of a load's use when it started: a model used while the load ran
    was newer, so the headroom unloaded the model just loaded (``mmctl load`` holds
    nothing) as soon as it was READY."""
    async def go():
        mgr, admin, clock = make(tmp_path, load_delay_s=0.3)
        await mgr.start()
        for n in MODELS[:6]:
            clock.tick()
            await mgr.pin(n)
        clock.tick()
        await mgr.ensure("m7")
        clock.tick()
        loading = asyncio.create_task(mgr.ensure("m8"))  # into the headroom: 8 of 8
        await asyncio.sleep(0.1)
        clock.tick()
        mgr.touch("m7")  # requests for m7 while m8 loads
        await loading
        await mgr.step()
        await settle(mgr, lambda: mgr.get("m7").state == ModelState.WARM)
        assert mgr.get("m8").state == ModelState.READY and loaded(admin) == set(MODELS[:6]) | {"m8"}

    run(go())


def test_a_pin_during_a_headroom_unload_loads_the_model_again(tmp_path):
    async def go():
        mgr, admin, clock = make(tmp_path, free_delay_s=0.2)
        await mgr.start()
        await load_in_order(mgr, clock, MODELS[:8])  # m1 leaves for the headroom
        assert mgr.get("m1").state == ModelState.UNLOADING
        rec = await mgr.pin("m1")
        assert (rec.state, rec.pinned) == (ModelState.READY, True)
        await mgr.step()
        await asyncio.sleep(0.3)
        assert mgr.get("m1").state == ModelState.READY and "m1" in loaded(admin)

    run(go())


def test_a_failed_headroom_unload_holds_its_room(tmp_path):
    async def go():
        mgr, admin, clock = make(tmp_path, failure_backoff_s=60)
        await mgr.start()
        await load_in_order(mgr, clock, MODELS[:7])
        admin.fail_unload.add("m1")
        clock.tick()
        await mgr.ensure("m8")  # the headroom unload of m1 fails
        await settle(mgr, lambda: mgr.get("m1").state == ModelState.UNLOAD_FAILED)
        planner = mgr.servers["s0"].planner
        assert "m1" in planner.residents and not planner.residents["m1"].leaving
        clock.tick()
        await mgr.ensure("m9")  # m1 still counts: m2 has to go, Triton never holds 9
        await settle(mgr, lambda: mgr.get("m2").state == ModelState.WARM)
        assert len(loaded(admin)) <= 8 and "m1" in loaded(admin)
        assert planner.used_slots <= 8

    run(go())


def test_two_misses_close_together_evict_one_model_each(tmp_path):
    async def go():
        mgr, admin, clock = make(tmp_path, max_loaded=3)  # too small for a default headroom
        await mgr.start()
        await load_in_order(mgr, clock, ["m1", "m2", "m3"])
        await asyncio.gather(mgr.ensure("m4"), mgr.ensure("m5"))
        assert loaded(admin) == {"m3", "m4", "m5"}  # m3 was not evicted for nothing
        assert mgr.servers["s0"].planner.used_slots == 3

    run(go())


def test_a_shadow_does_not_take_the_headroom(tmp_path):
    async def go():
        stages = {"m9": "shadow"}
        mgr, admin, clock = make(
            tmp_path, priority_of=lambda n: STAGE_PRIORITY[stages.get(n, "production")])
        await mgr.start()
        await load_in_order(mgr, clock, MODELS[:7])
        with pytest.raises(CapacityExhausted, match="shadow"):
            await mgr.ensure("m9")
        assert loaded(admin) == set(MODELS[:7])  # no serving model left on its behalf

    run(go())


def test_headroom_settings_are_checked():
    with pytest.raises(InvalidInput, match="headroom_models"):
        ManagerConfig(headroom_models=-1)


# --------------------------------------------------------------------------- overlap
def test_overlap_starts_the_load_while_the_victim_shuts_down_when_memory_holds_it(tmp_path):
    async def go():
        mgr, admin, clock = make(tmp_path, max_loaded=2, unload_timeout_s=30,
                                 free_memory=lambda server: 64 * GiB)
        await mgr.start()
        await load_in_order(mgr, clock, ["m1", "m2"])
        admin.free_gate = asyncio.Event()  # m1 frees only when the test says
        at_load = states_at_load(admin, ["m1"])
        clock.tick()
        await asyncio.wait_for(mgr.ensure("m3"), 10)  # done while m1 still shuts down
        assert at_load["m3"]["m1"] != TritonModelState.UNAVAILABLE  # sent before m1 freed
        planner = mgr.servers["s0"].planner
        # Honest counts: m1 is still counted (Triton has not confirmed it gone).
        assert planner.used_slots == 3 and planner.committed_slots == 2
        assert mgr.get("m1").state == ModelState.UNLOADING
        admin.free_gate.set()
        await settle(mgr, lambda: mgr.get("m1").state == ModelState.WARM)
        assert planner.used_slots == 2 and loaded(admin) == {"m2", "m3"}

    run(go())


@pytest.mark.parametrize("probe", ["short", "unmeasured", "broken", "none"])
def test_no_overlap_unless_measured_memory_holds_the_newcomer(tmp_path, probe, caplog):
    def broken(server):
        raise OSError("no /proc here")

    free_memory = {"short": lambda s: GiB // 2, "unmeasured": lambda s: None,
                   "broken": broken, "none": None}[probe]

    async def go():
        mgr, admin, clock = make(tmp_path, max_loaded=2, free_delay_s=0.4, free_memory=free_memory)
        await mgr.start()
        await load_in_order(mgr, clock, ["m1", "m2"])
        at_load = states_at_load(admin, ["m1"])
        clock.tick()
        await mgr.ensure("m3")
        # Waited for Triton to confirm m1 gone: m3's load was sent once m1 had freed.
        assert at_load["m3"] == {"m1": TritonModelState.UNAVAILABLE}
        await mgr.ensure("m1")
        assert loaded(admin) == {"m3", "m1"}

    with caplog.at_level(logging.ERROR, logger="control_plane.manager"):
        run(go())
    if probe == "broken":  # said once, not once per poll
        assert len([r for r in caplog.records if "measuring free memory" in r.message]) == 1


def test_overlap_counts_every_load_in_flight_on_the_device(tmp_path):
    async def go():
        # 2.5 GiB free: one load in flight takes its size + 1 GiB margin, so two loads
        # fit ahead of their victims, the third waits for room: here, since no victim frees
        # until the test says, for a load in flight to finish.
        mgr, admin, clock = make(tmp_path, max_loaded=3, load_delay_s=0.1, unload_timeout_s=30,
                                 free_memory=lambda server: int(2.5 * GiB))
        await mgr.start()
        await load_in_order(mgr, clock, ["m1", "m2", "m3"])
        admin.free_gate = asyncio.Event()
        newcomers = ["m4", "m5", "m6"]
        at_load = states_at_load(admin, ["m1", "m2", "m3", *newcomers])
        clock.tick()
        await asyncio.wait_for(asyncio.gather(*(mgr.ensure(n) for n in newcomers)), 10)
        victims = ("m1", "m2", "m3")
        for states in at_load.values():  # every load was sent before any victim freed
            assert all(states[v] != TritonModelState.UNAVAILABLE for v in victims), at_load
        # Two were sent before any load finished; the third (whichever placed last) only
        # after one of those two had.
        first = [n for n in newcomers if not any(
            at_load[n][m] == TritonModelState.READY for m in newcomers)]
        (third,) = set(newcomers) - set(first)
        assert len(first) == 2, at_load
        assert any(at_load[third][m] == TritonModelState.READY for m in first), at_load
        admin.free_gate.set()
        await settle(mgr, lambda: all(mgr.get(v).state == ModelState.WARM for v in victims))

    run(go())


def test_host_available_bytes_reads_meminfo_and_the_cgroup_limit():
    meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n"
    assert host_available_bytes(meminfo, "max\n", "5\n") == 20_000_000 * 1024
    assert host_available_bytes(meminfo, str(8 * GiB), str(6 * GiB)) == 2 * GiB
    assert host_available_bytes("MemTotal: 5 kB\n", "max", "0") is None
