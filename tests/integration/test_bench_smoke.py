"""Benchmarks run: each one here once at its smallest size, as `make bench` would run it, so a
benchmark that crashes fails the suite instead of rotting until someone runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def test_load_profile_runs_and_reports_every_phase(tmp_path):
    """It crashed after every other benchmark of `make bench` had run (a median over cycles
    that measured no index poll)."""
    out_file = tmp_path / "load_profile.json"
    out = run_bench("bench.load_profile", "--cycles", "1", "--out", str(out_file))
    result = json.loads(out_file.read_text())
    assert result["median"]["ensure_s"] > 0 and result["median"]["index_polls"] >= 1
    assert "= ensure (miss with room, no eviction)" in out.stdout


def test_abuse_runs_and_prints_each_hostile_body():
    out = run_bench("bench.abuse", "--quick", "--repeats", "1")
    for body in ("normal", "gzip_empty_members", "deep_nesting"):
        assert body in out.stdout
