"""Sending to Triton: a request that meets its model unloaded under it, or its Triton
unreachable, is sent once more, after an ensure, to wherever the model is now (the
control plane places it on a server that is up); every other Triton failure reaches the
client as Triton's answer (about the name the client asked for) without a second send,
and a Triton that stays down as one that is down."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.grpc import service_pb2

from domain.router_errors import BackendUnavailable, UpstreamError
from domain.routes import RouteTable
from router.assembly import Router
from router.serving.ensure_and_resend import MAX_RESENDS
from router.serving.serving_state import UNLOADED_PREFIX, ServerAddress
from tests.conftest import run

FIRST = ServerAddress("triton0", "first:8001", "first:8000")
SECOND = ServerAddress("triton1", "second:8001", "second:8000")


class MovingState:
    """``m`` is READY on FIRST as far as the router knows; an ensure finds it on SECOND."""

    repository = None

    def __init__(self, first: ServerAddress = FIRST):
        self.first = first
        self.ensured: list[str] = []
        self.unreachable: list[str] = []  # servers the ensures said a request could not reach
        self.answered: list[tuple[str, int]] = []  # (model, ensures) of answered requests

    def ready_server(self, model):
        return self.first

    async def ensure(self, model, unreachable=None):
        self.ensured.append(model)
        if unreachable is not None:
            self.unreachable.append(unreachable)
        return SECOND

    def touch(self, model):
        pass

    def requests_answered(self, model, ensures):
        self.answered.append((model, ensures))

    def carrier_of(self, model):
        return None

    def servers(self):
        return [FIRST, SECOND]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Triton:
    """Plays ModelInfer on each server: answers[server name] is raised or returned, in turn."""

    def __init__(self, **answers):
        self.answers = {name: list(a) for name, a in answers.items()}
        self.sent: list[str] = []

    def rpc(self, server: ServerAddress):
        async def model_infer(message, timeout=None):
            self.sent.append(server.name)
            answer = self.answers[server.name].pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return model_infer


def raw_router(triton: Triton, state: MovingState | None = None) -> tuple[Router, MovingState]:
    state = state or MovingState()
    router = Router(state, RouteTable())
    router.channels.raw_infer = triton.rpc  # the bytes path sends through raw_infer(server)
    return router, state


def raw_request(model: str = "m") -> bytes:
    return service_pb2.ModelInferRequest(model_name=model).SerializeToString()


UNLOADED = rpc_error(grpc.StatusCode.NOT_FOUND, f"{UNLOADED_PREFIX}: 'm' is not found")


def test_a_request_that_meets_its_model_unloaded_is_sent_again_where_it_is_now():
    triton = Triton(triton0=[UNLOADED], triton1=[b""])
    router, state = raw_router(triton)

    response = run(router.forwarder.infer_raw(raw_request(), lambda: None))

    assert triton.sent == ["triton0", "triton1"]
    assert state.ensured == ["m"]  # asked again although this process believed it loaded
    assert service_pb2.ModelInferResponse.FromString(response).model_name == "m"
    assert state.answered == [("m", 1)]  # answered: the hold of its ensure ends now


def test_the_typed_path_sends_again_after_an_unload_too():
    triton = Triton(triton0=[UNLOADED], triton1=[service_pb2.ModelInferResponse()])
    router, state = raw_router(triton)
    router.channels.stub = lambda server: type("Stub", (), {"ModelInfer": staticmethod(triton.rpc(server))})

    response = run(router.forwarder.infer(service_pb2.ModelInferRequest(model_name="m"), None))

    assert triton.sent == ["triton0", "triton1"] and state.ensured == ["m"]
    assert response.model_name == "m" and not response.parameters  # served as itself: Triton's answer


def test_under_thrash_a_request_is_sent_again_each_time_its_model_was_unloaded_again():
    triton = Triton(triton0=[UNLOADED], triton1=[UNLOADED, UNLOADED, b""])
    router, state = raw_router(triton)

    response = run(router.forwarder.infer_raw(raw_request(), lambda: None))

    assert triton.sent == ["triton0", "triton1", "triton1", "triton1"]
    assert state.ensured == ["m"] * 3
    assert service_pb2.ModelInferResponse.FromString(response).model_name == "m"


def test_a_model_unloaded_at_every_send_reaches_the_client_after_a_bounded_number_of_resends():
    triton = Triton(triton0=[UNLOADED], triton1=[UNLOADED] * MAX_RESENDS)
    router, _state = raw_router(triton)

    with pytest.raises(UpstreamError) as info:
        run(router.forwarder.infer_raw(raw_request(), lambda: None))

    assert triton.sent == ["triton0"] + ["triton1"] * MAX_RESENDS
    assert info.value.grpc_code == grpc.StatusCode.NOT_FOUND


def test_tritons_own_answer_passes_on_about_the_asked_name_without_a_resend():
    shape = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "unexpected shape for input 'IN' for model 'm'")
    triton = Triton(triton0=[shape])
    router, state = raw_router(triton)

    with pytest.raises(UpstreamError) as info:
        run(router.forwarder.infer_raw(raw_request(), lambda: None))

    assert triton.sent == ["triton0"] and state.ensured == []
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert "for model 'm'" in str(info.value)


DOWN = rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")


def test_a_request_whose_triton_is_down_is_sent_again_where_the_control_plane_placed_it():
    triton = Triton(triton0=[DOWN], triton1=[b""])
    router, state = raw_router(triton)

    response = run(router.forwarder.infer_raw(raw_request(), lambda: None))

    assert triton.sent == ["triton0", "triton1"]
    assert state.unreachable == ["triton0"]  # the control plane is told which one
    assert service_pb2.ModelInferResponse.FromString(response).model_name == "m"


def test_a_model_on_a_server_reported_down_is_a_miss_and_never_sent_there():
    triton = Triton(triton1=[b""])
    router, state = raw_router(triton, MovingState(ServerAddress("triton0", "first:8001",
                                                                 "first:8000", up=False)))

    run(router.forwarder.infer_raw(raw_request(), lambda: None))

    assert triton.sent == ["triton1"] and state.unreachable == ["triton0"]


def test_a_triton_that_stays_down_is_unavailable_and_named():
    triton = Triton(triton0=[DOWN], triton1=[DOWN] * MAX_RESENDS)
    router, state = raw_router(triton)

    with pytest.raises(BackendUnavailable, match="triton1 at .* is unavailable"):
        run(router.forwarder.infer_raw(raw_request(), lambda: None))

    assert triton.sent == ["triton0"] + ["triton1"] * MAX_RESENDS  # bounded
    assert state.unreachable == ["triton0"] + ["triton1"] * (MAX_RESENDS - 1)
