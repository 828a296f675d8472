"""What router workers serve from travels as per-key changes: a worker that is behind gets
only what changed, a new one the whole state, and a change costs the same bytes whatever
the number of models."""

from __future__ import annotations

import json
from types import SimpleNamespace

from control_plane.admin.dataplane import DataPlaneHub
from control_plane.dataplane.publisher import PublishedState
from control_plane.manager.records import ModelRecord, ModelState
from control_plane.registry import Registry
from control_plane.state.state_store import StateStore
from router.serving.state_client import RemoteState
from tests.conftest import run


def test_changes_since_a_version_or_the_whole_state_when_the_log_is_too_short():
    published = PublishedState("e1", log_changes=3)
    assert published.apply([("placement", "a", "t0"), ("placement", "b", "t0")])
    assert not published.apply([("placement", "a", "t0")])  # nothing differs: no version
    assert published.apply([("placement", "a", None)])
    assert published.version == 2
    assert published.changes_since(1) == [["placement", "a", None]]
    assert published.changes_since(0) == [["placement", "a", "t0"], ["placement", "b", "t0"],
                                          ["placement", "a", None]]
    published.apply([("placement", "c", "t1")])
    published.apply([("placement", "d", "t1")])
    assert published.changes_since(0) is None  # the log no longer reaches back: whole state
    whole = json.loads(published.answer(0, "e1"))
    assert whole["sections"]["placement"] == {"b": "t0", "c": "t1", "d": "t1"}
    other_epoch = json.loads(published.answer(published.version, "e0"))
    assert "sections" in other_epoch  # a worker of another life gets everything
    assert json.loads(published.answer(3, "e1"))["changes"] == [["placement", "d", "t1"]]


def test_diff_of_a_whole_section_sets_and_removes_only_what_differs():
    published = PublishedState("e1")
    published.apply(published.diff("production", {"a": "a.v1", "b": "b.v1"}))
    assert published.diff("production", {"a": "a.v1", "c": "c.v1"}) == [
        ("production", "c", "c.v1"), ("production", "b", None)]


class Manager:
    """The manager as the hub reads it: records, readiness, servers, state changes."""

    def __init__(self, models: int):
        self.metrics = None
        self.repository = None
        self.listeners = []
        self.records = {}
        self.server = SimpleNamespace(name="triton0", up=True,
                                      spec=SimpleNamespace(grpc_url="127.0.0.1:1", http_url="127.0.0.1:2",
                                                           concurrency=None))
        self.servers = {"triton0": self.server}
        for i in range(models):
            rec = self.records[f"m{i:05d}"] = ModelRecord(f"m{i:05d}", on_move=self._moved)
            if i % 2 == 0:
                rec.move(ModelState.LOADING, server="triton0")
                rec.move(ModelState.READY)

    def _moved(self, name):
        for listener in self.listeners:
            listener(name)

    def on_state_change(self, listener):
        self.listeners.append(listener)

    def ready_server_of(self, name):
        rec = self.records.get(name)
        return self.server if rec is not None and rec.state == ModelState.READY else None

    def copy_servers_of(self, name):
        return []


def hub_of(tmp_path, models: int) -> tuple[DataPlaneHub, Manager]:
    store = StateStore(tmp_path / f"state-{models}.db")
    manager = Manager(models)
    return DataPlaneHub(manager, Registry(store.db), store), manager


def test_a_load_costs_the_same_bytes_with_a_thousand_or_ten_thousand_models(tmp_path):
    async def go():
        sizes = {}
        for models in (1_000, 10_000):
            hub, manager = hub_of(tmp_path, models)
            hub.publish()
            before = hub.version
            whole = len(hub.published.answer(-1, ""))
            rec = manager.records["m00001"]
            rec.move(ModelState.LOADING, server="triton0")
            rec.move(ModelState.READY)
            hub.publish()
            change = hub.published.answer(before, hub.epoch)
            assert json.loads(change)["changes"] == [["placement", "m00001", "triton0"]]
            sizes[models] = (whole, len(change))
        assert sizes[10_000][0] > 9 * sizes[1_000][0]  # the whole state grows with the models
        assert sizes[10_000][1] == sizes[1_000][1]  # one change does not

    run(go())


def test_a_worker_applying_changes_ends_with_what_a_new_worker_gets(tmp_path):
    async def go():
        hub, manager = hub_of(tmp_path, 50)
        hub.publish()
        behind = RemoteState("http://127.0.0.1:1", "token", "w0")
        behind.apply(json.loads(hub.published.answer(-1, "")))
        seen = behind.version
        assert behind.ready_server("m00000").name == "triton0" and behind.ready_server("m00001") is None
        for name, to in (("m00000", ModelState.UNLOADING), ("m00001", ModelState.LOADING),
                         ("m00001", ModelState.READY)):
            manager.records[name].move(to, server="triton0")
        hub.table.set_limit("m00003", 5.0, 5.0)
        manager.server.up = False
        hub.publish()
        behind.apply(json.loads(hub.published.answer(seen, hub.epoch)))
        fresh = RemoteState("http://127.0.0.1:1", "token", "w1")
        fresh.apply(json.loads(hub.published.answer(-1, "")))
        assert behind.sections == fresh.sections and behind.version == fresh.version
        assert behind.ready_server("m00000") is None and behind.ready_server("m00001").name == "triton0"
        assert behind.table.limits == {"m00003": {"qps": 5.0, "burst": 5.0}}
        assert not behind.addresses["triton0"].up

    run(go())


def test_a_state_change_is_published_without_waiting_for_the_tick(tmp_path):
    async def go():
        import asyncio

        hub, manager = hub_of(tmp_path, 10)
        hub.publish()
        before = hub.version
        rec = manager.records["m00001"]
        rec.move(ModelState.LOADING, server="triton0")
        rec.move(ModelState.READY)
        await asyncio.sleep(0)  # one turn of the loop, no publish loop running
        assert hub.version == before + 1
        assert json.loads(hub.published.answer(before, hub.epoch))["changes"] == [
            ["placement", "m00001", "triton0"]]

    run(go())


def test_the_age_of_a_version_is_known_while_the_log_has_it():
    published = PublishedState("e1", log_changes=1)
    published.apply([("placement", "a", "t0")])
    assert 0 <= published.age_of(1) < 1
    published.apply([("placement", "b", "t0")])
    assert published.age_of(1) is None and published.age_of(2) is not None
    assert published.age_of(7) is None
