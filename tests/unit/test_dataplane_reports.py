"""Router workers' reports to the control plane: a malformed one is refused whole with a
400 that says what a report holds, and nothing of it is applied."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from control_plane.admin import dataplane
from control_plane.admin.api import error_middleware
from control_plane.admin.dataplane import DataPlaneHub
from control_plane.rollouts.stats import StatsBook


class Touches:
    def __init__(self):
        self.touched: list[str] = []

    def touch(self, name):
        self.touched.append(name)


def hub() -> DataPlaneHub:
    """The hub's report handler needs its workers, stats and manager only."""
    h = DataPlaneHub.__new__(DataPlaneHub)
    h.workers, h.stats, h.manager = {}, StatsBook(), Touches()
    return h


def post_report(monkeypatch, h: DataPlaneHub, body: dict) -> tuple[int, dict]:
    async def parsed(_request):
        return body

    monkeypatch.setattr(dataplane, "json_body", parsed)
    request = make_mocked_request("POST", "/v1/dataplane/report", app=web.Application())
    resp = asyncio.run(error_middleware(request, h.report))
    return resp.status, json.loads(resp.body)


GOOD = {"worker": "w0", "pid": 7, "uses": {"cust001": 3}, "requests": 3,
        "samples": [["canary:m", "canary", "OK", 4.5, False], ["canary:m", "baseline", "INTERNAL", None, True]],
        "shadow": {"m": {"mirrored": 2, "latency_delta_ms_sum": 1.5}}}


def test_a_report_is_applied(monkeypatch):
    h = hub()
    status, _ = post_report(monkeypatch, h, GOOD)
    assert status == 200
    assert h.manager.touched == ["cust001"] * 3
    assert h.workers["w0"].requests == 3 and h.workers["w0"].samples == 2
    assert h.stats.scope("canary:m")["canary"]["requests"] == 1
    assert h.workers["w0"].shadow["m"]["mirrored"] == 2 and isinstance(h.workers["w0"].shadow["m"]["mirrored"], int)


@pytest.mark.parametrize("bad", [
    {"samples": [1]},
    {"samples": [["canary:m", "canary", "OK", "fast", False]]},
    {"uses": {"cust001": "abc"}},
    {"uses": ["cust001"]},
    {"requests": "many"},
    {"pid": "z"},
    {"shadow": {"m": {"mirrored": "two"}}},
])
def test_a_malformed_report_is_refused_whole(monkeypatch, bad):
    h = hub()
    status, body = post_report(monkeypatch, h, dict(GOOD, **bad))
    assert status == 400 and body["error"] == "invalid_input", body
    assert "report" in body["message"] or "pid" in body["message"]
    assert h.manager.touched == [] and h.workers == {} and h.stats.scope("canary:m") == {}
