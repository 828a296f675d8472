"""mmctl against a started product: the admin API refuses what a web page could send while
mmctl works with the token `mmctl up` wrote; unknown names exit 4; the defaults show."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
import requests

from tests.product import MMCTL, Product

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def product(fleet_template, tmp_path_factory):
    root = tmp_path_factory.mktemp("admin-access")
    repo = root / "repository"
    shutil.copytree(fleet_template, repo)
    p = Product(root / "state", repo, "--max-loaded", "4").start()
    yield p
    p.stop()


def _state(p: Product, model: str) -> str:
    return next(m for m in p.json("status") if m["model"] == model)["state"]


def test_token_file_is_written_private(product):
    assert stat.S_IMODE(product.token_file.stat().st_mode) == 0o600
    assert len(product.token_file.read_text().strip()) >= 32
    assert product.json("endpoints")["admin_token_file"] == str(product.token_file.resolve())


def test_a_browser_style_post_cannot_load_a_model(product):
    url = product.url + "/v1/models/cust003/load"
    auth = product.admin_headers()
    # A form or fetch() from any web page: text/plain (or no content type), no token.
    resp = requests.post(url, data="{}", headers={"Content-Type": "text/plain"}, timeout=30)
    assert resp.status_code == 401
    # Even with the token, only JSON changes state.
    resp = requests.post(url, data="{}", headers={**auth, "Content-Type": "text/plain"}, timeout=30)
    assert resp.status_code == 415 and "application/json" in resp.json()["message"]
    resp = requests.post(url, headers=auth, timeout=30)  # no body, no content type
    assert resp.status_code == 415
    # DNS rebinding: the attacker's name resolved to 127.0.0.1.
    resp = requests.post(url, json={}, headers={**auth, "Host": f"evil.example:{product.admin_port}"},
                         timeout=30)
    assert resp.status_code == 403 and resp.json()["error"] == "forbidden"
    resp = requests.post(url, json={}, headers={**auth, "Origin": "http://evil.example"}, timeout=30)
    assert resp.status_code == 403
    assert _state(product, "cust003") == "warm"  # none of them got through

    resp = requests.post(url, json={}, headers=auth, timeout=120)
    assert resp.status_code == 200 and resp.json()["state"] == "ready"


def test_reads_need_the_token_but_metrics_and_health_do_not(product):
    assert requests.get(product.url + "/v1/status", timeout=10).status_code == 401
    assert requests.get(product.url + "/v1/status", headers=product.admin_headers(),
                        timeout=10).status_code == 200
    assert requests.get(product.url + "/metrics", timeout=10).status_code == 200
    assert requests.get(product.url + "/health", timeout=10).status_code == 200


def test_mmctl_uses_the_token_and_says_when_it_is_wrong(product, tmp_path):
    assert product.mmctl("load", "cust004").returncode == 0
    assert product.mmctl("limit", "set", "cust004", "--qps", "100").returncode == 0
    env = dict(os.environ, **product.client_env())
    env["MMCTL_TOKEN"] = "wrong"
    out = subprocess.run([*MMCTL, "status"], capture_output=True, text=True, env=env, timeout=60,
                         check=False)
    assert out.returncode == 2
    assert "token" in out.stderr and "MMCTL_TOKEN" in out.stderr
    env.pop("MMCTL_TOKEN")
    env["MMS_TOKEN_FILE"] = str(tmp_path / "missing.token")
    out = subprocess.run([*MMCTL, "status"], capture_output=True, text=True, env=env, timeout=60,
                         check=False)
    assert out.returncode == 2 and "missing.token" in out.stderr


def test_alias_and_limit_on_unknown_models_exit_4(product):
    for args in (["alias", "foo", "nosuch"], ["limit", "set", "nosuch", "--qps", "5"]):
        out = product.mmctl(*args)
        assert out.returncode == 4, (args, out.stdout, out.stderr)
        assert "unknown model 'nosuch'" in out.stderr and "mmctl status --all" in out.stderr
    auth = product.admin_headers()
    routes = requests.get(product.url + "/v1/routes", headers=auth, timeout=10).json()
    assert "foo" not in {r["name"] for r in routes}
    assert "nosuch" not in requests.get(product.url + "/v1/limits", headers=auth, timeout=10).json()
    assert product.mmctl("alias", "foo", "cust002").returncode == 0
    assert product.mmctl("limit", "set", "foo", "--qps", "5").returncode == 0


def test_fleet_shows_the_budget_derived_from_the_machine(product):
    from control_plane.triton.devices import (
        default_memory_budget,
        discover_or_config,
        host_memory_bytes,
    )

    (server,) = product.json("fleet")
    assert server["max_loaded"] == 4  # given
    expected, _how = default_memory_budget(discover_or_config(), 1, host_memory_bytes())
    assert expected and server["memory_budget_bytes"] == expected
    table = product.mmctl("fleet").stdout.splitlines()
    budget_col = table[0].index("BUDGET")
    assert table[1][budget_col:].split()[0] != "-" and "GiB" in table[1]
