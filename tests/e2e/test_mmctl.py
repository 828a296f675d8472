"""Drive the product the way a person does: `mmctl up` in one process, `mmctl` commands."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from control_plane.triton.process import free_port
from tests.conftest import pid_alive
from tests.product import MMCTL, Product

pytestmark = pytest.mark.integration


@pytest.fixture
def product_factory(repository, tmp_path):
    started: list[Product] = []

    def make(*extra: str, state_dir: Path | None = None) -> Product:
        p = Product(state_dir or tmp_path / "state", repository, *extra).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()
    for p in started:
        p.assert_no_triton_left()


def ready_in_triton(grpc_url: str, product: Product | None = None) -> set[str]:
    """What Triton has loaded; a product's Triton answers with the product's key only."""
    headers = product.triton_key_headers() if product is not None else None
    index = grpcclient.InferenceServerClient(grpc_url).get_model_repository_index(
        headers=headers, as_json=True)
    return {m["name"] for m in index["models"] if m.get("state") == "READY"}


def test_mmctl_walkthrough(product_factory):
    p = product_factory("--max-loaded", "2", "--policy", "lru")
    status = p.json("status")
    assert {"model", "state", "pinned", "last_used"} <= set(status[0])
    assert {m["state"] for m in status} == {"warm"}

    assert p.mmctl("load", "cust007").returncode == 0
    assert p.json("status") and next(m for m in p.json("status") if m["model"] == "cust007")["state"] == "ready"
    assert p.mmctl("pin", "cust001").returncode == 0
    health = p.mmctl("health", "cust007")
    assert health.returncode == 0 and "healthy" in health.stdout and "warm-up ok" in health.stdout

    # A tritonclient inference against the served model gets scores back.
    endpoints = p.json("endpoints")
    grpc_url = endpoints["triton"][0]["grpc"]
    client = grpcclient.InferenceServerClient(grpc_url)
    x = grpcclient.InferInput("FEATURES", [3, 64], "FP32")
    x.set_data_from_numpy(np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32))
    scores = client.infer("cust007", [x]).as_numpy("SCORES")
    assert scores.shape == (3, 1) and np.all((scores > 0) & (scores < 1))

    # Full and everything else pinned -> exit 5 with the pinned names.
    assert p.mmctl("pin", "cust007").returncode == 0
    full = p.mmctl("load", "cust003")
    assert full.returncode == 5 and "cust001" in full.stderr and "cust007" in full.stderr
    assert ready_in_triton(grpc_url, p) == {"cust001", "cust007"}

    assert p.mmctl("unload", "cust007").returncode == 2  # pinned
    assert p.mmctl("unpin", "cust007").returncode == 0
    assert p.mmctl("unload", "cust007").returncode == 0
    assert ready_in_triton(grpc_url, p) == {"cust001"}
    unhealthy = p.mmctl("health", "cust007")
    assert unhealthy.returncode == 8 and "unhealthy" in unhealthy.stdout

    bad_name = p.mmctl("load", "../../etc/passwd")
    assert bad_name.returncode == 2 and "'..'" in bad_name.stderr
    unknown = p.mmctl("load", "cust999")
    assert unknown.returncode == 4 and "not in the model repository" in unknown.stderr

    metrics = requests.get(p.url + "/metrics", timeout=5).text
    assert 'mms_loads_total{result="ok",server="triton0"}' in metrics
    assert "mms_load_seconds_bucket" in metrics and "mms_loaded_bytes" in metrics
    table = p.mmctl("status")
    assert table.returncode == 0 and "cust001" in table.stdout and "yes" in table.stdout

    # Filters: one name, a glob, a state, a server; the control plane filters.
    assert [m["model"] for m in p.json("status", "cust001")] == ["cust001"]
    assert p.json("status", "cust999") == []
    assert {m["model"] for m in p.json("status", "cust00[1-3]")} == {"cust001", "cust002", "cust003"}
    assert [m["model"] for m in p.json("status", "--state", "ready")] == ["cust001"]
    assert [m["model"] for m in p.json("status", "--server", "triton0")] == ["cust001"]
    assert {m["state"] for m in p.json("status", "cust*", "--state", "warm")} == {"warm"}
    one = p.mmctl("status", "cust001")
    assert one.returncode == 0 and one.stdout.splitlines()[1].startswith("cust001")
    assert len(one.stdout.splitlines()) == 2  # the header and the model: no "more warm" line
    bad = requests.get(p.url + "/v1/status", params={"state": "asleep"}, headers=p.admin_headers(),
                       timeout=5)
    assert bad.status_code == 400 and "unknown state 'asleep'" in bad.json()["message"]


def test_mmctl_without_control_plane_says_so(tmp_path):
    env = dict(os.environ, MMCTL_URL=f"http://127.0.0.1:{free_port()}")
    out = subprocess.run([*MMCTL, "status"], capture_output=True, text=True, env=env, timeout=60,
                         check=False)
    assert out.returncode == 3
    assert "not running" in out.stderr and "make up" in out.stderr


def test_sigkill_restart_keeps_pins_and_matches_triton(product_factory, tmp_path):
    state = tmp_path / "state"
    p = product_factory("--max-loaded", "3", state_dir=state)
    assert p.mmctl("pin", "cust001").returncode == 0
    assert p.mmctl("load", "cust002").returncode == 0
    triton_before = p.triton_pids()
    assert len(triton_before) == 1
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    # The managed Triton dies with its parent: no orphan keeps memory.
    deadline = time.monotonic() + 20
    while any(pid_alive(pid) for pid in triton_before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(pid) for pid in triton_before)

    p2 = product_factory("--max-loaded", "3", state_dir=state)
    status = {m["model"]: m for m in p2.json("status")}
    assert status["cust001"]["pinned"] and status["cust001"]["state"] == "ready"
    assert status["cust002"]["state"] == "warm" and not status["cust002"]["pinned"]
    grpc_url = p2.json("endpoints")["triton"][0]["grpc"]
    assert ready_in_triton(grpc_url, p2) == {m for m, r in status.items() if r["state"] == "ready"}


def test_sigkill_restart_attached_adopts_what_triton_has_loaded(product_factory, triton, tmp_path):
    state = tmp_path / "state-attached"
    p = product_factory("--attach", triton.grpc_url, "--max-loaded", "3", "--policy", "lru",
                        state_dir=state)
    # A Triton started without the restricted-API key is named at start and by mmctl fleet.
    attached = {s["server"]: s for s in p.json("fleet")}["attached0"]
    assert attached["model_control"] == "open"
    assert "attached0" in p.mmctl("fleet").stderr and "without a key" in p.mmctl("fleet").stderr
    assert "takes model control from anyone" in p.log_text()
    assert p.mmctl("pin", "cust001").returncode == 0
    assert p.mmctl("load", "cust002").returncode == 0
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    assert triton.alive()  # an attached Triton belongs to someone else and keeps running
    assert ready_in_triton(triton.grpc_url) == {"cust001", "cust002"}

    p2 = product_factory("--attach", triton.grpc_url, "--max-loaded", "3", "--policy", "lru",
                         state_dir=state)
    status = {m["model"]: m for m in p2.json("status")}
    assert status["cust001"]["state"] == status["cust002"]["state"] == "ready"
    assert status["cust001"]["pinned"] and not status["cust002"]["pinned"]
    assert ready_in_triton(triton.grpc_url) == {m for m, r in status.items() if r["state"] == "ready"}
    assert p2.mmctl("load", "cust003").returncode == 0
    assert p2.mmctl("load", "cust004").returncode == 0  # evicts the adopted cust002
    assert ready_in_triton(triton.grpc_url) == {"cust001", "cust003", "cust004"}
