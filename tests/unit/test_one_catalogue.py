"""One catalogue: the repository's own folders are registry versions the warm tier serves as
they are (no cold copy), and the admin API resolves a logical name to its production version."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from control_plane.admin import api as admin_api
from control_plane.admin.api import make_app
from control_plane.registry import register_repository
from domain.errors import InvalidInput, ModelNotFound
from tests.conftest import run
from tests.unit.test_warm_tier import Env, make_folder


def test_recover_keeps_registered_repository_folders(tmp_path):
    env = Env(tmp_path, budget_models=None, count=1)
    make_folder(env.warm.repository, "cust017")
    make_folder(env.warm.repository, "cust017-v2")
    register_repository(env.registry, env.warm.repository, versions={"cust017-v2": ("cust017", 2)})

    report = env.new_warm().recover()
    # Their only copy is this folder: served as local-only, never dropped for lacking a warm
    # manifest (which only folders staged from the cold store have).
    assert sorted(report["local"]) == ["cust017", "cust017-v2"] and report["dropped"] == []
    assert {"cust017", "cust017-v2"} <= env.names()


def test_repository_versions_stage_in_place_and_are_never_evicted(tmp_path):
    env = Env(tmp_path, budget_models=2.5, count=2)
    folder = make_folder(env.warm.repository, "cust017")
    register_repository(env.registry, env.warm.repository)
    warm = env.new_warm(env.warm.budget_bytes)
    warm.recover()

    async def go():
        assert await warm.stage("cust017") == sum(
            p.stat().st_size for p in folder.rglob("*") if p.is_file())
        await warm.stage("m1.v1")
        await warm.stage("m2.v1")  # makes room by evicting m1, never the repository folder

    run(go())
    assert {p.name for p in warm.repository.iterdir()} == {"cust017", "m2.v1"}
    assert warm.tier_of("cust017") == "warm"
    with pytest.raises(InvalidInput, match="no copy in the cold store"):
        warm.evict("cust017")


def test_a_repository_version_whose_folder_is_gone_says_what_to_do(tmp_path):
    env = Env(tmp_path, budget_models=None, count=1)
    make_folder(env.warm.repository, "cust017")
    register_repository(env.registry, env.warm.repository)
    warm = env.new_warm()
    (warm.repository / "cust017" / "config.pbtxt").unlink()
    with pytest.raises(ModelNotFound, match=r"cust017 \(cust017 version 1\) was registered from the folder"
                                            r".*mmctl registry add cust017 --from-dir DIR"):
        run(warm.stage("cust017"))
    env.registry.promote("cust017", 1, "retired", who="t")
    with pytest.raises(InvalidInput, match="is retired"):
        run(warm.stage("cust017"))


class FakeManager:
    """Records what the admin handlers asked the manager for."""

    def __init__(self):
        self.asked: list[tuple[str, str]] = []

    def _rec(self, what, name):
        self.asked.append((what, name))
        return type("Rec", (), {"to_dict": lambda _self: {"model": name}})()

    async def ensure(self, name, retry_failed=False):
        return self._rec("load", name)

    async def unload(self, name, force=False):
        return self._rec("unload", name)

    async def pin(self, name):
        return self._rec("pin", name)

    async def unpin(self, name):
        return self._rec("unpin", name)

    def get(self, name):
        return self._rec("get", name)

    async def scale(self, name, replicas, minimum=None, maximum=None):
        return self._rec("scale", name)

    def status_row(self, rec):
        return rec.to_dict()

    async def health(self, name, probe=False):
        self.asked.append(("health", name))
        return {"model": name, "healthy": True}


def test_admin_model_handlers_resolve_logical_names(tmp_path):
    env = Env(tmp_path, budget_models=None, count=1)  # m1 version 1, registered
    env.registry.promote("m1", 1, "production", who="t")
    manager = FakeManager()
    app = make_app(manager, {"resolve_name": env.registry.resolve_name})
    handlers = {"load": admin_api.load, "pin": admin_api.pin, "unpin": admin_api.unpin,
                "unload": admin_api.unload, "get": admin_api.model_status, "health": admin_api.health}

    async def call(what, name):
        request = make_mocked_request("POST", f"/v1/models/{name}/{what}", match_info={"model": name},
                                      app=app)
        return await handlers[what](request)

    async def go():
        for what in handlers:
            assert (await call(what, "m1")).status == 200
        # A concrete name and a name the registry does not know pass through.
        await call("load", "m1.v1")
        await call("load", "other")
        env.registry.promote("m1", 1, "retired", who="t")
        with pytest.raises(ModelNotFound, match="m1 has no production version"):
            await call("load", "m1")

    run(go())
    assert manager.asked == [("load", "m1.v1"), ("pin", "m1.v1"), ("unpin", "m1.v1"),
                             ("unload", "m1.v1"), ("get", "m1.v1"), ("health", "m1.v1"),
                             ("load", "m1.v1"), ("load", "other")]


def test_scaling_a_logical_name_says_which_version_to_scale(tmp_path, monkeypatch):
    """Copies belong to a concrete version: ``mmctl scale m1`` names the version instead of
    scaling whichever version is in production today."""
    env = Env(tmp_path, budget_models=None, count=1)
    env.registry.promote("m1", 1, "production", who="t")
    manager = FakeManager()
    app = make_app(manager, {"resolve_name": env.registry.resolve_name})

    async def scale(name, body):
        request = make_mocked_request("POST", f"/v1/models/{name}/scale", match_info={"model": name},
                                      app=app)
        monkeypatch.setattr(admin_api, "json_body", lambda _request: _async(body))
        return await admin_api.scale(request)

    async def go():
        with pytest.raises(InvalidInput, match=r"m1 is a logical name.*mmctl scale m1.v1 --replicas N"):
            await scale("m1", {"replicas": 2})
        with pytest.raises(InvalidInput, match=r'\{"replicas": N\}'):
            await scale("m1.v1", {"replicas": 2, "extra": 1})
        assert (await scale("m1.v1", {"replicas": 2})).status == 200

    run(go())
    assert manager.asked == [("scale", "m1.v1")]


async def _async(value):
    return value
