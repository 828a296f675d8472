"""A frozen Triton is a down Triton: one that hangs instead of dying (a hung GPU, a stuck
backend; here SIGSTOP) is declared down within seconds, the requests waiting on it are
sent where its models are placed now, within their deadlines, over gRPC and HTTP, and the
frozen process is killed and started again by the control plane, with nothing left loaded
twice.

Two real tritonservers under `mmctl up` with a router worker; clients keep requests in
flight to the model's server when it is stopped.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import requests
from safetensors.torch import load_file

from control_plane.demo.fleet import WEIGHTS_FILE
from tests.conftest import pid_alive
from tests.product import Product
from tests.reference import mlp_scores
from tests.router_clients import client_for, infer_scores, ready_on
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

MODEL = "cust001"
DEADLINE_S = 30.0
FEATURES = np.random.default_rng(29).standard_normal((2, 64)).astype(np.float32)








def product_log(product: Product):
    return lambda: product.log_text()[-4000:]


def test_a_frozen_triton_is_down_and_its_requests_are_answered_elsewhere(repository, tmp_path):
    product = Product(tmp_path / "state", repository, "--triton-servers", "2", "--fleet-size", "0",
                      "--router-workers", "1", "--max-loaded", "4").start()
    frozen_pid = None
    try:
        endpoints = product.json("endpoints")
        headers = product.admin_headers()
        expected = mlp_scores(load_file(str(repository / MODEL / "1" / WEIGHTS_FILE)), FEATURES)

        def admin(path: str):
            return requests.get(f"{product.url}{path}", headers=headers, timeout=10).json()

        for protocol in ("grpc", "http"):  # loaded, and both paths answer right
            client = client_for(endpoints, protocol, DEADLINE_S)
            scores = infer_scores(client, protocol, MODEL, FEATURES, DEADLINE_S)
            np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
            client.close()
        frozen = admin(f"/v1/models/{MODEL}")["server"]
        survivor = next(s["server"] for s in admin("/v1/fleet") if s["server"] != frozen)
        frozen_pid = next(p["pid"] for p in endpoints["processes"]
                          if p.get("role") == "triton" and p.get("name") == frozen)

        errors: list[str] = []
        served: list[tuple[str, float, float]] = []  # (protocol, sent, answered), monotonic
        stop = threading.Event()

        def traffic(protocol: str) -> None:
            client = client_for(endpoints, protocol, DEADLINE_S)
            try:
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        scores = infer_scores(client, protocol, MODEL, FEATURES, DEADLINE_S)
                        np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
                        served.append((protocol, sent, time.monotonic()))
                    except Exception as exc:  # noqa: BLE001  (every failure is the test's finding)
                        errors.append(f"{protocol} after {time.monotonic() - sent:.1f}s: "
                                      f"{type(exc).__name__}: {exc}")
            finally:
                client.close()

        threads = [threading.Thread(target=traffic, args=(p,)) for p in ("grpc", "grpc", "http", "http")]
        for t in threads:
            t.start()
        time.sleep(1.0)  # requests in flight on the model's server
        os.kill(frozen_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()

        def up(server: str) -> bool:
            return next(s for s in admin("/v1/fleet") if s["server"] == server)["up"]

        wait_for(lambda: not up(frozen), 10, f"{frozen} was not declared down", product_log(product))
        down_after_s = time.monotonic() - stopped_at
        wait_for(lambda: admin(f"/v1/models/{MODEL}")["server"] == survivor, DEADLINE_S,
                 f"{MODEL} was not placed on {survivor}", product_log(product))
        wait_for(lambda: sum(1 for _p, _sent, answered in served if answered > stopped_at) >= 8
                 or errors, DEADLINE_S, "requests were not answered after the freeze", product_log(product))
        stop.set()
        for t in threads:
            t.join(DEADLINE_S + 5)
        after = {p: [answered - sent for q, sent, answered in served if q == p and answered > stopped_at]
                 for p in ("grpc", "http")}
        print(f"{frozen} down {down_after_s:.1f}s after SIGSTOP; answered after it: "
              + ", ".join(f"{p} {len(t)}, the slowest in {max(t, default=0):.1f}s" for p, t in after.items()))
        assert errors == [], errors[:5]
        assert max(answered - sent for _p, sent, answered in served) < DEADLINE_S
        # Requests of both protocols waited on the frozen server, and were sent elsewhere.
        assert all(max(t, default=0) > 1.0 for t in after.values()), after
        assert down_after_s < 5.0 + 1.0  # down within 5 s (and the fleet read that saw it)

        # The frozen process is killed and started again, empty: the model is loaded once.
        wait_for(lambda: not pid_alive(frozen_pid), 10,
                 f"the frozen tritonserver {frozen_pid} was not killed", product_log(product))
        wait_for(lambda: up(frozen), 30, f"{frozen} was not started again", product_log(product))
        fleet = {s["server"]: s for s in admin("/v1/fleet")}
        assert MODEL in fleet[survivor]["loaded"] and MODEL not in fleet[frozen]["loaded"]
        assert ready_on(fleet[survivor]["http_url"], MODEL)
        assert not ready_on(fleet[frozen]["http_url"], MODEL)
        assert admin(f"/v1/models/{MODEL}")["state"] == "ready"
        # No false alarm: the survivor, as loaded as the machine, was never taken for down.
        assert not [line for line in product.log_text().splitlines()
                    if f"Triton {survivor} at" in line and "is down" in line]
        client = client_for(endpoints, "http", DEADLINE_S)
        np.testing.assert_allclose(infer_scores(client, "http", MODEL, FEATURES, DEADLINE_S),
                                   expected, rtol=1e-5, atol=1e-6)
        client.close()
    finally:
        if frozen_pid is not None and pid_alive(frozen_pid):
            os.kill(frozen_pid, signal.SIGCONT)
        product.stop()
    product.assert_no_triton_left()

