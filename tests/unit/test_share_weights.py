"""Fair-share weights on the control plane (control_plane.rollouts.shares): set per model or
tenant, saved, resolved to the concrete names the router sees; a worker's part of a server's
concurrency."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from control_plane.rollouts.shares import ShareWeights
from domain.errors import InvalidInput
from domain.public_names import PublicNames
from router.serving.state_client import RemoteState


@dataclass
class Version:
    model: str
    version: int
    tenant: str | None = None
    stage: str = "production"

    @property
    def name(self) -> str:
        return f"{self.model}.v{self.version}"


class Store(dict):
    def get(self, key, default=None):
        return super().get(key, default)

    def put(self, key, value):
        self[key] = value


VERSIONS = [Version("acme-rec", 1, "acme"), Version("acme-rec", 2, "acme"),
            Version("globex-rec", 1, "globex"), Version("solo", 1)]


def weights(store=None) -> ShareWeights:
    names = PublicNames(lambda: VERSIONS)
    return ShareWeights(store if store is not None else Store(), lambda: VERSIONS, names)


def test_a_tenants_weight_covers_its_versions_and_a_models_own_weight_beats_it():
    w = weights()
    assert w.resolved() == {}
    w.set_tenant("acme", 2)
    assert w.resolved() == {"acme-rec.v1": 2.0, "acme-rec.v2": 2.0}
    w.set_model("acme-rec.v2", 5)  # a concrete version
    w.set_model("cust017", 3)  # a plain Triton model or a family's variant
    assert w.resolved() == {"acme-rec.v1": 2.0, "acme-rec.v2": 5.0, "cust017": 3.0}
    w.set_model("globex-rec", 0.5)  # a registry model: all its versions
    assert w.resolved()["globex-rec.v1"] == 0.5
    w.set_tenant("acme", None)
    assert "acme-rec.v1" not in w.resolved()


def test_weights_are_saved_and_read_back():
    store = Store()
    w = weights(store)
    w.set_model("cust017", 4)
    w.set_tenant("acme", 2)
    again = weights(store)
    assert again.listing() == {"models": {"cust017": 4.0}, "tenants": {"acme": 2.0}}
    assert again.resolved()["acme-rec.v1"] == 2.0


@pytest.mark.parametrize("bad", [0, -1, 1001, float("nan"), float("inf"), "4", True])
def test_a_weight_out_of_range_is_refused_and_nothing_changes(bad):
    w = weights()
    with pytest.raises(InvalidInput, match="weight"):
        w.set_model("cust017", bad)
    assert w.listing() == {"models": {}, "tenants": {}}


def test_a_worker_takes_its_part_of_a_servers_concurrency():
    state = RemoteState("http://127.0.0.1:1", "t", "w0")
    state.apply({"version": 1, "epoch": "e", "sections": {
        "concurrency": {"triton0": 8, "triton1": 1}, "shares": {"cust017": 4.0},
        "meta": {"workers": 3}}})
    assert state.concurrency("triton0") == 2  # 8 over 3 workers
    assert state.concurrency("triton1") == 1  # at least one
    assert state.concurrency("triton2") is None  # no concurrency: no gate
    assert state.share_weight("cust017") == 4.0 and state.share_weight("other") == 1.0
    # A control plane of the previous version publishes neither section.
    state.apply({"version": 1, "epoch": "e2", "sections": {"meta": {"workers": 1}}})
    assert state.concurrency("triton0") is None and state.share_weight("cust017") == 1.0


@pytest.mark.parametrize("args", [["share", "set", "--tenant", "acme", "--weight", "nan"],
                                  ["share", "set", "cust017", "--weight", "inf"],
                                  ["limit", "set", "cust017", "--qps", "nan"]])
def test_a_number_json_cannot_carry_is_a_usage_error_before_any_call(args, monkeypatch):
    from click.testing import CliRunner

    from mmctl.main import cli

    monkeypatch.setenv("MMS_URL", "http://127.0.0.1:1")  # never reached
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "is not a finite number" in result.output, result.output
