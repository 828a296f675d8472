"""Thrash: many clients over more models than fit, through the router, on the real stack.
Slow is acceptable under thrash; an error for a request that could be served is not."""

from __future__ import annotations

import random
import shutil
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.product import Product

pytestmark = pytest.mark.integration

CLIENTS, REQUESTS_EACH = 16, 5


def thrash(url: str, models: list[str]) -> list[str]:
    """CLIENTS threads, each REQUESTS_EACH requests to random models; every failure's text."""
    errors: list[str] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        c = grpcclient.InferenceServerClient(url)
        x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
        x.set_data_from_numpy(np.ones((1, 64), np.float32))
        for _ in range(REQUESTS_EACH):
            model = rng.choice(models)
            try:
                scores = c.infer(model, [x], client_timeout=240).as_numpy("SCORES")
                assert scores.shape == (1, 1)
            except Exception as exc:  # noqa: BLE001  (every failure is what this test counts)
                errors.append(f"{model}: {exc}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def assert_thrash_loses_nothing(p: Product) -> None:
    """Thrash the started product ``p`` over cust001..cust008; stop it; no request failed."""
    try:
        errors = thrash(p.json("endpoints")["router_grpc"], [f"cust00{i}" for i in range(1, 9)])
        assert errors == [], f"{len(errors)} of {CLIENTS * REQUESTS_EACH} requests failed: {errors[:5]}"
    finally:
        p.stop()
        p.assert_no_triton_left()


def test_thrash_over_separate_models_loses_no_request(fleet_template, tmp_path):
    repo = tmp_path / "repository"
    shutil.copytree(fleet_template, repo)
    assert_thrash_loses_nothing(Product(tmp_path / "state", repo, "--max-loaded", "3",
                                        "--router-workers", "1", "--policy", "lru").start())


def test_thrash_over_a_family_loses_no_request(tmp_path):
    assert_thrash_loses_nothing(Product(tmp_path / "state", None, "--fleet-size", "8", "--max-loaded",
                                        "3", "--router-workers", "1", "--policy", "lru").start())
