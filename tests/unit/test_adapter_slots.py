"""Adapters as the model manager's entries: ``AdapterSlots`` decides which adapters hold a
base's device slots (the manager's policy, pins, requests on their way) and the model's own
cache (the real one, in process, behind a fake transport) only does what it is told."""

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from control_plane.adapters import slots as slots_module
from control_plane.adapters.slots import AdapterSlots
from control_plane.demo.fleet import FleetSpec, base_weights
from control_plane.demo.lora import LoraDemoSpec, write_demo_adapter, write_lora_model
from control_plane.triton.control_socket import ControlSockets
from domain.errors import CapacityExhausted, InvalidInput, ModelNotFound
from model_runtime.lora.errors import AdapterCapacityExhausted, AdapterNotFound, LoraError
from model_runtime.lora.manifest import Manifest, write_manifest
from model_runtime.lora.models import RecommenderMLP, TinyLMConfig
from model_runtime.lora.runtime import LoraSettings, build_server, recommender_runner
from model_runtime.lora.server import Job

SPEC = LoraDemoSpec(
    tinylm=TinyLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64),
    recommender=FleetSpec(feature_dim=8, hidden_dim=16),
)
BASE = "recommender_lora"
NAMES = ["a", "b", "c", "d"]
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


def answer(call):
    """Run a callback-style call of the model (``reply(result, error)``) to its reply."""
    done = threading.Event()
    box = {}

    def reply(result, error):
        box["result"], box["error"] = result, error
        done.set()

    call(reply)
    assert done.wait(30), "the model did not answer"
    return box["result"], box["error"]


class InProcessAdmin:
    """TritonAdmin.adapter_control over the real model's control path, errors mapped as
    TritonAdmin maps the model's Triton codes."""

    def __init__(self, model):
        self.model = model
        self.commands = []
        self.control_sockets = ControlSockets("in-process")

    async def adapter_control(self, base, command, key=None):
        self.commands.append(command)
        result, error = await asyncio.to_thread(answer, lambda reply: self.model.control(command, reply))
        if isinstance(error, AdapterCapacityExhausted):
            raise CapacityExhausted(error.message)
        if isinstance(error, AdapterNotFound):
            raise ModelNotFound(error.message)
        if isinstance(error, LoraError):
            raise InvalidInput(error.message)
        return result


class FakeManager:
    """What AdapterSlots uses of the ModelManager: its servers, the base's copies, request
    holds and the state-change listeners."""

    def __init__(self, admin):
        self.servers = {"triton0": SimpleNamespace(name="triton0", up=True, admin=admin)}
        self.config = SimpleNamespace(policy="lru", on_its_way_s=30.0)
        self.base_ready = True
        self.moved = []
        self.answered = []
        self.listeners = []

    def copy_servers_of(self, name):
        return ["triton0"] if name == BASE and self.base_ready else []

    async def ensure_for_request(self, name, unreachable=None, owner=None):
        assert name == BASE
        return self.servers["triton0"]

    def requests_answered(self, name, count=1, owner=None):
        self.answered.append((name, count))
        return count

    def on_state_change(self, listener):
        self.listeners.append(listener)

    def announce_moved(self, name):
        self.moved.append(name)


@pytest.fixture
def stack(tmp_path):
    repo = tmp_path / "repository"
    write_lora_model(repo, BASE, SPEC)
    adapter_dir = repo / BASE / "adapters"
    for name in NAMES:
        write_demo_adapter(adapter_dir, BASE, name, rank=4, spec=SPEC)
    write_manifest(adapter_dir, Manifest(generation=1, residency="control_plane"))
    net = RecommenderMLP(base_weights(SPEC.recommender))
    settings = LoraSettings.from_parameters({"max_device_adapters": "2", "manifest_poll_s": "0"},
                                            repo / BASE)
    model = build_server(net, recommender_runner(net), settings, base_name=BASE)
    admin = InProcessAdmin(model)
    manager = FakeManager(admin)
    clock = iter(range(1000, 10_000))
    slots = AdapterSlots(manager, repo, clock=lambda: float(next(clock)))
    yield SimpleNamespace(model=model, admin=admin, manager=manager, slots=slots, adapter_dir=adapter_dir,
                          repo=repo)
    model.close()


def serve(model, name):
    result, error = answer(lambda reply: model.submit([Job(name, X, reply, rows=2)]))
    return result, error


def served_alone(name, tmp_path):
    """``name``'s answer from a model of its own (self-managed), the reference."""
    net = RecommenderMLP(base_weights(SPEC.recommender))
    settings = LoraSettings.from_parameters({"max_device_adapters": "1", "manifest_poll_s": "0",
                                             "adapter_dir": str(tmp_path / "repository" / BASE / "adapters")},
                                            tmp_path)
    alone = build_server(net, recommender_runner(net), settings, base_name=BASE, start_watcher=False)
    alone.cache.managed = False
    try:
        result, error = serve(alone, name)
        assert error is None, error
        return result
    finally:
        alone.close()


def ensure(stack, name):
    return asyncio.run(stack.slots.ensure_for_request(f"{BASE}:{name}"))


def test_the_policy_of_the_manager_picks_which_adapter_leaves_a_full_base(stack, tmp_path):
    async def scenario():
        for name in ("a", "b"):
            await stack.slots.ensure_for_request(f"{BASE}:{name}")
            stack.slots.requests_answered(f"{BASE}:{name}")
        stack.slots.touch(f"{BASE}:a")  # a used after b: b is the least recently used
        await stack.slots.ensure_for_request(f"{BASE}:c")
        stack.slots.requests_answered(f"{BASE}:c")

    asyncio.run(scenario())
    assert sorted(stack.model.cache.resident()) == ["a", "c"]
    assert stack.admin.commands[-1] == {"op": "load", "adapter": "c", "evict": ["b"], "answer": "slots"}
    assert stack.slots.servers_holding(f"{BASE}:c") == ["triton0"]
    assert stack.slots.ready_server_of(f"{BASE}:b") is None
    assert {f"{BASE}:b", f"{BASE}:c"} <= set(stack.manager.moved)  # published as placements
    result, error = serve(stack.model, "c")
    assert error is None
    np.testing.assert_array_equal(result, served_alone("c", tmp_path))  # c's own weights
    # Each ended request ended its base's hold too.
    assert stack.manager.answered == [(BASE, 1)] * 3


def test_an_adapter_a_request_is_on_its_way_to_is_no_victim(stack):
    async def scenario():
        await stack.slots.ensure_for_request(f"{BASE}:a")
        await stack.slots.ensure_for_request(f"{BASE}:b")
        stack.slots.capacity_wait_s = 0.3  # waits that long for a slot, then says why not
        with pytest.raises(CapacityExhausted, match=r"on their way to \(a, b\)"):
            await stack.slots.ensure_for_request(f"{BASE}:c")
        stack.slots.capacity_wait_s = 30.0
        waiting = asyncio.create_task(stack.slots.ensure_for_request(f"{BASE}:c"))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # both slots still busy
        stack.slots.requests_answered(f"{BASE}:a")  # a's request was answered: its slot frees
        await asyncio.wait_for(waiting, 5)

    asyncio.run(scenario())
    assert sorted(stack.model.cache.resident()) == ["b", "c"]


async def two_loads_waiting_for_busy_slots(stack):
    """Both slots held by requests on their way (a, b); c waits, then d: (c's task, d's)."""
    await stack.slots.ensure_for_request(f"{BASE}:a")
    await stack.slots.ensure_for_request(f"{BASE}:b")
    stack.slots.capacity_wait_s = 30.0
    older = asyncio.create_task(stack.slots.ensure_for_request(f"{BASE}:c"))
    await asyncio.sleep(0.1)
    younger = asyncio.create_task(stack.slots.ensure_for_request(f"{BASE}:d"))
    await asyncio.sleep(0.1)
    return older, younger


def test_a_slot_freed_goes_to_the_adapter_load_that_waited_longest_and_wakes_no_other(stack, monkeypatch):
    """Two loads wait for the base's two busy slots: the end of a's hold gives its slot to
    the older (c) at once, and wakes no other load (each would plan again under the base's
    lock: work the size of the queue for every request answered); the end of b's gives d."""
    monkeypatch.setattr(slots_module, "BUSY_RECHECK_S", 10.0)  # only being told wakes a load

    async def scenario():
        older, younger = await two_loads_waiting_for_busy_slots(stack)
        tries = []
        place_once = stack.slots._place_once
        monkeypatch.setattr(stack.slots, "_place_once",
                            lambda server, base, adapter: tries.append(adapter) or place_once(server, base, adapter))
        stack.slots.requests_answered(f"{BASE}:a")
        await asyncio.wait_for(older, 5)
        await asyncio.sleep(0.05)
        assert tries == ["c"] and not younger.done()
        stack.slots.requests_answered(f"{BASE}:b")
        await asyncio.wait_for(younger, 5)
        assert tries == ["c", "d"]

    asyncio.run(scenario())
    assert sorted(stack.model.cache.resident()) == ["c", "d"]


def test_loads_woken_for_a_slot_another_took_pass_the_turn_on_once_each(stack, monkeypatch):
    """A slot's hold ends and the oldest waiting load is woken, but a load that did not wait
    took the slot first: the woken load passes its turn to the next younger one, which tries
    once and passes it on to nobody.  (Passing it to the oldest waiter sent it back to the
    first: the two loads tried in turn, without end, for as long as the slots stayed busy.)"""
    monkeypatch.setattr(slots_module, "BUSY_RECHECK_S", 10.0)  # only being told wakes a load

    async def scenario():
        older, younger = await two_loads_waiting_for_busy_slots(stack)
        tries = []

        async def taken_first(server, base, adapter):
            tries.append(adapter)
            raise slots_module.SlotsBusy("every slot is held by a request on its way")
        monkeypatch.setattr(stack.slots, "_place_once", taken_first)
        stack.slots.requests_answered(f"{BASE}:a")
        await asyncio.sleep(0.3)
        assert tries == ["c", "d"]
        for task in (older, younger):
            task.cancel()
        await asyncio.gather(older, younger, return_exceptions=True)

    asyncio.run(scenario())


def test_a_pinned_adapter_keeps_its_slot_and_a_stale_view_is_read_again(stack):
    write_manifest(stack.adapter_dir, Manifest(generation=2, pinned=("d",), residency="control_plane"))
    for future in stack.model.sync():
        future.result(timeout=30)

    async def scenario():
        await stack.slots.ensure_for_request(f"{BASE}:a")  # reads the slots: d pinned, one free
        stack.slots.requests_answered(f"{BASE}:a")
        # The model took its second slot behind this control plane's back (as a manifest
        # preload would): the next load meets a full model, reads it and plans again.
        stack.model.cache.managed = False
        stack.model.cache.load("b").result(timeout=30)
        stack.model.cache.managed = True
        for name in ("c", "a"):
            await stack.slots.ensure_for_request(f"{BASE}:{name}")
            stack.slots.requests_answered(f"{BASE}:{name}")

    asyncio.run(scenario())
    assert sorted(stack.model.cache.resident()) == ["a", "d"]
    evicted = [v for c in stack.admin.commands if c["op"] == "load" for v in c["evict"]]
    assert "d" not in evicted and evicted


def test_unknown_adapters_and_names_are_not_found_with_what_to_do(stack):
    with pytest.raises(ModelNotFound, match="unknown adapter 'zzz' for recommender_lora; `mmctl adapter list"):
        ensure(stack, "zzz")
    (stack.repo / "identity").mkdir()
    (stack.repo / "identity" / "config.pbtxt").write_text('name: "identity"\nbackend: "python"\n')
    with pytest.raises(ModelNotFound, match="identity is not a LoRA base model"):
        asyncio.run(stack.slots.ensure_for_request("identity:a"))
    with pytest.raises(ModelNotFound, match="unknown base model 'nothing'"):
        asyncio.run(stack.slots.ensure_for_request("nothing:a"))
    assert stack.admin.commands == []


def test_a_base_that_leaves_its_server_takes_its_adapters_with_it(stack):
    ensure(stack, "a")
    stack.manager.moved.clear()
    stack.manager.base_ready = False

    async def announce():  # the manager's listeners run on its event loop
        for listener in stack.manager.listeners:
            listener(BASE)

    asyncio.run(announce())
    assert stack.slots.ready_server_of(f"{BASE}:a") is None
    assert stack.manager.moved == [f"{BASE}:a"] and stack.slots.rows() == []


def test_the_models_control_socket_takes_keyed_commands_only(stack, tmp_path, monkeypatch):
    """The LoRA model's control socket (model_runtime.control_socket) runs a command that
    carries the control plane's key, refuses one that does not, and never echoes the key."""
    import json
    import socket
    import sys
    import uuid

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", SimpleNamespace())
    from model_runtime.control_socket import ControlSocketServer
    from model_runtime.lora.triton_glue import LoraTritonModel

    glue = LoraTritonModel()  # what initialize sets up, around the in-process model
    glue.server, glue.control_key = stack.model, "k" * 32
    server = ControlSocketServer(f"mms-test-{uuid.uuid4().hex[:8]}", glue._socket_command)
    glue.control_socket = server.name
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(30)
        conn.connect("\0" + server.name)
        stream = conn.makefile("rwb")

        def ask(command):
            stream.write(json.dumps(command).encode() + b"\n")
            stream.flush()
            return json.loads(stream.readline())

        refused = ask({"op": "load", "adapter": "a", "key": "guess"})
        assert refused["code"] == "INVALID_ARG" and "key" in refused["error"]
        assert stack.model.cache.resident() == []
        answer = ask({"op": "load", "adapter": "a", "evict": [], "answer": "slots", "key": "k" * 32})
        assert [x["name"] for x in answer["adapters"]] == ["a"] and answer["control_socket"] == server.name
        assert "k" * 32 not in json.dumps(answer)
        missing = ask({"op": "load", "adapter": "zzz", "key": "k" * 32})
        assert missing["code"] == "NOT_FOUND"
        conn.close()
    finally:
        server.close()


def test_a_base_unloaded_under_the_fill_is_ensured_again_not_reported_unknown(stack):
    """An explicit unload of the base between its ensure and the adapter's fill: the fill
    meets no model (NOT_FOUND), and the miss ensures the base again instead of telling the
    client the adapter is unknown."""
    real = stack.admin.adapter_control
    unloaded = []

    async def unloaded_once(base, command, key=None):
        if command["op"] == "load" and not unloaded:
            unloaded.append(command["adapter"])
            stack.manager.base_ready = False
            for listener in stack.manager.listeners:
                listener(BASE)  # the manager saw it go
            raise ModelNotFound("Request for unknown model: 'recommender_lora' is not found")
        return await real(base, command, key)

    ensure_base = stack.manager.ensure_for_request

    async def loaded_again(name, unreachable=None, owner=None):
        stack.manager.base_ready = True  # the next ensure loads it again
        return await ensure_base(name, unreachable, owner)

    stack.admin.adapter_control = unloaded_once
    stack.manager.ensure_for_request = loaded_again
    assert ensure(stack, "a").name == "triton0"
    assert unloaded == ["a"] and stack.model.cache.resident() == ["a"]
    assert stack.manager.answered == [(BASE, 1)]  # the first attempt's hold of the base ended


def test_a_base_is_described_once_until_its_config_or_folder_changes(stack, monkeypatch):
    """A miss reads the base's description from memory (it parsed config.pbtxt and listed the
    folder on every miss); a changed config or a new version folder is read again."""
    from control_plane.adapters import slots as slots_module

    described = []
    real = slots_module.describe_base
    monkeypatch.setattr(slots_module, "describe_base",
                        lambda repo, base: described.append(base) or real(repo, base))
    for _ in range(3):
        assert stack.slots.base_of(f"{BASE}:a") == (BASE, "a")
    assert described == [BASE]
    (stack.repo / BASE / "2").mkdir()  # a new version: the folder changed
    (stack.repo / BASE / "2" / "weights.safetensors").write_bytes(b"")
    assert stack.slots.base_of(f"{BASE}:b") == (BASE, "b") and len(described) == 2
    config = stack.repo / BASE / "config.pbtxt"
    config.write_text(config.read_text().replace("ADAPTER_CONTROL", "SOMETHING_ELSE"))
    with pytest.raises(ModelNotFound, match="is not a LoRA base model"):
        stack.slots.base_of(f"{BASE}:a")
