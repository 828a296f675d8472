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

    def copy_servers(self, model):
        return []

    def concurrency(self, server):
        return None

    def share_weight(self, model):
        return 1.0

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

    def expected_miss_s(self, model):
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


def test_a_triton_that_stays_down_is_unavailable_and_where_is_not_told():
    triton = Triton(triton0=[DOWN], triton1=[DOWN] * MAX_RESENDS)
    router, state = raw_router(triton)

    with pytest.raises(BackendUnavailable, match="is unavailable; the control plane restarts it") as exc:
        run(router.forwarder.infer_raw(raw_request(), lambda: None))
    # The server's name and address are the operators' (the log), never a client's.
    assert "triton" not in exc.value.message.replace("'", " ").split() and ":" not in exc.value.message

    assert triton.sent == ["triton0"] + ["triton1"] * MAX_RESENDS  # bounded
    assert state.unreachable == ["triton0"] + ["triton1"] * (MAX_RESENDS - 1)


# --------------------------------------------------------------------------- deadlines
class ColdState(MovingState):
    """``m`` is loaded nowhere; its last load took ``load_s`` (None: never loaded).
    ``loaded``: when given, an ensure's load ends only once the test sets it."""

    def __init__(self, load_s, loaded=None):
        super().__init__()
        self.load_s = load_s
        self.loaded = loaded

    def ready_server(self, model):
        return None

    def expected_miss_s(self, model):
        return self.load_s

    async def ensure(self, model, unreachable=None):
        self.ensured.append(model)
        if self.loaded is not None:
            await self.loaded.wait()
        return SECOND


def test_a_miss_that_cannot_load_within_the_deadline_is_refused_at_once_and_its_load_starts():
    import asyncio

    from domain.router_errors import DeadlineTooShort

    async def go():
        triton = Triton(triton1=[b""])
        loaded = asyncio.Event()  # the load ends when the test says
        router, state = raw_router(triton, ColdState(load_s=2.0, loaded=loaded))
        with pytest.raises(DeadlineTooShort) as refused:
            await asyncio.wait_for(router.forwarder.infer_raw(raw_request(), lambda: None, 0.25), 10)
        # At once: refused while its load has not ended (a wait for it would still wait).
        assert not loaded.is_set() and state.answered == []
        assert "its load takes about 2.00 s" in refused.value.message
        assert "0.2" in refused.value.message and "retry in 2.0 s" in refused.value.message
        assert refused.value.retry_after_s == 2.0 and triton.sent == []
        for _ in range(5):  # a few turns of the event loop: the load starts for the retry
            await asyncio.sleep(0)
        assert state.ensured == ["m"] and state.answered == []  # started, not ended
        loaded.set()
        for _ in range(100):  # turns of the event loop, no timer: until the load's task ends
            if state.answered:
                break
            await asyncio.sleep(0)
        assert state.answered == [("m", 1)]  # its hold ended with it
        assert router.metrics.deadline_refused.labels("load")._value.get() == 1

    run(go())


@pytest.mark.parametrize("load_s, timeout_s", [(0.1, 0.25), (None, 0.25), (2.0, None)])
def test_a_miss_is_served_when_its_load_fits_the_deadline_or_nothing_says_otherwise(load_s, timeout_s):
    triton = Triton(triton1=[b""])
    router, state = raw_router(triton, ColdState(load_s=load_s))
    response = run(router.forwarder.infer_raw(raw_request(), lambda: None, timeout_s))
    assert service_pb2.ModelInferResponse.FromString(response).model_name == "m"
    assert triton.sent == ["triton1"] and state.ensured == ["m"]


@pytest.mark.parametrize("header, expected", [("250", 0.25), ("120000", 60.0), (None, None)])
def test_the_http_deadline_header_gives_the_deadline_capped_by_the_routers(header, expected):
    from router.frontends.http_inference import TIMEOUT_HEADER, request_timeout_s

    headers = {} if header is None else {TIMEOUT_HEADER: header}
    assert request_timeout_s(headers, 60.0) == expected


@pytest.mark.parametrize("header", ["0", "-5", "soon", "nan", "inf"])
def test_a_bad_http_deadline_header_is_a_clear_error(header):
    from domain.router_errors import InvalidRequest
    from router.frontends.http_inference import TIMEOUT_HEADER, request_timeout_s

    with pytest.raises(InvalidRequest, match="deadline in milliseconds, a number > 0"):
        request_timeout_s({TIMEOUT_HEADER: header}, 60.0)


class CopiesState(MovingState):
    """``m`` has copies on FIRST and SECOND (``mmctl scale m --replicas 2``)."""

    def copy_servers(self, model):
        return [SECOND]


class CopiesTriton:
    """Answers at once, except on the servers in ``held`` until ``release`` is set."""

    def __init__(self, held=()):
        import asyncio

        self.held = set(held)
        self.release = asyncio.Event()
        self.sent: list[str] = []

    def rpc(self, server: ServerAddress):
        async def model_infer(message, timeout=None):
            self.sent.append(server.name)
            if server.name in self.held:
                await self.release.wait()
            return b""
        return model_infer


def test_idle_copies_share_the_requests():
    triton = CopiesTriton()
    router, state = raw_router(triton, CopiesState())  # type: ignore[arg-type]
    for _ in range(400):
        run(router.forwarder.infer_raw(raw_request(), lambda: None))
    first = triton.sent.count("triton0")
    assert 120 <= first <= 280, first  # two random choices among idle copies: about half each
    assert state.ensured == []  # every request found a copy ready: no miss
    assert router.sender.queues.outstanding == {"triton0": 0, "triton1": 0}


def test_a_copy_with_requests_outstanding_gets_no_more_while_another_is_free():
    import asyncio

    triton = CopiesTriton(held={"triton0"})
    router, _state = raw_router(triton, CopiesState())  # type: ignore[arg-type]

    async def go():
        sent = []
        while router.sender.queues.outstanding["triton0"] == 0:  # until one request waits on triton0
            sent.append(asyncio.ensure_future(router.forwarder.infer_raw(raw_request(), lambda: None)))
            await asyncio.sleep(0.001)
        triton.sent.clear()
        for _ in range(50):  # every other request goes to the free copy
            await router.forwarder.infer_raw(raw_request(), lambda: None)
        assert triton.sent == ["triton1"] * 50
        waiting = router.sender.queues.outstanding["triton0"]
        assert router.sender.queues.outstanding_by_model() == {"m": waiting}  # what a report says
        triton.release.set()
        await asyncio.gather(*sent)
        assert router.sender.queues.outstanding == {"triton0": 0, "triton1": 0}
        assert router.sender.queues.outstanding_by_model() == {}

    run(go())


def test_a_request_that_cannot_start_within_its_deadline_is_refused_at_once():
    """One copy answers one request per 50 ms: of 30 sent at once with 400 ms to live, those
    that fit are answered within it and the others are refused at once, saying why.  (The
    times are long enough that a busy machine's scheduling jitter does not decide it.)"""
    import asyncio

    from domain.router_errors import DeadlineTooShort, RequestTimeout

    async def go():
        busy = asyncio.Lock()
        sent: list[str] = []
        answers = [0]  # Triton's answers so far

        def rpc(server):
            async def model_infer(message, timeout=None):
                sent.append(server.name)
                async with busy:  # one instance: a request at a time
                    await asyncio.sleep(0.05)
                answers[0] += 1
                return b""
            return model_infer

        router, _state = raw_router(Triton())
        router.channels.raw_infer = rpc
        for _ in range(24):  # its answers tell the router the rate it serves at
            await router.forwarder.infer_raw(raw_request(), lambda: None, 1.0)

        async def one():
            """What the client heard, and how many answers Triton had given by then."""
            try:
                await router.forwarder.infer_raw(raw_request(), lambda: None, 0.4)
                return "answered", answers[0] - 24, None
            except DeadlineTooShort as exc:
                return "refused", answers[0] - 24, exc.message
            except RequestTimeout as exc:  # the router's own deadline: sent, not in time
                return "timed out", answers[0] - 24, exc.message

        outcomes = await asyncio.gather(*(one() for _ in range(30)))
        answered = [n for kind, n, _ in outcomes if kind == "answered"]
        refused = [(n, why) for kind, n, why in outcomes if kind == "refused"]
        assert 3 <= len(answered) <= 8 and len(answered) + len(refused) == 30, outcomes
        # Everything sent was answered in time (none met the deadline), and the rest heard
        # at once: before Triton had answered any of the 30, not at their deadline.
        assert [n for n, _ in refused] == [0] * len(refused), outcomes
        assert "cannot start within this request's deadline" in refused[0][1]
        assert "requests wait for it on triton0" in refused[0][1]
        assert len(sent) == 24 + len(answered)  # refused requests never reached Triton
        assert router.metrics.deadline_refused.labels("queue")._value.get() == len(refused)

    run(go())


class QueuingTriton:
    """One instance answering one request per ``service_s``, first come first served, as
    Triton does: a request it accepted takes its turn even when its caller stopped waiting
    (Triton does not drop a queued gRPC request whose deadline passed).  ``running``
    cleared: the instance is stalled (a busy machine, a long batch)."""

    def __init__(self, service_s: float):
        import asyncio

        self.service_s = service_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.running = asyncio.Event()
        self.running.set()
        self.executed = 0
        self.worker = asyncio.ensure_future(self._work())

    async def _work(self):
        import asyncio

        while True:
            answer = await self.queue.get()
            await self.running.wait()
            await asyncio.sleep(self.service_s)
            self.executed += 1
            if not answer.done():
                answer.set_result(b"")

    def rpc(self, server: ServerAddress):
        import asyncio

        async def model_infer(message, timeout=None):
            answer = asyncio.get_running_loop().create_future()
            self.queue.put_nowait(answer)
            try:  # the gRPC client's own deadline: the caller hears it, Triton's queue does not
                return await asyncio.wait_for(asyncio.shield(answer), timeout)
            except TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        return model_infer


def test_requests_whose_deadline_passed_at_triton_still_count_in_its_queue():
    """A copy stalled for 0.3 s while requests with 100 ms to live come at twice what it
    serves: they all time out, and Triton still runs each of them after the stall.  The
    router keeps counting them as queued until Triton answers them, so it learns the copy's
    rate and real queue from them and refuses what cannot start in time: in the flood's
    last second, requests are answered in time or refused at once again.  (Forgetting
    them at their deadline left the router with no answer to learn a rate from and a queue
    it thought empty: it sent every request, and each waited past its deadline behind the
    ones before, for as long as the flood went on.)"""
    import asyncio
    import time

    from domain.router_errors import DeadlineTooShort, RouterError

    async def go():
        triton = QueuingTriton(0.025)  # 40 requests/s
        router, _state = raw_router(triton)  # type: ignore[arg-type]
        outcomes: list[tuple[float, str]] = []

        async def one():
            sent = time.monotonic()
            try:
                await router.forwarder.infer_raw(raw_request(), lambda: None, 0.1)
                kind = "answered"
            except DeadlineTooShort:
                kind = "refused"
            except RouterError as exc:  # Triton's DEADLINE_EXCEEDED, or the router's own
                kind = "timeout" if exc.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED else repr(exc)
            outcomes.append((sent - start, kind))

        start = time.monotonic()
        triton.running.clear()
        tasks = []
        for n in range(240):  # 80 requests/s for 3 s; the copy stalls for the first 0.3 s
            due = start + n / 80
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if due - start >= 0.3:
                triton.running.set()
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
        # The last second: the stall's backlog (about a second of work) is long gone, even
        # on a busy machine whose timers run late.  Forgotten, it never goes: 0 answered.
        late = [kind for sent, kind in outcomes if sent >= 2.0]
        assert late.count("answered") >= 8, outcomes  # about 40 of the 80 fit
        assert late.count("refused") >= 8, outcomes  # and the rest heard at once
        assert late.count("timeout") <= 20, outcomes  # all 80 when the queue was forgotten
        triton.worker.cancel()

    run(go())


def test_a_send_kept_past_its_deadline_ends_when_triton_answers_and_their_number_is_bounded():
    """The client hears DEADLINE_EXCEEDED at its deadline while the send stays open (Triton
    still runs the request) until Triton answers; it counts in the copy's queue until then.
    Past MAX_KEPT_PAST_DEADLINE such sends, a send is cut at the client's deadline as before."""
    import asyncio

    from domain.router_errors import RequestTimeout
    from router.serving.copy_queues import MAX_KEPT_PAST_DEADLINE

    async def go():
        release = asyncio.Event()
        given: list[float] = []

        def rpc(server):
            async def model_infer(message, timeout=None):
                given.append(timeout)
                try:
                    await asyncio.wait_for(release.wait(), timeout)
                except TimeoutError:  # the gRPC client's own deadline
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
                return b""
            return model_infer

        router, _state = raw_router(Triton())
        router.channels.raw_infer = rpc
        queues = router.sender.queues
        with pytest.raises(RequestTimeout, match="deadline of 50 ms"):
            await router.forwarder.infer_raw(raw_request(), lambda: None, 0.05)
        assert given[-1] >= router.config.request_timeout_s  # the send outlives the deadline
        assert queues.kept_past_deadline == 1 and queues.queued == {("triton0", "m"): 1}
        past_deadline = router.metrics.past_deadline
        assert past_deadline._value.get() == 1  # mmr_requests_past_deadline
        release.set()  # Triton answers it
        for _ in range(5):
            await asyncio.sleep(0)
        assert queues.kept_past_deadline == 0 and queues.queued == {}
        assert past_deadline._value.get() == 0
        assert len(queues.answered_at[("triton0", "m")]) == 1  # its answer counts in the rate

        release.clear()
        queues.kept_past_deadline = MAX_KEPT_PAST_DEADLINE  # as many kept as allowed
        with pytest.raises(UpstreamError):  # cut by its own deadline, Triton's DEADLINE_EXCEEDED
            await router.forwarder.infer_raw(raw_request(), lambda: None, 0.05)
        assert given[-1] <= 0.05 and queues.queued == {}

    run(go())
