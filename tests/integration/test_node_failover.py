"""A Triton node that dies: requests for its models are served from another node at once,
not refused until the node is declared lost.

Two real tritonservers stand for two nodes (registered by address, as other machines'
Tritons are), under `mmctl up` with a router worker.  The node holding a model is killed;
the next request for that model succeeds within its deadline, served by the other node,
while the dead node is still only down (its "lost" bookkeeping waits for
--server-lost-after, far longer than the request).
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from tests.product import Product

pytestmark = pytest.mark.integration

LOST_AFTER_S = 300.0  # the test is over long before a node is declared lost
REQUEST_DEADLINE_S = 30.0


def infer(client, model: str):
    """One request over gRPC or HTTP (``client``'s module)."""
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    x = module.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    if module is grpcclient:
        return client.infer(model, [x], client_timeout=REQUEST_DEADLINE_S)
    return client.infer(model, [x], timeout=int(REQUEST_DEADLINE_S))


@pytest.fixture
def two_nodes(repository, tmp_path):
    nodes = {}
    try:
        for name in ("node-a", "node-b"):
            proc = TritonProcess(TritonLaunchConfig(repository=repository, work_dir=tmp_path / name))
            proc.start()
            nodes[name] = proc
        yield nodes
    finally:
        for proc in nodes.values():
            proc.stop()
        assert not any(p.alive() for p in nodes.values()), "a tritonserver was left running"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_for_a_model_on_a_dead_node_is_served_by_another_node(two_nodes, repository, tmp_path,
                                                                        protocol):
    servers_file = tmp_path / "servers.json"
    servers_file.write_text(json.dumps({"servers": [
        {"name": name, "grpc_url": p.grpc_url, "http_url": p.http_url, "node": name,
         "memory_budget": "4GiB", "max_loaded": 8} for name, p in two_nodes.items()]}))
    product = Product(tmp_path / "state", repository, "--servers-file", str(servers_file),
                      "--fleet-size", "0", "--server-lost-after", str(LOST_AFTER_S),
                      "--router-workers", "1").start()
    try:
        endpoints = product.json("endpoints")
        client = (grpcclient.InferenceServerClient(endpoints["router_grpc"]) if protocol == "grpc"
                  else httpclient.InferenceServerClient(endpoints["router_http"], network_timeout=60))
        expected = infer(client, "cust001").as_numpy("SCORES")
        headers = product.admin_headers()

        def model(name: str) -> dict:
            return requests.get(f"{product.url}/v1/models/{name}", headers=headers, timeout=10).json()

        dead = model("cust001")["server"]
        survivor = next(n for n in two_nodes if n != dead)
        killed = two_nodes[dead].proc
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)

        started = time.monotonic()
        scores = infer(client, "cust001").as_numpy("SCORES")  # before the fix: UNAVAILABLE
        took_s = time.monotonic() - started
        assert np.array_equal(scores, expected)
        assert model("cust001")["server"] == survivor
        fleet = {s["server"]: s for s in requests.get(f"{product.url}/v1/fleet", headers=headers,
                                                      timeout=10).json()}
        # Re-placed for the request, not by the lost-node bookkeeping: that waits its time.
        assert fleet[dead]["up"] is False and fleet[dead]["lost"] is False
        assert "cust001" in fleet[survivor]["loaded"] and "cust001" not in fleet[dead]["loaded"]
        print(f"served from {survivor} {took_s:.2f}s after {dead} died")
        client.close()
    finally:
        product.stop()
