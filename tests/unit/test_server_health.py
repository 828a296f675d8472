"""A frozen Triton is a down Triton.  A server's health (up, suspect, down) is moved by one
writer on liveness probes: three missed in a row make it down, one answer resets the count.
The probes run beside everything else, so a frozen server holds up nothing; a local one
that is down is killed and started again, a registered one's models are placed elsewhere,
and the copies a server kept meanwhile are unloaded when it answers again.  The router cuts
short a request waiting on a server the control plane declared down, and sends it where the
model is now, within its deadline, over gRPC and HTTP alike."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from types import SimpleNamespace

import grpc
import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from control_plane.manager.health import Health
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerHealth, ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import TritonModelState
from control_plane.triton.process import TritonProcess
from domain.router_errors import RequestTimeout, UpstreamError
from domain.routes import RouteTable
from router.assembly import Router, RouterConfig
from router.frontends.http_frontend import make_http_app
from router.serving.serving_state import ServerAddress
from tests.conftest import run
from tests.unit.test_manager_unit import MODELS, FakeAdmin


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class ProbedAdmin(FakeAdmin):
    """A Triton that answers its liveness probe after ``answer_s``, and nothing while
    ``frozen`` (SIGSTOP: neither an answer nor a refusal)."""

    def __init__(self, models=MODELS, answer_s: float = 0.0, **kwargs):
        super().__init__(models, **kwargs)
        self.answer_s = answer_s
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.probes = 0

    @property
    def frozen(self) -> bool:
        return not self.thawed.is_set()

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def is_live(self):
        self.probes += 1
        await self.thawed.wait()
        await asyncio.sleep(self.answer_s)
        return True

    async def index(self, ready_only=False):
        await self.thawed.wait()
        return await super().index(ready_only)


FAST = {"probe_interval_s": 0.05, "probe_timeout_s": 0.05, "probe_failures": 3}


def manager(tmp_path, admins: dict, processes: dict | None = None, **cfg) -> ModelManager:
    servers = [ModelManager.make_server(ServerSpec(name, f"{name}:1", f"{name}:2", max_loaded=4), "lru",
                                        admin=admin, process=(processes or {}).get(name))
               for name, admin in admins.items()]
    return ModelManager(servers, StateStore(tmp_path / "s.db"),
                        config=ManagerConfig(policy="lru", unload_timeout_s=0.3, **{**FAST, **cfg}))


async def wait_until(predicate, timeout_s: float = 5.0, what: str = "") -> float:
    """Seconds until ``predicate()`` held (fails after ``timeout_s``)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


# --------------------------------------------------------------------------- the state machine
def test_three_missed_probes_in_a_row_make_a_server_down_and_an_answer_resets_the_count(tmp_path):
    mgr = manager(tmp_path, {"s0": FakeAdmin(MODELS)})
    server = mgr.servers["s0"]
    clock = FakeClock()
    downs, ups = [], []
    health = Health(mgr.servers, mgr.config, mgr.metrics, clock,
                    on_down=lambda s, why: downs.append((s.name, why)),
                    on_up=lambda s: ups.append(s.name))

    health.missed(server, "no answer")
    health.missed(server, "no answer")
    assert server.health is ServerHealth.SUSPECT and server.up  # suspect still serves
    health.answered(server)  # a success resets the count
    assert server.health is ServerHealth.UP and server.missed_probes == 0
    health.missed(server, "no answer")
    health.missed(server, "no answer")
    assert server.health is ServerHealth.SUSPECT and downs == []
    clock.now += 2.0
    health.missed(server, "no answer")
    assert server.health is ServerHealth.DOWN and not server.up
    assert server.down_since == 1002.0
    assert downs == [("s0", "no answer (3 probes in a row)")]
    health.missed(server, "no answer")  # still down: no second alarm
    assert len(downs) == 1 and server.down_since == 1002.0
    assert not health.lost_now(server)  # down for less than server_lost_after_s
    clock.now += mgr.config.server_lost_after_s
    assert health.lost_now(server) and server.health is ServerHealth.LOST and server.lost
    assert not health.lost_now(server) and not server.up  # lost once
    health.answered(server)
    assert server.health is ServerHealth.UP and ups == ["s0"]
    assert server.down_since is None and server.lost is False
    assert server.to_dict()["health"] == "up"


def test_evidence_beyond_a_probe_makes_a_server_down_at_once_and_an_illegal_change_fails(tmp_path):
    mgr = manager(tmp_path, {"s0": FakeAdmin(MODELS)})
    server = mgr.servers["s0"]
    health = Health(mgr.servers, mgr.config, mgr.metrics, FakeClock())
    health.unreachable(server, "a request could not reach it, nor a probe")
    assert server.health is ServerHealth.DOWN
    with pytest.raises(RuntimeError, match="illegal health change down -> suspect"):
        health._move(server, ServerHealth.SUSPECT, "")


# --------------------------------------------------------------------------- the probes
def test_a_frozen_server_is_down_after_three_probe_timeouts_and_blocks_nothing(tmp_path):
    async def go():
        admins = {"s0": ProbedAdmin(), "s1": ProbedAdmin()}
        mgr = manager(tmp_path, admins)
        await mgr.start()
        ticks = []

        async def ticker():  # the event loop goes on serving while a server is frozen
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        tick_task = asyncio.get_running_loop().create_task(ticker())
        probes_before = {name: admin.probes for name, admin in admins.items()}
        ticks_before = len(ticks)
        admins["s0"].freeze()
        await wait_until(lambda: not mgr.servers["s0"].up, what="s0 down")
        # Down on the missed probes themselves (counted, not timed: a loaded machine only
        # spreads them out): three timed out, and at most one more was under way.
        missed = admins["s0"].probes - probes_before["s0"]
        assert FAST["probe_failures"] <= missed <= FAST["probe_failures"] + 1, missed
        # Meanwhile s1's probes and the loop went on beside the frozen ones.
        assert admins["s1"].probes - probes_before["s1"] >= FAST["probe_failures"] - 1
        assert mgr.servers["s1"].health is ServerHealth.UP
        assert len(ticks) - ticks_before >= FAST["probe_failures"]
        # A pass holds up on nothing: waiting on the frozen server would never end, so a
        # bound far above a busy machine's slowest pass still tells the two apart.
        step = asyncio.get_running_loop().create_task(mgr.step())
        await asyncio.wait_for(step, 10.0)
        admins["s0"].thaw()
        await wait_until(lambda: mgr.servers["s0"].up, what="s0 up again")
        tick_task.cancel()
        await mgr.close()

    run(go())


def test_a_busy_server_that_answers_within_the_timeout_is_never_suspect(tmp_path):
    async def go():
        # A loaded machine: slow (each answer takes longer than the probe interval and than
        # FAST's probe timeout), but an answer within the timeout it is given.  That timeout
        # is far above the answer: it decides nothing on a busy machine either.
        admin = ProbedAdmin(answer_s=0.1)
        mgr = manager(tmp_path, {"s0": admin}, probe_timeout_s=10.0)
        await mgr.start()
        healths = set()
        while admin.probes < 10:
            healths.add(mgr.servers["s0"].health)
            await asyncio.sleep(0.005)
        assert healths == {ServerHealth.UP}
        await mgr.close()

    run(go())


# --------------------------------------------------------------------------- what follows
class LocalProcess:
    """A tritonserver this control plane started, as the manager sees it."""

    def __init__(self, admin: ProbedAdmin):
        self.admin = admin
        self.killed = self.launched = 0
        self.running = True
        self.proc = None
        self.pid = 4242
        self.cfg = SimpleNamespace(ready_timeout_s=1.0)

    def alive(self) -> bool:
        return self.running

    def kill_unanswering(self) -> None:
        self.killed += 1
        self.running = False

    def launch(self) -> None:  # a new tritonserver: nothing loaded, answering
        self.launched += 1
        self.running = True
        self.admin.states = dict.fromkeys(self.admin.states, TritonModelState.ABSENT)
        self.admin.thaw()

    def wait_ready(self, timeout_s: float) -> None:
        pass


def test_a_stopped_process_is_killed_and_waited_for(tmp_path):
    """SIGKILL ends a process stopped by SIGSTOP (a frozen tritonserver never exits)."""
    frozen = TritonProcess.__new__(TritonProcess)  # the process part only: no tritonserver
    frozen.proc, frozen.adopted = subprocess.Popen(["sleep", "60"]), None
    frozen.proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    frozen.kill_unanswering()
    assert not frozen.alive() and frozen.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5.0


def test_a_frozen_local_triton_is_killed_and_started_again_and_its_models_go_elsewhere(tmp_path):
    async def go():
        admins = {"s0": ProbedAdmin(), "s1": ProbedAdmin()}
        local = LocalProcess(admins["s0"])
        mgr = manager(tmp_path, admins, processes={"s0": local})
        await mgr.start()
        await mgr.pin("m1")
        assert mgr.records["m1"].server == "s0"

        admins["s0"].freeze()
        await wait_until(lambda: local.killed, what="the frozen tritonserver killed")
        await wait_until(lambda: mgr.ready_server_of("m1") is mgr.servers["s1"],
                         what="the pinned model loaded on the other server")
        await mgr.step()  # the pass that finds it dead starts it again
        assert local.launched == 1 and local.killed == 1
        await wait_until(lambda: mgr.servers["s0"].up, what="s0 up once it answers")
        await mgr.step()
        assert admins["s0"].states["m1"] != TritonModelState.READY  # started empty
        assert mgr.ready_server_of("m1") is mgr.servers["s1"]  # loaded once
        await mgr.close()

    run(go())


def test_a_frozen_registered_server_keeps_its_models_until_needed_and_drops_its_copies_when_back(
        tmp_path):
    """A registered (attached) Triton is not ours to kill.  A request re-places its model;
    when it answers again (SIGCONT) while that load is still on its way, its copy is
    unloaded all the same once the load is done: nothing is loaded twice."""
    async def go():
        admins = {"s0": ProbedAdmin(), "s1": ProbedAdmin(load_delay_s=0.3)}
        mgr = manager(tmp_path, admins, server_lost_after_s=600)
        await mgr.start()
        assert (await mgr.ensure_for_request("m1")).name == "s0"

        admins["s0"].freeze()
        await wait_until(lambda: not mgr.servers["s0"].up, what="s0 down")
        assert mgr.records["m1"].server == "s0" and not mgr.servers["s0"].lost  # not needed yet
        moving = asyncio.get_running_loop().create_task(mgr.ensure_for_request("m1"))
        await wait_until(lambda: mgr.records["m1"].state == ModelState.LOADING, what="m1 loading")
        admins["s0"].thaw()  # back while m1 is still loading on s1
        await wait_until(lambda: mgr.servers["s0"].up, what="s0 up again")
        await mgr.step()
        assert (await moving).name == "s1"
        await mgr.step()
        await wait_until(lambda: admins["s0"].states["m1"] != TritonModelState.READY,
                         what="the copy s0 kept unloaded")
        assert mgr.ready_server_of("m1") is mgr.servers["s1"]
        assert admins["s1"].states["m1"] == TritonModelState.READY
        assert "m1" not in mgr.servers["s0"].planner.residents
        await mgr.close()

    run(go())


# --------------------------------------------------------------------------- the router
FIRST = ServerAddress("triton0", "first:8001", "127.0.0.1:1")
SECOND = ServerAddress("triton1", "second:8001", "127.0.0.1:2")


class PublishedState:
    """The control plane's view as a router worker has it: ``m`` on ``first`` until an
    ensure places it on ``second``; ``down`` marks ``first`` down (published)."""

    repository = None

    def __init__(self, first: ServerAddress = FIRST, second: ServerAddress = SECOND):
        self.first, self.second = first, second
        self.down = False
        self.unreachable: list[str] = []

    def ready_server(self, model):
        return self._first()

    def copy_servers(self, model):
        return []

    def concurrency(self, server):
        return None

    def share_weight(self, model):
        return 1.0

    def _first(self) -> ServerAddress:
        f = self.first
        return ServerAddress(f.name, f.grpc_url, f.http_url, up=not self.down)

    async def ensure(self, model, unreachable=None):
        if unreachable is not None:
            self.unreachable.append(unreachable)
        return self.second

    def touch(self, model):
        pass

    def requests_answered(self, model, ensures):
        pass

    def carrier_of(self, model):
        return None

    def expected_miss_s(self, model):
        return None

    def servers(self):
        return [self._first(), self.second]


def router_on_frozen_tritons(frozen: set[str]) -> tuple[PublishedState, Router, list[str]]:
    """A router whose Tritons named in ``frozen`` neither answer nor refuse (the others
    answer at once), and the servers its requests were sent to, in order."""
    state = PublishedState()
    router = Router(state, RouteTable())
    sent: list[str] = []

    def rpc(server):
        async def model_infer(message, timeout=None):
            sent.append(server.name)
            if server.name in frozen:
                await asyncio.Event().wait()
            return b""
        return model_infer

    router.channels.raw_infer = rpc
    return state, router, sent


def test_a_grpc_request_waiting_on_a_server_declared_down_is_sent_where_the_model_is_now():
    async def go():
        state, router, sent = router_on_frozen_tritons({FIRST.name})
        # An hour to live: only the server declared down can end its wait on the frozen one.
        request = router.forwarder.infer_raw(b"\n\x01m", lambda: None, timeout_s=3600.0)
        task = asyncio.get_running_loop().create_task(request)
        await asyncio.sleep(0.3)
        assert not task.done()  # suspect, not down yet: it waits
        state.down = True  # the control plane declared it down
        await asyncio.wait_for(task, 10.0)  # answered: cut short (10 s: a hung test only)
        assert sent == ["triton0", "triton1"]
        assert state.unreachable == ["triton0"]

    run(go())


def test_a_grpc_request_sent_again_has_what_is_left_of_its_one_deadline():
    """Declared down after 1.2 s, its server's request goes to the other server, which does
    not answer either: the client hears DEADLINE_EXCEEDED at its deadline of 2 s, not 2 s
    after the second send (3.2 s or later)."""
    async def go():
        state, router, sent = router_on_frozen_tritons({"triton0", "triton1"})
        started = time.monotonic()
        task = asyncio.get_running_loop().create_task(
            router.forwarder.infer_raw(b"\n\x01m", lambda: None, timeout_s=2.0))
        await asyncio.sleep(1.2)
        state.down = True
        with pytest.raises(RequestTimeout, match="deadline of 2000 ms"):
            await asyncio.wait_for(task, 10.0)
        assert sent == ["triton0", "triton1"]
        assert 1.9 <= time.monotonic() - started < 2.9

    run(go())


async def fake_triton(frozen: asyncio.Event | None):
    """A Triton's HTTP infer: answers at once, or never while ``frozen`` is not set."""
    async def infer(request: web.Request) -> web.Response:
        await request.read()
        if frozen is not None:
            await frozen.wait()
        return web.json_response({"model_name": "m", "outputs": [
            {"name": "OUT", "datatype": "FP32", "shape": [1], "data": [2.0]}]})

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


BODY = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [1.0]}]})


async def http_router(state, config: RouterConfig | None = None):
    server = TestServer(make_http_app(Router(state, RouteTable(), config)), host="127.0.0.1")
    await server.start_server()
    return server


def test_an_http_request_waiting_on_a_server_declared_down_is_sent_where_the_model_is_now():
    async def go():
        never = asyncio.Event()
        frozen, alive = await fake_triton(never), await fake_triton(None)
        state = PublishedState(ServerAddress("triton0", "x:1", f"127.0.0.1:{frozen.port}"),
                               ServerAddress("triton1", "x:2", f"127.0.0.1:{alive.port}"))
        # An hour to live: only the server declared down can end its wait on the frozen one.
        router = await http_router(state, RouterConfig(request_timeout_s=3600.0))
        async with ClientSession() as session:
            posting = asyncio.get_running_loop().create_task(
                session.post(router.make_url("/v2/models/m/infer"), data=BODY))
            await asyncio.sleep(0.3)
            assert not posting.done()
            state.down = True
            resp = await asyncio.wait_for(posting, 10.0)  # cut short (10 s: a hung test only)
            body = await resp.json()
        assert resp.status == 200 and body["outputs"][0]["data"] == [2.0]
        assert state.unreachable == ["triton0"]
        for server in (router, frozen, alive):
            await server.close()

    run(go())


def test_an_http_request_has_one_deadline_for_all_its_sends_as_over_grpc():
    """Never answered and never declared down: the client gets 504 at the router's request
    deadline, not after a fresh deadline per send (nor a 500)."""
    async def go():
        never = asyncio.Event()
        frozen = await fake_triton(never)
        state = PublishedState(ServerAddress("triton0", "x:1", f"127.0.0.1:{frozen.port}"))
        deadline_s = 2.0
        router = await http_router(state, RouterConfig(request_timeout_s=deadline_s))
        started = time.monotonic()
        async with ClientSession() as session, session.post(
                router.make_url("/v2/models/m/infer"), data=BODY) as resp:
            status, body = resp.status, await resp.json()
        assert status == 504 and "deadline" in body["error"]
        # One deadline: a second send with a fresh one would answer after twice as long;
        # the bound leaves a busy machine most of a deadline of slack below that.
        assert time.monotonic() - started < 1.75 * deadline_s
        for server in (router, frozen):
            await server.close()

    run(go())


def test_a_grpc_request_ends_with_tritons_deadline_answer_when_nothing_says_its_server_is_down():
    async def go():
        state = PublishedState()
        router = Router(state, RouteTable())

        def rpc(server):
            async def model_infer(message, timeout=None):
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), details="Deadline Exceeded")
            return model_infer

        router.channels.raw_infer = rpc
        with pytest.raises(UpstreamError) as info:
            await router.forwarder.infer_raw(b"\n\x01m", lambda: None, timeout_s=1.0)
        assert info.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED and state.unreachable == []

    run(go())


def test_mmctl_fleet_says_when_a_server_is_suspect_or_down():
    from mmctl.main import _server_state

    assert _server_state({"up": True, "health": "up"}) == "up"
    assert _server_state({"up": True, "health": "suspect"}) == "suspect"
    assert _server_state({"up": False, "health": "down"}) == "DOWN"
    assert _server_state({"up": False}) == "DOWN"  # a control plane from before health states
