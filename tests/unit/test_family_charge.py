"""A model family is charged for the slots it holds: its K x slot_bytes count against its
server's budget from its load on, filled or not; a variant's miss takes a slot of its
family (evicting a variant of that family), and a family with no variant left is the victim
that returns all of its room."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.eviction import CachePlanner, Capacity, LRUPolicy, Resident
from control_plane.manager import ManagerConfig, ModelManager, ServerSpec
from control_plane.manager.records import ModelState, SlotPool
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import IndexEntry, TritonModelState
from domain.errors import CapacityExhausted, ControlPlaneError, TritonUnavailable
from tests.unit.test_manager_unit import FakeAdmin

SLOT_BYTES = 100
SLOTS = 2
VARIANTS = ("v1", "v2", "v3")
SIZES = {"m1": 250, "m2": 200, "m3": 300, **{v: SLOT_BYTES for v in VARIANTS}}


def run(coro):
    return asyncio.run(coro)


class FakeFamilyAdmin(FakeAdmin):
    """FakeAdmin whose v1..v3 are variants of family ``fam`` (2 slots of 100 bytes): the
    family model is loaded with a variant's first load and unloaded only by
    ``unload_slots``; Triton's index lists the variants, not the family."""

    def __init__(self, models):
        super().__init__([*models, *VARIANTS])
        self.in_one_request = set(VARIANTS)
        self.family_loads = 0
        self.family_unloads = 0
        self.family_loaded = False

    def measured(self, model):
        return model not in VARIANTS

    def slot_pool(self, model):
        return SlotPool("fam", SLOTS, SLOT_BYTES) if model in VARIANTS else None

    def loaded_slots(self, family):
        return SLOTS if family == "fam" and self.family_loaded else None

    def slot_pools(self):
        return {"fam": SlotPool("fam", SLOTS, SLOT_BYTES)} if self.family_loaded else {}

    async def load(self, model):
        if model in VARIANTS and not self.family_loaded:
            self.family_loaded = True
            self.family_loads += 1
        await super().load(model)

    async def unload_slots(self, family):
        assert not any(self.states[v] == TritonModelState.READY for v in VARIANTS), \
            "a family was unloaded with variants in its slots"
        self.family_loaded = False
        self.family_unloads += 1

    async def index(self, ready_only=False):
        return {m: IndexEntry(m, s) for m, s in self.states.items()
                if not ready_only or s == TritonModelState.READY}


class Sizes:
    """A stager that knows every model's size."""

    async def stage(self, model):
        return SIZES[model]

    def set_busy(self, model, busy):
        pass

    def known(self):
        return set(SIZES)


def make(tmp_path, budget_bytes, models=("m1", "m2", "m3"), repository=None):
    admin = FakeFamilyAdmin(models)
    spec = ServerSpec("s0", "fake:1", "fake:2", memory_budget_bytes=budget_bytes)
    server = ModelManager.make_server(spec, "lru", admin=admin)
    mgr = ModelManager([server], StateStore(tmp_path / "s.db"), stager=Sizes(),
                       repository=repository,
                       config=ManagerConfig(policy="lru", unload_timeout_s=0.3, headroom_models=0))
    return mgr, admin, server


def ready(mgr):
    return {m["model"] for m in mgr.status() if m["state"] == "ready"}


async def idle(mgr):
    while mgr.state.tasks.unloads or mgr.state.tasks.loads or mgr.state.tasks.background:
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- the planner
def pool_planner(max_bytes=None, max_slots=None):
    planner = CachePlanner(LRUPolicy(), Capacity(max_bytes, max_slots))
    planner.admit(Resident("fam@s0", SLOTS * SLOT_BYTES, holds=SLOTS), 0.0)
    return planner


@pytest.mark.parametrize("case, members, plan_for, expected_victims", [
    ("a free slot costs nothing", ["v1"], "v2", []),
    ("a full family evicts its least recently used variant", ["v1", "v2"], "v3", ["v1"]),
])
def test_a_variant_takes_a_slot_of_its_family(case, members, plan_for, expected_victims):
    planner = pool_planner(max_bytes=SLOTS * SLOT_BYTES + 250)
    planner.admit(Resident("m1", 250), 0.5)
    for t, v in enumerate(members, start=1):
        planner.admit(Resident(v, SLOT_BYTES, pool="fam@s0"), float(t))
    plan = planner.plan(plan_for, SLOT_BYTES, pool="fam@s0", pool_slots=SLOTS)
    assert plan.victims == expected_victims, case
    assert plan.pool_slots == 0
    assert planner.used_bytes == SLOTS * SLOT_BYTES + 250, "variants count inside their family"


def test_empty_slots_are_not_free_room_and_an_empty_family_is_a_victim():
    planner = pool_planner(max_bytes=450, max_slots=3)
    assert planner.used_bytes == 200 and planner.used_slots == SLOTS
    planner.admit(Resident("v1", SLOT_BYTES, pool="fam@s0"), 1.0)
    # 250 more bytes fit beside the family's 200; 300 do not, and with a variant in its
    # slots the family is no victim: nothing frees room.
    assert planner.plan("m1", 250).victims == []
    with pytest.raises(CapacityExhausted):
        planner.plan("m3", 300)
    planner.remove("v1")  # its last variant left: the whole family is the victim
    plan = planner.plan("m3", 300)
    assert plan.victims == ["fam@s0"] and plan.freed_bytes == 200


def test_a_family_not_loaded_needs_the_room_of_all_its_slots():
    planner = CachePlanner(LRUPolicy(), Capacity(450, None))
    planner.admit(Resident("m1", 300), 0.0)
    plan = planner.plan("v1", SLOT_BYTES, pool="fam@s0", pool_slots=SLOTS)
    assert plan.pool_slots == SLOTS and plan.victims == ["m1"]


# --------------------------------------------------------------------------- the manager
def test_a_familys_empty_slots_are_never_room_for_a_separate_model(tmp_path):
    async def go():
        mgr, admin, server = make(tmp_path, budget_bytes=600)
        await mgr.start()
        await mgr.ensure("v1")  # the family loads with 2 slots: 200 bytes, one slot empty
        assert server.planner.used_bytes == 200
        await mgr.ensure("m1")  # 250: 450 used
        mgr.touch("v1")
        # 200 more would fit only in the room of the empty slot: m1 leaves (LRU; evicting
        # v1 frees no room), and the family keeps its slots.
        await mgr.ensure("m2")
        await idle(mgr)
        assert ready(mgr) == {"v1", "m2"}
        assert server.planner.used_bytes == 400  # the budget is 600
        fleet = mgr.fleet()[0]
        assert fleet["used_bytes"] == 400
        assert fleet["slot_pools"] == {"fam": {"slots": 2, "bytes": 200, "members": 1}}
        # With m2 pinned nothing can make room for m3 (300): refused, the family untouched.
        await mgr.pin("m2")
        with pytest.raises(CapacityExhausted):
            await mgr.ensure("m3")
        assert ready(mgr) == {"v1", "m2"} and admin.family_loaded
        await mgr.close()

    run(go())


def test_a_variants_miss_evicts_a_variant_of_its_family_not_other_models(tmp_path):
    async def go():
        mgr, admin, server = make(tmp_path, budget_bytes=450)
        await mgr.start()
        for name in ("v1", "v2", "m1"):
            await mgr.ensure(name)
        mgr.touch("v2")
        mgr.touch("m1")
        await mgr.ensure("v3")  # no free slot: v1 leaves in the same request, m1 stays
        await idle(mgr)
        assert admin.replace_calls == [("v3", ["v1"])]
        assert ready(mgr) == {"v2", "v3", "m1"}
        assert server.planner.used_bytes == 450
        await mgr.pin("v2")
        await mgr.pin("v3")
        with pytest.raises(CapacityExhausted, match="pinned"):
            await mgr.ensure("v1")
        assert ready(mgr) == {"v2", "v3", "m1"}
        await mgr.close()

    run(go())


def test_a_family_whose_variants_all_left_is_unloaded_for_a_separate_model(tmp_path):
    async def go():
        mgr, admin, server = make(tmp_path, budget_bytes=400)
        await mgr.start()
        await mgr.ensure("v1")
        await mgr.unload("v1")
        assert admin.family_loaded and server.planner.used_bytes == 200, \
            "an empty family keeps its slots until their room is needed"
        await mgr.ensure("m3")  # 300: only the family's room makes it fit
        await idle(mgr)
        assert admin.family_unloads == 1 and not admin.family_loaded
        assert ready(mgr) == {"m3"} and server.planner.used_bytes == 300
        assert "fam@s0" not in server.planner.residents
        await mgr.ensure("v1")  # needed again: m3 leaves, the family is loaded again
        await idle(mgr)
        assert admin.family_loads == 2 and ready(mgr) == {"v1"}
        assert server.planner.used_bytes == 200
        await mgr.close()

    run(go())


def test_the_first_start_evicts_what_assumed_empty_slots_were_free(tmp_path):
    """A server filled while empty slots counted as free: its family (one variant) and two
    models adopted from Triton are over the budget now; the reconcile evicts models, least
    recently used first, until they fit, and never the family holding a variant."""
    repo = tmp_path / "repo"
    for name in ("m1", "m2"):
        (repo / name).mkdir(parents=True)
        (repo / name / "model.bin").write_bytes(b"x" * SIZES[name])

    async def go():
        mgr, admin, server = make(tmp_path, budget_bytes=500, models=("m1", "m2"),
                                  repository=repo)
        admin.family_loaded = True
        for name in ("v1", "m1", "m2"):
            admin.states[name] = TritonModelState.READY
        await mgr.start()
        await idle(mgr)
        assert ready(mgr) >= {"v1"} and admin.family_loaded
        assert server.planner.used_bytes <= 500
        assert len(ready(mgr) & {"m1", "m2"}) == 1
        await mgr.close()

    run(go())


def make_two(tmp_path, budget_bytes):
    """Two servers, each with its own family instance (FakeFamilyAdmin)."""
    admins = {n: FakeFamilyAdmin(("m1", "m2", "m3")) for n in ("s0", "s1")}
    servers = [ModelManager.make_server(ServerSpec(n, f"{n}:1", f"{n}:2", memory_budget_bytes=budget_bytes),
                                        "lru", admin=a) for n, a in admins.items()]
    mgr = ModelManager(servers, StateStore(tmp_path / "s.db"), stager=Sizes(),
                       config=ManagerConfig(policy="lru", unload_timeout_s=0.3, headroom_models=0))
    return mgr, admins, {s.name: s for s in servers}


def test_a_variants_copy_takes_a_slot_of_its_family_on_the_other_server(tmp_path):
    async def go():
        mgr, admins, servers = make_two(tmp_path, budget_bytes=400)
        await mgr.start()
        await mgr.scale("v1", 2)
        await idle(mgr)
        # v1 in a slot on both servers, each server's family charged its 2 slots (200
        # bytes) and the copy counted as one member of the family there, nothing more.
        assert [n for n, a in admins.items() if a.states.get("v1") == TritonModelState.READY] == ["s0", "s1"]
        assert all(a.family_loaded for a in admins.values())
        for name, server in servers.items():
            assert server.planner.used_bytes == 200, name
            pools = next(f for f in mgr.fleet() if f["server"] == name)["slot_pools"]
            assert pools == {"fam": {"slots": 2, "bytes": 200, "members": 1}}, (name, pools)
        (row,) = [r for r in mgr.status() if r["model"] == "v1"]
        assert sorted(c["server"] for c in row["copies"] if c["state"] == "ready") == ["s0", "s1"]
        own = row["server"]
        other = next(n for n in servers if n != own)
        # Another variant's miss on the copy's server takes the free slot; a third variant's
        # miss there evicts the extra copy first (the lowest priority), never v2's own.
        await mgr.ensure("v2")
        await mgr.ensure("v3")
        await idle(mgr)
        ready_on_other = {m for m, s in admins[other].states.items() if s == TritonModelState.READY}
        own_on_other = {r["model"] for r in mgr.status()
                        if r["server"] == other and r["state"] == "ready"}
        assert own_on_other <= ready_on_other and len(ready_on_other) <= 2, ready_on_other
        # mmctl unload: every copy leaves, its families' slots stay charged until needed.
        await mgr.unload("v1")
        await idle(mgr)
        assert not any(a.states.get("v1") == TritonModelState.READY for a in admins.values())
        await mgr.close()

    run(go())


def test_a_first_load_failed_with_triton_unreachable_frees_its_familys_room(tmp_path):
    """The family's first load fails with Triton unreachable, and so does the unload that
    undoes it: the variant is left UNLOAD_FAILED, a member of the family's room, which
    stays LOADING.  Once the reconcile finds the variant gone, nothing held the room any
    more, yet it stayed LOADING for good: its bytes counted, and every later miss of the
    family waited out capacity_wait_s for 'its family is being unloaded'."""
    async def go():
        mgr, admin, server = make(tmp_path, budget_bytes=400)
        await mgr.start()

        async def unreachable(model):
            raise TritonUnavailable("Triton at fake:1 does not answer")

        admin.load = admin.unload = unreachable
        with pytest.raises(ControlPlaneError):
            await mgr.ensure("v1")
        del admin.load, admin.unload  # Triton answers again
        for _ in range(3):
            await mgr.step()
            await idle(mgr)
        pool = mgr.state.book.pools["fam@s0"]
        assert pool.state == ModelState.WARM and server.planner.used_bytes == 0, pool.state
        await asyncio.wait_for(mgr.ensure("v2"), 5)
        assert ready(mgr) == {"v2"} and server.planner.used_bytes == 200
        await mgr.close()

    run(go())
