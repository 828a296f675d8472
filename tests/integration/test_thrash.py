"""Thrash: many clients over more models than fit, through the router, on the real stack.
Slow is acceptable under thrash; an error for a request that could be served is not."""

from __future__ import annotations

import shutil

import pytest

from bench.thrash import thrash
from tests.product import Product

pytestmark = pytest.mark.integration

CLIENTS, REQUESTS_EACH = 16, 5


def assert_thrash_loses_nothing(p: Product) -> None:
    """Thrash the started product ``p`` over cust001..cust008; stop it; no request failed."""
    try:
        records = thrash(p.json("endpoints")["router_grpc"], [f"cust00{i}" for i in range(1, 9)],
                         CLIENTS, REQUESTS_EACH)
        errors = [f"{r['model']}: {r['error']}" for r in records if not r["ok"]]
        assert len(records) == CLIENTS * REQUESTS_EACH
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
