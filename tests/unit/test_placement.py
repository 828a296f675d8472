"""Placement: each filter table-tested with named cases, ordering keys, the errors."""

from __future__ import annotations

import pytest

from control_plane.eviction import CachePlanner, Capacity, Resident, make_policy
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.placement import (
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
from control_plane.manager.records import CopyKey, ServerSpec
from control_plane.triton.admin import TritonAdmin
from domain.errors import CapacityExhausted, TritonUnavailable

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
def test_each_placement_filter_refuses_a_server_and_says_why(flt, request_, candidate, expected):
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
def test_placement_prefers_servers_in_this_order(request_, candidates, expected):
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
        self.admin = TritonAdmin(self.spec.grpc_url)  # models of their own: no slots

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


def test_a_models_own_copy_goes_where_no_extra_copy_of_it_is_unless_every_server_holds_one():
    emptier = FakeServer("emptier", budget=1000 * MB)
    fuller = FakeServer("fuller", budget=1000 * MB)
    fuller.planner.admit(Resident("other", 400 * MB), 0)
    placer = Placer()
    assert placer.place("m.v1", 100 * MB, [emptier, fuller])[0] is emptier  # the least used
    emptier.planner.admit(Resident(CopyKey("m.v1", "emptier"), 100 * MB), 0)
    assert placer.place("m.v1", 100 * MB, [emptier, fuller])[0] is fuller
    fuller.planner.admit(Resident(CopyKey("m.v1", "fuller"), 100 * MB), 0)
    assert placer.place("m.v1", 100 * MB, [emptier, fuller])[0] is emptier
    # Another model's copy keeps nobody away.
    assert placer.place("n.v1", 100 * MB, [emptier, fuller])[0] is emptier


def test_manager_uses_the_placer_and_counts_capacity_errors(tmp_path):
    from control_plane.state.state_store import StateStore
    from tests.unit.test_manager_unit import FakeAdmin

    admin_a, admin_b = FakeAdmin(["x"]), FakeAdmin(["x"])
    a = ModelManager.make_server(ServerSpec("a", "a:1", "a:2", memory_budget_bytes=10), "lru", admin=admin_a)
    b = ModelManager.make_server(ServerSpec("b", "b:1", "b:2", memory_budget_bytes=20), "lru", admin=admin_b)
    mgr = ModelManager([a, b], StateStore(tmp_path / "s.db"),
                       placer=Placer(labels={"a": ServerLabels(isolated=True)}))
    server, victims = mgr.loader.place("x", 5)
    assert (server.name, victims) == ("b", [])  # non-gold stays off the isolated one
    with pytest.raises(CapacityExhausted, match="fits on no device"):
        mgr.loader.place("x", 50)
    assert mgr.metrics.capacity_errors._value.get() == 1


# --------------------------------------------------------------------------- run where placed
SIMPLE = '''name: "m"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
'''


@pytest.mark.parametrize("groups, kind, expected", [
    pytest.param("instance_group [ { count: 2 kind: KIND_CPU } ]", "KIND_GPU", ["KIND_GPU"],
                 id="cpu config on a GPU server"),
    pytest.param("instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]", "KIND_CPU", ["KIND_CPU"],
                 id="gpu config on a CPU server"),
    pytest.param("instance_group [ { kind: KIND_AUTO } ]", "KIND_GPU", ["KIND_GPU"], id="auto"),
    pytest.param("instance_group [ { kind: KIND_CPU } ]", "KIND_CPU", None, id="already right"),
    pytest.param("instance_group [ { kind: KIND_MODEL } ]", "KIND_GPU", None,
                 id="the model places itself"),
    pytest.param("", "KIND_GPU", None, id="no instance_group: Triton's default follows the server"),
])
def test_the_instance_kind_follows_the_device_it_is_placed_on(groups, kind, expected):
    import json

    from control_plane.manager.placement import instance_kind_config

    out = instance_kind_config(SIMPLE + groups, kind)
    if expected is None:
        assert out is None
        return
    config = json.loads(out)
    assert [g["kind"] for g in config["instance_group"]] == expected
    assert config["name"] == "m" and config["backend"] == "python"
    assert config["input"][0]["dims"] == ["4"]  # the rest of the config is carried over
    assert all("gpus" not in g for g in config["instance_group"]) or kind == "KIND_GPU"
    if "count: 2" in groups:
        assert config["instance_group"][0]["count"] == 2


def test_instance_kind_override_reads_the_repository_and_leaves_bad_configs_to_triton(tmp_path):
    from control_plane.manager.placement import instance_kind_override

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(SIMPLE + "instance_group [ { kind: KIND_CPU } ]")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.pbtxt").write_text("name: 'bad' this is { not a config")
    load_config = instance_kind_override(tmp_path, "KIND_GPU")
    assert '"KIND_GPU"' in load_config("m")
    assert load_config("bad") is None and load_config("missing") is None


# --------------------------------------------------------------------------- measured size
def planner_with(budget, slots=None, **residents):
    planner = CachePlanner(make_policy("lru"), Capacity(budget, slots))
    for i, (name, (size, pinned)) in enumerate(residents.items()):
        planner.admit(Resident(name, size, pinned=pinned), i)
    return planner


@pytest.mark.parametrize("budget, slots, residents, measured, expected", [
    pytest.param(100, None, {"a": (30, False), "new": (10, False)}, 60, [], id="fits as measured"),
    pytest.param(100, None, {"a": (30, False), "b": (30, False), "new": (10, False)}, 60, ["a"],
                 id="evicts the least recently used"),
    pytest.param(100, 3, {"a": (30, False), "b": (30, False), "new": (10, False)}, 40, [],
                 id="a full slot count evicts nothing: the model already holds its slot"),
    pytest.param(None, None, {"new": (10, False)}, 10**12, [], id="no byte budget"),
])
def test_a_model_measured_larger_than_accounted_evicts_what_it_needs(budget, slots, residents, measured, expected):
    from control_plane.manager.placement import plan_measured

    planner = planner_with(budget, slots, **residents)
    planner.update("new", evictable=False)  # loading
    assert plan_measured(planner, "new", measured) == expected
    assert planner.capacity.max_slots == slots and planner.residents["new"].size_bytes == 10


@pytest.mark.parametrize("residents, measured, message", [
    pytest.param({"p": (60, True), "new": (10, False)}, 50, "nothing evictable makes room",
                 id="pinned models hold the rest"),
    pytest.param({"new": (10, False)}, 150, "more than the whole budget", id="larger than the device"),
])
def test_a_model_measured_larger_than_any_room_is_refused_with_a_reason(residents, measured, message):
    from control_plane.manager.placement import plan_measured

    planner = planner_with(100, None, **residents)
    planner.update("new", evictable=False)
    with pytest.raises(CapacityExhausted, match=message):
        plan_measured(planner, "new", measured)


def test_gold_on_a_fleet_without_isolated_devices_names_the_fix():
    with pytest.raises(CapacityExhausted) as err:
        choose(req(sla="gold"), [cand(server="gpu0", device="gpu0"), cand(server="gpu1", device="gpu1")])
    msg = str(err.value)
    assert "only on an isolated device (a MIG slice), and this fleet has none" in msg
    assert "gpu0 (gpu0), gpu1 (gpu1) are shared" in msg and "--sla silver" in msg
