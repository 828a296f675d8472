"""What a stream of misses costs the control plane besides the misses: the holds a worker's
answered requests end travel with its next ensure call instead of a call each."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from control_plane.admin import dataplane
from router.serving import state_client
from tests.unit.test_dataplane_reports import NoModels, serving_hub


class Ensures(NoModels):
    """The manager as the hub's ensure and answered calls use it: every model loads on s0."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []
        self.server = SimpleNamespace(name="s0", up=True, spec=SimpleNamespace(
            grpc_url="127.0.0.1:1", http_url="http://127.0.0.1:2"))

    async def ensure_for_request(self, model, unreachable=None, owner=None):
        self.calls.append(("ensure", model))
        return self.server

    def requests_answered(self, model, count=1, owner=None):
        self.calls.append(("answered", model, count))
        return count


async def hub_with(tmp_path, monkeypatch, manager):
    h, server, (w0,) = await serving_hub(tmp_path, monkeypatch)
    h.manager = manager
    h.publisher.manager = manager
    h.reports.touch = manager.touch
    h.publish()
    assert await h.settle(timeout_s=5)
    return h, server, w0


async def close(h, server, w0):
    await w0.stop()
    await h.release_watchers()
    await server.close()


def test_answered_holds_travel_with_the_next_ensure(tmp_path, monkeypatch):
    async def go():
        manager = Ensures()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        try:
            assert w0.sections["meta"]["answered_with_ensure"]
            await w0.ensure("a")
            w0.requests_answered("a", 1)
            await w0.ensure("b")  # within ANSWERED_DELAY_S: carries a's hold
            assert manager.calls == [("ensure", "a"), ("answered", "a", 1), ("ensure", "b")]
            # No ensure follows: the hold is told on its own, once.
            w0.requests_answered("b", 1)
            await asyncio.sleep(state_client.ANSWERED_DELAY_S + 0.3)
            assert manager.calls[3:] == [("answered", "b", 1)]
        finally:
            await close(h, server, w0)

    asyncio.run(go())


def test_a_control_plane_that_does_not_say_it_takes_them_is_told_at_once(tmp_path, monkeypatch):
    async def go():
        manager = Ensures()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        try:
            w0.sections["meta"].pop("answered_with_ensure")  # as an earlier version publishes
            await w0.ensure("a")
            w0.requests_answered("a", 1)
            for _ in range(100):
                if len(manager.calls) == 2:
                    break
                await asyncio.sleep(0.001)  # far below ANSWERED_DELAY_S... on a quiet machine
            await w0.ensure("b")
            assert manager.calls == [("ensure", "a"), ("answered", "a", 1), ("ensure", "b")]
        finally:
            await close(h, server, w0)

    asyncio.run(go())


class EnsuresAndTouches(Ensures):
    def touch(self, name):
        self.calls.append(("touch", name))


def test_an_ensure_carries_the_uses_since_the_last_report_before_its_miss_picks_a_victim(
        tmp_path, monkeypatch):
    """Reports come every 0.25 s; a miss in between would pick its victim by uses that old (a
    busy variant served meanwhile would look the least recently used).  The ensure carries
    the worker's uses since, in the order of their last use, taken before the miss; a
    control plane of an earlier version gets them with the next report instead."""
    async def go():
        manager = EnsuresAndTouches()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        try:
            assert w0.sections["meta"]["uses_with_ensure"]
            for model in ("a", "b", "a"):
                w0.touch(model)
            await w0.ensure("c")
            assert manager.calls == [("touch", "b"), ("touch", "a"), ("touch", "a"), ("ensure", "c")]
            await w0.ensure("d")  # nothing used since: nothing carried
            assert manager.calls[4:] == [("ensure", "d")]
            await w0._send_report()  # nor reported twice
            assert manager.calls[5:] == []
            w0.sections["meta"].pop("uses_with_ensure")  # as an earlier version publishes
            w0.touch("e")
            await w0.ensure("f")
            assert manager.calls[5:] == [("ensure", "f")]
            await w0._send_report()
            assert manager.calls[6:] == [("touch", "e")]
        finally:
            await close(h, server, w0)

    asyncio.run(go())


TOO_MANY_ANSWERED = {f"m{i}": 1 for i in range(dataplane.MAX_ANSWERED_WITH_ENSURE + 1)}


@pytest.mark.parametrize(("field", "bad_values"), [
    ("answered", (["a"], {"a": 0}, {"a": "1"}, {"": 1}, {"a": 1.5}, TOO_MANY_ANSWERED)),
    ("since", (-1, "3", 1.5, True, [1])),
    ("uses", (["a"], "a", {"a": "x"}, {"a": None})),
])
def test_a_malformed_field_of_an_ensure_is_refused_and_loads_or_ends_nothing(
        tmp_path, monkeypatch, field, bad_values):
    """Beside good fields: none of them is applied either (no hold ended, no use taken)."""
    async def go():
        manager = EnsuresAndTouches()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        try:
            url = str(server.make_url("/v1/dataplane/ensure"))
            async with aiohttp.ClientSession() as session:
                for bad in bad_values:
                    body = {"model": "x", "answered": {"a": 1}, "uses": {"a": 1}, field: bad}
                    async with session.post(url, json=body) as resp:
                        body = await resp.json()
                    assert resp.status == 400 and field in body["message"], (bad, body)
            assert manager.calls == []
        finally:
            await close(h, server, w0)

    asyncio.run(go())

class Evicts(Ensures):
    """Room for one model: each ensure evicts the one before it, as a full server does."""

    def __init__(self):
        super().__init__()
        self.resident: str | None = None
        self.listeners = []

    def on_state_change(self, listener):
        self.listeners.append(listener)

    def ready_server_of(self, name):
        return self.server if name == self.resident else None

    async def ensure_for_request(self, model, unreachable=None, owner=None):
        evicted, self.resident = self.resident, model
        for name in filter(None, (evicted, model)):
            for listener in self.listeners:
                listener(name)
        return await super().ensure_for_request(model, unreachable, owner)


def test_an_ensure_answer_takes_what_its_load_evicted_off_the_workers_placement(tmp_path, monkeypatch):
    """The next request for an evicted model is a miss at the worker, not a send to a server
    that no longer has it: the long-poll is held back here, so only the ensure's answer can
    have told the worker."""
    async def go():
        manager = Evicts()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        manager.listeners.append(h.publisher.model_moved)
        monkeypatch.setattr(dataplane, "SNAPSHOT_LINGER_S", 30.0)
        try:
            await w0.ensure("a")
            assert w0.ready_server("a").name == "s0"
            await w0.ensure("b")
            assert w0.ready_server("a") is None, w0.placement
            assert w0.ready_server("b").name == "s0"
            assert w0.version == h.version
        finally:
            monkeypatch.setattr(dataplane, "SNAPSHOT_LINGER_S", 0.0)
            await close(h, server, w0)

    asyncio.run(go())


def test_changes_older_than_the_workers_version_are_passed_over(tmp_path, monkeypatch):
    """An ensure's answer and the long-poll bring changes in either order: the older one
    must not set a placement back."""
    async def go():
        manager = Evicts()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        manager.listeners.append(h.publisher.model_moved)
        try:
            before = w0.version
            await w0.ensure("a")
            older = {"version": w0.version, "epoch": w0.epoch, "changes": [["placement", "a", None]]}
            await w0.ensure("b")
            await w0.ensure("a")
            assert w0.version > older["version"] > before
            w0.apply(older)
            assert w0.ready_server("a").name == "s0"
        finally:
            await close(h, server, w0)

    asyncio.run(go())


def test_a_long_poll_does_not_answer_what_an_ensures_answer_brought_the_worker(tmp_path, monkeypatch):
    """A miss's changes reach its worker with the ensure's answer; the worker's long-poll
    waits on (one HTTP answer less per miss for both processes) and answers the next change
    that no ensure brought."""
    async def go():
        manager = Evicts()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        manager.listeners.append(h.publisher.model_moved)
        answered: list[int] = []  # the versions the long-poll's answers with changes were at
        answer = h.published.answer

        def counted_answer(since, epoch):
            answered.append(h.version)
            return answer(since, epoch)

        monkeypatch.setattr(h.published, "answer", counted_answer)
        try:
            for model in ("a", "b", "a", "b"):
                await w0.ensure(model)
                assert w0.version == h.version
                await asyncio.sleep(dataplane.SNAPSHOT_LINGER_S + 0.05)
            assert answered == [], f"the long-poll answered what the ensures had brought: {answered}"
            assert h.workers["w0"].has(h.version, h.epoch)

            manager.resident = None
            h.publisher.model_moved("b")  # evicted by no ensure of this worker's
            for _ in range(200):
                if w0.ready_server("b") is None:
                    break
                await asyncio.sleep(0.01)
            assert w0.ready_server("b") is None and answered == [h.version]
        finally:
            monkeypatch.undo()
            await close(h, server, w0)

    asyncio.run(go())


def test_a_worker_that_lost_an_ensures_answer_gets_the_changes_from_its_long_poll(tmp_path, monkeypatch):
    """The next ensure says what the worker has (``since``): behind what an earlier answer
    brought it, its long-poll answers again."""
    async def go():
        manager = Evicts()
        h, server, w0 = await hub_with(tmp_path, monkeypatch, manager)
        manager.listeners.append(h.publisher.model_moved)
        try:
            await w0.ensure("a")
            seen = h.workers["w0"]
            assert seen.ensured_version == h.version
            # Its answer lost: an ensure says the worker is behind, its answer too many changes.
            h._ensured("w0", seen.ensured_version - 1, h.epoch, None)
            assert seen.ensured_version < h.version
            # Another control plane's life: nothing an ensure brought counts.
            h._ensured("w0", 5, "another-epoch", None)
            assert seen.ensured_version == -1
        finally:
            await close(h, server, w0)

    asyncio.run(go())
