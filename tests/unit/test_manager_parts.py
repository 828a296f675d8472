"""Each part of the model manager built alone, with only the parts it is given: the
wiring is explicit, so a part can be tested with stand-ins for the others."""

from __future__ import annotations

import asyncio
import time

import pytest

from control_plane.manager.executor import Executor
from control_plane.manager.fleet_state import ManagerState
from control_plane.manager.known_models import Catalog
from control_plane.manager.leases import Leases
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.pins import Pins
from control_plane.manager.placement import Placer
from control_plane.manager.recency import Recency
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.manager.room import RoomLedger
from control_plane.manager.unloader import Unloader
from control_plane.metrics import ControlPlaneMetrics
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import TritonModelState
from control_plane.triton.devices import NoMemoryMeter
from domain.errors import InvalidInput, ModelNotFound
from tests.conftest import run
from tests.unit.test_manager_unit import MODELS, FakeAdmin


def shared_state(tmp_path, admin=None, max_loaded=2) -> ManagerState:
    admin = admin or FakeAdmin(MODELS)
    server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=max_loaded),
                                      "lru", admin=admin)
    config = ManagerConfig(policy="lru", unload_timeout_s=0.3)
    return ManagerState(servers={"s0": server}, store=StateStore(tmp_path / "s.db"),
                        repository=None, config=config, metrics=ControlPlaneMetrics(),
                        clock=time.time, stager=None, priority_of=lambda _n: 0, placer=Placer(),
                        warmup_enabled=lambda _n: True, memory=NoMemoryMeter(),
                        room=RoomLedger(config, None))


def resident_ready(state: ManagerState, name: str) -> None:
    """``name`` READY on s0, as a finished load leaves it."""
    server = state.servers["s0"]
    server.admin.states[name] = TritonModelState.READY
    rec = state.book.record(name)
    rec.move(ModelState.LOADING, server="s0", memory_bytes=0)
    rec.move(ModelState.READY)


def catalog_of(state: ManagerState) -> Catalog:
    return Catalog(state.book, state.servers, state.stager, state.repository, state.memory)


def test_each_part_gets_only_what_it_uses_and_the_parts_it_calls(tmp_path):
    admin = FakeAdmin(MODELS)
    server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=2), "lru",
                                      admin=admin)
    mgr = ModelManager([server], StateStore(tmp_path / "s.db"))
    parts = [mgr.catalog, mgr.recency, mgr.unloader, mgr.loader, mgr.pins, mgr.reconciler,
             mgr.leases, mgr.reconciler.health]
    assert not any(hasattr(part, "state") for part in parts)  # no part holds everything
    book_readers = [p for p in parts if hasattr(p, "book")]
    assert all(p.book is mgr.state.book for p in book_readers) and len(book_readers) == 7
    assert not hasattr(mgr.recency, "tasks") and not hasattr(mgr.leases, "tasks")
    assert not hasattr(mgr.reconciler.health, "book")  # health sees servers, never records
    assert mgr.loader.unloader is mgr.unloader and mgr.pins.loader is mgr.loader
    assert mgr.leases.loader is mgr.loader and not hasattr(mgr.leases, "reconciler")
    assert mgr.leases.place_off_down == mgr.reconciler.place_off_down  # the reconcile's answer
    assert not hasattr(mgr.unloader, "catalog")  # it unloads the record the catalog found
    # The unloader decides what leaves; the executor carries unloads out, as it does loads.
    assert mgr.unloader.executor is mgr.executor and not hasattr(mgr.executor, "unloader")
    assert not hasattr(mgr.copies, "unloader")
    assert mgr.reconciler.pins is mgr.pins and mgr.reconciler.unloader is mgr.unloader


def test_catalog_alone_knows_what_some_triton_lists(tmp_path):
    async def go():
        catalog = catalog_of(shared_state(tmp_path))
        await catalog.known("m1")
        with pytest.raises(ModelNotFound, match="nosuch"):
            await catalog.known("nosuch")
        assert catalog.get("m1").state == ModelState.WARM
        assert catalog.ready_server_of("m1") is None

    run(go())


def test_unloader_alone_unloads_and_frees_the_room(tmp_path):
    async def go():
        state = shared_state(tmp_path)
        executor = Executor(state.book, state.tasks, state.keeping, state.config, state.clock,
                            state.room, state.warmup_enabled)
        unloader = Unloader(state.book, state.servers, state.tasks, state.keeping, state.config,
                            executor)
        resident_ready(state, "m1")
        await unloader.unload(state.book.records["m1"])
        assert state.book.records["m1"].state == ModelState.WARM
        assert state.servers["s0"].planner.used_slots == 0
        state.book.record("m2").set_pinned(True)
        resident_ready(state, "m2")
        with pytest.raises(InvalidInput, match="pinned"):
            await unloader.unload(state.book.records["m2"])

    run(go())


class StandInLoader:
    """What Pins and Leases ask of a loader: ``ensure``."""

    def __init__(self, state: ManagerState, fail: bool = False):
        self.state, self.fail, self.ensured = state, fail, []

    async def ensure(self, name, retry_failed=False):
        self.ensured.append(name)
        if self.fail:
            raise InvalidInput(f"no room for {name}")
        resident_ready(self.state, name)
        return self.state.book.records[name]


def test_pins_alone_load_through_the_loader_and_keep_no_pin_that_failed(tmp_path):
    async def go():
        state = shared_state(tmp_path)
        loader = StandInLoader(state)
        pins = Pins(state.book, state.tasks, state.store, state.config, catalog_of(state), loader)
        await pins.pin("m1")
        assert loader.ensured == ["m1"] and state.store.pins() == {"m1"}
        pins.loader = StandInLoader(state, fail=True)
        with pytest.raises(InvalidInput):
            await pins.pin("m2")
        assert not state.book.records["m2"].pinned and state.store.pins() == {"m1"}

    run(go())


def test_leases_alone_hold_a_model_from_its_load_until_the_request_is_answered(tmp_path):
    async def go():
        state = shared_state(tmp_path)
        catalog = catalog_of(state)
        leases = Leases(state.book, state.config, catalog,
                        Recency(state.book, state.servers, state.clock), StandInLoader(state),
                        check_reachable=lambda name: asyncio.sleep(0),
                        place_off_down=lambda rec: None)
        server = await leases.ensure_for_request("m1")
        assert server.name == "s0"
        residents = state.servers["s0"].planner.residents
        assert not residents["m1"].evictable  # held: no other load may evict it yet
        assert leases.requests_answered("m1") == 1
        assert residents["m1"].evictable and len(leases.request_holds) == 0

    run(go())


def test_the_catalog_finds_models_by_name_glob_state_and_server(tmp_path):
    async def go():
        state = shared_state(tmp_path)
        catalog = catalog_of(state)
        await catalog.refresh_catalog()
        resident_ready(state, "m2")
        state.book.record("m3").set_pinned(True)
        names = lambda found: [r.name for r in found[0]]
        assert names(catalog.find("m2")) == ["m2"]
        assert names(catalog.find("nosuch")) == []
        assert names(catalog.find("m[1-3]")) == ["m1", "m2", "m3"]
        assert names(catalog.find(state=ModelState.READY)) == ["m2"]
        assert names(catalog.find(server="s0")) == ["m2"]
        assert names(catalog.find("m*", state=ModelState.WARM)) == ["m1", "m3", "m4", "m5", "m6"]
        shown, hidden = catalog.find(include_warm=False)
        assert [r.name for r in shown] == ["m2", "m3"] and hidden == 4  # m3 is pinned

    run(go())
