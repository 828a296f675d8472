"""The admin API's access checks (token, Host, Origin, JSON content type) and mmctl's token
lookup, without sockets: requests are built with aiohttp's mocked requests and go through the
same middlewares the served app uses."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from control_plane.admin.access import (
    AdminAccess,
    TooManyAttempts,
    access_for,
    access_middleware,
    ensure_token_file,
)
from control_plane.admin.api import error_middleware
from control_plane.client import find_token

TOKEN = "s3cret-token"
ACCESS = AdminAccess(token=TOKEN, bind_host="127.0.0.1")
GOOD = {"Host": "127.0.0.1:8090", "Authorization": f"Bearer {TOKEN}",
        "Content-Type": "application/json"}


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def call(method: str, path: str, access: AdminAccess = ACCESS, drop=(), **headers) -> web.Response:
    """One request through error_middleware -> access_middleware -> a handler that says ok,
    the order make_app installs them in."""
    sent = {k: v for k, v in {**GOOD, **{k.replace("_", "-"): v for k, v in headers.items()}}.items()
            if k not in drop and v is not None}
    request = make_mocked_request(method, path, headers=sent)
    check = access_middleware(access)

    async def inner(req):
        return await check(req, _ok)

    return asyncio.run(error_middleware(request, inner))


def refused(resp: web.Response, status: int, code: str) -> bool:
    import json

    return resp.status == status and json.loads(resp.body)["error"] == code


def test_state_change_with_token_and_json_is_served():
    assert call("POST", "/v1/models/cust001/load").status == 200
    assert call("DELETE", "/v1/shadows/cust001").status == 200
    assert call("GET", "/v1/status", drop=("Content-Type",)).status == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_state_change_that_is_not_json_is_refused(content_type):
    # What a web page can send cross-origin without a preflight: a form post, text/plain, or
    # a fetch with no body and so no content type at all.
    for method in ("POST", "PUT", "DELETE"):
        resp = call(method, "/v1/models/cust001/load", Content_Type=content_type)
        assert refused(resp, 415, "unsupported_media_type"), (method, content_type)


def test_json_with_charset_is_json():
    assert call("POST", "/v1/models/x/load", Content_Type="application/json; charset=utf-8").status == 200


@pytest.mark.parametrize("host", ["evil.example:8090", "evil.example", "127.0.0.1.nip.io:8090",
                                  "10.1.2.3:8090", "", "127.0.0.1:abc", None])
def test_a_host_that_is_not_ours_is_refused(host):
    # DNS rebinding: the page's own domain re-pointed at 127.0.0.1 arrives as Host: evil...
    resp = call("GET", "/v1/status", Host=host, drop=() if host is not None else ("Host",))
    assert refused(resp, 403, "forbidden")
    assert refused(call("GET", "/metrics", Host=host, drop=() if host is not None else ("Host",)),
                   403, "forbidden")


@pytest.mark.parametrize("host", ["127.0.0.1:8090", "localhost:8090", "LOCALHOST.", "[::1]:8090",
                                  "127.0.0.2"])
def test_loopback_hosts_are_ours(host):
    assert call("POST", "/v1/models/x/load", Host=host).status == 200


def test_configured_and_wildcard_hosts():
    named = access_for("admin.internal", TOKEN, extra_hosts=["Ops.Example."])
    assert call("GET", "/v1/status", named, Host="admin.internal:8090").status == 200
    assert call("GET", "/v1/status", named, Host="ops.example:8090").status == 200
    assert refused(call("GET", "/v1/status", named, Host="other.example"), 403, "forbidden")
    wildcard = access_for("0.0.0.0", TOKEN)
    assert call("GET", "/v1/status", wildcard, Host="10.1.2.3:8090").status == 200
    assert refused(call("GET", "/v1/status", wildcard, Host="evil.example"), 403, "forbidden")


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "null"},  # sandboxed frames, file:// pages
    {"Origin": "http://localhost:3000"},  # another local web app is another origin
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
])
def test_cross_origin_requests_are_refused_even_with_a_token(headers):
    resp = call("POST", "/v1/models/x/load", **{k.replace("-", "_"): v for k, v in headers.items()})
    assert refused(resp, 403, "forbidden")


def test_same_origin_is_not_cross_origin():
    assert call("POST", "/v1/x", Origin="http://127.0.0.1:8090", Sec_Fetch_Site="same-origin").status == 200


def test_missing_or_wrong_token_is_401_with_a_hint():
    resp = call("POST", "/v1/models/x/load", drop=("Authorization",))
    assert refused(resp, 401, "unauthorized")
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert b"MMCTL_TOKEN" in resp.body and b"admin.token" in resp.body
    assert refused(call("GET", "/v1/status", Authorization="Bearer nope"), 401, "unauthorized")
    assert refused(call("GET", "/v1/status", Authorization=TOKEN), 401, "unauthorized")  # no scheme
    assert call("GET", "/v1/status", Authorization=f"bearer {TOKEN}").status == 200


def test_metrics_and_health_are_public_but_a_probe_is_not():
    # Prometheus and liveness probes scrape without a token; a probe runs an inference.
    for path in ("/metrics", "/health", "/health/cust001"):
        assert call("GET", path, drop=("Authorization",)).status == 200, path
    assert refused(call("GET", "/health/cust001?probe=1", drop=("Authorization",)), 401, "unauthorized")
    assert refused(call("POST", "/metrics", drop=("Authorization",)), 401, "unauthorized")


def test_no_token_configured_still_checks_host_origin_and_content_type():
    open_access = AdminAccess(token=None)
    assert call("POST", "/v1/x", open_access, drop=("Authorization",)).status == 200
    assert refused(call("POST", "/v1/x", open_access, Content_Type="text/plain"), 415,
                   "unsupported_media_type")
    assert refused(call("POST", "/v1/x", open_access, Origin="http://evil.example"), 403, "forbidden")


def test_token_file_is_private_and_reused(tmp_path):
    path = tmp_path / "state" / "admin.token"
    first = ensure_token_file(path)
    assert len(first) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token_file(path) == first  # a restart keeps clients working
    assert ensure_token_file(path, "given") == "given" and path.read_text().strip() == "given"
    os.chmod(path, 0o644)  # readable by others: not trusted any more
    fresh = ensure_token_file(path)
    assert fresh != "given" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_mmctl_finds_the_token_in_env_then_file(tmp_path, monkeypatch):
    token_file = tmp_path / "admin.token"
    monkeypatch.delenv("MMCTL_TOKEN", raising=False)
    assert find_token(token_file)[0] is None and "no token file" in find_token(token_file)[1]
    token_file.write_text("from-file\n")
    assert find_token(token_file) == ("from-file", str(token_file))
    monkeypatch.setenv("MMCTL_TOKEN", "from-env")
    assert find_token(token_file) == ("from-env", "MMCTL_TOKEN")


def test_mmctl_sends_json_and_the_token(monkeypatch, tmp_path):
    import requests

    from mmctl.common import Api

    sent = []

    class Resp:
        status_code = 200

        def json(self):
            return {}

    def fake_request(method, url, **kwargs):
        sent.append((method, kwargs))
        return Resp()

    monkeypatch.setattr(requests, "request", fake_request)
    monkeypatch.setenv("MMCTL_TOKEN", "tok")
    api = Api("http://127.0.0.1:1", 5.0, tmp_path / "none")
    api.call("POST", "/v1/models/x/load")
    api.call("GET", "/v1/status")
    (_, post), (_, get) = sent
    assert post["json"] == {} and post["headers"]["Authorization"] == "Bearer tok"
    assert get["json"] is None and get["headers"]["Authorization"] == "Bearer tok"


def test_compose_exposes_only_the_router():
    """docker/compose.yaml: no other container reaches Triton's control ports or the admin API."""
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    published = [str(p) for s in services.values() for p in s.get("ports", [])]
    assert published and all(p.split(":")[-1] in ("8000", "8001") for p in published), published
    triton = services["triton"]
    assert "ports" not in triton and "expose" not in triton
    # Triton shares only an internal network, with nobody but the control plane.
    (net,) = triton["networks"]
    assert compose["networks"][net].get("internal") is True
    on_net = {name for name, s in services.items() if net in s.get("networks", [])}
    assert on_net == {"triton", "control-plane"}
    command = services["control-plane"]["command"]
    assert command[command.index("--admin-host") + 1] == "127.0.0.1"
    assert "MMS_ADMIN_TOKEN" in services["control-plane"]["environment"]
    # Triton's model control, shared memory, trace and log settings take the key only, from
    # a volume of its own: Triton's container (the models' code) never mounts the state.
    command = triton["command"]
    assert command[command.index("--key-file") + 1] == "/keys/triton.key"
    assert triton["volumes"] == ["models:/models", "triton-key:/keys:ro"]
    assert not any(v.startswith("state:") for v in triton["volumes"])
    assert "share-key" in services["control-plane"]["entrypoint"][2]


def test_the_gpu_tritons_flags_are_the_products_own():
    """docker/compose.gpu.yaml starts NGC's tritonserver by hand (NGC's Python is older than
    the product's): with the flags of launch.triton_args, every one, the key its only secret."""
    import yaml

    from control_plane.triton.launch import TritonLaunchConfig, triton_args

    root = Path(__file__).resolve().parents[2]
    (script,) = yaml.safe_load((root / "docker" / "compose.gpu.yaml").read_text())["services"]["triton"]["command"]
    flags = [word for word in script.split() if word.startswith("--")]
    cfg = TritonLaunchConfig(repository=Path("/models"), work_dir=Path("/tmp"), host="0.0.0.0",
                             http_port=8100, grpc_port=8101, metrics_port=8102, restricted_key="$$KEY")
    want = [flag.replace("model-repository,shared-memory,trace,logging", "$$APIS")
            for flag in triton_args(cfg, Path("/unused"), None) if not flag.startswith("--backend-directory")]
    assert flags == want
    assert "KEY=$$(cat /keys/triton.key);" in script


# ---------------------------------------------------------------------- wrong-token limit
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def limited(clock) -> AdminAccess:
    from control_plane.admin.access import WrongTokens

    return AdminAccess(token=TOKEN, bind_host="127.0.0.1",
                       wrong_tokens=WrongTokens(limit=3, window_s=60, exempt_loopback=False, clock=clock))


def test_an_address_sending_wrong_tokens_is_refused_for_the_window_even_with_the_right_one():
    clock = Clock()
    access = limited(clock)
    for _ in range(3):
        assert refused(call("GET", "/v1/status", access, Authorization="Bearer guess"), 401, "unauthorized")
    resp = call("GET", "/v1/status", access)  # the right token: a guess must not be confirmed
    assert refused(resp, 429, "too_many_attempts")
    assert "resume in 60 s" in resp.text
    clock.now += 61
    assert call("GET", "/v1/status", access).status == 200


def test_requests_without_a_token_and_right_tokens_count_for_nothing():
    access = limited(Clock())
    for _ in range(10):
        assert call("GET", "/v1/status", access).status == 200
        assert refused(call("GET", "/v1/status", access, drop=("Authorization",)), 401, "unauthorized")
    assert call("GET", "/v1/status", access).status == 200


def test_loopback_clients_are_never_locked_out():
    from control_plane.admin.access import WrongTokens

    wrong = WrongTokens(limit=1)
    for _ in range(5):
        wrong.note_wrong("127.0.0.1")
        wrong.note_wrong("::1")
    wrong.refuse_if_over("127.0.0.1")
    wrong.note_wrong("10.0.0.9")
    from control_plane.admin.access import TooManyAttempts

    with pytest.raises(TooManyAttempts):
        wrong.refuse_if_over("10.0.0.9")


DATAPLANE = "d" * 32


def test_a_locked_out_address_learns_nothing_of_the_dataplane_token():
    """The data-plane token was compared before the lockout was asked: an address locked out
    for wrong tokens still had a right guess served (and told apart by 403 elsewhere)."""
    clock = Clock()
    access = AdminAccess(token=TOKEN, dataplane_token=DATAPLANE, bind_host="127.0.0.1",
                         wrong_tokens=limited(clock).wrong_tokens)
    for _ in range(3):
        assert refused(call("GET", "/v1/dataplane/state", access, Authorization="Bearer guess"),
                       401, "unauthorized")
    for path in ("/v1/dataplane/state", "/v1/status"):  # a right guess: the same 429
        for token in (DATAPLANE, TOKEN, "guess"):
            resp = call("GET", path, access, Authorization=f"Bearer {token}")
            assert refused(resp, 429, "too_many_attempts"), (path, token, resp.status)
            assert DATAPLANE not in resp.text
    for _ in range(3):  # the same through token_ok, for a router worker's address
        assert not access.token_ok("Bearer guess", "10.0.0.9", "/v1/dataplane/state")
    with pytest.raises(TooManyAttempts):
        access.token_ok(f"Bearer {DATAPLANE}", "10.0.0.9", "/v1/dataplane/state")
    assert access.token_ok(f"Bearer {DATAPLANE}", "10.0.0.10", "/v1/dataplane/state")
    clock.now += 61
    assert call("GET", "/v1/dataplane/state", access, Authorization=f"Bearer {DATAPLANE}").status == 200
    assert refused(call("GET", "/v1/status", access, Authorization=f"Bearer {DATAPLANE}"), 403,
                   "forbidden")


def test_the_sign_in_check_is_locked_out_before_it_compares():
    clock = Clock()
    access = limited(clock)
    for _ in range(3):
        assert not access.check_token("guess", "10.0.0.9")
    with pytest.raises(TooManyAttempts):
        access.check_token(TOKEN, "10.0.0.9")


def test_a_short_dataplane_token_given_by_hand_is_refused_at_start(tmp_path):
    from control_plane.runtime.config import ServiceConfig
    from domain.errors import InvalidInput
    from domain.settings import MIN_TOKEN_CHARS

    short = "dp-" + "s" * (MIN_TOKEN_CHARS - 4)
    with pytest.raises(InvalidInput) as refusal:
        ServiceConfig(state_dir=tmp_path, dataplane_token=short).validate()
    message = str(refusal.value)
    assert "MMS_DATAPLANE_TOKEN" in message and f"at least {MIN_TOKEN_CHARS}" in message
    assert short not in message
    ServiceConfig(state_dir=tmp_path, dataplane_token="x" * MIN_TOKEN_CHARS).validate()


def test_a_short_dataplane_token_file_or_value_is_refused_by_the_token_file(tmp_path):
    """Where the control plane reads its data-plane token (mmctl up's supervisor and the
    control plane's own start): the environment's value or a file written by hand."""
    from control_plane.admin.access import ensure_dataplane_token_file
    from domain.errors import InvalidInput
    from domain.settings import MIN_TOKEN_CHARS

    path = tmp_path / "dataplane.token"
    short = "dp-" + "s" * (MIN_TOKEN_CHARS - 4)
    with pytest.raises(InvalidInput, match=f"MMS_DATAPLANE_TOKEN.*at least {MIN_TOKEN_CHARS}") as given:
        ensure_dataplane_token_file(path, short)
    assert short not in str(given.value) and not path.exists()
    path.write_text(short + "\n")
    os.chmod(path, 0o600)
    with pytest.raises(InvalidInput, match=f"dataplane.token.*at least {MIN_TOKEN_CHARS}") as in_file:
        ensure_dataplane_token_file(path)
    assert short not in str(in_file.value) and path.read_text() == short + "\n"
    long_enough = "x" * MIN_TOKEN_CHARS
    assert ensure_dataplane_token_file(path, long_enough) == long_enough
    assert ensure_dataplane_token_file(path) == long_enough  # reused
    path.unlink()
    assert len(ensure_dataplane_token_file(path)) >= 32  # generated


def test_a_short_admin_token_given_by_hand_is_refused_at_start(tmp_path):
    from control_plane.runtime.config import ServiceConfig
    from domain.errors import InvalidInput

    with pytest.raises(InvalidInput, match="at least 16"):
        ServiceConfig(state_dir=tmp_path, admin_token="secret").validate()
    ServiceConfig(state_dir=tmp_path, admin_token="x" * 16).validate()


def test_a_token_that_is_not_utf8_is_a_wrong_token_not_an_error():
    """A header's bytes that are not UTF-8 reach the check as surrogates (so may a JSON
    string, the status page's sign-in): encoding them raised, a 500 with a traceback logged
    per request, and no wrong token counted against the address (the same through a real
    admin API: tests/security/test_ports_and_credentials.py)."""
    clock = Clock()
    access = limited(clock)
    with_dataplane = AdminAccess(token=TOKEN, dataplane_token="d" * 32, bind_host="127.0.0.1")
    for token in ("\udcff\udcfe", "\ud800"):
        assert not access.token_ok(f"Bearer {token}", "10.0.0.9", "/v1/status")
        assert not with_dataplane.token_ok(f"Bearer {token}", "10.0.0.9", "/v1/dataplane/x")
    assert not access.check_token("\ud800", "10.0.0.9")  # the third wrong one
    from control_plane.admin.access import TooManyAttempts

    with pytest.raises(TooManyAttempts):
        access.token_ok(f"Bearer {TOKEN}", "10.0.0.9", "/v1/status")
    assert not access.session_ok("1.2.\udcff", clock.now)
