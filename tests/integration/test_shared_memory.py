"""System shared memory through the router, as Triton serves it: the same client calls (the
ones Triton's shared-memory example clients make) against a real tritonserver directly and
through `mmctl up` with two router workers give the same outputs, in the same regions, and
the same status codes and texts for every mistake.  CUDA shared memory is refused as Triton
refuses a handle it cannot open, with what to use instead.

The conformance tests at the end each send the calls of one case where Triton's own client
tests once told the router from Triton (qa/L0_shared_memory, qa/L0_cuda_shared_memory) to
both, and compare the answers."""

from __future__ import annotations

import base64
import mmap
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from tests.integration.test_fidelity import copy_model
from tests.product import Product

pytestmark = pytest.mark.integration

CLIENTS = {"grpc": grpcclient, "http": httpclient}
A = np.arange(16, dtype=np.int32)
B = np.full(16, 3, dtype=np.int32)
TENSOR_BYTES = A.nbytes


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """{"direct": (grpc, http), "routed": (grpc, http)}"""
    root = tmp_path_factory.mktemp("shm")
    copy_model(root / "direct", "simple")
    copy_model(root / "repository", "simple")
    triton = TritonProcess(TritonLaunchConfig(repository=root / "direct", work_dir=root / "triton"))
    triton.start()
    product = Product(root / "state", root / "repository", "--router-workers", "2")
    try:
        product.start()
        grpcclient.InferenceServerClient(triton.grpc_url).load_model("simple")
        endpoints = product.json("endpoints")
        yield {"direct": (triton.grpc_url, triton.http_url),
               "routed": (endpoints["router_grpc"], endpoints["router_http"])}
    finally:
        product.stop()
        triton.stop()


@pytest.fixture
def regions():
    """Two POSIX shared-memory objects of the client: inputs (A then B) and outputs."""
    tag = uuid.uuid4().hex[:8]
    made = {}
    for role, size in (("in", 2 * TENSOR_BYTES), ("out", 2 * TENSOR_BYTES)):
        made[role] = (f"/mms_test_{role}_{tag}", shm.create_shared_memory_region(
            f"{role}_{tag}", f"/mms_test_{role}_{tag}", size))
    shm.set_shared_memory_region(made["in"][1], [A, B])
    yield made
    for _key, handle in made.values():
        shm.destroy_shared_memory_region(handle)


def client(urls, side: str, protocol: str):
    grpc_url, http_url = urls[side]
    return CLIENTS[protocol].InferenceServerClient(grpc_url if protocol == "grpc" else http_url)


def outcome(call, *args, **kwargs):
    try:
        return "OK", call(*args, **kwargs)
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()


IN_USE = "it is currently in use"


def unregister_once_released(c, name: str = "") -> str:
    """The code of unregistering ``name`` (every region: "") once no request holds it.  Triton releases a
    request's hold on its regions a moment after its answer (the answer of a refused request
    included) and refuses the unregister until then (INTERNAL '... it is currently in use');
    the router holds none past its answer.  Asked again only while that is the answer, and
    at most 50 times: any other answer is what is compared."""
    for _ in range(50):
        code, message = outcome(c.unregister_system_shared_memory, name)
        if code == "OK" or IN_USE not in str(message):
            return code
    return f"{code}: {message}"


def shm_input(module, name: str, region: str, offset: int, byte_size: int = TENSOR_BYTES):
    tensor = module.InferInput(name, [16], "INT32")
    tensor.set_shared_memory(region, byte_size, offset=offset)
    return tensor


def shm_output(module, name: str, region: str, offset: int, byte_size: int = TENSOR_BYTES):
    kwargs = {"binary_data": True} if module is httpclient else {}
    output = module.InferRequestedOutput(name, **kwargs)
    output.set_shared_memory(region, byte_size, offset=offset)
    return output


def answer_outputs(result, protocol: str):
    """The outputs of an answer as the client sees them, and any data it carries."""
    if protocol == "grpc":
        response = result.get_response()
        return ([(o.name, o.datatype, list(o.shape), dict(o.parameters)) for o in response.outputs],
                list(response.raw_output_contents))
    return result.get_response()["outputs"]


def session(urls, side: str, protocol: str, regions) -> list:
    """One client's shared-memory session; returns what it saw, step by step."""
    c = client(urls, side, protocol)
    m = CLIENTS[protocol]
    (in_key, _), (out_key, out_handle) = regions["in"], regions["out"]
    seen = []

    def step(label, value):
        seen.append((label, value))

    def outputs():
        return [shm.get_contents_as_numpy(out_handle, np.int32, [16], offset=o).tolist()
                for o in (0, TENSOR_BYTES)]

    def clear_outputs():
        shm.set_shared_memory_region(out_handle, [np.zeros(32, dtype=np.int32)])

    unregister_once_released(c)
    step("register in", outcome(c.register_system_shared_memory, "input_data", in_key, 2 * TENSOR_BYTES)[0])
    step("register out", outcome(c.register_system_shared_memory, "output_data", out_key, 2 * TENSOR_BYTES)[0])
    status = c.get_system_shared_memory_status()
    if protocol == "grpc":
        status = [{"name": r.name, "key": r.key, "byte_size": r.byte_size} for r in status.regions.values()]
    step("status", sorted((r["name"], r["key"], int(r["byte_size"])) for r in status))

    # Every input and output in shared memory (simple_*_shm_client).
    clear_outputs()
    code, result = outcome(c.infer, "simple",
                           [shm_input(m, "INPUT0", "input_data", 0),
                            shm_input(m, "INPUT1", "input_data", TENSOR_BYTES)],
                           outputs=[shm_output(m, "OUTPUT0", "output_data", 0),
                                    shm_output(m, "OUTPUT1", "output_data", TENSOR_BYTES)])
    step("all in shm", code)
    step("all in shm: outputs in the region", outputs())
    step("all in shm: the answer's outputs, without data", answer_outputs(result, protocol))

    # Mixed: one input inline, one output in the answer.
    clear_outputs()
    inline = m.InferInput("INPUT1", [16], "INT32")
    inline.set_data_from_numpy(B * 2)
    code, result = outcome(c.infer, "simple", [shm_input(m, "INPUT0", "input_data", 0), inline],
                           outputs=[shm_output(m, "OUTPUT0", "output_data", 0),
                                    m.InferRequestedOutput("OUTPUT1")])
    step("mixed", code)
    step("mixed: OUTPUT0 in the region", outputs()[0])
    step("mixed: OUTPUT1 in the answer", result.as_numpy("OUTPUT1").tolist())

    # Mistakes, each with Triton's code and text.
    step("register twice", outcome(c.register_system_shared_memory, "input_data", in_key, 2 * TENSOR_BYTES))
    step("register a key that is no region",
         outcome(c.register_system_shared_memory, "nokey", "/mms_test_no_such_key", 64))
    step("register past the end", outcome(c.register_system_shared_memory, "big", in_key, 4096))
    step("register an offset past the end",
         outcome(c.register_system_shared_memory, "far", in_key, 64, offset=4096))
    step("register a second region of a registered key",
         outcome(c.register_system_shared_memory, "second", in_key, TENSOR_BYTES))
    step("status of an unknown region", outcome(c.get_system_shared_memory_status, "nosuch")[1:])
    step("infer from an unknown region",
         outcome(c.infer, "simple", [shm_input(m, "INPUT0", "nosuch", 0),
                                     shm_input(m, "INPUT1", "input_data", TENSOR_BYTES)]))
    step("infer past the region's end",
         outcome(c.infer, "simple", [shm_input(m, "INPUT0", "input_data", TENSOR_BYTES + 8),
                                     shm_input(m, "INPUT1", "input_data", 0)]))
    step("output region too small",
         outcome(c.infer, "simple", [shm_input(m, "INPUT0", "input_data", 0),
                                     shm_input(m, "INPUT1", "input_data", TENSOR_BYTES)],
                 outputs=[shm_output(m, "OUTPUT0", "output_data", 0, byte_size=TENSOR_BYTES // 2)]))
    step("unregister an unknown region", outcome(c.unregister_system_shared_memory, "nosuch")[0])
    step("unregister one", unregister_once_released(c, "output_data"))
    step("infer into an unregistered region",
         outcome(c.infer, "simple", [shm_input(m, "INPUT0", "input_data", 0),
                                     shm_input(m, "INPUT1", "input_data", TENSOR_BYTES)],
                 outputs=[shm_output(m, "OUTPUT0", "output_data", 0)]))
    step("unregister all", unregister_once_released(c))
    status = c.get_system_shared_memory_status()
    step("status after", len(status.regions) if protocol == "grpc" else len(status))
    return seen


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_shared_memory_session_as_against_triton(urls, regions, protocol):
    direct = session(urls, "direct", protocol, regions)
    routed = session(urls, "routed", protocol, regions)
    assert dict(direct)["all in shm: outputs in the region"] == [(A + B).tolist(), (A - B).tolist()]
    assert dict(direct)["mixed: OUTPUT1 in the answer"] == (A - 2 * B).tolist()
    assert dict(direct)["all in shm"] == "OK"
    for (label, want), (_, got) in zip(direct, routed, strict=True):
        assert got == want, f"{label}: Triton {want!r}, router {got!r}"


def test_registration_reaches_every_worker(urls, regions):
    """Registered on one connection, used and unregistered on fresh connections, which the
    kernel spreads over both router workers."""
    (in_key, _), (out_key, out_handle) = regions["in"], regions["out"]
    first = client(urls, "routed", "grpc")
    first.unregister_system_shared_memory()
    first.register_system_shared_memory("input_data", in_key, 2 * TENSOR_BYTES)
    first.register_system_shared_memory("output_data", out_key, 2 * TENSOR_BYTES)
    for i in range(12):
        protocol = ("grpc", "http")[i % 2]
        m = CLIENTS[protocol]
        fresh = client(urls, "routed", protocol)
        fresh.infer("simple", [shm_input(m, "INPUT0", "input_data", 0),
                               shm_input(m, "INPUT1", "input_data", TENSOR_BYTES)],
                    outputs=[shm_output(m, "OUTPUT0", "output_data", 0)])
        assert shm.get_contents_as_numpy(out_handle, np.int32, [16]).tolist() == (A + B).tolist()
        shm.set_shared_memory_region(out_handle, [np.zeros(16, dtype=np.int32)])
    client(urls, "routed", "http").unregister_system_shared_memory("input_data")
    for _ in range(6):
        code, message = outcome(client(urls, "routed", "grpc").infer, "simple",
                                [shm_input(grpcclient, "INPUT0", "input_data", 0),
                                 shm_input(grpcclient, "INPUT1", "input_data", TENSOR_BYTES)])
        assert (code, message) == ("StatusCode.NOT_FOUND", "Unable to find shared memory region: 'input_data'")
    first.unregister_system_shared_memory()


# ---------------------------------------------------------------- conformance, case by case
SIDES = ("direct", "routed")
INVALID = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}
PAGE = mmap.PAGESIZE


@pytest.fixture
def fresh_object():
    """A shared-memory object no region names yet, of two pages: Triton refuses any second
    region of a key it registered (the session's "register a second region of a registered
    key"), whatever its bounds."""
    key = f"/mms_test_fresh_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(key[1:], key, 2 * PAGE)
    yield key
    shm.destroy_shared_memory_region(handle)


def on_both(urls, protocol: str, method: str, *args, **kwargs) -> dict:
    """The outcome of one client call against Triton and through the router."""
    return {side: outcome(getattr(client(urls, side, protocol), method), *args, **kwargs) for side in SIDES}


def unregister_on_both(urls, protocol: str) -> None:
    """What a failed comparison left registered on either side (the stacks serve the module)."""
    for side in SIDES:
        unregister_once_released(client(urls, side, protocol))


def assert_alike(answers: dict, want) -> None:
    assert answers["direct"] == want, f"Triton answered {answers['direct']!r}, not {want!r}"
    assert answers["routed"] == want, f"Triton {answers['direct']!r}, router {answers['routed']!r}"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_registration_past_the_objects_end_is_refused_as_triton_refuses_it(urls, fresh_object, protocol):
    """L0_shared_memory's test_register_out_of_bound: INVALID_ARGUMENT / 400 in Triton's words
    (the router answered INTERNAL / 500 'Invalid shared memory region')."""
    try:
        for name, offset, byte_size in (("size", 0, 2 * PAGE + 1), ("offset", 4 * PAGE, 64),
                                        ("both", PAGE, PAGE + 1)):
            answers = on_both(urls, protocol, "register_system_shared_memory", name, fresh_object, byte_size,
                              offset=offset)
            assert_alike(answers, (INVALID[protocol],
                                   f"failed to register shared memory region '{name}': invalid args"))
    finally:
        unregister_on_both(urls, protocol)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_place_past_its_regions_end_is_refused_as_triton_refuses_it(urls, regions, protocol):
    """L0_shared_memory's test_infer_offset_out_of_bound: an offset at or past the end of its
    region, of an input or an output, is 'Invalid offset', not 'Invalid offset + byte size'
    (what the router answered); an output's before the model runs.  Over HTTP the offset
    Triton's test sends is 2**64 - 32; over gRPC the same size_t is the int64 -32."""
    m = CLIENTS[protocol]
    (in_key, _), (out_key, _) = regions["in"], regions["out"]
    huge = 2**64 - 32 if protocol == "http" else -32
    unregister_on_both(urls, protocol)
    for side in SIDES:
        c = client(urls, side, protocol)
        c.register_system_shared_memory("input_data", in_key, 2 * TENSOR_BYTES)
        c.register_system_shared_memory("output_data", out_key, 2 * TENSOR_BYTES)
    try:
        for label, input_offset, output_offset, region in (
                ("an input's offset at its region's end", 2 * TENSOR_BYTES, 0, "input_data"),
                ("an output's offset at its region's end", 0, 2 * TENSOR_BYTES, "output_data"),
                ("an output's offset past 2**63", 0, huge, "output_data")):
            inputs = [shm_input(m, "INPUT0", "input_data", input_offset),
                      shm_input(m, "INPUT1", "input_data", TENSOR_BYTES)]
            outputs = [shm_output(m, "OUTPUT0", "output_data", output_offset),
                       shm_output(m, "OUTPUT1", "output_data", TENSOR_BYTES)]
            answers = on_both(urls, protocol, "infer", "simple", inputs, outputs=outputs)
            want = (INVALID[protocol], f"Invalid offset for shared memory region: '{region}'")
            assert answers["direct"] == want, (label, answers)
            assert answers["routed"] == want, (label, answers)
    finally:
        unregister_on_both(urls, protocol)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_region_triton_cannot_map_is_refused_as_triton_refuses_it(urls, fresh_object, protocol):
    """Triton maps a region when it is registered: mmap refuses an offset that is not a
    multiple of the page size and a region of no bytes (the router accepted both)."""
    try:
        for name, offset, byte_size in (("unaligned", 100, 28), ("nothing", 0, 0)):
            answers = on_both(urls, protocol, "register_system_shared_memory", name, fresh_object, byte_size,
                              offset=offset)
            assert_alike(answers, (INVALID[protocol], (f"failed to register shared memory region '{name}': "
                                                       "unable to process address spaceInvalid argument")))
        # A page-aligned offset maps: registered on both.
        answers = on_both(urls, protocol, "register_system_shared_memory", "aligned", fresh_object, PAGE,
                          offset=PAGE)
        assert_alike({side: code for side, (code, _) in answers.items()}, "OK")
    finally:
        unregister_on_both(urls, protocol)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cuda_shared_memory_is_refused_in_tritons_words_with_what_to_use(urls, protocol):
    """L0_cuda_shared_memory matches 'failed to register shared memory region.*invalid args':
    the router refuses every CUDA registration as Triton refuses a handle it cannot open
    (the router answered UNIMPLEMENTED / 501), then says what to use instead."""
    handle = base64.b64encode(bytes(64))  # as cuda_shared_memory.get_raw_handle returns it
    answers = on_both(urls, protocol, "register_cuda_shared_memory", "gpu_region", handle, 0, 64)
    triton_words = "failed to register shared memory region: invalid args"
    assert answers["direct"] == (INVALID[protocol], triton_words), answers
    code, message = answers["routed"]
    assert code == INVALID[protocol] and message.startswith(triton_words), answers
    assert "system shared memory" in message and "send the tensors in the request" in message, message
    if protocol == "http":  # a handle that is not 64 bytes is refused first, in Triton's words
        short = on_both(urls, protocol, "register_cuda_shared_memory", "gpu_region", base64.b64encode(bytes(8)),
                        0, 64)
        assert_alike(short, ("400", "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"))
    for side in SIDES:
        c = client(urls, side, protocol)
        status = c.get_cuda_shared_memory_status()
        assert (len(status.regions) if protocol == "grpc" else len(status)) == 0
        c.unregister_cuda_shared_memory()  # nothing registered: no error
