"""The admin API's Python client raises typed errors (never exits), so a program can drive
the product; mmctl maps the same errors to its documented exit codes."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from control_plane.client import AdminClient, AdminRefused, ControlPlaneUnreachable, NoAnswerInTime
from control_plane.triton.process import free_port
from domain.errors import CapacityExhausted, InvalidInput, ModelNotFound
from domain.exit_codes import (
    EXIT_CAPACITY,
    EXIT_NOT_FOUND,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from mmctl.main import cli

ANSWERS = {  # path -> (status, JSON body)
    "/v1/models/cust001/load": (200, b'{"model": "cust001", "state": "ready", "server": "triton0"}'),
    "/v1/models/nosuch/load": (404, b'{"error": "model_not_found", "message": "unknown model nosuch"}'),
    "/v1/models/big/load": (409, b'{"error": "capacity_exhausted", "message": "every model is pinned"}'),
    "/v1/models/cust001/pin": (401, b'{"error": "unauthorized", "message": "wrong token"}'),
    "/health/sick": (503, b'{"model": "sick", "healthy": false, "state": "ready", "warmup": {}}'),
}


@pytest.fixture(scope="module")
def admin_url():
    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body = ANSWERS.get(self.path.split("?")[0], (404, b'{"error": "x", "message": "?"}'))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_answers_and_typed_errors(admin_url):
    admin = AdminClient(admin_url, timeout_s=5, token="tok")
    assert admin.load("cust001")["state"] == "ready"
    with pytest.raises(ModelNotFound, match="unknown model nosuch"):
        admin.load("nosuch")
    with pytest.raises(CapacityExhausted, match="every model is pinned"):
        admin.load("big")
    with pytest.raises(AdminRefused) as refused:
        admin.pin("cust001")
    assert (refused.value.code, refused.value.status) == ("unauthorized", 401)
    assert admin.health("sick")["healthy"] is False  # an unhealthy model is an answer


def test_a_control_plane_that_is_not_there():
    with pytest.raises(ControlPlaneUnreachable, match="not running at"):
        AdminClient(f"http://127.0.0.1:{free_port()}", timeout_s=5, token="t").status()


def test_a_control_plane_that_accepts_but_never_answers_fails_within_the_timeout():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts, never answers
    try:
        with pytest.raises(NoAnswerInTime, match="within 1s"):
            AdminClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1, token="t").status()
    finally:
        listener.close()


def test_an_unreadable_token_file_is_invalid_input(tmp_path, monkeypatch):
    monkeypatch.delenv("MMCTL_TOKEN", raising=False)
    with pytest.raises(InvalidInput, match="cannot read the admin token file"):
        AdminClient("http://127.0.0.1:1", token_file=tmp_path).status()  # a directory


def test_mmctl_maps_the_same_errors_to_exit_codes(admin_url, monkeypatch):
    monkeypatch.setenv("MMCTL_TOKEN", "tok")
    runner = CliRunner()
    for args, code in ((["load", "nosuch"], EXIT_NOT_FOUND), (["load", "big"], EXIT_CAPACITY),
                       (["pin", "cust001"], EXIT_USAGE), (["health", "sick"], 8)):
        result = runner.invoke(cli, ["--url", admin_url, *args])
        assert result.exit_code == code, (args, result.output)
    result = runner.invoke(cli, ["--url", f"http://127.0.0.1:{free_port()}", "status"])
    assert result.exit_code == EXIT_UNREACHABLE and "not running at" in result.output
