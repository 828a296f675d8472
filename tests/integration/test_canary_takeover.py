"""A canary survives a change of leader: on a real PostgreSQL (pgserver) shared by two
control planes, the standby that takes the lease over judges the canary on the requests the
old leader saw, and the ones it sees itself, as one window."""

from __future__ import annotations

import pytest

from control_plane.admin.dataplane import DataPlaneHub
from control_plane.registry import Registry
from control_plane.state import LeaderLease, open_database
from control_plane.state.state_store import StateStore

pytestmark = pytest.mark.integration

LEASE_TTL_S = 1.0


def leading_hub(postgres_url: str, identity: str) -> tuple[DataPlaneHub, LeaderLease, StateStore]:
    """A control plane's data-plane hub once it holds the lease, as the service starts it:
    the fence is set before the hub's writer opens its own connection."""
    store = StateStore(open_database(postgres_url))
    lease = LeaderLease(store.db, identity=identity, ttl_s=LEASE_TTL_S)
    assert lease.wait_until_leader(retry_s=0.1)
    store.db.fence = lease.fence()
    # The canary's judgement reads neither the manager nor the families.
    return DataPlaneHub(None, Registry(store.db), store), lease, store


def report(hub: DataPlaneHub, variant: str, ok: int, failed: int) -> None:
    """Outcomes as the router workers' reports bring them (``DataPlaneHub.report``)."""
    for _ in range(ok):
        hub.stats.record_outcome("canary:m", variant, "OK", 5.0)
    for _ in range(failed):
        hub.stats.record_outcome("canary:m", variant, "INTERNAL", 5.0)


def test_a_standby_taking_over_judges_the_canary_on_the_requests_seen_before(postgres_url):
    leader, leader_lease, leader_store = leading_hub(postgres_url, "cp-a")
    leader.table.start_canary("m", "m2", stages=[50, 100], stage_s=3600, check_interval_s=0,
                              min_requests=50, max_error_rate=0.05, max_failed_checks=1)
    report(leader, "canary", ok=32, failed=8)
    report(leader, "baseline", ok=40, failed=0)
    leader.canaries.step()
    assert leader.table.canary("m").history[-1]["decision"] == "hold"  # 40 < 50: no verdict yet
    assert leader.route_store.flush(10.0)
    # The leader dies: it neither renews nor releases its lease, and writes nothing more.
    leader.route_store.close()
    leader_lease.stop()

    standby, standby_lease, standby_store = leading_hub(postgres_url, "cp-b")
    try:
        assert standby_lease.token == leader_lease.token + 1
        report(standby, "canary", ok=16, failed=4)
        report(standby, "baseline", ok=20, failed=0)
        standby.canaries.step()
        canary = standby.table.canary("m")
        last = canary.history[-1]
        # 60 canary requests with 12 errors: judged, and rolled back, on both leaders' traffic.
        assert last["decision"] == "rollback", last
        assert (last["canary"]["requests"], last["canary"]["errors"]) == (60, 12)
        assert last["baseline"]["requests"] == 60
        assert canary.status == "rolled_back"
        assert standby.stats.scope("canary:m")["canary"]["requests"] == 60
    finally:
        standby.route_store.close()
        standby_lease.close()
        standby_store.close()
        leader_lease.close()
        leader_store.close()
