"""A clean stop of `mmctl up` gives back the host RAM its default warm tier (tmpfs) holds."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from control_plane.tiers.warm import default_warm_repository, tmpfs_warm_root
from tests.product import Product

pytestmark = pytest.mark.integration

SIMPLE = Path(__file__).resolve().parent.parent / "fixtures" / "models" / "simple"


def test_clean_stop_removes_the_tmpfs_warm_tier(tmp_path):
    state = tmp_path / "state"
    root = tmpfs_warm_root(state)
    if default_warm_repository(state).parent != root:
        pytest.skip("no writable /dev/shm: the warm tier is on disk")
    product = Product(state, None, "--fleet-size", "0").start()  # no --repository: the default
    try:
        assert product.json("endpoints")["repository"] == str(root / "repository")
        added = product.mmctl("registry", "add", "simple", "--from-dir", str(SIMPLE))
        assert added.returncode == 0, added.stderr
        loaded = product.mmctl("load", "simple")
        assert loaded.returncode == 0, loaded.stderr
        staged = [p for p in (root / "repository").iterdir() if (p / "config.pbtxt").is_file()]
        assert staged, "the model was not staged into the tmpfs warm tier"
    finally:
        product.stop()
    try:
        assert product.proc.returncode == 0, product.log_text()
        assert not root.exists(), f"{root} still holds {sorted(p.name for p in root.rglob('*'))[:10]}"
        deadline = time.monotonic() + 20
        while product.triton_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not product.triton_pids()
    finally:
        shutil.rmtree(root, ignore_errors=True)
