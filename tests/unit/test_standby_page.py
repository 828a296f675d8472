"""A standby's admin port: a person opening the status page there is sent to the leader;
programs keep getting the JSON 503 that names it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from control_plane.runtime.leadership import standby_app


class Lease:
    def __init__(self, holder):
        self.holder = holder

    def current(self):
        return self.holder


def ask(holder, path: str, accept: str):
    async def go():
        client = TestClient(TestServer(standby_app(Lease(holder))))
        await client.start_server()
        try:
            resp = await client.get(path, headers={"Accept": accept})
            return resp.status, resp.headers["Content-Type"], await resp.text()
        finally:
            await client.close()

    return asyncio.run(go())


def test_a_browser_gets_a_page_that_links_to_the_leader():
    leader = SimpleNamespace(holder="cp-a", address="http://10.0.0.5:8090")
    status, kind, body = ask(leader, "/", "text/html,application/xhtml+xml")
    assert status == 503 and kind.startswith("text/html")
    assert 'href="http://10.0.0.5:8090/"' in body and "standby" in body and "cp-a" in body


def test_the_page_escapes_what_the_lease_says_and_links_only_to_http():
    leader = SimpleNamespace(holder="<script>x</script>", address="javascript:alert(1)")
    _, _, body = ask(leader, "/", "text/html")
    assert "<script>" not in body and "&lt;script&gt;" in body
    assert "href=" not in body


def test_programs_still_get_the_json_that_names_the_leader():
    leader = SimpleNamespace(holder="cp-a", address="http://10.0.0.5:8090")
    for path, accept in (("/", "application/json"), ("/v1/status", "text/html")):
        status, kind, body = ask(leader, path, accept)
        assert status == 503 and kind.startswith("application/json"), (path, body)
        assert '"error": "standby"' in body and "10.0.0.5" in body
