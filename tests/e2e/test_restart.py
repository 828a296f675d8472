"""`mmctl up` started again right after a crash, on the same fixed Triton ports.

The crashed control plane's Triton gets SIGTERM from the kernel (parent-death signal) and
shuts down gracefully, which takes as long as its in-flight requests.  Until it is gone it
holds the Triton ports; the new `mmctl up` must wait for it (or end it), not fail.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from control_plane.triton.process import free_port
from tests.conftest import pid_alive
from tests.integration.answers import Answers, features
from tests.product import Product

pytestmark = pytest.mark.integration


def _wait_gone(product: Product, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while product.triton_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not product.triton_pids(), "a tritonserver was left behind"


def test_restart_right_after_sigkill_with_fixed_triton_ports(repository, tmp_path):
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    fixed = ("--triton-http-port", str(http_port), "--triton-grpc-port", str(grpc_port),
             "--triton-metrics-port", str(metrics_port))
    product = Product(tmp_path / "state", repository, *fixed).start()
    try:
        assert product.mmctl("load", "slow").returncode == 0
        (old_pid,) = product.triton_pids()
        # Requests in flight keep the old Triton busy (3 s per execute) after its parent dies.
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        for _ in range(3):
            x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
            x.set_data_from_numpy(np.zeros((1, 64), np.float32))
            client.async_infer("slow", [x], callback=lambda result, error: None)
            time.sleep(0.3)

        product.proc.send_signal(signal.SIGKILL)
        product.proc.wait()
        time.sleep(0.2)
        assert pid_alive(old_pid), "the old Triton should still be shutting down"
        product.start()  # failed with exit 3 (Triton could not bind its port) before the fix

        assert not pid_alive(old_pid)
        new_pids = product.triton_pids()
        assert len(new_pids) == 1 and new_pids != [old_pid]
        assert product.mmctl("load", "cust001").returncode == 0
        assert product.json("endpoints")["triton"][0]["grpc"] == f"127.0.0.1:{grpc_port}"
        # The new life serves: through its router, with cust001's own scores.
        router = grpcclient.InferenceServerClient(product.json("endpoints")["router_grpc"])
        x = features(2)
        inp = grpcclient.InferInput("FEATURES", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        Answers(repository).assert_answer("cust001", x,
                                          router.infer("cust001", [inp]).as_numpy("SCORES"))
        router.close()
    finally:
        product.stop()
        _wait_gone(product)
