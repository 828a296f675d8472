"""Fair shares on a saturated server, driven as a person does: `mmctl up --server-concurrency`
on a model family whose batches take 25 ms (simulated device time: the family sleeps per
batch), unmodified HTTP clients through the router's workers, `mmctl share`.

Triton runs the family's requests first come, first served: a customer that floods it puts
its whole backlog in front of the next customer's request.  With a concurrency the router
holds the backlog and gives the next turn to the customer that has waited least served: a
trickle's request is answered after a few of the flood's, not after the flood's backlog."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient

from control_plane.demo.fleet import (
    FleetSpec,
    base_weights,
    customer_weights,
    generate_family_fleet,
)
from tests.product import Product
from tests.reference import mlp_scores

pytestmark = pytest.mark.integration

# Each request is one whole batch (4 rows, max batch 4), so Triton cannot fold the trickle's
# request into a flood batch: one request, one 25 ms turn of the family's one instance.
SPEC = FleetSpec(count=3, hidden_dim=16, hidden_layers=1, max_batch_size=4,
                 extra_parameters=(("execute_delay_s", "0.025"),))
FLOODERS = 24  # clients sending cust001 back to back: a backlog of ~24 requests (0.6 s)
TRICKLE = 6  # cust002 requests sent one after another while the flood runs


def features(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, SPEC.feature_dim)).astype(np.float32)


def reference(name: str, x: np.ndarray) -> np.ndarray:
    return mlp_scores(customer_weights(SPEC, name, base_weights(SPEC)), x)


def infer(url: str, model: str, x: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        inp = httpclient.InferInput("FEATURES", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(model, [inp]).as_numpy("SCORES")
    finally:
        client.close()


def flood_answers_during_each_trickle_request(url: str) -> tuple[list[int], list[str]]:
    """How many flood answers arrived while each trickle request waited, and every answer
    that was not its model's own."""
    stop = threading.Event()
    flood_done: list[float] = []
    wrong: list[str] = []
    lock = threading.Lock()

    def flood(seed: int) -> None:
        x = features(seed)
        want = reference("cust001", x)
        while not stop.is_set():
            got = infer(url, "cust001", x)
            with lock:
                flood_done.append(time.monotonic())
                if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                    wrong.append(f"cust001 answered {got.ravel().tolist()}")

    overtaken: list[int] = []
    with ThreadPoolExecutor(FLOODERS) as pool:
        floods = [pool.submit(flood, seed) for seed in range(FLOODERS)]
        try:
            while len(flood_done) < 2 * FLOODERS:  # the backlog is there
                time.sleep(0.01)
            for i in range(TRICKLE):
                x = features(1000 + i)
                sent = time.monotonic()
                got = infer(url, "cust002", x)
                answered = time.monotonic()
                if not np.allclose(got, reference("cust002", x), rtol=1e-4, atol=1e-5):
                    wrong.append(f"cust002 answered {got.ravel().tolist()}")
                with lock:
                    overtaken.append(sum(1 for t in flood_done if sent <= t <= answered))
        finally:
            stop.set()
            for f in floods:
                f.result()
    return overtaken, wrong


@pytest.fixture
def family_repository(tmp_path):
    repo = tmp_path / "repository"
    generate_family_fleet(repo, SPEC)
    return repo


def test_a_flood_does_not_queue_in_front_of_another_customer(tmp_path, family_repository):
    product = Product(tmp_path / "state", family_repository, "--fleet-size", "0",
                      "--server-concurrency", "2", "--router-workers", "2").start()
    try:
        shares = product.json("share", "list")
        assert shares["servers"] == {"triton0": 2}
        assert product.mmctl("share", "set", "cust002", "--weight", "2").returncode == 0
        assert product.mmctl("share", "set", "cust002", "--weight", "0").returncode == 2
        assert product.json("share", "list")["models"] == {"cust002": 2.0}
        url = product.json("endpoints")["router_http"]
        for name in ("cust001", "cust002"):  # both loaded: no miss in what is measured
            x = features(7)
            np.testing.assert_allclose(infer(url, name, x), reference(name, x), rtol=1e-4, atol=1e-5)

        overtaken, wrong = flood_answers_during_each_trickle_request(url)
        assert wrong == [], wrong[:3]
        # Each trickle request waits for the turns already running (2 over the workers)
        # and is next: a few flood answers, not the ~24 of the flood's backlog in Triton's
        # queue (what the same run shows without a concurrency).
        assert sorted(overtaken)[TRICKLE // 2] <= 6, overtaken
        metrics = requests.get(f"http://{url}/metrics", timeout=10).text
        assert 'mmr_share_wait_seconds_count{model="cust001"}' in metrics
    finally:
        product.stop()
        product.assert_no_triton_left()
