"""Routing changes through the admin API must name something that exists: an alias to an
unknown model or a limit on an unknown name is refused with 404 (mmctl exit 4), not stored."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

import control_plane.admin.rollout_routes as router_admin
from control_plane.admin.api import error_middleware
from control_plane.admin.rollout_routes import ROUTER_ADMIN_KEY, alias_set, limit_set, router_errors
from domain.errors import ModelNotFound as CpModelNotFound
from domain.routes import RouteTable


class FakeManager:
    """The manager's catalogue: ``known`` raises ModelNotFound for other names."""

    def __init__(self, known):
        self.names = set(known)
        self.asked = []

    async def known(self, name):
        self.asked.append(name)
        if name not in self.names:
            raise CpModelNotFound(f"unknown model {name!r}")


@pytest.fixture
def router():
    production = {"simple": "simple.v1"}
    table = RouteTable(default_target=production.get)
    table.set_alias("rec", "cust017")
    return SimpleNamespace(table=table, manager=FakeManager({"cust001", "cust017", "simple.v1",
                                                             "tinylm"}))


def admin_call(monkeypatch, router, method: str, path: str, handler, name: str,
               body: dict) -> tuple[int, dict]:
    """Send one request for ``name`` through the admin app's error middlewares to ``handler``;
    the JSON body is handed over as json_body would parse it (mocked requests carry no
    payload).  Returns (HTTP status, decoded JSON body)."""
    app = web.Application()
    app[ROUTER_ADMIN_KEY] = router

    async def parsed(_request):
        return body

    monkeypatch.setattr(router_admin, "_json", parsed)
    request = make_mocked_request(method, path, app=app, match_info={"name": name})

    async def inner(req):
        return await router_errors(req, handler)

    resp = asyncio.run(error_middleware(request, inner))
    return resp.status, json.loads(resp.body)


@pytest.fixture
def put(router, monkeypatch):
    """PUT one routing change through the admin app's error middlewares."""

    def send(handler, name: str, body: dict):
        return admin_call(monkeypatch, router, "PUT", f"/v1/x/{name}", handler, name, body)

    return send


def test_alias_to_an_unknown_model_is_404_and_not_stored(router, put):
    status, body = put(alias_set, "foo", {"target": "nosuch"})
    assert status == 404 and body["error"] == "model_not_found" and "nosuch" in body["message"]
    assert "foo" not in router.table.routes


def test_alias_to_a_logical_name_says_which_model_it_serves(put):
    status, body = put(alias_set, "foo", {"target": "simple"})
    assert status == 404 and "simple.v1" in body["message"]


def test_alias_to_a_known_model_is_stored(router, put):
    status, _ = put(alias_set, "foo", {"target": "cust001"})
    assert status == 200 and router.table.target_of("foo") == "cust001"


def test_alias_with_a_bad_name_is_bad_input_before_unknown(router, put):
    status, _ = put(alias_set, "foo", {"target": "../x"})
    assert status == 400 and router.manager.asked == []


@pytest.mark.parametrize("name", ["nosuch", "nosuch:acme"])
def test_limit_on_an_unknown_name_is_404_and_not_stored(router, put, name):
    status, body = put(limit_set, name, {"qps": 5})
    assert status == 404 and body["error"] == "model_not_found"
    assert name not in router.table.limits


@pytest.mark.parametrize("name", ["cust001", "rec", "simple", "tinylm:acme"])
def test_limit_on_a_model_route_logical_name_or_adapter_is_stored(router, put, name):
    status, _ = put(limit_set, name, {"qps": 5})
    assert status == 200 and router.table.limits[name]["qps"] == 5.0
