"""Attacks on system shared memory through the public port, each closed by the router.

A region is memory of a process on the router's host.  Only loopback peers may list,
unregister or name regions (not only register them); a region is checked against its object
as it is at each use (an object truncated after registration is a client error, not a dead
worker); the bytes a request reads from regions count against the request limit; a key
that is a symbolic link and an empty object are refused.

Remote peers come two ways: through the real network (the router listens on every address
and the test connects to this host's own non-loopback address, skipped where there is none),
and through the router's handlers with the peer address injected (always run).  The
loopback paths go through `mmctl up` and a real tritonserver."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import mmap
import os
import socket
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from domain.router_errors import RouterError
from router.assembly import RouterConfig
from router.frontends import grpc_frontend
from router.frontends.http_frontend import make_http_app
from router.frontends.shared_memory import SystemSharedMemory
from router.frontends.shared_memory_requests import names_region
from router.serving.metrics import RouterMetrics
from tests.integration.test_fidelity import copy_model
from tests.product import Product

pytestmark = pytest.mark.integration

CLIENTS = {"grpc": grpcclient, "http": httpclient}
LIMIT_BYTES = 1 << 20  # the product's --max-request-bytes
A = np.arange(16, dtype=np.int32)
B = np.full(16, 7, dtype=np.int32)
TENSOR_BYTES = A.nbytes
SHM = Path("/dev/shm")
REMOTE_PEER = "203.0.113.9"  # an injected peer that is not loopback (TEST-NET-3)


def other_address() -> str | None:
    """An address of this host that is not loopback, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((REMOTE_PEER, 9))  # UDP: nothing is sent, the kernel picks a source
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.fixture(scope="module")
def product(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm_attacks")
    copy_model(root / "repository", "simple")
    p = Product(root / "state", root / "repository", "--router-workers", "1", "--router-host", "0.0.0.0",
                "--max-request-bytes", str(LIMIT_BYTES))
    try:
        p.start()
        endpoints = p.json("endpoints")
        p.ports = {"grpc": endpoints["router_grpc"].rsplit(":", 1)[1],
                   "http": endpoints["router_http"].rsplit(":", 1)[1]}
        yield p
    finally:
        p.stop()


def local(product, protocol: str):
    return CLIENTS[protocol].InferenceServerClient(f"127.0.0.1:{product.ports[protocol]}")


def remote(product, protocol: str):
    address = other_address()
    if address is None:
        pytest.skip("this host has no address other than loopback (the injected-peer tests cover it)")
    return CLIENTS[protocol].InferenceServerClient(f"{address}:{product.ports[protocol]}")


def outcome(call, *args, **kwargs):
    try:
        return "OK", call(*args, **kwargs)
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()


def worker(product) -> dict:
    (found,) = [p for p in product.processes()["processes"] if p["role"] == "router-worker"]
    return found


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


class Objects:
    """POSIX shared-memory objects of this test (files in /dev/shm), removed afterwards."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:8]
        self.paths: list[Path] = []

    def make(self, role: str, data: bytes = b"", size: int | None = None) -> str:
        path = SHM / f"mms_attack_{role}_{self.tag}"
        path.write_bytes(data)
        if size is not None:
            os.truncate(path, size)  # sparse: no memory until written
        self.paths.append(path)
        return "/" + path.name

    def remove(self):
        for path in self.paths:
            path.unlink(missing_ok=True)


@pytest.fixture
def objects():
    made = Objects()
    yield made
    made.remove()


@pytest.fixture
def victim(product, objects):
    """A loopback client's registered regions: inputs (A then B) and outputs (zeros)."""
    names = {"in": f"victim_in_{objects.tag}", "out": f"victim_out_{objects.tag}"}
    keys = {"in": objects.make("in", A.tobytes() + B.tobytes()),
            "out": objects.make("out", bytes(2 * TENSOR_BYTES))}
    owner = local(product, "grpc")
    for role, name in names.items():
        owner.register_system_shared_memory(name, keys[role], 2 * TENSOR_BYTES)
    yield SimpleNamespace(names=names, keys=keys, out_path=SHM / keys["out"][1:])
    for name in names.values():
        owner.unregister_system_shared_memory(name)


def shm_input(module, name: str, region: str, offset: int = 0, byte_size: int = TENSOR_BYTES):
    tensor = module.InferInput(name, [16], "INT32")
    tensor.set_shared_memory(region, byte_size, offset=offset)
    return tensor


def shm_output(module, name: str, region: str, offset: int = 0, byte_size: int = TENSOR_BYTES):
    output = module.InferRequestedOutput(name, **({"binary_data": True} if module is httpclient else {}))
    output.set_shared_memory(region, byte_size, offset=offset)
    return output


def inline_input(module, name: str, data: np.ndarray):
    tensor = module.InferInput(name, [16], "INT32")
    tensor.set_data_from_numpy(data)
    return tensor


def add_from(module, names: dict) -> tuple:
    """simple's inputs from the victim's input region: OUTPUT0 = A + B."""
    return (shm_input(module, "INPUT0", names["in"]),
            shm_input(module, "INPUT1", names["in"], offset=TENSOR_BYTES))


def registered(product, name: str) -> bool:
    status = local(product, "http").get_system_shared_memory_status()
    return name in {r["name"] for r in status}


REFUSED = {"grpc": "StatusCode.PERMISSION_DENIED", "http": "403"}


def assert_refused_for_remote(code_message) -> None:
    code, message = code_message
    assert code in REFUSED.values(), code_message
    assert "loopback" in message and "send the tensors in the request" in message, message


# ---------------------------------------------------------------- remote peers, real network
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_status_from_a_remote_peer_is_refused(product, victim, protocol):
    assert_refused_for_remote(outcome(remote(product, protocol).get_system_shared_memory_status))
    assert_refused_for_remote(outcome(remote(product, protocol).get_system_shared_memory_status,
                                      victim.names["in"]))
    # The owner, on loopback, still sees its regions.
    assert registered(product, victim.names["in"]) and registered(product, victim.names["out"])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unregister_from_a_remote_peer_is_refused(product, victim, protocol):
    attacker = remote(product, protocol)
    assert_refused_for_remote(outcome(attacker.unregister_system_shared_memory))
    assert_refused_for_remote(outcome(attacker.unregister_system_shared_memory, victim.names["in"]))
    assert registered(product, victim.names["in"]) and registered(product, victim.names["out"])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_inference_naming_a_region_from_a_remote_peer_is_refused(product, victim, protocol):
    m = CLIENTS[protocol]
    attacker = remote(product, protocol)
    # Reading the victim's memory back as OUTPUT0 = INPUT0 + INPUT1.
    assert_refused_for_remote(outcome(attacker.infer, "simple", add_from(m, victim.names)))
    # Writing outputs into the victim's memory.
    assert_refused_for_remote(outcome(
        attacker.infer, "simple", [inline_input(m, "INPUT0", A), inline_input(m, "INPUT1", A)],
        outputs=[shm_output(m, "OUTPUT0", victim.names["out"])]))
    assert victim.out_path.read_bytes() == bytes(2 * TENSOR_BYTES)
    if protocol == "grpc":  # the stream answers each request in-band
        answers = []
        attacker.start_stream(callback=lambda result, error: answers.append(error))
        attacker.async_stream_infer("simple", list(add_from(m, victim.names)))
        attacker.stop_stream()
        assert len(answers) == 1 and answers[0] is not None
        assert "loopback" in answers[0].message(), answers[0].message()
    # The same calls from loopback are served: the bytes come back, the output is written.
    owner = local(product, protocol)
    result = owner.infer("simple", add_from(m, victim.names))
    assert result.as_numpy("OUTPUT0").tolist() == (A + B).tolist()
    owner.infer("simple", [inline_input(m, "INPUT0", A), inline_input(m, "INPUT1", A)],
                outputs=[shm_output(m, "OUTPUT0", victim.names["out"])])
    assert np.frombuffer(victim.out_path.read_bytes()[:TENSOR_BYTES], np.int32).tolist() == (2 * A).tolist()


# ---------------------------------------------------------------- loopback clients' mistakes
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_region_truncated_after_registration_is_a_client_error(product, objects, protocol):
    """Two pages, INPUT1 on the second: once the object is cut to one page, touching a
    mapping of the second would be SIGBUS (the worker would die)."""
    m = CLIENTS[protocol]
    c = local(product, protocol)
    page = mmap.PAGESIZE
    name = f"shrinks_{objects.tag}"
    key = objects.make("shrinks", A.tobytes().ljust(page, b"\0") + B.tobytes().ljust(page, b"\0"))
    c.register_system_shared_memory(name, key, 2 * page)
    inputs = (shm_input(m, "INPUT0", name), shm_input(m, "INPUT1", name, offset=page))
    try:
        assert c.infer("simple", inputs).as_numpy("OUTPUT0").tolist() == (A + B).tolist()
        before = worker(product)
        os.truncate(SHM / key[1:], page)
        code, message = outcome(c.infer, "simple", inputs)
        assert code in ("StatusCode.FAILED_PRECONDITION", "400"), (code, message)
        assert name in message and f"{page} bytes" in message and "register" in message, message
        # The same worker serves the next request.
        inline = [inline_input(m, "INPUT0", A), inline_input(m, "INPUT1", B)]
        assert c.infer("simple", inline).as_numpy("OUTPUT0").tolist() == (A + B).tolist()
        after = worker(product)
        assert (after["pid"], after.get("restarts")) == (before["pid"], before.get("restarts"))
    finally:
        c.unregister_system_shared_memory(name)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_region_named_100_times_is_refused_by_the_request_limit(product, objects, protocol):
    """100 inputs naming one 8 MiB region would read 800 MiB (a 1 GiB region: 100 GiB) from
    a request of a few kilobytes."""
    m = CLIENTS[protocol]
    c = local(product, protocol)
    region_bytes = 8 << 20
    name = f"big_{objects.tag}"
    c.register_system_shared_memory(name, objects.make("big", size=region_bytes), region_bytes)
    try:
        pid = worker(product)["pid"]
        peak_before = peak_rss_bytes(pid)
        inputs = []
        for i in range(100):
            tensor = m.InferInput(f"INPUT{i}", [region_bytes // 4], "INT32")
            tensor.set_shared_memory(name, region_bytes)
            inputs.append(tensor)
        start = time.monotonic()
        code, message = outcome(c.infer, "simple", inputs)
        elapsed_s = time.monotonic() - start
        assert code in ("StatusCode.RESOURCE_EXHAUSTED", "413"), (code, message)
        assert f"{100 * region_bytes} bytes" in message and f"limit of {LIMIT_BYTES} bytes" in message, message
        assert "--max-request-bytes" in message, message
        assert elapsed_s < 1.0
        assert peak_rss_bytes(pid) - peak_before < region_bytes  # not one region's bytes read
        assert worker(product)["pid"] == pid
    finally:
        c.unregister_system_shared_memory(name)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_symlink_key_is_refused(product, objects, protocol, tmp_path):
    """A key that is a symbolic link would read or write whatever file it points to (the
    router may run as another user than the client)."""
    m = CLIENTS[protocol]
    c = local(product, protocol)
    secret = tmp_path / "secret"
    secret.write_bytes(A.tobytes() + B.tobytes())
    link = SHM / f"mms_attack_link_{objects.tag}"
    link.symlink_to(secret)
    objects.paths.append(link)
    name = f"swapped_{objects.tag}"
    try:
        code, message = outcome(c.register_system_shared_memory, f"link_{objects.tag}", "/" + link.name,
                                2 * TENSOR_BYTES)
        assert code in ("StatusCode.INVALID_ARGUMENT", "400"), (code, message)
        assert "symbolic link" in message, message
        # A link put in the object's place after registration is refused at use.
        key = objects.make("swapped", bytes(2 * TENSOR_BYTES))
        c.register_system_shared_memory(name, key, 2 * TENSOR_BYTES)
        (SHM / key[1:]).unlink()
        (SHM / key[1:]).symlink_to(secret)
        code, message = outcome(c.infer, "simple", add_from(m, {"in": name}))
        assert code in ("StatusCode.INVALID_ARGUMENT", "400"), (code, message)
        assert "symbolic link" in message, message
    finally:
        c.unregister_system_shared_memory(name)
        c.unregister_system_shared_memory(f"link_{objects.tag}")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_empty_object_is_a_client_error(product, objects, protocol):
    c = local(product, protocol)
    key = objects.make("empty")
    for byte_size in (0, TENSOR_BYTES):
        code, message = outcome(c.register_system_shared_memory, f"empty_{objects.tag}", key, byte_size)
        assert code in ("StatusCode.INVALID_ARGUMENT", "400"), (byte_size, code, message)
        assert "empty" in message and key in message, message
    assert not registered(product, f"empty_{objects.tag}")


def test_a_malformed_registration_file_is_a_client_error(product, objects):
    m = httpclient
    c = local(product, "http")
    name = f"garbled_{objects.tag}"
    c.register_system_shared_memory(name, objects.make("garbled", A.tobytes() + B.tobytes()), 2 * TENSOR_BYTES)
    try:
        files = list((product.state_dir / "run" / "shared-memory").glob("*.json"))
        (garbled,) = [f for f in files if json.loads(f.read_text())["name"] == name]
        garbled.write_text('{"name": "' + name + '", "key": 5')
        for call, args in ((c.get_system_shared_memory_status, (name,)),
                           (c.infer, ("simple", add_from(m, {"in": name})))):
            code, message = outcome(call, *args)
            assert code == "400", (code, message)
            assert name in message and "register it again" in message, message
        assert name not in {r["name"] for r in c.get_system_shared_memory_status()}
    finally:
        c.unregister_system_shared_memory(name)
    assert not garbled.exists()


# ---------------------------------------------------------------- remote peers, injected
class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(code, details)
        self.code, self.details = code, details


class FakeContext:
    """A gRPC servicer context whose peer is ``peer``."""

    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code, details):
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple:
        return ()


@pytest.fixture
def injected(tmp_path, objects):
    """A router's shared memory with one region registered, behind its real handlers, and
    no model behind it: every call below must be refused before routing."""
    memory = SystemSharedMemory(tmp_path / "registrations")
    memory.register("victim", objects.make("injected", A.tobytes() + B.tobytes()), 0, 2 * TENSOR_BYTES)
    router = SimpleNamespace(shared_memory=memory, metrics=RouterMetrics(),
                             config=RouterConfig(max_request_bytes=LIMIT_BYTES))
    yield router
    memory.close()


def _grpc_refusal(call) -> tuple:
    with pytest.raises(Aborted) as refused:
        asyncio.run(call)
    return refused.value.code, refused.value.details


def test_grpc_calls_from_an_injected_remote_peer_are_refused(injected):
    servicer = grpc_frontend.InferenceServicer(injected, LIMIT_BYTES)
    remote_peer = FakeContext(f"ipv4:{REMOTE_PEER}:40000")
    request = service_pb2.ModelInferRequest(model_name="simple")
    for tensor in add_from(grpcclient, {"in": "victim"}):
        request.inputs.append(tensor._get_tensor())
    infer_raw = grpc_frontend.model_infer_raw(injected, LIMIT_BYTES)
    for call in (servicer.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest(), remote_peer),
                 servicer.SystemSharedMemoryStatus(
                     service_pb2.SystemSharedMemoryStatusRequest(name="victim"), remote_peer),
                 servicer.SystemSharedMemoryUnregister(service_pb2.SystemSharedMemoryUnregisterRequest(),
                                                       remote_peer),
                 servicer.ModelInfer(request, remote_peer),
                 infer_raw(request.SerializeToString(), remote_peer)):
        code, details = _grpc_refusal(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "loopback" in details, details
    assert [r.name for r in injected.shared_memory.status()] == ["victim"]
    # From loopback the status is served.
    loopback = FakeContext("ipv4:127.0.0.1:40000")
    answer = asyncio.run(servicer.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest(), loopback))
    assert list(answer.regions) == ["victim"]


def test_http_calls_from_an_injected_remote_peer_are_refused(injected):
    app = make_http_app(injected)

    @web.middleware
    async def remote_peer(request, handler):
        return await handler(request.clone(remote=REMOTE_PEER))

    app.middlewares.insert(0, remote_peer)
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [16], "parameters": {
            "shared_memory_region": "victim", "shared_memory_byte_size": TENSOR_BYTES}},
        {"name": "INPUT1", "datatype": "INT32", "shape": [16], "parameters": {
            "shared_memory_region": "victim", "shared_memory_byte_size": TENSOR_BYTES,
            "shared_memory_offset": TENSOR_BYTES}}]})

    async def calls():
        async with TestClient(TestServer(app)) as client:
            answers = []
            for method, path, data in (("GET", "/v2/systemsharedmemory/status", None),
                                       ("GET", "/v2/systemsharedmemory/region/victim/status", None),
                                       ("POST", "/v2/systemsharedmemory/unregister", None),
                                       ("POST", "/v2/systemsharedmemory/region/victim/unregister", None),
                                       ("POST", "/v2/models/simple/infer", body)):
                resp = await client.request(method, path, data=data)
                answers.append((path, resp.status, (await resp.json())["error"]))
            return answers

    for path, status, error in asyncio.run(calls()):
        assert status == 403 and "loopback" in error, (path, status, error)
    assert [r.name for r in injected.shared_memory.status()] == ["victim"]


def test_a_large_request_naming_a_region_is_found_without_searching_its_tensors(injected):
    """The raw gRPC path looks for regions only in the inputs and outputs of a request (not
    its tensor bytes): a region named anywhere there is still admitted or refused."""
    memory, remote_peer = injected.shared_memory, f"ipv4:{REMOTE_PEER}:40000"
    big = np.zeros(64 * 1024, np.int32)

    def request(*, region_in: str = "", region_out: str = "", mark_in_data: bool = False) -> bytes:
        r = service_pb2.ModelInferRequest(model_name="simple")
        # Tensor bytes first: any order of fields parses the same.
        data = big.tobytes() if not mark_in_data else b"shared_memory_region" + big.tobytes()[20:]
        r.raw_input_contents.append(data)
        r.inputs.add(name="INPUT0", datatype="INT32", shape=[big.size])
        if region_in:
            r.inputs.add(name="INPUT1", datatype="INT32", shape=[16]).parameters[
                "shared_memory_region"].string_param = region_in
        if region_out:
            r.outputs.add(name="OUTPUT0").parameters["shared_memory_region"].string_param = region_out
        return r.SerializeToString()

    for raw in (request(region_in="victim"), request(region_out="victim"),
                request(region_in="victim", mark_in_data=True)):
        assert len(raw) > 64 * 1024
        with pytest.raises(RouterError, match="loopback") as refused:
            memory.admit_raw(raw, remote_peer, LIMIT_BYTES)
        assert refused.value.grpc_code == grpc.StatusCode.PERMISSION_DENIED
    # The parameter's name in tensor bytes names no region, and those bytes are not searched.
    assert not names_region(request(mark_in_data=True))
    memory.admit_raw(request(mark_in_data=True), remote_peer, LIMIT_BYTES)
    memory.admit_raw(request(region_in="victim"), "ipv4:127.0.0.1:40000", LIMIT_BYTES)
    with pytest.raises(RouterError, match=f"limit of {64 * 1024} bytes") as over:
        memory.admit_raw(request(region_in="victim"), "ipv4:127.0.0.1:40000", 64 * 1024)
    assert over.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
