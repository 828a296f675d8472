"""Each part of the router alone, with fakes for what it is given: the decision
(``Decider``), the recording of outcomes (``Recording``), the channels to Triton
(``Channels``), the sends (``Sender``), ModelInfer (``Forwarder``) and the answers about
models (``Answers``); then ``Router``, which only builds and wires them."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from tritonclient.grpc import service_pb2

from domain.public_names import PublicNames
from domain.router_errors import InvalidRequest, RateLimited, UnknownModel
from domain.routes import Decision, RouteTable
from router.assembly import Router, RouterConfig
from router.frontends.grpc_inference import Forwarder
from router.rollouts.routing_decisions import Decider
from router.serving.ensure_and_resend import Sender
from router.serving.metrics import FLUSH_INTERVAL_S, Recording, RouterMetrics
from router.serving.readiness_and_metadata import Answers
from router.serving.server_lookup import Call, ServerLookup
from router.serving.serving_state import ServerAddress
from router.serving.triton_channels import Channels
from tests.conftest import run

SERVER = ServerAddress("triton0", "triton0:8001", "triton0:8000")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "simple"


# --------------------------------------------------------------------------- fakes
class Limits:
    """A limiter that records what each request spends and refuses the names in ``refuse``."""

    def __init__(self, refuse=()):
        self.spent: list[tuple[str, ...]] = []
        self.refuse = set(refuse)

    async def acquire(self, names) -> None:
        names = tuple(names)
        self.spent.append(names)
        if self.refuse & set(names):
            raise RateLimited("limited", 1.0)


class State:
    """Where models are: ``ready`` on SERVER; an ensure loads a model there."""

    def __init__(self, ready=(), repository: Path | None = None):
        self.ready = set(ready)
        self.repository = repository
        self.ensured: list[str] = []
        self.touched: list[str] = []
        self.answered: list[tuple[str, int]] = []

    def ready_server(self, model):
        return SERVER if model in self.ready else None

    def copy_servers(self, model):
        return []

    def concurrency(self, server):
        return None

    def share_weight(self, model):
        return 1.0

    async def ensure(self, model, unreachable=None):
        self.ensured.append(model)
        self.ready.add(model)
        return SERVER

    def touch(self, model):
        self.touched.append(model)

    def requests_answered(self, model, ensures):
        self.answered.append((model, ensures))

    def carrier_of(self, model):
        return None

    def expected_miss_s(self, model):
        return None

    def servers(self):
        return [SERVER]


class Outcomes:
    def __init__(self):
        self.seen: list[tuple] = []

    def record_outcome(self, scope, variant, code, served_ms, randomly_assigned=False):
        self.seen.append((scope, variant, code, served_ms, randomly_assigned))


class Recorded:
    """A Recording that keeps what it was told."""

    def __init__(self):
        self.calls: list[tuple] = []

    def record(self, decision, latency_s, code, known=True, served_s=None):
        self.calls.append((decision.logical, decision.model, code, known, served_s is not None))


class Triton:
    """Channels to a fake Triton: raw ModelInfer answers ``answer`` and keeps what it got."""

    def __init__(self, answer: bytes = b""):
        self.answer = answer
        self.sent: list[tuple[str, bytes]] = []
        self.stubs: dict[str, object] = {}

    def raw_infer(self, server):
        async def model_infer(message, timeout=None):
            self.sent.append((server.name, message))
            return self.answer
        return model_infer

    def stub(self, server):
        return self.stubs[server.name]


def decider(table: RouteTable | None = None, names=None, limiter=None) -> Decider:
    return Decider(table or RouteTable(), names, limiter or Limits())


# --------------------------------------------------------------------------- Decider
def test_the_decider_routes_and_spends_the_limits_of_the_name_and_the_model_it_reaches():
    table = RouteTable()
    table.set_alias("rec", "cust001")
    limits = Limits(refuse={"cust002"})
    d = Decider(table, None, limits)

    decision = d.route("rec", None)
    assert (decision.logical, decision.model) == ("rec", "cust001")
    run(d.admit(decision))
    run(d.admit(d.route("cust001", None)))
    assert limits.spent == [("rec", "cust001"), ("cust001",)]
    with pytest.raises(RateLimited):
        run(d.admit(d.route("cust002", None)))

    # A new table (a router worker's next snapshot) is what the next request is routed by.
    d.table = RouteTable()
    assert d.route("rec", None).model == "rec"


def test_the_decider_names_what_served_a_request_as_the_client_knows_it():
    names = PublicNames(lambda: [SimpleNamespace(model="simple", version=2, stage="production",
                                                 name="simple.v2")])
    d = decider(RouteTable(default_target=names.production.get, unrouted=names.unrouted), names)

    decision = d.route("simple", None)
    assert decision.model == "simple.v2"
    assert d.public_identity(decision) == ("simple", "2")
    assert d.resolve("simple", None, "2").model == "simple.v2"
    with pytest.raises(UnknownModel, match="'simple' version 7 is not found"):
        d.resolve("simple", None, "7")
    assert d.public_text("model 'simple.v2' failed", "simple.v2", "simple") == "model 'simple' failed"


def test_the_decisions_kept_for_names_without_a_route_follow_the_table_and_the_names():
    """A name without a route is decided once and its decision kept; a route added for it,
    a new production version, a new table or new names are what the next request sees."""
    versions = [SimpleNamespace(model="simple", version=2, stage="production", name="simple.v2")]
    names = PublicNames(lambda: versions, expose_concrete=True)
    table = RouteTable(default_target=names.production.get, unrouted=names.unrouted)
    d = decider(table, names)

    first = d.route("simple", None)
    assert first.model == "simple.v2" and d.route("simple", None) is first  # kept
    assert d.route("other", None).model == "other"  # a concrete name, exposed

    versions.append(SimpleNamespace(model="simple", version=3, stage="production", name="simple.v3"))
    names.refresh()  # the registry promoted version 3: the generation moves on
    assert d.route("simple", None).model == "simple.v3"

    table.set_alias("simple", "simple.v2")  # a route now: decided by the route, not kept
    assert d.route("simple", None).model == "simple.v2"
    table.routes.pop("simple")  # the route removed, as a snapshot without it would
    table.save()
    assert d.route("simple", None).model == "simple.v3"

    d.table = RouteTable(default_target=lambda name: "elsewhere", unrouted=names.unrouted)
    assert d.route("simple", None).model == "elsewhere"  # a router worker's next snapshot
    d.names = PublicNames(lambda: (), expose_concrete=False)
    d.table = RouteTable(default_target=d.names.production.get, unrouted=d.names.unrouted)
    with pytest.raises(UnknownModel):  # unknown names are never kept
        d.route("simple", None)
    with pytest.raises(UnknownModel):
        d.route("simple", None)


def test_a_decider_without_names_keeps_nothing_for_a_table_whose_targets_it_cannot_watch():
    targets = {"m": "m.v1"}
    d = decider(RouteTable(default_target=targets.get))
    assert d.route("m", None).model == "m.v1"
    targets["m"] = "m.v2"  # changed under the table, nothing bumped: must still be seen
    assert d.route("m", None).model == "m.v2"


def test_the_kept_decisions_are_bounded():
    from router.rollouts.routing_decisions import UNROUTED_CACHE_MAX

    d = decider()
    for i in range(UNROUTED_CACHE_MAX + 10):
        d.route(f"m{i}", None)
    assert len(d._unrouted) <= UNROUTED_CACHE_MAX


# --------------------------------------------------------------------------- Recording
def test_recording_counts_every_request_and_hands_on_only_experiment_and_canary_outcomes():
    metrics, outcomes = RouterMetrics(), Outcomes()
    recording = Recording(metrics, outcomes)

    recording.record(Decision("m", "m", "default", scope="model:m"), 0.01, "OK", served_s=0.004)
    recording.record(Decision("m", "m2", "canary", scope="canary:m"), 0.5, "OK", served_s=0.004)
    recording.record(Decision("m", "m2", "canary", scope="canary:m"), 0.5, "UNAVAILABLE")

    assert outcomes.seen == [("canary:m", "canary", "OK", 4.0, False),
                             ("canary:m", "canary", "UNAVAILABLE", None, False)]
    text = generate_latest(metrics.registry).decode()
    assert 'mmr_requests_total{code="OK",model="m2",route="m",variant="canary"} 1.0' in text
    # Without statistics to feed, the series are still counted.
    Recording(RouterMetrics()).record(Decision("m", "m2", "canary", scope="canary:m"), 0.1, "OK")


def test_made_up_names_past_the_series_cap_grow_nothing():
    """The cache of series was keyed by the names themselves: a client sending made-up names
    (refused by its miss budget before they were known unknown) grew it without bound."""
    from domain.series import OTHER_LABEL, BoundedLabel

    metrics = RouterMetrics()
    metrics.model_label, metrics.route_label = BoundedLabel(cap=3), BoundedLabel(cap=3)
    recording = Recording(metrics)
    for i in range(1000):
        recording.record(Decision(f"made-up-{i}", f"made-up-{i}", "default"), 0.001, "RESOURCE_EXHAUSTED")
    assert len(recording._children) <= 4
    text = generate_latest(metrics.registry).decode()
    assert f'mmr_requests_total{{code="RESOURCE_EXHAUSTED",model="{OTHER_LABEL}",route="{OTHER_LABEL}",variant="default"}} 997.0' in text


def test_the_prometheus_writes_of_requests_are_made_together_and_netted():
    """In a running loop the writes of requests wait up to FLUSH_INTERVAL_S and are made
    together: the in-flight changes netted, the counts of a series in one increment, every
    latency observed."""
    metrics = RouterMetrics()
    recording = Recording(metrics)

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, labels or None) or 0.0

    async def go():
        loop = asyncio.get_running_loop()
        metrics.writes.started()
        await asyncio.sleep(0)
        assert value("mmr_inflight_requests") == 0.0  # not yet: with the writes after it
        await _flushed(loop)
        assert value("mmr_inflight_requests") == 1.0  # while the request is with Triton
        metrics.writes.ended()
        recording.record(Decision("m", "m", "default", scope="model:m"), 0.01, "OK")
        recording.record(Decision("m", "m", "default", scope="model:m"), 0.02, "OK")
        metrics.writes.started()
        metrics.writes.ended()
        await asyncio.sleep(0)
        assert value("mmr_requests_total", route="m", model="m", variant="default", code="OK") == 0.0
        await _flushed(loop)
        assert value("mmr_inflight_requests") == 0.0
        assert value("mmr_requests_total", route="m", model="m", variant="default", code="OK") == 2.0
        assert value("mmr_request_seconds_count", route="m", variant="default") == 2.0
        assert abs(value("mmr_request_seconds_sum", route="m", variant="default") - 0.03) < 1e-9

    run(go())
    metrics.writes.started()  # no running loop: at once
    assert value("mmr_inflight_requests") == 1.0


def test_a_flush_makes_the_writes_due_at_once():
    """What a scrape of the router's own /metrics does first: no request it follows is missing."""
    metrics = RouterMetrics()

    async def go():
        metrics.writes.started()
        metrics.writes.flush()
        assert metrics.registry.get_sample_value("mmr_inflight_requests") == 1.0

    run(go())


async def _flushed(loop) -> None:
    """Until the flush due now has run: a timer set later, for longer, fires after it."""
    done = loop.create_future()
    loop.call_later(2 * FLUSH_INTERVAL_S, done.set_result, None)
    await done


def test_writes_due_on_a_loop_that_ended_are_made_on_the_next_one():
    metrics = RouterMetrics()
    loop = asyncio.new_event_loop()

    async def start():
        metrics.writes.started()  # its flush is due on this loop, which never turns again

    loop.run_until_complete(start())
    loop.close()

    async def later():
        metrics.writes.started()
        await _flushed(asyncio.get_running_loop())

    run(later())
    assert metrics.registry.get_sample_value("mmr_inflight_requests") == 2.0


# --------------------------------------------------------------------------- Channels
def test_channels_open_one_channel_per_server_and_close_them():
    async def go():
        channels = Channels()
        first = channels.stub(SERVER)
        assert channels.stub(SERVER) is first
        assert channels.raw_infer(SERVER) is channels.raw_infer(SERVER)
        other = channels.stub(ServerAddress("triton1", "triton1:8001", "triton1:8000"))
        assert other is not first
        await channels.close()
        assert channels.stub(SERVER) is not first  # a closed channel is never reused

        await channels.close()

    run(go())


# --------------------------------------------------------------------------- Sender
def sender(state: State, limits: Limits | None = None, triton: Triton | None = None,
           recording=None) -> Sender:
    return Sender(state, decider(limiter=limits), triton or Triton(), recording or Recorded(),
                  RouterMetrics(), RouterConfig())


class RawExchange:
    """Raw ModelInfer on the channels, no resend: the transport of a send, reduced."""

    def __init__(self, channels):
        self.channels = channels

    def attempt(self, server, message, left_s):
        return self.channels.raw_infer(server)(message, timeout=left_s)

    @staticmethod
    def resend_for(outcome):
        return None

    @staticmethod
    def failure(call, exc, asked):
        return None


def test_the_sender_loads_a_missing_model_sends_and_records_the_outcome():
    state, limits, triton, recorded = State(), Limits(), Triton(answer=b"answer"), Recorded()
    s = sender(state, limits, triton, recorded)

    async def go():
        async with s.serving("m", None) as call:
            assert s.inflight == 1
            return await s.send(call, RawExchange(s.channels), b"request", None, "m")

    assert run(go()) == b"answer"
    assert state.ensured == ["m"] and state.touched == ["m"] and state.answered == [("m", 1)]
    assert limits.spent == [("m",)] and triton.sent == [("triton0", b"request")]
    assert recorded.calls == [("m", "m", "OK", True, True)] and s.inflight == 0


def test_the_sender_records_a_refused_request_with_its_code_and_sends_nothing():
    state, triton, recorded = State(ready={"m"}), Triton(), Recorded()
    s = sender(state, Limits(refuse={"m"}), triton, recorded)

    async def go():
        async with s.serving("m", None):
            pass

    with pytest.raises(RateLimited):
        run(go())
    assert triton.sent == [] and recorded.calls == []  # refused before it was a request


def test_the_sender_records_a_request_that_fails_while_its_server_is_found():
    """A load that fails after the request counted (in flight, its limits spent) is recorded
    with its code, its hold ended and the in-flight count back down; an unknown name is
    recorded without series of its own."""
    from domain import errors as cp

    class Failing(State):
        async def ensure(self, model, unreachable=None):
            self.ensured.append(model)
            raise cp.ModelNotFound(model) if model == "nope" else cp.CapacityExhausted("full")

    state, recorded = Failing(), Recorded()
    s = sender(state, Limits(), Triton(), recorded)

    async def go(name):
        async with s.serving(name, None):
            raise AssertionError("never served")

    with pytest.raises(UnknownModel):
        run(go("nope"))
    from domain.router_errors import BackendUnavailable
    with pytest.raises(BackendUnavailable):
        run(go("m"))
    assert recorded.calls == [("nope", "nope", "NOT_FOUND", False, False),
                              ("m", "m", "UNAVAILABLE", True, False)]
    assert s.inflight == 0 and state.answered == []


def test_the_sender_records_a_body_that_fails_with_its_code():
    state, recorded = State(ready={"m"}), Recorded()
    s = sender(state, Limits(), Triton(), recorded)

    async def go(exc):
        async with s.serving("m", None) as call:
            assert call.server == SERVER and state.touched[-1] == "m"
            raise exc

    with pytest.raises(RateLimited):
        run(go(RateLimited("later", 1.0)))
    with pytest.raises(ValueError):
        run(go(ValueError("a bug")))
    assert [c[2] for c in recorded.calls] == ["RESOURCE_EXHAUSTED", "INTERNAL"]
    assert s.inflight == 0


def test_a_shadow_send_that_missed_ends_its_hold_once_answered():
    """A shadow's miss took a hold on the shadow model (as a client's does) that nothing
    ended: the control plane kept the model held until its own timeout."""
    state, triton = State(), Triton(answer=b"shadow answer")
    s = sender(state, triton=triton)
    assert run(s.send_shadow("s", b"mirror", 1.0)) == b"shadow answer"
    assert state.ensured == ["s"] and state.answered == [("s", 1)]
    assert triton.sent == [("triton0", b"mirror")]


# --------------------------------------------------------------------------- Forwarder
class Sends:
    """A Sender that serves every request on SERVER and answers ``answer``."""

    def __init__(self, d: Decider, answer: bytes = b""):
        self.decider = d
        self.answer = answer
        self.bodies: list[bytes] = []
        self.channels = None  # the message is kept here, never sent

    @contextlib.asynccontextmanager
    async def serving(self, logical, user_id, version="", timeout_s=None):
        yield Call(self.decider.route(logical, user_id, version), time.perf_counter(), SERVER)

    async def send(self, call, exchange, message, timeout_s, asked):
        self.bodies.append(message)
        return self.answer


class Mirror:
    def __init__(self):
        self.offered = []

    def offer(self, item):
        self.offered.append(item)
        return True


def test_the_forwarder_readdresses_a_request_answers_under_the_asked_name_and_mirrors_it():
    table = RouteTable()
    table.set_alias("rec", "cust001")
    table.set_shadow("rec", "cust001-next", 100.0)
    d = decider(table)
    triton_answer = service_pb2.ModelInferResponse(model_name="cust001").SerializeToString()
    sends, mirror = Sends(d, triton_answer), Mirror()
    forwarder = Forwarder(State(), d, sends, mirror, shared_memory=None)
    raw = service_pb2.ModelInferRequest(model_name="rec", id="r1").SerializeToString()

    answer = service_pb2.ModelInferResponse.FromString(run(forwarder.infer_raw(raw, lambda: None)))

    sent = service_pb2.ModelInferRequest.FromString(sends.bodies[0])
    assert (sent.model_name, sent.id) == ("cust001", "r1")
    assert answer.model_name == "rec" and answer.parameters["model"].string_param == "cust001"
    [item] = mirror.offered
    assert (item.route, item.shadow_model) == ("rec", "cust001-next")
    assert service_pb2.ModelInferRequest.FromString(item.request).model_name == "cust001-next"


def test_the_forwarder_refuses_adapter_control_before_anything_is_served():
    sends = Sends(decider())
    forwarder = Forwarder(State(), sends.decider, sends, Mirror(), shared_memory=None)
    request = service_pb2.ModelInferRequest(model_name="tinylm")
    request.inputs.add(name="ADAPTER")
    with pytest.raises(InvalidRequest, match="adapter=NAME"):
        run(forwarder.infer_raw(request.SerializeToString(), lambda: None))
    assert sends.bodies == []


# --------------------------------------------------------------------------- Answers
class MetadataStub:
    async def ModelMetadata(self, request):
        return service_pb2.ModelMetadataResponse(name=request.name, versions=["1"], platform="python")


def test_answers_come_from_triton_for_a_loaded_model_and_from_its_folder_for_a_cold_one(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "cold", ignore=shutil.ignore_patterns("README.md"))
    table = RouteTable()
    table.set_alias("rec", "warm")
    table.set_alias("old", "cold")
    state = State(ready={"warm"}, repository=tmp_path)
    triton = Triton()
    triton.stubs["triton0"] = MetadataStub()
    answers = Answers(state, decider(table), triton)

    async def go():
        return (await answers.model_call("rec", "metadata"), await answers.model_call("old", "metadata"))

    warm, cold = run(go())
    assert (warm.name, warm.platform) == ("rec", "python")  # Triton's answer, the asked name
    assert cold.name == "old" and cold.versions == ["1"]  # from config.pbtxt, no load
    assert state.ensured == []
    assert answers.model_ready("rec") and not answers.model_ready("old")
    assert answers.any_server_up()


# --------------------------------------------------------------------------- Router
def test_the_router_wires_one_decider_into_every_part_and_runs_only_the_judge_it_is_given():
    state, stats = State(), Outcomes()
    router = Router(state, RouteTable(), stats=stats)

    assert router.sender.decider is router.decider
    pipeline = router.pipeline
    assert pipeline.decider is router.decider and router.answers.decider is router.decider
    assert pipeline.sender is router.sender and pipeline.shadow is router.shadow
    assert router.forwarder.pipeline is pipeline
    assert router.sender.channels is router.channels is router.answers.channels
    assert router.recording.outcomes is stats and router.sender.recording is router.recording
    new = RouteTable()
    router.table = new  # a router worker's next snapshot
    assert router.decider.table is new and router.table is new

    async def go():
        await router.start()
        judged = router._canary_task
        await router.stop()
        return judged

    assert run(go()) is None  # no canary controller given: nothing judged here
    steps = []
    judging = Router(state, RouteTable(), RouterConfig(canary_interval_s=0.01),
                     canaries=SimpleNamespace(step=lambda: steps.append(1)))

    async def judged():
        await judging.start()
        while not steps:
            await asyncio.sleep(0.01)
        await judging.stop()

    run(judged())
    assert steps


@pytest.mark.parametrize("detail", [
    "server triton0 (127.0.0.1:40267) is down",
    "no Triton server is up to load cust001: triton1 (10.0.0.7:8001) is down",
])
def test_a_miss_with_no_server_up_tells_the_client_what_happened_not_where(detail):
    """The control plane's reason names servers and their addresses: the operator's."""
    from domain import errors as cp
    from domain.router_errors import BackendUnavailable

    error = ServerLookup.serving_error(cp.TritonUnavailable(detail), "cust001")
    assert isinstance(error, BackendUnavailable)
    assert "'cust001' is unavailable" in str(error)
    for secret in ("triton0", "triton1", "127.0.0.1", "10.0.0.7"):
        assert secret not in str(error)
