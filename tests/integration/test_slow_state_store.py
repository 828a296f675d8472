"""A slow state store holds up the admin write that waits on it, nothing else.

`mmctl up` on a real PostgreSQL (pgserver) and a real tritonserver.  Another connection
holds a lock on the pins table, so an unpin's write waits in PostgreSQL (as behind a long
transaction, a vacuum or a slow disk).  Meanwhile the control plane answers its other
admin calls and serves a cold model (a load through the router), and the unpin completes
once the lock is let go.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import psycopg
import pytest
import requests
import tritonclient.grpc as grpcclient

from tests.product import Product

pytestmark = pytest.mark.integration

ANSWER_S = 30.0  # generous: the point is answering while the write waits, not how fast


def waiting_on_a_lock(postgres_url: str) -> int:
    """Statements of this database waiting for a lock held by another connection."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                            "AND wait_event_type = 'Lock'").fetchone()[0]


def test_an_admin_write_stuck_in_postgresql_stalls_neither_other_admin_calls_nor_loads(
        repository, tmp_path, postgres_url):
    product = Product(tmp_path / "state", repository, "--state-url", postgres_url,
                      "--max-loaded", "4", "--router-workers", "1").start()
    headers = product.admin_headers()
    locker = None
    try:
        endpoints = product.json("endpoints")
        assert requests.post(f"{product.url}/v1/models/cust001/pin", json={}, headers=headers,
                             timeout=120).ok

        locker = psycopg.connect(postgres_url)  # a transaction of its own, left open
        locker.execute("LOCK TABLE pins IN EXCLUSIVE MODE")  # reads go on, writes wait
        unpinned: list[requests.Response] = []
        unpin = threading.Thread(target=lambda: unpinned.append(requests.post(
            f"{product.url}/v1/models/cust001/unpin", json={}, headers=headers, timeout=300)))
        unpin.start()
        deadline = time.monotonic() + ANSWER_S
        while waiting_on_a_lock(postgres_url) == 0:
            assert time.monotonic() < deadline, "the unpin never reached PostgreSQL"
            time.sleep(0.05)

        # The unpin's write waits in PostgreSQL; the control plane goes on.
        status = requests.get(f"{product.url}/v1/status", headers=headers, timeout=ANSWER_S)
        assert status.status_code == 200
        assert requests.get(f"{product.url}/health", timeout=ANSWER_S).status_code == 200
        client = grpcclient.InferenceServerClient(endpoints["router_grpc"])
        x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
        x.set_data_from_numpy(np.ones((1, 64), np.float32))
        assert client.infer("cust002", [x], client_timeout=ANSWER_S).as_numpy("SCORES") is not None
        client.close()
        assert unpin.is_alive() and waiting_on_a_lock(postgres_url) >= 1, \
            "the unpin's write should still be waiting for the lock"

        locker.commit()  # the lock goes: the write lands, the unpin answers
        unpin.join(60)
        assert unpinned and unpinned[0].status_code == 200, unpinned
        assert unpinned[0].json()["pinned"] is False
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute("SELECT count(*) FROM pins WHERE model = 'cust001'").fetchone()[0] == 0
    finally:
        if locker is not None:
            locker.close()
        product.stop()
