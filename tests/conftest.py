"""Shared fixtures.  Integration tests run the real tritonserver on free loopback ports."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

# A model state change the manager's state machine does not list fails the test (and any
# `mmctl up` a test starts) instead of being logged and counted.
os.environ["MMS_STRICT_TRANSITIONS"] = "1"

from control_plane.demo.fleet import (
    FleetSpec,
    base_weights,
    customer_weights,
    generate_extras,
    generate_fleet,
    write_model,
)
from control_plane.triton.process import TritonLaunchConfig, TritonProcess

SMALL = FleetSpec(count=8, hidden_dim=32, hidden_layers=1)


def run(coro):
    """Run a coroutine to completion in a fresh loop (tests stay synchronous)."""
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def fleet_template(tmp_path_factory) -> Path:
    """cust001..cust008, the demo extras, slow (3 s per execute) and broken (fails to load)."""
    repo = tmp_path_factory.mktemp("fleet")
    generate_fleet(repo, SMALL)
    generate_extras(repo, SMALL)  # identity, cust017-v2/-v3, cust017-faulty (fails 1 in 2)
    slow = FleetSpec(count=1, hidden_dim=32, hidden_layers=1, extra_parameters=(("execute_delay_s", "3"),))
    write_model(repo, "slow", slow, customer_weights(slow, "slow", base_weights(slow)))
    write_model(repo, "broken", SMALL, customer_weights(SMALL, "broken", base_weights(SMALL)))
    (repo / "broken" / "1" / "model.py").write_text("raise RuntimeError('this model is broken on purpose')\n")
    return repo


@pytest.fixture
def repository(fleet_template, tmp_path) -> Path:
    repo = tmp_path / "repository"
    shutil.copytree(fleet_template, repo)
    return repo


@pytest.fixture
def triton(repository, tmp_path):
    proc = TritonProcess(TritonLaunchConfig(repository=repository, work_dir=tmp_path / "triton"))
    proc.start()
    yield proc
    proc.stop()
    assert not proc.alive(), "tritonserver was left running"


def triton_log_count(proc: TritonProcess, needle: str) -> int:
    return proc.log_path.read_text(errors="replace").count(needle)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    """A real PostgreSQL (the pgserver wheel), one per test run; tests take databases of
    their own from it (``fresh_database``)."""
    import pgserver

    server = pgserver.get_server(str(tmp_path_factory.mktemp("pg")), cleanup_mode="stop")
    yield server
    server.cleanup()


def fresh_database(server, name: str) -> str:
    """The URL of a new, empty database ``name`` on ``server``."""
    import psycopg

    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.get_uri(name)


@pytest.fixture
def postgres_url(postgres_server, request) -> str:
    import re

    return fresh_database(postgres_server, re.sub(r"\W", "_", request.node.name)[:60].lower())
