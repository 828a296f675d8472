"""One cache per server: a model, an extra copy and a variant in its family's slot are each
an entry with its bytes and one place of ``--max-loaded``; one policy orders them all, a
miss of any kind evicts the least recently used evictable entry of any kind, and a family
model costs nothing beyond the slots its variants fill (elastic slots), unloaded once no
variant is left in them."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.eviction import CachePlanner, Capacity, LRUPolicy, Resident
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import IndexEntry, SlotPool, TritonModelState
from domain.errors import CapacityExhausted, ControlPlaneError, TritonUnavailable
from tests.unit.test_manager_unit import FakeAdmin

SLOT_BYTES = 100
SLOTS = 2
VARIANTS = ("v1", "v2", "v3")
SIZES = {"m1": 250, "m2": 200, "m3": 300, **{v: SLOT_BYTES for v in VARIANTS}}


def run(coro):
    return asyncio.run(coro)


class FakeFamilyAdmin(FakeAdmin):
    """FakeAdmin whose v1..v3 are variants of family ``fam`` (at most 2 slots of 100 bytes):
    the family model is loaded with a variant's first load and unloaded only by
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


def make(tmp_path, budget_bytes=None, models=("m1", "m2", "m3"), repository=None, max_loaded=None):
    admin = FakeFamilyAdmin(models)
    spec = ServerSpec("s0", "fake:1", "fake:2", memory_budget_bytes=budget_bytes,
                      max_loaded=max_loaded)
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


def member(name, at, planner, **fields):
    planner.admit(Resident(name, SLOT_BYTES, pool="fam@s0", **fields), float(at))


# Each case: the budget, what is resident (name, when last used, fields), the newcomer
# (a variant of fam when it starts with "v") and the victims planned, or the error's words.
CASES = [
    ("a family costs only the slots its variants fill", (450, None),
     [("v1", 1, {}), ("m1", 2, {})], ("m2", 200), ["v1"]),
    ("a free place costs nothing", (450, None), [("v1", 1, {}), ("m1", 2, {})], ("v2", 100), []),
    ("a variant may evict a separate model", (350, None),
     [("m1", 1, {}), ("v1", 2, {})], ("v2", 100), ["m1"]),
    ("a separate model evicts variants, oldest first", (None, 3),
     [("v1", 1, {}), ("v2", 2, {}), ("m1", 3, {})], ("m2", 250), ["v1"]),
    ("a full family evicts its own variant, never another entry", (None, 10),
     [("v1", 1, {}), ("m1", 0, {}), ("v2", 2, {})], ("v3", 100), ["v1"]),
    ("pinned variants are skipped", (None, 3),
     [("v1", 1, {"pinned": True}), ("m1", 2, {}), ("v2", 3, {})], ("m2", 250), ["m1"]),
    ("a variant serving requests is skipped", (None, 2),
     [("v1", 1, {"evictable": False}), ("v2", 2, {})], ("m1", 250), ["v2"]),
    ("a shadow evicts only shadows, whatever their kind", (None, 2),
     [("v1", 1, {"priority": 0}), ("m1", 0, {})], ("s1", 10), ["v1"]),
    ("everything pinned or busy: refused, naming them", (None, 2),
     [("v1", 1, {"pinned": True}), ("v2", 2, {"evictable": False})], ("m1", 250),
     "pinned: v1; busy serving, loading or unloading: v2"),
    ("a full family with every variant pinned", (None, 10),
     [("v1", 1, {"pinned": True}), ("v2", 2, {"pinned": True})], ("v3", 100),
     "all 2 slots of its family"),
]


@pytest.mark.parametrize("case, budget, residents, newcomer, expected", CASES,
                         ids=[c[0] for c in CASES])
def test_one_policy_orders_every_entry_of_a_server(case, budget, residents, newcomer, expected):
    planner = pool_planner(*budget)
    planner.priority_of = lambda key: 0 if key.startswith("s") else 2
    for name, at, fields in residents:
        if name.startswith("v"):
            member(name, at, planner, **fields)
        else:
            planner.admit(Resident(name, SIZES.get(name, 10), **fields), float(at))
    name, size = newcomer
    pool = "fam@s0" if name.startswith("v") else None
    if isinstance(expected, str):
        with pytest.raises(CapacityExhausted, match=expected.replace("(", r"\(")):
            planner.plan(name, size, pool=pool, pool_slots=SLOTS)
        return
    plan = planner.plan(name, size, pool=pool, pool_slots=SLOTS)
    assert plan.victims == expected, case
    assert plan.pool_slots == 0, "the family is there with a slot for it"


def test_a_family_counts_its_filled_slots_only():
    planner = pool_planner(max_bytes=450, max_slots=3)
    assert planner.used_bytes == 0 and planner.used_slots == 0 and planner.models == 0
    member("v1", 1, planner)
    assert planner.used_bytes == SLOT_BYTES and planner.used_slots == 1 and planner.models == 1
    assert planner.empty_pools() == []
    planner.remove("v1")  # its last variant left: the family holds nothing, and goes
    assert planner.used_bytes == 0 and planner.empty_pools() == ["fam@s0"]
    assert planner.plan("m3", 300).victims == [], "a family is never a victim"


def test_a_family_not_loaded_is_loaded_by_the_plan_for_one_slots_room():
    planner = CachePlanner(LRUPolicy(), Capacity(350, None))
    planner.admit(Resident("m1", 300), 0.0)
    plan = planner.plan("v1", SLOT_BYTES, pool="fam@s0", pool_slots=SLOTS)
    assert plan.pool_slots == SLOTS and plan.victims == ["m1"]
    planner = CachePlanner(LRUPolicy(), Capacity(450, None))
    planner.admit(Resident("m1", 300), 0.0)
    plan = planner.plan("v1", SLOT_BYTES, pool="fam@s0", pool_slots=SLOTS)
    assert plan.pool_slots == SLOTS and plan.victims == [], "one slot's room is free"


def test_a_full_family_grows_when_a_load_would_give_it_more_slots():
    planner = pool_planner(max_slots=10)
    member("v1", 1, planner)
    member("v2", 2, planner)
    plan = planner.plan("v3", SLOT_BYTES, pool="fam@s0", pool_slots=SLOTS + 2)
    assert plan.victims == [] and plan.pool_slots == SLOTS + 2
    planner.update("v1", leaving=True)  # a member on its way out: its slot is the newcomer's
    assert planner.plan("v3", SLOT_BYTES, pool="fam@s0", pool_slots=SLOTS).pool_slots == 0


def test_the_headroom_takes_no_variant_off_the_next_miss_path_and_still_frees_models():
    """Headroom keeps a slow unload (a Triton model's) off the next miss's path; a variant
    leaves at the speed of a fill, in the same request as its replacement's, so unloading
    one ahead of time would only cost a hit and a second request."""
    from control_plane.eviction import HeadroomSpec

    planner = pool_planner(max_slots=10)
    planner.headroom = HeadroomSpec(models=1)
    for t in range(10):
        member(f"v{t}", t, planner)
    assert planner.headroom_target().slots == 1 and planner.headroom_victims() == []
    planner = pool_planner(max_slots=10)
    planner.headroom = HeadroomSpec(models=1)
    planner.admit(Resident("m1", 250), 0.0)  # the least recently used entry is a model
    for t in range(1, 10):
        member(f"v{t}", t, planner)
    assert planner.headroom_victims() == ["m1"]


# --------------------------------------------------------------------------- the manager
def test_a_separate_model_evicts_the_least_recently_used_variant(tmp_path):
    """The family takes no room of its own: with --max-loaded 2 and two variants in their
    slots, a separate model evicts the older variant, and the family keeps the other."""
    async def go():
        mgr, admin, server = make(tmp_path, max_loaded=2)
        await mgr.start()
        await mgr.ensure("v1")
        assert server.planner.used_slots == 1, "one variant: one place"
        await mgr.ensure("v2")
        mgr.touch("v2")
        await mgr.ensure("m1")
        await idle(mgr)
        assert ready(mgr) == {"v2", "m1"}
        assert admin.family_loaded and admin.family_loads == 1
        fleet = mgr.fleet()[0]
        assert fleet["slot_pools"] == {"fam": {"slots": SLOTS, "members": 1, "bytes": SLOT_BYTES}}
        # A variant's miss evicts the least recently used entry of any kind: m1 now.
        mgr.touch("v2")
        await mgr.ensure("v3")
        await idle(mgr)
        assert ready(mgr) == {"v2", "v3"} and admin.family_loads == 1
        await mgr.close()

    run(go())


def test_nothing_evictable_is_said_only_when_true_and_names_what_holds_the_room(tmp_path):
    async def go():
        mgr, admin, _server = make(tmp_path, max_loaded=2)
        await mgr.start()
        await mgr.pin("v1")
        await mgr.pin("m1")
        with pytest.raises(CapacityExhausted, match="pinned: m1, v1"):
            await mgr.ensure("m2")
        assert ready(mgr) == {"v1", "m1"} and admin.family_loaded
        await mgr.unpin("v1")
        await mgr.ensure("m2")  # v1 is evictable again: it goes, not the error
        await idle(mgr)
        assert ready(mgr) == {"m1", "m2"}
        await mgr.close()

    run(go())


def test_a_variants_miss_in_a_full_family_replaces_a_variant_in_one_request(tmp_path):
    async def go():
        mgr, admin, server = make(tmp_path, budget_bytes=1000)
        await mgr.start()
        for name in ("v1", "v2", "m1"):
            await mgr.ensure(name)
        mgr.touch("v2")
        mgr.touch("m1")
        await mgr.ensure("v3")  # the family has 2 slots: v1 leaves in the same request
        await idle(mgr)
        assert admin.replace_calls == [("v3", ["v1"])]
        assert ready(mgr) == {"v2", "v3", "m1"}
        assert server.planner.used_bytes == 2 * SLOT_BYTES + SIZES["m1"]
        await mgr.pin("v2")
        await mgr.pin("v3")
        with pytest.raises(CapacityExhausted, match="pinned"):
            await mgr.ensure("v1")
        assert ready(mgr) == {"v2", "v3", "m1"}
        await mgr.close()

    run(go())


def test_a_family_whose_variants_all_left_is_unloaded(tmp_path):
    async def go():
        mgr, admin, server = make(tmp_path, budget_bytes=400)
        await mgr.start()
        await mgr.ensure("v1")
        await mgr.ensure("m3")  # 300 + 100: both fit
        await idle(mgr)
        assert admin.family_loaded and server.planner.used_bytes == 400
        await mgr.ensure("m2")  # 200: v1 (the oldest) leaves, and its family with it
        await idle(mgr)
        assert ready(mgr) == {"m2"} or ready(mgr) == {"m3", "m2"}
        assert admin.family_unloads == 1 and not admin.family_loaded
        assert "fam@s0" not in server.planner.residents
        await mgr.ensure("v1")  # needed again: the family is loaded again
        await idle(mgr)
        assert admin.family_loads == 2 and "v1" in ready(mgr)
        await mgr.unload("v1")  # mmctl unload of its last variant: the next pass unloads it
        await mgr.step()
        await idle(mgr)
        assert admin.family_unloads == 2 and not admin.family_loaded
        await mgr.close()

    run(go())


def test_the_first_start_evicts_entries_of_any_kind_down_to_the_budget(tmp_path):
    """A server adopted over its budget (a family with one variant and two models that
    Triton had loaded): the reconcile evicts least recently used entries until they fit."""
    repo = tmp_path / "repo"
    for name in ("m1", "m2", "v1"):
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
        assert server.planner.used_bytes <= 500
        assert len(ready(mgr)) == 2, ready(mgr)
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
        mgr, admins, servers = make_two(tmp_path, budget_bytes=200)
        await mgr.start()
        await mgr.scale("v1", 2)
        await idle(mgr)
        # v1 in a slot on both servers, each counting one slot's room there.
        assert [n for n, a in admins.items() if a.states.get("v1") == TritonModelState.READY] == ["s0", "s1"]
        assert all(a.family_loaded for a in admins.values())
        for name, server in servers.items():
            assert server.planner.used_bytes == SLOT_BYTES, name
            pools = next(f for f in mgr.fleet() if f["server"] == name)["slot_pools"]
            assert pools == {"fam": {"slots": SLOTS, "bytes": SLOT_BYTES, "members": 1}}, (name, pools)
        (row,) = [r for r in mgr.status() if r["model"] == "v1"]
        assert sorted(c["server"] for c in row["copies"] if c["state"] == "ready") == ["s0", "s1"]
        own = row["server"]
        other = next(n for n in servers if n != own)
        # Two more variants: each server's room is two slots; the extra copy goes first
        # (the lowest priority), never a variant's own copy.
        await mgr.ensure("v2")
        await mgr.ensure("v3")
        await idle(mgr)
        ready_on_other = {m for m, s in admins[other].states.items() if s == TritonModelState.READY}
        own_on_other = {r["model"] for r in mgr.status()
                        if r["server"] == other and r["state"] == "ready"}
        assert own_on_other <= ready_on_other and len(ready_on_other) <= 2, ready_on_other
        assert {"v2", "v3"} <= ready(mgr)
        await mgr.unload("v1")
        await idle(mgr)
        assert not any(a.states.get("v1") == TritonModelState.READY for a in admins.values())
        await mgr.close()

    run(go())


def test_a_first_load_failed_with_triton_unreachable_frees_its_familys_room(tmp_path):
    """The family's first load fails with Triton unreachable, and so does the unload that
    undoes it: the variant is left UNLOAD_FAILED, a member of the family, which stays
    LOADING.  Once the reconcile finds the variant gone, nothing holds the family any more:
    it is settled warm, and the next miss of the family loads it again."""
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
        assert ready(mgr) == {"v2"} and server.planner.used_bytes == SLOT_BYTES
        await mgr.close()

    run(go())
