"""Manager logic with a fake Triton (unit tier: no sockets, no processes)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading

import pytest

from control_plane.eviction import STAGE_PRIORITY
from control_plane.manager import loader as loader_module
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import IndexEntry, TritonModelState
from domain.errors import (
    CapacityExhausted,
    EvictionFailed,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
    OperationTimeout,
    TritonUnavailable,
)
from tests.conftest import run


class FakeAdmin:
    """Triton's model-control surface in memory; unloads free after ``free_delay_s``."""

    def __init__(self, models, load_delay_s=0.05, free_delay_s=0.02):
        self.states = {m: TritonModelState.ABSENT for m in models}
        self.load_calls: list[str] = []
        self.load_delay_s = load_delay_s
        self.free_delay_s = free_delay_s
        self.fail_load: set[str] = set()
        self.fail_warmup: set[str] = set()
        self.stuck_unloading: set[str] = set()
        self.fail_unload: set[str] = set()
        self.plans: dict = {}  # model -> WarmupPlan; default: no own warm-up, synthetic on
        self.warmup_calls: list[str] = []

        # Models whose loads may evict their victims in the same request (a family's
        # variants), and those requests as (model, victims).
        self.in_one_request: set[str] = set()
        self.replace_calls: list[tuple[str, list[str]]] = []

        # Set to an asyncio.Event, a load (``load_gate``) or the freeing after an unload
        # (``free_gate``) ends when the test sets it, not after its delay: a test says in
        # which order things happen instead of hoping the machine keeps to the delays.
        self.load_gate = None
        self.free_gate = None
        self.loading: set[str] = set()  # loads under way now
        self.most_loading = 0  # the most under way at once

    def measured(self, model):
        return True

    def replaces_in_one(self, model, victims):
        return bool(victims) and {model, *victims} <= self.in_one_request

    async def load_replacing(self, model, victims):
        self.replace_calls.append((model, list(victims)))
        for victim in victims:
            if self.states.get(victim) == TritonModelState.READY:
                self.states[victim] = TritonModelState.UNAVAILABLE
        await self.load(model)

    async def is_live(self):  # the liveness probe: this Triton always answers
        return True

    async def index(self, ready_only=False):
        return {m: IndexEntry(m, s) for m, s in self.states.items()
                if not ready_only or s == TritonModelState.READY}

    async def load(self, model):
        self.load_calls.append(model)
        self.states[model] = TritonModelState.LOADING
        self.loading.add(model)
        self.most_loading = max(self.most_loading, len(self.loading))
        try:
            if self.load_gate is not None:
                await self.load_gate.wait()
            else:
                await asyncio.sleep(self.load_delay_s)
        finally:
            self.loading.discard(model)
        if model in self.fail_load:
            self.states[model] = TritonModelState.UNAVAILABLE
            raise ModelLoadFailed(f"Triton failed to load {model}: boom")
        self.states[model] = TritonModelState.READY

    async def warmup_plan(self, model):
        from control_plane.triton.admin import WarmupPlan

        return self.plans.get(model, WarmupPlan(model_samples=0, synthetic_enabled=True))

    async def warmup(self, model, plan=None):
        self.warmup_calls.append(model)
        if model in self.fail_warmup:
            raise ModelLoadFailed(f"warm-up inference of {model} failed: bad output")
        return 1.0

    async def unload(self, model):
        if model in self.fail_unload:
            raise ModelLoadFailed(f"Triton failed to unload {model}: internal error")
        if self.states.get(model) != TritonModelState.READY:
            return
        self.states[model] = TritonModelState.UNLOADING
        if model in self.stuck_unloading:
            return

        async def free():
            if self.free_gate is not None:
                await self.free_gate.wait()
            else:
                await asyncio.sleep(self.free_delay_s)
            self.states[model] = TritonModelState.UNAVAILABLE

        asyncio.get_running_loop().create_task(free())

    async def wait_unavailable(self, model, timeout_s=None):
        deadline = asyncio.get_running_loop().time() + (timeout_s or 1)
        while self.states.get(model) == TritonModelState.UNLOADING:
            if asyncio.get_running_loop().time() > deadline:
                raise OperationTimeout(f"{model} still UNLOADING")
            await asyncio.sleep(0.005)
        return 0.0

    async def statistics(self):
        return {}

    # A Triton of models of their own: no family slots (TritonAdmin's answers).
    def slot_pool(self, model):
        return None

    def loaded_slots(self, family):
        return None

    def slot_pools(self):
        return {}

    def family_slots(self, family):
        return None

    async def close(self):
        pass


MODELS = [f"m{i}" for i in range(1, 7)]


def make(tmp_path, max_loaded=2, free_delay_s=0.02, stager=None, **cfg):
    admin = FakeAdmin(MODELS, free_delay_s=free_delay_s)
    spec = ServerSpec("s0", "fake:1", "fake:2", max_loaded=max_loaded)
    server = ModelManager.make_server(spec, "lru", admin=admin)
    mgr = ModelManager([server], StateStore(tmp_path / "s.db"), stager=stager,
                       config=ManagerConfig(policy="lru", unload_timeout_s=0.3, **cfg))
    return mgr, admin


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    """Turn the event loop until ``predicate()`` holds.  ``timeout_s`` only stops a hung
    test: nothing here is a bound on how fast the code is."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


def test_concurrent_ensures_share_one_load(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        await mgr.start()
        await asyncio.gather(*(mgr.ensure("m1") for _ in range(16)))
        assert admin.load_calls == ["m1"]

    run(go())


def test_loads_of_different_models_overlap(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=4)
        admin.load_gate = asyncio.Event()  # no load ends until all three were sent
        await mgr.start()
        loads = asyncio.gather(mgr.ensure("m1"), mgr.ensure("m2"), mgr.ensure("m3"))
        # Loads one after another would never have three under way at once: this hangs.
        await until(lambda: admin.loading == {"m1", "m2", "m3"}, "three loads under way at once")
        admin.load_gate.set()
        await asyncio.wait_for(loads, 10)
        assert admin.most_loading == 3

    run(go())


def test_failed_load_is_failed_with_reason_and_holds_nothing(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        admin.fail_load.add("m1")
        await mgr.start()
        with pytest.raises(ModelLoadFailed, match="boom"):
            await mgr.ensure("m1")
        rec = mgr.get("m1")
        assert rec.state == ModelState.FAILED and "boom" in rec.failure
        assert mgr.servers["s0"].planner.used_slots == 0
        admin.fail_load.clear()
        with pytest.raises(ModelLoadFailed, match="not retrying"):  # backoff: no load storm
            await mgr.ensure("m1")
        assert admin.load_calls == ["m1"]
        assert (await mgr.ensure("m1", retry_failed=True)).state == ModelState.READY

    run(go())


def test_a_refused_synthetic_warmup_is_reported_and_the_model_served(tmp_path):
    """Triton loaded it; only the control plane's invented request failed (Triton's own
    simple_string example refuses b"warmup")."""
    async def go():
        mgr, admin = make(tmp_path)
        admin.fail_warmup.add("m2")
        await mgr.start()
        rec = await mgr.ensure("m2")
        assert rec.state == ModelState.READY and admin.states["m2"] == TritonModelState.READY
        health = await mgr.health("m2")
        assert health["healthy"] is False and health["state"] == "ready"
        assert "warm-up inference of m2 failed" in health["warmup"]["error"]
        assert mgr.metrics.warmup_failures.labels("s0")._value.get() == 1
        assert (await mgr.ensure("m2")) is rec  # served: a hit, not a failed load

    run(go())


def test_stuck_unload_keeps_memory_counted_and_fails_the_new_load(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=1)
        await mgr.start()
        await mgr.ensure("m1")
        admin.stuck_unloading.add("m1")
        with pytest.raises(OperationTimeout):
            await mgr.ensure("m2")
        assert mgr.get("m1").state == ModelState.UNLOAD_FAILED  # stuck, still counted
        assert "m1" in mgr.servers["s0"].planner.residents
        assert "m2" not in mgr.servers["s0"].planner.residents
        assert mgr.get("m2").state == ModelState.WARM

    run(go())


def test_a_victim_whose_unload_fails_gives_the_newcomers_room_back_and_says_so(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=1)
        await mgr.start()
        await mgr.ensure("m1")
        admin.fail_unload.add("m1")
        with pytest.raises(EvictionFailed) as raised:
            await mgr.ensure("m2")
        assert raised.value.message.startswith("could not free room for m2 on s0: ")
        assert "Triton failed to unload m1" in raised.value.message
        assert mgr.get("m2").state == ModelState.WARM and mgr.get("m2").server is None
        assert "m2" not in mgr.servers["s0"].planner.residents  # its reservation given back
        assert mgr.get("m1").state == ModelState.UNLOAD_FAILED  # still counted where it is
        assert mgr.metrics.loads.labels("s0", "evict_failed")._value.get() == 1
        admin.fail_unload.clear()
        await mgr.unload("m1")  # the operator's retry frees the room: m2 loads now
        assert (await mgr.ensure("m2")).state == ModelState.READY

    run(go())


def test_all_pinned_refuses_without_evicting(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=2)
        await mgr.start()
        await mgr.pin("m1")
        await mgr.pin("m2")
        with pytest.raises(CapacityExhausted, match="m1, m2"):
            await mgr.ensure("m3")
        assert admin.states["m1"] == admin.states["m2"] == TritonModelState.READY
        assert admin.load_calls == ["m1", "m2"]

    run(go())


def test_pin_that_cannot_load_is_not_kept(tmp_path):
    async def go():
        mgr, _admin = make(tmp_path, max_loaded=1)
        await mgr.start()
        await mgr.pin("m1")
        with pytest.raises(CapacityExhausted):
            await mgr.pin("m2")
        assert not mgr.get("m2").pinned
        assert mgr.store.pins() == {"m1"}

    run(go())


def test_reconcile_notices_a_model_triton_dropped(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        await mgr.start()
        await mgr.ensure("m1")
        admin.states["m1"] = TritonModelState.UNAVAILABLE  # unloaded behind our back
        await mgr.step()
        assert mgr.get("m1").state == ModelState.WARM
        assert mgr.servers["s0"].planner.used_slots == 0
        admin.states["m3"] = TritonModelState.READY  # loaded behind our back
        await mgr.step()
        assert mgr.get("m3").state == ModelState.READY

    run(go())


def test_reconcile_evicts_down_to_budget_after_adoption(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=2)
        for m in ("m1", "m2", "m3"):
            admin.states[m] = TritonModelState.READY
        await mgr.start()
        ready = [m for m, s in admin.states.items() if s == TritonModelState.READY]
        assert len(ready) == 2

    run(go())


def test_a_load_waits_for_room_held_by_a_load_in_progress(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=1)
        await mgr.start()
        # m2 finds the only slot reserved by m1's load: it waits, then evicts m1.
        await asyncio.gather(mgr.ensure("m1"), mgr.ensure("m2"))
        assert admin.load_calls == ["m1", "m2"]
        assert mgr.get("m2").state == ModelState.READY
        assert mgr.get("m1").state == ModelState.WARM

    run(go())


def test_room_held_by_pins_fails_at_once(tmp_path):
    async def go():
        # A load that waited for room held by a pin would wait out capacity_wait_s (an hour
        # here) before it failed: a refusal at all says it did not wait.
        mgr, admin = make(tmp_path, max_loaded=1, capacity_wait_s=3600)
        await mgr.start()
        await mgr.pin("m1")
        ensuring = asyncio.create_task(mgr.ensure("m2"))
        done, _ = await asyncio.wait({ensuring}, timeout=10)  # stops a hung test only
        assert done, "m2 waits for room that only an unpin can give back"
        with pytest.raises(CapacityExhausted, match="m1"):
            ensuring.result()
        assert "m2" not in admin.load_calls and admin.states["m1"] == TritonModelState.READY

    run(go())


def test_unload_is_not_blocked_by_requests_waiting_for_the_same_model(tmp_path):
    async def go():
        # A drain that waited for the request would last drain_timeout_s (an hour here): the
        # unload finishing while the request is still held says it did not wait for it.
        mgr, _admin = make(tmp_path, max_loaded=2, drain_timeout_s=3600)
        await mgr.start()
        await mgr.ensure("m1")
        waiting = await mgr.acquire("m1")  # a request that has not reached Triton yet
        await asyncio.wait_for(mgr.unload("m1"), 10)  # stops a hung test only
        assert mgr.get("m1").state == ModelState.WARM
        mgr.release(waiting)  # only now: the unload did not wait for it

    run(go())


def test_failed_staging_backs_off(tmp_path):
    async def go():
        calls = []

        class BadStager:
            async def stage(self, model):
                calls.append(model)
                raise ModelLoadFailed(f"{model}: sha256 mismatch")

            def set_busy(self, model, busy):
                pass

            def known(self):
                return {"m1"}

        mgr, _admin = make(tmp_path, stager=BadStager())
        await mgr.start()
        with pytest.raises(ModelLoadFailed, match="sha256"):
            await mgr.ensure("m1")
        with pytest.raises(ModelLoadFailed, match="not retrying"):
            await mgr.ensure("m1")
        assert calls == ["m1"]

    run(go())



# --------------------------------------------------------------------------- pins vs unloads
def test_pin_wins_over_an_unload_that_has_not_finished(tmp_path):
    """load, unload, pin 0.03 s apart: the model ends loaded, pinned, in Triton too."""

    async def go():
        mgr, admin = make(tmp_path, max_loaded=2)
        admin.load_delay_s = 0.1
        await mgr.start()
        load = asyncio.create_task(mgr.ensure("m1"))
        await asyncio.sleep(0.03)
        unload = asyncio.create_task(mgr.unload("m1"))
        await asyncio.sleep(0.03)
        pinned = await mgr.pin("m1")
        await asyncio.gather(load, unload, return_exceptions=True)
        assert pinned.state == ModelState.READY and pinned.pinned
        await asyncio.sleep(0.1)  # anything still running would have finished by now
        rec = mgr.get("m1")
        assert (rec.state, rec.pinned) == (ModelState.READY, True)
        assert admin.states["m1"] == TritonModelState.READY
        assert mgr.servers["s0"].planner.residents["m1"].pinned

    run(go())


def test_pin_during_an_unload_in_progress_loads_again(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=2, free_delay_s=0.2)
        await mgr.start()
        await mgr.ensure("m1")
        unload = asyncio.create_task(mgr.unload("m1"))
        await asyncio.sleep(0.05)  # Triton is freeing it now
        assert mgr.get("m1").state == ModelState.UNLOADING
        rec = await mgr.pin("m1")
        await unload
        assert (rec.state, rec.pinned) == (ModelState.READY, True)
        assert admin.states["m1"] == TritonModelState.READY

    run(go())


def test_reconcile_loads_a_pinned_model_that_is_not_loaded(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        await mgr.start()
        await mgr.pin("m1")
        admin.states["m1"] = TritonModelState.UNAVAILABLE  # dropped behind our back
        await mgr.step()
        for _ in range(100):
            if mgr.get("m1").state == ModelState.READY:
                break
            await asyncio.sleep(0.01)
        assert mgr.get("m1").state == ModelState.READY
        assert admin.states["m1"] == TritonModelState.READY

    run(go())


def test_capacity_message_counts_only_models_really_pinned(tmp_path):
    """A model pinned while it is being unloaded does not hold its slot as a pin."""

    async def go():
        mgr, _admin = make(tmp_path, max_loaded=2, free_delay_s=0.2, capacity_wait_s=0.05)
        await mgr.start()
        await mgr.pin("m1")
        await mgr.ensure("m2")
        unload = asyncio.create_task(mgr.unload("m2"))
        await asyncio.sleep(0.05)
        pin = asyncio.create_task(mgr.pin("m2"))
        await asyncio.sleep(0.01)
        messages = []
        try:
            await mgr.ensure("m3")
        except CapacityExhausted as exc:
            messages.append(exc.message)
        await asyncio.gather(unload, pin, return_exceptions=True)
        for message in messages:
            pinned = re.search(r"pinned: ([^;)]*)", message).group(1).split(", ")
            assert len(pinned) <= 2, message
            assert "m2" not in pinned, message  # it was unloading: busy, not a pinned slot
        if not messages:
            # m3 found room (m2's slot was not counted as a pin while it unloaded); the pin
            # then loaded m2 again, evicting m3: both pins hold, within the two slots.
            assert mgr.get("m1").pinned and mgr.get("m2").pinned
            assert mgr.get("m2").state == ModelState.READY and mgr.get("m3").state != ModelState.READY
        resident = {n for n in ("m1", "m2", "m3") if mgr.get(n).state == ModelState.READY}
        assert len(resident) <= 2 and resident == {
            n for n in ("m1", "m2", "m3") if _admin.states[n] == TritonModelState.READY}

    run(go())


# --------------------------------------------------------------------------- failed unloads
def make_two(tmp_path, **cfg):
    """Two servers with one slot each and their own fake Triton."""
    admins = {n: FakeAdmin(MODELS) for n in ("s0", "s1")}
    servers = [ModelManager.make_server(ServerSpec(n, f"{n}:1", f"{n}:2", max_loaded=1), "lru",
                                        admin=admins[n]) for n in ("s0", "s1")]
    mgr = ModelManager(servers, StateStore(tmp_path / "s.db"),
                       config=ManagerConfig(policy="lru", unload_timeout_s=0.3, **cfg))
    return mgr, admins


def test_failed_unload_never_loads_the_model_elsewhere_and_keeps_it_counted(tmp_path):
    async def go():
        mgr, admins = make_two(tmp_path, failure_backoff_s=0.2)
        await mgr.start()
        rec = await mgr.ensure("m1")
        first = rec.server
        other = "s1" if first == "s0" else "s0"
        admins[first].fail_unload.add("m1")
        with pytest.raises(ModelLoadFailed, match="unload"):
            await mgr.unload("m1")
        assert rec.state == ModelState.UNLOAD_FAILED and rec.server == first
        assert "m1" in mgr.servers[first].planner.residents  # still counted as used
        # Right after the failure: backoff, and never a second copy on the other server.
        with pytest.raises(ModelLoadFailed, match="not retrying"):
            await mgr.ensure("m1")
        assert admins[other].load_calls == []
        # After the backoff, while the first server still fails to unload it: still refused.
        await asyncio.sleep(0.25)
        with pytest.raises(ModelLoadFailed):
            await mgr.ensure("m1")
        assert admins[other].load_calls == [] and admins[first].load_calls == ["m1"]
        # Once the first server confirms it gone, the model loads again (once, somewhere).
        admins[first].fail_unload.clear()
        await asyncio.sleep(0.25)
        rec = await mgr.ensure("m1")
        assert rec.state == ModelState.READY
        ready = [n for n, a in admins.items() if a.states["m1"] == TritonModelState.READY]
        assert ready == [rec.server]
        holders = [n for n, s in mgr.servers.items() if "m1" in s.planner.residents]
        assert holders == [rec.server]

    run(go())


def test_reconcile_retries_a_failed_unload_with_backoff(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, failure_backoff_s=0.3)
        await mgr.start()
        await mgr.ensure("m1")
        admin.fail_unload.add("m1")
        with pytest.raises(ModelLoadFailed):
            await mgr.unload("m1")
        calls = []
        real_unload = admin.unload

        async def counting_unload(model):
            calls.append(model)
            return await real_unload(model)

        admin.unload = counting_unload
        for _ in range(5):  # reconcile passes inside the backoff: no unload storm
            await mgr.step()
            await asyncio.sleep(0.01)
        assert calls == []
        admin.fail_unload.clear()
        await asyncio.sleep(0.3)
        await mgr.step()
        for _ in range(100):
            if "m1" not in mgr.servers["s0"].planner.residents:
                break
            await asyncio.sleep(0.01)
        assert calls == ["m1"]
        assert "m1" not in mgr.servers["s0"].planner.residents
        assert mgr.get("m1").server is None

    run(go())


# --------------------------------------------------------------------------- shadows
def staged(tmp_path, stages, max_loaded=2, **cfg):
    """A manager whose models have rollout stages (name -> stage)."""
    admin = FakeAdmin(MODELS)
    server = ModelManager.make_server(ServerSpec("s0", "f:1", "f:2", max_loaded=max_loaded), "lru",
                                      admin=admin)
    mgr = ModelManager([server], StateStore(tmp_path / "s.db"),
                       config=ManagerConfig(policy="lru", unload_timeout_s=0.3, **cfg),
                       priority_of=lambda n: STAGE_PRIORITY[stages.get(n, "production")])
    return mgr, admin


def test_a_shadow_load_never_evicts_a_model_serving_traffic(tmp_path):
    async def go():
        mgr, admin = staged(tmp_path, {"m3": "shadow", "m4": "shadow", "m2": "canary"})
        await mgr.start()
        await mgr.ensure("m1")  # production
        await mgr.ensure("m2")  # canary: serves a share of production traffic
        with pytest.raises(CapacityExhausted, match="shadow") as err:
            await mgr.ensure("m3")
        assert "m1" in err.value.message and "m2" in err.value.message
        assert {m for m, s in admin.states.items() if s == TritonModelState.READY} == {"m1", "m2"}
        assert "m3" not in admin.load_calls
        assert mgr.get("m3").state == ModelState.WARM

    run(go())


def test_a_shadow_load_may_evict_another_shadow(tmp_path):
    async def go():
        mgr, admin = staged(tmp_path, {"m3": "shadow", "m4": "shadow"})
        await mgr.start()
        await mgr.ensure("m3")  # shadow, the least recently used
        await mgr.ensure("m1")  # production
        await mgr.ensure("m4")  # evicts the other shadow, not m1
        assert {m for m, s in admin.states.items() if s == TritonModelState.READY} == {"m1", "m4"}

    run(go())


def test_a_shadow_does_not_wait_for_room_held_by_production_loads(tmp_path):
    async def go():
        # m1's load ends only when the test says: a shadow that waited for its room would
        # still be waiting (up to capacity_wait_s, an hour here) when the test stops.
        mgr, admin = staged(tmp_path, {"m3": "shadow"}, max_loaded=1, capacity_wait_s=3600)
        admin.load_gate = asyncio.Event()
        await mgr.start()
        prod = asyncio.create_task(mgr.ensure("m1"))
        await until(lambda: "m1" in admin.loading, "m1 loading")  # it holds the only slot
        shadow = asyncio.create_task(mgr.ensure("m3"))
        done, _ = await asyncio.wait({shadow}, timeout=10)  # stops a hung test only
        assert done, "the shadow waits for room held by a production load"
        with pytest.raises(CapacityExhausted, match="shadow"):
            shadow.result()
        assert "m1" in admin.loading  # refused while m1 was still loading
        admin.load_gate.set()
        await prod

    run(go())


# --------------------------------------------------------------------------- warm-up
def test_a_model_with_its_own_warmup_gets_no_synthetic_one(tmp_path):
    from control_plane.triton.admin import WarmupPlan

    async def go():
        mgr, admin = make(tmp_path)
        admin.plans["m1"] = WarmupPlan(model_samples=2, synthetic_enabled=True)
        admin.plans["m2"] = WarmupPlan(model_samples=0, synthetic_enabled=False)
        admin.fail_warmup.update({"m1", "m2"})  # the synthetic one would fail: never sent
        await mgr.start()
        rec1, rec2 = await mgr.ensure("m1"), await mgr.ensure("m2")
        assert admin.warmup_calls == []
        assert (rec1.warmup["mode"], rec2.warmup["mode"]) == ("model", "off")
        assert "mms_warmup" in rec2.warmup["note"]
        assert rec1.healthy and rec2.healthy

    run(go())


def test_the_registry_can_turn_the_synthetic_warmup_off(tmp_path):
    async def go():
        admin = FakeAdmin(MODELS)
        server = ModelManager.make_server(ServerSpec("s0", "f:1", "f:2", max_loaded=2), "lru",
                                          admin=admin)
        mgr = ModelManager([server], StateStore(tmp_path / "s.db"),
                           config=ManagerConfig(policy="lru"),
                           warmup_enabled=lambda name: name != "m1")
        await mgr.start()
        assert (await mgr.ensure("m1")).warmup["mode"] == "off"
        assert (await mgr.ensure("m2")).warmup["mode"] == "synthetic"
        assert admin.warmup_calls == ["m2"]

    run(go())


# --------------------------------------------------------------------------- event loop
def test_artifact_size_walk_does_not_block_the_event_loop(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, max_loaded=3)
        loop = asyncio.get_running_loop()
        walks: list[bool] = []  # per walk: whether the event loop ran while it went on

        # A large repository on a slow disk: the walk ends only once the event loop has run
        # a callback it was handed meanwhile.  Off the loop, in a thread, the loop runs it at
        # once; a walk on the loop would wait for itself (10 s, then says so) instead.
        def slow_walk(name):
            loop_ran = threading.Event()
            loop.call_soon_threadsafe(loop_ran.set)
            walks.append(loop_ran.wait(10))
            return 10

        mgr.catalog.artifact_bytes = slow_walk
        await mgr.start()
        await mgr.ensure("m1")
        admin.states["m2"] = TritonModelState.READY  # adopted by the reconcile: sized too
        await mgr.step()
        assert len(walks) >= 2 and all(walks), f"a walk blocked the event loop: {walks}"
        assert mgr.get("m1").memory_bytes == mgr.get("m2").memory_bytes == 10

    run(go())


def test_known_refuses_an_unknown_name_once_per_ttl(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        index_calls = []
        real_index = admin.index

        async def counted_index():
            index_calls.append(1)
            return await real_index()

        admin.index = counted_index
        await mgr.known("m1")  # in the repository: no error
        with pytest.raises(ModelNotFound, match="nosuch"):
            await mgr.known("nosuch")
        asked = len(index_calls)
        assert asked >= 1  # the first refusal asked Triton
        with pytest.raises(ModelNotFound, match="nosuch"):
            await mgr.known("nosuch")
        assert len(index_calls) == asked  # remembered: no index RPC for a repeated bad name

    run(go())


class RecordingMeter:
    """A GPU memory meter that records which loads and unloads it was asked to measure."""

    def __init__(self):
        self.measured: list[str] = []
        self.released_models: list[str] = []

    @contextlib.asynccontextmanager
    async def measuring(self, server, model):
        from control_plane.triton.devices.meter import Measurement

        self.measured.append(model)
        yield Measurement()

    async def released(self, server, model):
        self.released_models.append(model)
        return True

    def describe(self, server):
        return {}


def test_a_familys_variant_is_never_measured_on_a_gpu_its_slot_is_its_size(tmp_path):
    """A variant's slot was allocated when its family loaded: measuring its load would count
    the family's whole allocation to it, and waiting for its unload's memory would wait
    forever."""
    async def go():
        admin = FakeAdmin(MODELS)
        admin.measured = lambda model: model != "m1"  # m1 is a family's variant
        meter = RecordingMeter()
        spec = ServerSpec("s0", "fake:1", "fake:2", max_loaded=1)
        server = ModelManager.make_server(spec, "lru", admin=admin)
        mgr = ModelManager([server], StateStore(tmp_path / "s.db"), memory=meter,
                           config=ManagerConfig(policy="lru", unload_timeout_s=0.3))
        await mgr.start()
        await mgr.ensure("m1")
        await mgr.ensure("m2")  # evicts m1
        await mgr.ensure("m1")  # evicts m2
        assert meter.measured == ["m2"] and meter.released_models == ["m2"]

    run(go())


def test_a_model_loaded_for_a_request_is_not_a_victim_while_the_request_is_on_its_way(tmp_path):
    """The router's miss: between the load answering and the request reaching Triton, another
    load must not evict it (under thrash that lost requests)."""
    async def go():
        mgr, admin = make(tmp_path, max_loaded=1, on_its_way_s=0.3)
        await mgr.start()
        server = await mgr.ensure_for_request("m1")
        assert server.name == "s0"
        held_at_unload = []  # whether m1's hold was still on when its unload was sent
        real_unload = admin.unload

        async def unload(model):
            held_at_unload.append((model, model in mgr.leases.request_holds))
            await real_unload(model)

        admin.unload = unload
        await asyncio.wait_for(mgr.ensure("m2"), 10)  # m2 waited for the hold, not refused
        assert held_at_unload == [("m1", False)]  # m1 left only once its hold was over
        assert mgr.records["m1"].state != ModelState.READY and mgr.records["m2"].state == ModelState.READY

    run(go())


def test_a_hold_ends_as_soon_as_its_request_is_answered(tmp_path):
    """Under thrash a slot turns over when the requests it was loaded for are answered, not
    after the whole ``on_its_way_s``."""
    async def go():
        mgr, _admin = make(tmp_path, max_loaded=1, on_its_way_s=30)
        await mgr.start()
        await mgr.ensure_for_request("m1")
        await mgr.ensure_for_request("m1")  # a second request: a second hold
        assert mgr.requests_answered("m1", 1) == 1
        other = asyncio.create_task(mgr.ensure("m2"))
        await asyncio.sleep(0.1)
        assert not other.done()  # the other request's hold still keeps m1
        assert mgr.requests_answered("m1", 5) == 1  # only the holds there are
        await asyncio.wait_for(other, 5)  # long before on_its_way_s
        assert mgr.records["m1"].state != ModelState.READY
        assert mgr.requests_answered("m1") == 0 and len(mgr.leases.request_holds) == 0

    run(go())


def test_a_workers_answers_end_its_own_holds_only(tmp_path):
    """Holds were one list per model: worker A's request outlived its hold (on_its_way_s),
    worker B ensured the model, and A's "answered" then ended B's hold while B's request
    was still on its way, so the model could leave under it."""
    async def go():
        mgr, _admin = make(tmp_path, max_loaded=1, on_its_way_s=0.2)
        await mgr.start()
        await mgr.ensure_for_request("m1", owner="w0")
        await asyncio.sleep(0.3)  # w0's hold expired: its request is still running
        await mgr.ensure_for_request("m1", owner="w1")
        assert mgr.requests_answered("m1", 1, owner="w0") == 0  # w1's hold is not w0's
        assert mgr.records["m1"].inflight == 1
        assert mgr.requests_answered("m1", 1, owner="w1") == 1
        assert mgr.records["m1"].inflight == 0 and len(mgr.leases.request_holds) == 0

    run(go())


def test_a_load_waiting_for_room_held_by_requests_starts_when_a_hold_ends(tmp_path, monkeypatch):
    """Room held by requests comes back when one is answered: the waiting load is told at
    once, not at its next poll (50 ms; made longer here, so that only being told starts it)."""
    monkeypatch.setattr(loader_module, "ROOM_POLL_S", 10.0)

    async def go():
        mgr, admin = make(tmp_path, max_loaded=1, on_its_way_s=30, capacity_wait_s=30)
        await mgr.start()
        await mgr.ensure_for_request("m1")
        waiting = asyncio.create_task(mgr.ensure("m2"))
        await asyncio.sleep(0.125)  # between two of the old 50 ms polls
        assert not waiting.done() and "m2" not in admin.load_calls  # m1's request holds the room
        assert mgr.requests_answered("m1", 1) == 1
        for _ in range(20):  # a few turns of the event loop, no time for a timer to fire
            await asyncio.sleep(0)
        assert mgr.records["m2"].state == ModelState.LOADING  # placed, m1 its victim
        assert mgr.records["m1"].state == ModelState.UNLOADING
        await asyncio.wait_for(waiting, 5)
        assert mgr.records["m2"].state == ModelState.READY and mgr.records["m1"].state != ModelState.READY

    run(go())


def test_when_a_hold_ends_the_load_that_waited_longest_tries_first_and_alone(tmp_path, monkeypatch):
    """Many loads waiting for one slot: the one that started waiting first gets it, and a
    change of room wakes one waiting load, not all of them (each would place again: work
    the size of the queue for every request answered)."""
    monkeypatch.setattr(loader_module, "ROOM_POLL_S", 10.0)
    models = [f"m{i}" for i in range(1, 21)]

    async def go():
        admin = FakeAdmin(models)
        server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=1), "lru",
                                          admin=admin)
        mgr = ModelManager([server], StateStore(tmp_path / "s.db"),
                           config=ManagerConfig(policy="lru", unload_timeout_s=0.3, on_its_way_s=30,
                                                capacity_wait_s=30))
        await mgr.start()
        await mgr.ensure_for_request("m1")
        waiting = []
        for name in models[1:]:  # m2 first, m20 last
            waiting.append(asyncio.create_task(mgr.ensure_for_request(name)))
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)
        places = []
        place = mgr.loader.place
        monkeypatch.setattr(mgr.loader, "place", lambda *a, **k: places.append(a[0]) or place(*a, **k))
        assert mgr.requests_answered("m1", 1) == 1
        for _ in range(20):
            await asyncio.sleep(0)
        assert mgr.records["m2"].state == ModelState.LOADING
        assert all(mgr.records[m].state != ModelState.LOADING for m in models[2:])
        assert len(places) < 8, places  # not one per waiting load (19)
        await asyncio.wait_for(waiting[0], 5)
        assert mgr.requests_answered("m2", 1) == 1
        await asyncio.wait_for(waiting[1], 5)  # then m3, the next oldest
        assert all(not t.done() for t in waiting[2:])
        for task in waiting[2:]:
            task.cancel()
        await asyncio.gather(*waiting[2:], return_exceptions=True)

    run(go())


def test_a_load_woken_for_room_it_cannot_use_passes_the_turn_to_the_next(tmp_path, monkeypatch):
    """The oldest waiting load cannot use the room a hold's end gave back (here it does not
    fit, whatever frees) and goes on waiting (another request's hold may free room it can
    use): the next waiting load places at once, not at its next poll (made 10 s here)."""
    monkeypatch.setattr(loader_module, "ROOM_POLL_S", 10.0)

    async def go():
        mgr, _admin = make(tmp_path, max_loaded=2, on_its_way_s=30, capacity_wait_s=30)
        await mgr.start()
        await mgr.ensure_for_request("m1")
        await mgr.ensure_for_request("m4")
        place = mgr.loader.place

        def oldest_never_fits(name, size_bytes):
            if name == "m2":
                raise CapacityExhausted("m2 fits nowhere")
            return place(name, size_bytes)
        monkeypatch.setattr(mgr.loader, "place", oldest_never_fits)
        oldest = asyncio.create_task(mgr.ensure_for_request("m2"))
        await asyncio.sleep(0.05)
        younger = asyncio.create_task(mgr.ensure_for_request("m3"))
        await asyncio.sleep(0.05)
        assert mgr.requests_answered("m1", 1) == 1
        for _ in range(20):  # a few turns of the event loop, no time for a timer to fire
            await asyncio.sleep(0)
        assert mgr.records["m3"].state == ModelState.LOADING  # placed, m1 its victim
        await asyncio.wait_for(younger, 5)
        assert not oldest.done()  # m4's request still holds its room
        oldest.cancel()
        await asyncio.gather(oldest, return_exceptions=True)

    run(go())


class WarmStager:
    """The warm tier with every model's files warm and current: ``stage`` answers without
    waiting for anything, as ``WarmTier.stage`` does then."""

    def __init__(self, models):
        self.models = set(models)

    async def stage(self, model):
        return 1000

    def set_busy(self, model, busy):
        pass

    def known(self):
        return self.models


def test_room_that_came_back_is_the_woken_loads_not_a_newcomers(tmp_path, monkeypatch):
    """A hold ends and wakes the load waiting for room; before it runs, a new miss arrives
    whose files are warm (its stage does not wait).  The room is the waiting load's: the
    newcomer waits behind it instead of placing at once and taking it (which served the
    newest misses first under thrash, and left the oldest waiting: the tail)."""
    monkeypatch.setattr(loader_module, "ROOM_POLL_S", 10.0)

    async def go():
        mgr, _admin = make(tmp_path, max_loaded=1, on_its_way_s=30, capacity_wait_s=30,
                           stager=WarmStager(MODELS))
        await mgr.start()
        await mgr.ensure_for_request("m1")
        waiting = asyncio.create_task(mgr.ensure_for_request("m2"))
        await until(lambda: mgr.loader.room.turns._turns, "m2 waiting for room")
        newcomer = asyncio.create_task(mgr.ensure_for_request("m3"))  # runs before m2 does
        assert mgr.requests_answered("m1", 1) == 1  # m2 woken: the room is its
        for _ in range(20):  # a few turns of the event loop, no time for a timer to fire
            await asyncio.sleep(0)
        assert mgr.records["m2"].state in (ModelState.LOADING, ModelState.READY)
        assert mgr.records["m3"].state == ModelState.WARM  # behind m2, not in its place
        await asyncio.wait_for(waiting, 5)
        assert mgr.requests_answered("m2", 1) == 1
        await asyncio.wait_for(newcomer, 5)  # the next change is its
        assert mgr.records["m3"].state == ModelState.READY

    run(go())


def test_only_a_change_that_may_give_room_back_wakes_a_waiting_load(tmp_path):
    """A request's hold starting takes room, never gives it: no waiting load is woken for
    it (it would place again for nothing).  The hold ending makes the model a victim again:
    that wakes one."""
    async def go():
        mgr, _admin = make(tmp_path, max_loaded=2, on_its_way_s=30)
        await mgr.start()
        await mgr.ensure("m1")  # loaded, no request holds it: a victim
        room = mgr.loader.room
        told = []
        room.changed = lambda: told.append("changed")
        await mgr.ensure_for_request("m1")  # a request holds it now: no victim
        assert told == []
        assert mgr.requests_answered("m1", 1) == 1
        assert told == ["changed"]

    run(go())


class NodeAdmin(FakeAdmin):
    """A Triton on another node, which can die (``down``): it answers nothing then."""

    down = False

    async def is_live(self):
        return not self.down

    async def index(self, ready_only=False):
        if self.down:
            raise TritonUnavailable("Triton at fake is not reachable (connection refused)")
        return await super().index(ready_only)


def test_a_request_for_a_model_on_a_dead_server_has_it_placed_on_another_at_once(tmp_path):
    """Not after server_lost_after_s: the request needs it now.  The dead server is only
    down; when it answers again the copy it kept is unloaded."""
    async def go():
        admins = {"s0": NodeAdmin(MODELS), "s1": NodeAdmin(MODELS)}
        servers = [ModelManager.make_server(ServerSpec(name, f"{name}:1", f"{name}:2", max_loaded=2),
                                            "lru", admin=admin) for name, admin in admins.items()]
        mgr = ModelManager(servers, StateStore(tmp_path / "s.db"),
                           config=ManagerConfig(policy="lru", unload_timeout_s=0.3,
                                                server_lost_after_s=600))
        await mgr.start()
        dead = (await mgr.ensure_for_request("m1")).name
        admins[dead].down = True

        server = await mgr.ensure_for_request("m1", unreachable=dead)

        assert server.name != dead and mgr.ready_server_of("m1") is server
        assert mgr.servers[dead].up is False and mgr.servers[dead].lost is False
        assert "m1" not in mgr.servers[dead].planner.residents
        admins[dead].down = False
        await mgr.step()  # it answers again, with its copy of m1 still loaded
        for _ in range(100):
            if admins[dead].states["m1"] != TritonModelState.READY:
                break
            await asyncio.sleep(0.01)
        assert admins[dead].states["m1"] != TritonModelState.READY
        assert mgr.ready_server_of("m1") is server

    run(go())


def test_a_version_only_in_the_cold_tier_is_known_to_health_and_unpin(tmp_path):
    """A registry version promoted but never loaded (its artifact still cold) is a known
    model: `mmctl health` and `mmctl unpin` answer for it, as `mmctl load` does."""

    class ColdStager:
        def known(self):
            return {"simple.v3"}

        def set_busy(self, name, busy):
            pass

    async def go():
        mgr, _admin = make(tmp_path, stager=ColdStager())
        await mgr.start()
        assert (await mgr.health("simple.v3"))["state"] == "warm"
        assert not (await mgr.unpin("simple.v3")).pinned
        with pytest.raises(ModelNotFound):
            mgr.get("nosuch.v1")

    run(go())


def test_a_model_loaded_while_a_reconcile_reads_the_index_is_not_forgotten(tmp_path):
    """The index a reconcile pass reads can predate a load that completes meanwhile: that
    model is not "no longer loaded" (forgetting it would leave Triton holding a model, or a
    family's slot, the manager counts as free)."""
    async def go():
        mgr, admin = make(tmp_path, max_loaded=4)
        await mgr.start()
        real_index = admin.index
        reading = asyncio.Event()
        loaded = asyncio.Event()

        async def slow_index(ready_only=False):
            snapshot = await real_index(ready_only)  # read before the load below completes
            reading.set()
            await loaded.wait()
            return snapshot

        admin.index = slow_index
        step = asyncio.get_running_loop().create_task(mgr.step())
        await reading.wait()
        await mgr.ensure("m1")
        loaded.set()
        await step
        assert mgr.get("m1").state == ModelState.READY
        assert "m1" in mgr.servers["s0"].planner.residents

    run(go())


def test_a_miss_that_replaces_in_one_request_sends_one_and_its_victim_ends_warm(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        admin.in_one_request = set(MODELS)
        await mgr.start()
        await mgr.ensure("m1")
        await mgr.ensure("m2")
        await mgr.ensure("m3")  # full: m1 goes, in the request that loads m3
        assert admin.replace_calls == [("m3", ["m1"])]
        assert admin.load_calls == ["m1", "m2", "m3"]  # no separate unload, no second load
        assert mgr.get("m1").state == ModelState.WARM and mgr.get("m3").state == ModelState.READY
        assert mgr.servers["s0"].planner.used_slots == 2
        assert mgr.metrics.evictions.labels("s0")._value.get() == 1

    run(go())


def test_a_load_of_the_victim_waits_for_the_request_that_replaces_it(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        admin.in_one_request = set(MODELS)
        await mgr.start()
        await mgr.ensure("m1")
        await mgr.ensure("m2")
        admin.load_delay_s = 0.1
        mgr.touch("m2")
        replacing = asyncio.get_running_loop().create_task(mgr.ensure("m3"))
        await asyncio.sleep(0.02)  # m3's request is in flight, m1 listed as unloading
        assert mgr.get("m1").state == ModelState.UNLOADING
        back = await mgr.ensure("m1")  # waits for it, then evicts m2 for m1
        await replacing
        assert back.state == ModelState.READY
        assert {r["model"] for r in mgr.status() if r["state"] == "ready"} == {"m1", "m3"}
        assert {m for m, s in admin.states.items() if s == TritonModelState.READY} == {"m1", "m3"}

    run(go())


def test_a_failed_replacing_request_unloads_the_victim_alone_and_fails_the_load(tmp_path):
    async def go():
        mgr, admin = make(tmp_path, failure_backoff_s=30)
        admin.in_one_request = set(MODELS)
        admin.fail_load.add("m3")
        await mgr.start()
        await mgr.ensure("m1")
        await mgr.ensure("m2")
        with pytest.raises(ModelLoadFailed, match="boom"):
            await mgr.ensure("m3")
        assert mgr.get("m3").state == ModelState.FAILED
        assert mgr.get("m1").state == ModelState.WARM  # unloaded on its own, nothing counted
        assert mgr.servers["s0"].planner.used_slots == 1
        await mgr.ensure("m4")  # the room is there
        assert mgr.get("m4").state == ModelState.READY

    run(go())


def test_turns_go_oldest_first_and_a_turn_passed_on_only_to_younger_waiters():
    """Six waiters: the oldest is woken, cannot use the room and passes it on, and so does
    each after it, each waiting again (its ticket twice in the queue, its done turn beside
    its new one); the pass ends at the youngest; the next wake goes to the oldest again."""
    from control_plane.manager.room import Turns

    async def go():
        turns = Turns()
        places = [turns.place() for _ in range(6)]
        for place in places:
            place.turn()
        assert turns.wake_oldest() and places[0].woken
        for n, place in enumerate(places):
            passed = place.pass_on()
            assert passed == (n < 5)
            if passed:
                assert places[n + 1].woken
            place.turn()  # waits again, its ticket unchanged
        assert not any(place.woken for place in places)
        for n in range(6):
            assert turns.wake_oldest() and places[n].woken
            assert not any(p.woken for p in places[n + 1:])
        assert not turns.wake_oldest()

    run(go())


def test_room_woken_for_a_waiter_is_promised_until_it_tries_or_leaves_it_to_the_next():
    """A woken waiter's room is promised (a newcomer waits behind it) until the waiter tries;
    one that leaves without trying (cancelled) hands its turn to the next waiter."""
    from control_plane.manager.room import Turns

    async def go():
        turns = Turns()
        first, second = turns.place(), turns.place()
        first.turn(), second.turn()
        assert not turns.promised()
        assert turns.wake_oldest() and turns.promised()
        first.trying()
        assert not turns.promised()  # it tried: the room was its to take or pass on
        second.turn()
        assert turns.wake_oldest() and second.woken and turns.promised()
        second.leave()  # gone without trying: the room is nobody's promise now
        assert not turns.promised()
        third, fourth = turns.place(), turns.place()
        third.turn(), fourth.turn()
        assert turns.wake_oldest() and third.woken
        third.leave()
        assert fourth.woken and turns.promised()  # handed on, not lost

    run(go())


@pytest.mark.parametrize("load_fails", [True, False], ids=["load-and-unload-fail", "load-succeeds-late"])
def test_a_load_on_a_server_declared_down_meanwhile_fails_clearly(tmp_path, load_fails):
    """The server was declared down during the load (its models forgotten, the record
    WARM with no server): the failed load's undo, or the late success, moved that record
    as if it were still there, an illegal move that raised something no caller catches
    (pinned loads started for the server's models died silently)."""
    async def go():
        mgr, admin = make(tmp_path)
        await mgr.start()
        admin.load_delay_s = 0.3
        if load_fails:
            admin.fail_load.add("m1")
            admin.fail_unload.add("m1")
        loading = asyncio.create_task(mgr.ensure("m1"))
        await asyncio.sleep(0.1)
        mgr.reconciler._forget_server_models(mgr.servers["s0"], "tritonserver exited")
        with pytest.raises(ModelLoadFailed):
            await loading
        assert mgr.get("m1").state == ModelState.WARM and mgr.get("m1").server is None
        if not load_fails:
            assert "declared down" in str(loading.exception())
        await mgr.close()

    run(go())


def test_a_pin_cancelled_while_another_waits_for_the_same_load_keeps_the_others_pin(tmp_path):
    """Two callers pin m1; the first one's client goes away during the shared load: its
    cancellation undid the pin, and the second caller was told it had pinned m1 though it
    was left unpinned, in memory and in the state store."""
    async def go():
        mgr, admin = make(tmp_path)
        await mgr.start()
        admin.load_delay_s = 0.3
        first = asyncio.create_task(mgr.pin("m1"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(mgr.pin("m1"))
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        rec = await second
        assert rec.pinned and mgr.get("m1").state == ModelState.READY
        assert "m1" in mgr.store.pins()
        # alone, a pin whose caller goes away is not kept, as one that cannot load
        lone = asyncio.create_task(mgr.pin("m2"))
        await asyncio.sleep(0.05)
        lone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await lone
        assert not mgr.get("m2").pinned and "m2" not in mgr.store.pins()
        await mgr.close()

    run(go())


def test_over_budget_after_adoption_the_lowest_stage_leaves_first(tmp_path):
    """Trimming a server adopted over its budget took the policy's first victim, whatever
    its stage: a production model left while an idle shadow stayed (a miss's plan takes the
    shadow)."""
    from control_plane.eviction import STAGE_PRIORITY

    async def go():
        admin = FakeAdmin(MODELS)
        server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=2), "lru",
                                          admin=admin)
        shadow = {"m3"}
        mgr = ModelManager([server], StateStore(tmp_path / "s.db"),
                           config=ManagerConfig(policy="lru", unload_timeout_s=0.3),
                           priority_of=lambda n: STAGE_PRIORITY["shadow" if n in shadow else "production"])
        for m in ("m1", "m2", "m3"):
            admin.states[m] = TritonModelState.READY
        await mgr.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while admin.states["m3"] == TritonModelState.READY and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert {m for m, s in admin.states.items() if s == TritonModelState.READY} == {"m1", "m2"}
        await mgr.close()

    run(go())


def test_a_burst_of_misses_writes_its_history_rows_in_one_transaction_and_close_loses_none(
        tmp_path, monkeypatch):
    """Each load and each eviction records a history row; a miss writes two.  Written as
    they come, each is a hand-off to the store's thread and a commit taking the event loop's
    time between back-to-back misses: the rows due are written together."""
    from control_plane.manager import fleet_state

    monkeypatch.setattr(fleet_state, "HISTORY_WRITE_DELAY_S", 3600.0)  # only close writes them

    async def go():
        mgr, _admin = make(tmp_path, max_loaded=1)
        store = mgr.store
        writes: list[dict] = []
        save_models = store.save_models

        def counted(rows):
            writes.append({m: dict(f) for m, f in rows.items()})
            save_models(rows)

        monkeypatch.setattr(store, "save_models", counted)
        await mgr.start()
        for name in ("m1", "m2", "m3"):  # each evicts the one before it
            await mgr.ensure(name)
        book = mgr.state.book.records
        await until(lambda: book["m2"].state != ModelState.UNLOADING, "m2 unloaded")
        assert writes == [] and store.model_rows() == {}
        await mgr.close()
        assert len(writes) == 1, writes
        rows = store.model_rows()
        assert rows["m3"]["server"] == "s0" and rows["m3"]["load_time_s"] is not None
        assert rows["m1"]["server"] is None and rows["m2"]["server"] is None
        assert rows["m1"]["load_time_s"] is not None  # its load's fields kept beside its unload's

    run(go())


def test_an_invalid_name_is_refused_at_the_manager_and_starts_no_load(tmp_path):
    async def go():
        mgr, admin = make(tmp_path)
        await mgr.start()
        for name in ("../m1", "m1/../../etc", "", "m" * 300):
            with pytest.raises(InvalidInput):
                await mgr.ensure(name)
        assert admin.load_calls == [] and not mgr.state.tasks.loads

    run(go())


def test_history_rows_that_fail_to_be_written_are_logged_and_the_model_is_served(
        tmp_path, monkeypatch, caplog):
    async def go():
        mgr, _admin = make(tmp_path, max_loaded=2)

        def refused(rows):
            raise RuntimeError("database is locked")

        monkeypatch.setattr(mgr.store, "save_models", refused)
        await mgr.start()
        rec = await mgr.ensure("m1")
        with caplog.at_level("ERROR"):
            await mgr.close()
        assert rec.state == ModelState.READY
        assert any("history of 1 model(s) (m1)" in r.getMessage() and "database is locked"
                   in r.getMessage() for r in caplog.records), caplog.text

    run(go())
