"""The router answers as Triton does, under the names clients use (unit tier: a fake Triton,
no sockets).  tests/integration/test_fidelity.py compares against a real tritonserver."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from tritonclient.grpc import model_config_pb2, service_pb2

from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ServerSpec
from control_plane.registry import ModelVersion
from control_plane.state.state_store import StateStore
from domain.public_names import PublicNames
from domain.router_errors import (
    InvalidVersion,
    ModelUnavailable,
    RateLimited,
    RouterError,
    UnknownModel,
    UpstreamError,
    parse_version,
)
from domain.routes import RouteTable
from router.assembly import Router
from router.rollouts.routing_decisions import Decider
from router.serving.repository_config import metadata_from_config, read_folder, triton_json
from tests.conftest import run
from tests.unit.test_manager_unit import FakeAdmin

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "simple"


def version(model, number, stage, name=None):
    return ModelVersion(model, number, f"file:///cold/{model}/{number}/", "sha256:x", 1, stage=stage,
                        triton_name=name)


VERSIONS = [
    version("simple", 1, "retired", name="simple"),
    version("simple", 2, "production"),
    version("simple", 3, "registered"),
    version("draft", 1, "registered"),  # a model with no production version
    version("cust017", 1, "production", name="cust017"),
    version("cust017", 4, "registered", name="cust017-faulty"),
]


def make_router(tmp_path, expose=False, registry=True):
    concrete = [v.name for v in VERSIONS]
    admin = FakeAdmin(concrete)
    server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=4), "lru",
                                      admin=admin)
    repository = tmp_path / "repository"
    repository.mkdir(parents=True)
    manager = ModelManager([server], StateStore(tmp_path / "state.db"), repository=repository)
    if not registry:
        return Router(manager, RouteTable()), admin
    names = PublicNames(lambda: VERSIONS, expose_concrete=expose)
    table = RouteTable(default_target=names.production.get, unrouted=names.unrouted)
    return Router(manager, table, names=names), admin


def add_folder(router, concrete):
    shutil.copytree(FIXTURE, router.manager.repository / concrete, ignore=shutil.ignore_patterns("README.md"))


# --------------------------------------------------------------------------- names
def test_registry_versions_are_reachable_by_number_and_answer_with_it(tmp_path):
    router, _ = make_router(tmp_path)
    assert router.decider.route("simple", None).model == "simple.v2"
    assert router.decider.route("simple", None, "3").model == "simple.v3"
    assert router.decider.route("cust017", None, "4").model == "cust017-faulty"
    for name, number, text in (
            ("simple", "1", "Request for unknown model: 'simple' version 1 is not found"),  # retired
            ("simple", "7", "Request for unknown model: 'simple' version 7 is not found"),
            ("nosuch", "1", "Request for unknown model: 'nosuch' is not found")):
        with pytest.raises(UnknownModel) as info:
            router.decider.route(name, None, number)
        assert info.value.message == text
    # Responses carry the asked name and the registry version, never simple.v3.
    decision = router.decider.route("simple", None, "3")
    assert router.decider.public_identity(decision) == ("simple", "3")
    triton = service_pb2.ModelInferResponse(model_name="simple.v3", model_version="1", id="r1")
    merged = service_pb2.ModelInferResponse.FromString(
        triton.SerializeToString() + router.forwarder._response_suffix("simple", decision))
    assert (merged.model_name, merged.model_version, merged.id) == ("simple", "3", "r1")
    assert merged.parameters["model"].string_param == "simple"


def test_concrete_names_answer_like_unknown_models_unless_exposed(tmp_path):
    router, _ = make_router(tmp_path)
    for name in ("simple.v2", "cust017-faulty", "../x"):
        with pytest.raises(UnknownModel, match=r"^Request for unknown model: '.*' is not found$"):
            router.decider.route(name, None)
        assert router.answers.model_ready(name) is False
    with pytest.raises(UnknownModel, match="^Request for unknown model: 'draft' has no available versions$"):
        router.decider.route("draft", None)
    # A route (alias) is a logical name; its version is the version of what it serves.
    router.table.set_alias("rec", "simple.v3")
    assert router.decider.route("rec", None).model == "simple.v3"
    assert router.decider.route("rec", None, "3").model == "simple.v3"
    with pytest.raises(UnknownModel, match="'rec' version 2 is not found"):
        router.decider.route("rec", None, "2")

    exposed, _ = make_router(tmp_path / "exposed", expose=True)
    decision = exposed.decider.route("cust017-faulty", None, "1")
    assert (decision.model, decision.version) == ("cust017-faulty", "1")  # Triton's own version
    assert exposed.decider.public_identity(decision) == ("cust017-faulty", None)


def admit(decider: Decider, decision) -> None:
    """Spend a request's limits as the sender does: await what ``admit`` returns, if anything."""
    admitting = decider.admit(decision)
    if admitting is not None:
        run(admitting)


def test_a_version_request_counts_against_the_limit_of_its_name(tmp_path):
    router, _ = make_router(tmp_path)
    router.table.set_limit("simple", 1, 1)
    decider = router.decider
    admit(decider, decider.route("simple", None, "3"))
    with pytest.raises(RateLimited):
        admit(decider, decider.route("simple", None, "2"))


@pytest.mark.parametrize("asked", ["rec:acme", "simple:acme"])
def test_an_adapter_request_spends_the_limit_of_its_base_name(tmp_path, asked):
    """``rec:acme`` (a route to the registry's simple) or ``simple:acme`` spent the limits
    of that full name and of the concrete model only: any adapter got round a limit set on
    ``rec`` or ``simple``."""
    router, _ = make_router(tmp_path)
    router.table.set_alias("rec", "simple.v3")
    base = asked.split(":")[0]
    router.table.set_limit(base, 1, 1)
    decider = router.decider
    admit(decider, decider.route(base, None))
    with pytest.raises(RateLimited, match=base):
        admit(decider, decider.route(asked, None))


STOL = ("failed to get model version from specified version string '{}' (details: stol), "
        "version should be an integral value > 0")


@pytest.mark.parametrize(("given", "expected"), [
    ("", ""), ("3", "3"), ("01", "1"),
    ("abc", STOL.format("abc")), ("1a", STOL.format("1a")), ("\u00b2", STOL.format("\u00b2")),
    ("99999999999999999999", STOL.format("99999999999999999999")),
    ("-1", "invalid model version specified '-1' , version should be an integral value > 0"),
    # Past 4,300 digits int() raises ValueError (once a 500); a long one is shown cut.
    ("1" * 5000, STOL.format("1" * 40 + "... (5000 characters)")), ("0" * 5000 + "7", "7"),
])
def test_versions_are_digits_only_in_tritons_words(given, expected):
    try:
        assert parse_version(given) == expected
    except InvalidVersion as exc:
        assert exc.message == expected


def test_triton_messages_name_the_model_the_client_asked_for():
    text = ("[request id: <id_unknown>] unexpected shape for input 'INPUT1' for model 'simple.v2'. "
            "Expected [16], got [15].")
    assert Decider.public_text(text, "simple.v2", "simple") == text.replace("'simple.v2'", "'simple'")
    # Only the quoted model name: another model whose name contains it is left alone.
    assert Decider.public_text("'cust017-v2' and 'cust017'", "cust017", "rec") == "'cust017-v2' and 'rec'"
    # A family's variant: Triton speaks of the family model that serves it.
    assert (Decider.public_text("unexpected shape for input 'FEATURES' for model 'recommender'",
                               "cust007", "cust007", "recommender")
            == "unexpected shape for input 'FEATURES' for model 'cust007'")


# --------------------------------------------------------------------------- never loads
def test_readiness_of_unknown_and_cold_models_is_false_and_loads_nothing(tmp_path):
    async def go():
        router, admin = make_router(tmp_path, registry=False)
        await router.manager.start()
        assert router.answers.model_ready("nosuch") is False  # Triton: ready false, not an error
        assert router.answers.model_ready("simple.v2") is False  # cold
        assert admin.load_calls == []
        await router.manager.ensure("simple.v2")
        assert router.answers.model_ready("simple.v2") is True
        with pytest.raises(RouterError, match="'abc'"):
            router.answers.model_ready("simple.v2", "abc")

    run(go())


def test_cold_metadata_and_config_come_from_config_pbtxt_without_a_load(tmp_path):
    async def go():
        router, admin = make_router(tmp_path)
        add_folder(router, "simple.v2")
        meta = await router.answers.model_call("simple", "metadata")
        assert (meta.name, list(meta.versions), meta.platform) == ("simple", ["2"], "python")
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("INPUT0", "INT32", [16]), ("INPUT1", "INT32", [16])]
        config = await router.answers.model_call("simple", "config")
        assert (config.config.name, config.config.backend) == ("simple", "python")
        assert [w.name for w in config.config.model_warmup] == ["random_sample"]
        with pytest.raises(ModelUnavailable, match=r"^requested model 'simple' is not available$"):
            await router.answers.model_call("simple", "statistics")
        with pytest.raises(ModelUnavailable, match="^requested model version is not available for model 'simple'$"):
            await router.answers.model_call("simple", "statistics", "7")
        # Registered, but its folder is not in the repository (not staged): Triton's answer
        # for a model it has not loaded.
        with pytest.raises(UnknownModel, match=r"^Request for unknown model: 'simple' is not found$"):
            await router.answers.model_call("simple", "config", "3")
        assert admin.load_calls == []

    run(go())


def test_unknown_names_create_no_metric_series(tmp_path):
    async def go():
        router, _admin = make_router(tmp_path, registry=False)
        await router.manager.start()
        names = [f"probe{uuid.uuid4().hex[:10]}" for _ in range(4)]
        for name, method in zip(names, ("metadata", "config", "statistics", "metadata")):
            with pytest.raises(RouterError):
                await router.answers.model_call(name, method)
            router.answers.model_ready(name)
        return names, (generate_latest(router.metrics.registry)
                       + generate_latest(router.manager.metrics.registry)).decode()

    names, text = run(go())
    assert not [n for n in names if n in text]


# --------------------------------------------------------------------------- shapes
def test_metadata_from_a_batching_config_has_the_batch_dimension():
    config = model_config_pb2.ModelConfig(name="m", platform="onnxruntime_onnx", max_batch_size=8)
    config.input.add(name="TEXT", data_type=model_config_pb2.TYPE_STRING, dims=[-1])
    config.output.add(name="SCORE", data_type=model_config_pb2.TYPE_FP32, dims=[3, 2])
    meta = triton_json(metadata_from_config(config, "asked", ["4"]))
    assert meta == {"name": "asked", "versions": ["4"], "platform": "onnxruntime_onnx",
                    "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, -1]}],
                    "outputs": [{"name": "SCORE", "datatype": "FP32", "shape": [-1, 3, 2]}]}


def test_config_json_is_written_as_triton_writes_it(tmp_path):
    found = read_folder(FIXTURE)
    assert found is not None and found.versions == ("1",)
    doc = triton_json(found.config)
    # Numbers stay numbers (protobuf's JSON mapping would write dims as strings), enums by
    # name, defaults present, unset sub-messages absent.
    assert doc["input"][0]["dims"] == [16] and doc["input"][0]["data_type"] == "TYPE_INT32"
    assert doc["max_batch_size"] == 0 and doc["platform"] == ""
    assert "dynamic_batching" not in doc and doc["instance_group"][0]["kind"] == "KIND_CPU"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.pbtxt").write_text("input { nonsense")
    assert read_folder(tmp_path / "bad") is None and read_folder(tmp_path / "missing") is None


def test_a_malformed_adapter_name_says_how_to_write_one(tmp_path):
    router, _ = make_router(tmp_path)
    with pytest.raises(RouterError, match="write BASE:ADAPTER") as info:
        router.decider.route("simple:a:b", None)
    assert info.value.grpc_code.name == "INVALID_ARGUMENT"


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.NOT_FOUND, 404), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNIMPLEMENTED, 501),
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.ALREADY_EXISTS, 400),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
])
def test_a_tritons_answer_forwarded_over_grpc_has_the_http_status_triton_gives_it(code, status):
    """An HTTP client's metadata, config or statistics call goes to Triton over gRPC: its
    refusal (the model unloaded meanwhile: NOT_FOUND) was a 500 whatever its code."""
    answer = UpstreamError(code, "Request for unknown model: 'm' is not found")
    assert (answer.grpc_code, answer.http_status) == (code, status)
