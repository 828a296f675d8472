"""A model's copies on several servers (``mmctl scale``), with fake Tritons (unit tier)."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import TritonModelState
from domain.errors import InvalidInput, ModelNotFound
from tests.conftest import run
from tests.unit.test_manager_unit import MODELS, FakeAdmin

READY = TritonModelState.READY
NAMES = ("s0", "s1", "s2")


def fleet(tmp_path, max_loaded=2, servers=NAMES, admins=None, store=None, load_of=dict, **cfg):
    admins = admins or {n: FakeAdmin(MODELS) for n in servers}
    made = [ModelManager.make_server(ServerSpec(n, f"{n}:1", f"{n}:2", max_loaded=max_loaded),
                                     "lru", admin=admins[n]) for n in servers]
    mgr = ModelManager(made, store or StateStore(tmp_path / "s.db"),
                       config=ManagerConfig(policy="lru", unload_timeout_s=0.3,
                                            failure_backoff_s=0.2, headroom_models=0, **cfg),
                       load_of=load_of)
    return mgr, admins


async def settle(mgr, until, timeout_s=3.0):
    """Run the manager's background work until ``until()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not until():
        assert asyncio.get_running_loop().time() < deadline, mgr.status()
        await asyncio.sleep(0.01)


def loaded_on(admins, model):
    return sorted(n for n, a in admins.items() if a.states.get(model) == READY)


def test_scale_loads_copies_on_other_servers_and_counts_each(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path)
        await mgr.start()
        rec = await mgr.scale("m1", 3)
        assert loaded_on(admins, "m1") == ["s0", "s1", "s2"]
        assert mgr.copy_servers_of("m1")[0] == rec.server
        assert sorted(mgr.copy_servers_of("m1")) == ["s0", "s1", "s2"]
        # Each copy holds room on its own server: the planners count one model each.
        assert [mgr.servers[n].planner.used_slots for n in NAMES] == [1, 1, 1]
        row = mgr.status_row(rec)
        assert row["replicas"] == 3
        assert sorted(c["server"] for c in row["copies"]) == ["s0", "s1", "s2"]
        assert {c["state"] for c in row["copies"]} == {"ready"}
        # Down to one: the extra copies are unloaded, the model's own stays.
        await mgr.scale("m1", 1)
        await settle(mgr, lambda: sum(mgr.servers[n].planner.used_slots for n in NAMES) == 1)
        assert loaded_on(admins, "m1") == [rec.server]
        assert mgr.copy_servers_of("m1") == [rec.server]
        await mgr.close()

    run(go())


def test_scale_refuses_bad_input_with_what_to_do(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path)
        await mgr.start()
        for bad in (0, -1, "2", 2.5, True, None):
            with pytest.raises(InvalidInput, match="whole number >= 1"):
                await mgr.scale("m1", bad)
        with pytest.raises(InvalidInput, match=r"the fleet has 3 server\(s\) .*--triton-servers"):
            await mgr.scale("m1", 4)
        with pytest.raises(ModelNotFound, match="unknown model 'nope'"):
            await mgr.scale("nope", 2)
        assert mgr.copies.targets == {}
        assert all(a.load_calls == [] for a in admins.values())  # nothing was loaded
        await mgr.close()

    run(go())


def test_an_extra_copy_never_evicts_a_models_own_copy(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path, servers=("s0", "s1"), max_loaded=2)
        await mgr.start()
        await mgr.ensure("m1")
        for name in ("m2", "m3", "m4"):  # fill both servers with models' own copies
            await mgr.ensure(name)
        before = {n: loaded_on(admins, n) for n in ("m1", "m2", "m3", "m4")}
        await mgr.scale("m1", 2)
        # No room but the other models' own: the copy waits, and says why.
        assert {n: loaded_on(admins, n) for n in before} == before
        row = mgr.status_row(mgr.get("m1"))
        assert len(row["copies"]) == 1 and "extra copy" in row["copies_note"]
        await mgr.close()

    run(go())


def test_a_models_load_evicts_extra_copies_first(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path, servers=("s0", "s1"), max_loaded=2)
        await mgr.start()
        await mgr.ensure("m2")  # oldest: the LRU victim, were it not for the copy
        own = (await mgr.ensure("m1")).server
        other = "s1" if own == "s0" else "s0"
        await mgr.scale("m1", 2)
        assert loaded_on(admins, "m1") == ["s0", "s1"]
        mgr.touch("m1")
        planner = mgr.servers[other].planner
        # The copy shares its server with m2, the least recently used model: the copy goes.
        assert sorted(planner.residents) == [f"m1#{other}", "m2"]
        assert planner.plan("m5", 0).victims == [f"m1#{other}"]
        await mgr.ensure("m3")
        await mgr.ensure("m4")  # the fleet is full: the copy went first, m1's own stays
        await settle(mgr, lambda: mgr.copy_servers_of("m1") == [own])
        assert own in loaded_on(admins, "m1")
        await mgr.close()

    run(go())


def test_a_copy_takes_over_when_the_models_own_server_goes(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path)
        await mgr.start()
        rec = await mgr.scale("m1", 2)
        own = rec.server
        copy_server = mgr.copy_servers_of("m1")[1]
        # Its own server is lost: the copy is its own at once (no load), and a new extra
        # copy is placed on the server left.
        mgr.reconciler._forget_server_models(mgr.servers[own], "test: server lost")
        mgr.servers[own].health = mgr.servers[own].health.DOWN
        assert (rec.state, rec.server) == (ModelState.READY, copy_server)
        assert len(admins[copy_server].load_calls) == 1
        third = next(n for n in NAMES if n not in (own, copy_server))
        await settle(mgr, lambda: mgr.copy_servers_of("m1") == [copy_server, third])
        await mgr.close()

    run(go())


def test_unload_unloads_every_copy(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path)
        await mgr.start()
        await mgr.scale("m1", 3)
        rec = await mgr.unload("m1")
        assert rec.state == ModelState.WARM
        assert loaded_on(admins, "m1") == []
        await settle(mgr, lambda: sum(mgr.servers[n].planner.used_slots for n in NAMES) == 0)
        assert mgr.copies.target("m1") == 3  # the target stays: its next load copies it again
        await mgr.ensure("m1")
        await settle(mgr, lambda: len(loaded_on(admins, "m1")) == 3)
        await mgr.close()

    run(go())


def test_a_pinned_models_copies_are_pinned(tmp_path):
    async def go():
        mgr, _admins = fleet(tmp_path, servers=("s0", "s1"))
        await mgr.start()
        await mgr.pin("m1")
        await mgr.scale("m1", 2)
        (copy,) = mgr.state.book.extra_copies("m1")
        assert copy.pinned and mgr.servers[copy.server].planner.residents[copy.name].pinned
        await mgr.unpin("m1")
        await mgr.copies.converge("m1")
        assert not mgr.servers[copy.server].planner.residents[copy.name].pinned
        await mgr.close()

    run(go())


class SlowIndexAdmin(FakeAdmin):
    """A Triton whose repository index comes ``index_delay_s`` late (a busy machine's)."""

    index_delay_s = 0.0

    async def index(self, ready_only=False):
        await asyncio.sleep(self.index_delay_s)
        return await super().index(ready_only)


@pytest.mark.parametrize("late_s", [0.0, 0.2], ids=["at-once", "extra-copy-server-late"])
def test_targets_and_copies_survive_a_restart(tmp_path, late_s):
    async def go():
        admins = {n: SlowIndexAdmin(MODELS) for n in NAMES}
        mgr, _ = fleet(tmp_path, admins=admins)
        await mgr.start()
        await mgr.scale("m1", 2)
        held = loaded_on(admins, "m1")
        await mgr.close()
        mgr.store.close()
        # A new control plane over the same Tritons: the target is read back, the two copies
        # Triton holds are adopted (one its own, one extra), nothing is loaded again; also
        # when the server holding the extra copy reads its index late, after the model's
        # own copy was adopted (its converge once loaded the copy again meanwhile).
        loads = {n: len(a.load_calls) for n, a in admins.items()}
        for name in held[1:]:
            admins[name].index_delay_s = late_s
        again, _ = fleet(tmp_path, admins=admins)
        await again.start()
        assert again.copies.target("m1") == 2
        assert sorted(again.copy_servers_of("m1")) == held
        assert sum(again.servers[n].planner.used_slots for n in NAMES) == 2
        await again.step()
        await asyncio.sleep(0.05)
        assert {n: len(a.load_calls) for n, a in admins.items()} == loads
        assert loaded_on(admins, "m1") == held
        await again.close()

    run(go())


def test_a_copy_triton_holds_without_a_target_is_unloaded(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path)
        admins["s0"].states["m1"] = READY
        admins["s2"].states["m1"] = READY  # a copy nobody asked for (another life's)
        await mgr.start()
        await settle(mgr, lambda: sum(mgr.servers[n].planner.used_slots for n in NAMES) == 1)
        assert mgr.copy_servers_of("m1") == loaded_on(admins, "m1")
        assert len(loaded_on(admins, "m1")) == 1
        await mgr.close()

    run(go())


def test_auto_follows_outstanding_requests_with_hysteresis_and_a_cool_down(tmp_path):
    async def go():
        load = {}
        mgr, admins = fleet(tmp_path, scale_up_outstanding=4.0, scale_up_after_s=3.0,
                            scale_down_after_s=10.0, load_of=lambda: load)
        await mgr.start()
        await mgr.scale("m1", "auto", 1, 3)
        assert (mgr.copies.target("m1"), admins["s0"].load_calls) == (1, [])  # loaded on demand
        await mgr.ensure("m1")
        load["m1"] = 10
        copies = mgr.copies

        def wanted_after(now):
            copies.autoscale(now)
            return copies.target("m1")

        # 10 outstanding on one copy: busy; a copy is added once that lasted 3 s.
        assert [wanted_after(t) for t in (100.0, 102.0)] == [1, 1]
        assert wanted_after(103.0) == 2
        await copies.converge("m1")
        assert len(mgr.copy_servers_of("m1")) == 2
        # 5 per copy still: one more after the cool-down and 3 s busy again; never past max.
        assert [wanted_after(t) for t in (104.0, 105.5, 107.0)] == [2, 2, 3]
        await copies.converge("m1")
        assert len(mgr.copy_servers_of("m1")) == 3 and wanted_after(200.0) == 3
        # 5 outstanding on 3 copies: neither busy (5 < 4 x 3) nor idle (5 >= 2 x 2): stays.
        load["m1"] = 5
        assert [wanted_after(t) for t in (300.0, 400.0)] == [3, 3]
        # Idle: one copy fewer after 10 s each, down to min.
        load.clear()
        assert [wanted_after(t) for t in (500.0, 509.0, 510.0)] == [3, 3, 2]
        await copies.converge("m1")
        await settle(mgr, lambda: len(loaded_on(admins, "m1")) == 2)
        assert [wanted_after(t) for t in (511.0, 521.0, 530.0)] == [2, 1, 1]
        await mgr.close()

    run(go())


def test_auto_is_checked_kept_across_restarts_and_shown(tmp_path):
    async def go():
        mgr, _admins = fleet(tmp_path)
        await mgr.start()
        for args, message in ((("auto", 3, 2), r"min \(3\) is more than max \(2\)"),
                              (("auto", 1, 4), "the fleet has 3 server"),
                              (("auto", 0, 2), "min must be a whole number"),
                              ((2, 1, 2), "min and max go with replicas \"auto\" only"),
                              (("many",), "whole number >= 1 or \"auto\"")):
            with pytest.raises(InvalidInput, match=message):
                await mgr.scale("m1", *args)
        rec = await mgr.scale("m1", "auto", 2, 3)  # the least it keeps: loaded and copied now
        assert len(mgr.copy_servers_of("m1")) == 2
        row = mgr.status_row(rec)
        assert (row["replicas"], row["autoscale"]) == (2, {"min": 2, "max": 3})
        await mgr.close()
        mgr.store.close()
        again, _ = fleet(tmp_path)
        assert again.status_row(again.get("m1"))["autoscale"] == {"min": 2, "max": 3}
        assert again.copies.target("m1") == 2

    run(go())


def test_with_three_copies_one_takes_over_and_the_other_stays_counted(tmp_path):
    async def go():
        mgr, _admins = fleet(tmp_path)
        await mgr.start()
        rec = await mgr.scale("m1", 3)
        own = rec.server
        mgr.reconciler._forget_server_models(mgr.servers[own], "test: server lost")
        mgr.servers[own].health = mgr.servers[own].health.DOWN
        # One of the two extra copies is its own now; the other is still an extra copy,
        # each counted once by its server.
        others = sorted(n for n in NAMES if n != own)
        assert rec.server in others and sorted(mgr.copy_servers_of("m1")) == others
        for name in others:
            assert mgr.servers[name].planner.used_slots == 1, mgr.servers[name].planner.residents
        await mgr.close()

    run(go())


def test_unload_while_a_copy_is_loading_leaves_no_copy(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path, servers=("s0", "s1"))
        await mgr.start()
        own = (await mgr.ensure("m1")).server
        other = "s1" if own == "s0" else "s0"
        admins[other].load_delay_s = 0.3  # the copy's load is under way when the unload comes
        scaling = asyncio.ensure_future(mgr.scale("m1", 2))
        await settle(mgr, lambda: admins[other].states.get("m1") == TritonModelState.LOADING)
        rec = await mgr.unload("m1")
        await scaling
        await settle(mgr, lambda: sum(mgr.servers[n].planner.used_slots for n in ("s0", "s1")) == 0)
        assert rec.state == ModelState.WARM and loaded_on(admins, "m1") == []
        assert mgr.copy_servers_of("m1") == []
        await mgr.close()

    run(go())


def test_the_copies_gauge_follows_each_pass_and_is_dropped_with_the_target(tmp_path):
    async def go():
        mgr, _admins = fleet(tmp_path)
        await mgr.start()
        await mgr.scale("m1", 3)
        gauge = mgr.metrics.registry.get_sample_value
        mgr.copies.converge_all()
        assert gauge("mms_model_copies", {"model": "m1"}) == 3
        await mgr.scale("m1", 1)
        await settle(mgr, lambda: not mgr.state.book.extra_copies("m1"))
        mgr.copies.converge_all()
        assert gauge("mms_model_copies", {"model": "m1"}) is None
        await mgr.close()

    run(go())


def test_a_copy_takes_over_when_the_models_own_copy_is_evicted(tmp_path):
    async def go():
        mgr, admins = fleet(tmp_path, servers=("s0", "s1"), max_loaded=1)
        await mgr.start()
        rec = await mgr.scale("m1", 2)
        own = rec.server
        other = "s1" if own == "s0" else "s0"
        admins[own].free_delay_s = 0.1  # a pass of the reconcile runs while it leaves
        evicting = asyncio.ensure_future(mgr.executor.unload_now(mgr.servers[own], mgr.state.book.records["m1"], "evicted"))
        mgr.copies.converge_all()
        await evicting
        await settle(mgr, lambda: rec.server == other and rec.state == ModelState.READY)
        assert loaded_on(admins, "m1") == [other]
        await mgr.close()

    run(go())


def test_a_models_extra_copies_are_kept_in_its_record_and_found_by_their_typed_keys(tmp_path):
    """One record per model holds its copies: its own and, by server, its extra ones, each
    found again from the planner's key without parsing it."""
    from control_plane.manager.records import CopyKey

    async def go():
        mgr, _admins = fleet(tmp_path, servers=("s0", "s1"))
        await mgr.start()
        await mgr.scale("m1", 2)
        await settle(mgr, lambda: len(mgr.copy_servers_of("m1")) == 2)
        book = mgr.state.book
        rec = book.records["m1"]
        (where,) = set(mgr.copy_servers_of("m1")) - {rec.server}
        copy = rec.extra[where]
        key = next(k for k in mgr.servers[where].planner.residents if isinstance(k, CopyKey))
        assert (key, key.model, key.server) == (copy.name, "m1", where)
        assert book.lookup(key) is copy and book.find(CopyKey("m1", "nowhere")) is None
        assert book.every_extra_copy() == [copy] and "m1#" + where not in book.records
        await mgr.close()

    run(go())
