"""Placement: each filter table-tested with named cases, ordering keys, the errors."""

from __future__ import annotations

import pytest

from control_plane.errors import CapacityExhausted, TritonUnavailable
from control_plane.eviction import CachePlanner, Capacity, Resident, make_policy
from control_plane.manager import ModelManager, ServerSpec
from control_plane.placement import (
    Candidate,
    ModelFacts,
    PlacementRequest,
    Placer,
    ServerLabels,
    choose,
    device_big_enough,
    fits_free_or_evictable,
    server_up,
    sla_isolation,
    tenant_affinity,
)

MB = 1_000_000


def req(**kw) -> PlacementRequest:
    kw.setdefault("model", "m.v1")
    kw.setdefault("size_bytes", 100 * MB)
    return PlacementRequest(**kw)


def cand(**kw) -> Candidate:
    kw.setdefault("server", "s0")
    return Candidate(**kw)


FILTER_CASES = [
    # (filter, request, candidate, expected substring of the reason or None)
    pytest.param(server_up, req(), cand(), None, id="up: passes"),
    pytest.param(server_up, req(), cand(up=False, address="h:1"), "server s0 (h:1) is down", id="up: down"),
    pytest.param(device_big_enough, req(), cand(capacity_bytes=100 * MB), None, id="big: exactly fits"),
    pytest.param(device_big_enough, req(), cand(capacity_bytes=99 * MB, device="gpu0/mig1"),
                 "whole budget of s0 (gpu0/mig1) is 99000000 bytes", id="big: larger than the device"),
    pytest.param(device_big_enough, req(), cand(), None, id="big: no byte budget"),
    pytest.param(device_big_enough, req(), cand(max_slots=0), "takes no models", id="big: zero slots"),
    pytest.param(sla_isolation, req(sla="gold"), cand(isolated=True), None, id="sla: gold on a MIG slice"),
    pytest.param(sla_isolation, req(sla="gold"), cand(device="cpu"), "needs an isolated device",
                 id="sla: gold on a shared device"),
    pytest.param(sla_isolation, req(sla="silver"), cand(isolated=True), None,
                 id="sla: silver may use an isolated device"),
    pytest.param(sla_isolation, req(sla="silver"), cand(isolated=True, reserved_for_sla="gold"),
                 "reserved for SLA gold models; m.v1 is silver", id="sla: reserved for gold"),
    pytest.param(sla_isolation, req(sla="gold"), cand(isolated=True, reserved_for_sla="gold"), None,
                 id="sla: gold on the gold slice"),
    pytest.param(tenant_affinity, req(tenant="acme"), cand(), None, id="tenant: unrestricted"),
    pytest.param(tenant_affinity, req(tenant="acme"), cand(tenants=frozenset({"acme"})), None,
                 id="tenant: allowed"),
    pytest.param(tenant_affinity, req(tenant="globex"), cand(tenants=frozenset({"acme"})),
                 "serves tenants ['acme'] only; m.v1 belongs to globex", id="tenant: other tenant"),
    pytest.param(tenant_affinity, req(), cand(tenants=frozenset({"acme"})), "belongs to no tenant",
                 id="tenant: no tenant on a tenant device"),
    pytest.param(fits_free_or_evictable, req(), cand(victims=("a",)), None, id="fits: with victims"),
    pytest.param(fits_free_or_evictable, req(), cand(plan_error=CapacityExhausted("all pinned: p1")),
                 "all pinned: p1", id="fits: planner cannot make room"),
]


@pytest.mark.parametrize("flt, request_, candidate, expected", FILTER_CASES)
def test_filters(flt, request_, candidate, expected):
    why = flt(request_, candidate)
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why


ORDER_CASES = [
    pytest.param(req(), [cand(server="a", warm=False), cand(server="b", used_bytes=90, capacity_bytes=100)],
                 "b", id="already warm beats least loaded"),
    pytest.param(req(), [cand(server="a", victims=("x",)), cand(server="b", victims=())],
                 "b", id="fewest victims"),
    pytest.param(req(), [cand(server="a", used_bytes=80, capacity_bytes=100),
                         cand(server="b", used_bytes=20, capacity_bytes=100)], "b", id="least loaded"),
    pytest.param(req(), [cand(server="a", used_slots=3, max_slots=4), cand(server="b", used_slots=1, max_slots=4)],
                 "b", id="least loaded by slots"),
    pytest.param(req(pinned=True), [cand(server="a", pinned_models=3), cand(server="b", pinned_models=1,
                                                                        used_bytes=50, capacity_bytes=100)],
                 "b", id="spread pinned models"),
    pytest.param(req(pinned=False), [cand(server="a", pinned_models=3), cand(server="b", pinned_models=1,
                                                                         used_bytes=50, capacity_bytes=100)],
                 "a", id="unpinned ignores pin spread"),
    pytest.param(req(), [cand(server="a", isolated=True), cand(server="b", used_bytes=50, capacity_bytes=100)],
                 "b", id="non-gold stays off isolated slices"),
    pytest.param(req(sla="gold"), [cand(server="a", isolated=True, used_bytes=60, capacity_bytes=100),
                                   cand(server="b", isolated=True, used_bytes=10, capacity_bytes=100)],
                 "b", id="gold: least loaded isolated"),
    pytest.param(req(), [cand(server="b"), cand(server="a")], "a", id="name breaks ties"),
]


@pytest.mark.parametrize("request_, candidates, expected", ORDER_CASES)
def test_ordering(request_, candidates, expected):
    small = PlacementRequest(request_.model, 1, request_.sla, request_.tenant, request_.pinned)
    assert choose(small, candidates).server == expected


def test_rejections_are_reported_per_server():
    d = choose(req(sla="gold"), [cand(server="shared"), cand(server="mig", isolated=True)])
    assert d.server == "mig"
    assert d.rejected["shared"][0] == "sla_isolation"


def test_too_big_for_every_device_names_the_largest():
    with pytest.raises(CapacityExhausted) as err:
        choose(req(size_bytes=50 * MB), [cand(server="small", capacity_bytes=10 * MB, device="gpu0/mig0"),
                                         cand(server="large", capacity_bytes=40 * MB, device="gpu0/mig1")])
    msg = str(err.value)
    assert "fits on no device" in msg and "largest is large (gpu0/mig1) with 40000000 bytes" in msg


def test_single_server_keeps_the_planner_message():
    planner_error = CapacityExhausted("m.v1 needs 1 slot; all pinned: p1, p2 (2 models)")
    with pytest.raises(CapacityExhausted) as err:
        choose(req(), [cand(plan_error=planner_error)])
    assert err.value is planner_error
    with pytest.raises(TritonUnavailable, match="is down"):
        choose(req(), [cand(up=False)])


def test_mixed_reasons_list_every_server():
    with pytest.raises(CapacityExhausted) as err:
        choose(req(sla="gold", tenant="acme"), [
            cand(server="s0"),
            cand(server="s1", isolated=True, tenants=frozenset({"globex"})),
            cand(server="s2", up=False)])
    msg = str(err.value)
    assert "s0: SLA gold needs an isolated device" in msg and "[sla_isolation]" in msg
    assert "s1:" in msg and "[tenant_affinity]" in msg and "s2:" in msg


def test_all_down_is_unavailable():
    with pytest.raises(TritonUnavailable, match="no Triton server is up"):
        choose(req(), [cand(server="a", up=False), cand(server="b", up=False)])


# --------------------------------------------------------------------------- Placer glue
class FakeServer:
    def __init__(self, name, budget=None, slots=None, up=True):
        self.spec = ServerSpec(name, f"{name}:1", f"{name}:2", device=name, memory_budget_bytes=budget,
                               max_loaded=slots)
        self.planner = CachePlanner(make_policy("lru"), Capacity(budget, slots))
        self.up = up

    @property
    def name(self):
        return self.spec.name


def test_placer_builds_candidates_from_planners_and_labels():
    small = FakeServer("small", budget=150 * MB)
    large = FakeServer("large", budget=1000 * MB)
    gold = FakeServer("gold", budget=300 * MB)
    small.planner.admit(Resident("p", 100 * MB, pinned=True), 0)
    facts = {"big.v1": ModelFacts(), "vip.v1": ModelFacts(sla="gold"), "s.v1": ModelFacts()}
    placer = Placer(facts=lambda n: facts.get(n, ModelFacts()),
                    labels={"gold": ServerLabels(isolated=True, reserved_for_sla="gold")})
    servers = [small, large, gold]
    assert placer.place("big.v1", 500 * MB, servers)[0] is large
    assert placer.place("vip.v1", 200 * MB, servers)[0] is gold
    assert placer.place("s.v1", 40 * MB, servers)[0] is large  # small is 67% used
    with pytest.raises(CapacityExhausted, match="fits on no device"):
        placer.place("huge.v1", 2000 * MB, servers)


def test_manager_uses_the_placer_and_counts_capacity_errors(tmp_path):
    from control_plane.state_store import StateStore
    from tests.unit.test_manager_unit import FakeAdmin

    admin_a, admin_b = FakeAdmin(["x"]), FakeAdmin(["x"])
    a = ModelManager.make_server(ServerSpec("a", "a:1", "a:2", memory_budget_bytes=10), "lru", admin=admin_a)
    b = ModelManager.make_server(ServerSpec("b", "b:1", "b:2", memory_budget_bytes=20), "lru", admin=admin_b)
    mgr = ModelManager([a, b], StateStore(tmp_path / "s.db"),
                       placer=Placer(labels={"a": ServerLabels(isolated=True)}))
    server, victims = mgr._place("x", 5)
    assert (server.name, victims) == ("b", [])  # non-gold stays off the isolated one
    with pytest.raises(CapacityExhausted, match="fits on no device"):
        mgr._place("x", 50)
    assert mgr.metrics.capacity_errors._value.get() == 1
