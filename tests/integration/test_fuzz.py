"""Malformed public requests against a started stack: every one is answered as a client error.

About 2,000 HTTP and 2,000 gRPC requests, generated from one seed: random paths and names,
valid requests with one part broken (wrong types, missing fields, duplicate keys, deep
nesting, huge shapes, numbers out of range, bad header lengths, broken compression), raw
bytes on the HTTP socket (broken request lines, headers and framing), random bytes as
protobuf, streams of bad messages.  Asserted: every request is answered, over HTTP with a
status that is not 5xx and a message, over gRPC with a status that is not INTERNAL, UNKNOWN,
UNAVAILABLE, CANCELLED or DATA_LOSS (a reset or closed connection or stream is no answer); no
call slower than 10 s, Triton never restarted; afterwards a valid request works,
``mmctl status`` works and the product's log has no traceback.  The named cases below pin
the refusals found this way, each with its message.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import shutil
import socket
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from tests.product import Product

pytestmark = pytest.mark.integration

SEED = 20260509
HTTP_CASES = 2000
RAW_HTTP_CASES = 100  # of HTTP_CASES: bytes written to a socket, not through an HTTP client
GRPC_CASES = 2000
HANG_S = 10.0
MAX_REQUEST_BYTES = 1 << 20
HEADER_LENGTH = "Inference-Header-Content-Length"
MODELS = ("cust001", "cust002")  # recommender: FEATURES FP32 [-1, 64] -> SCORES
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES")


# ---------------------------------------------------------------------------- random values
def random_name(rng: random.Random) -> str:
    return rng.choice([
        lambda: rng.choice(MODELS),
        lambda: rng.choice(MODELS) + ":" + rng.choice(["acme", "", "../x", "a:b"]),
        lambda: "".join(rng.choice("abcxyz019_-.") for _ in range(rng.randint(1, 12))),
        lambda: rng.choice(["..", "../etc", "a/b", "a%2Fb", "%00", "x" * rng.randint(200, 5000),
                            " ", "ü名", "cust001.v9", "cust001-faulty", "identity", "$(id)",
                            "cust001%20", "-", "A" * 64]),
    ])()


def random_json(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, rng.randint(-9, 9)])
    if kind == "float":
        return rng.choice([0.5, -1.5, 1e38, 3.5e38, 1e308, 1e-320, rng.random()])
    if kind == "str":
        return rng.choice(["", "x", "FP32", "FEATURES", "\u00fc", "a" * 300, "1", "true"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["name", "shape", "data", "x", "parameters"]): random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def valid_request(rng: random.Random, binary: bool) -> tuple[dict, bytes]:
    rows = rng.randint(1, 3)
    data = np.asarray([[rng.random() for _ in range(64)] for _ in range(rows)], np.float32)
    inp = {"name": "FEATURES", "shape": [rows, 64], "datatype": "FP32"}
    doc: dict = {"inputs": [inp]}
    if rng.random() < 0.5:
        doc["outputs"] = [{"name": "SCORES", "parameters": {"binary_data": rng.random() < 0.5}}]
    if rng.random() < 0.3:
        doc["id"] = f"req-{rng.randint(0, 999)}"
    if binary:
        inp["parameters"] = {"binary_data_size": data.nbytes}
        return doc, data.tobytes()
    inp["data"] = data.flatten().tolist() if rng.random() < 0.5 else data.tolist()
    return doc, b""


def deep(rng: random.Random) -> str:
    n = rng.choice([100, 1000, 5000, 100000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    return opener * n + "1" + closer * n


# ---------------------------------------------------------------------------- HTTP cases
def _mutate(rng: random.Random, doc: dict) -> dict | str:
    """One broken part of a valid request (a JSON value, or raw text where JSON cannot say it)."""
    inp = doc["inputs"][0]
    choice = rng.randrange(30)
    if choice == 0:
        del doc["inputs"]
    elif choice == 1:
        doc["inputs"] = random_json(rng)
    elif choice == 2:
        inp.pop(rng.choice(["name", "datatype", "shape"]))
    elif choice == 3:
        inp["shape"] = rng.choice([random_json(rng), "2,64", 64, [-1, 64], [1.5, 64], [True],
                                   [2**63, 2], [2**64], [2**40, 2**40], [10**30], [None]])
    elif choice == 4:
        inp["datatype"] = rng.choice([random_json(rng), "fp32", "FLOAT", "", "INT128", "TYPE_FP32"])
    elif choice == 5:
        inp["data"] = rng.choice([random_json(rng), [1, 2, 3], [[1] * 64, [2]], "abc",
                                  [[["x"] * 64]], [None] * 64, [True] * 64, [1e400] * 64])
        inp.get("parameters", {}).pop("binary_data_size", None)
    elif choice == 6:
        inp["datatype"] = rng.choice(DATATYPES)
        inp["data"] = [rng.choice([300, -1, 2**64, 1.5, "s", True, 70000, 2**31, 1e39])] * (
            inp["shape"][0] * 64)
        inp.pop("parameters", None)
    elif choice == 7:
        doc["parameters"] = rng.choice([random_json(rng), [], "x", {"priority": -1},
                                        {"timeout": "x"}, {"sequence_id": 1.5},
                                        {"triton_x": 1}, {"x": [1]}, {"x": {"y": 1}},
                                        {"adapter": 5}, {"adapter": ""}, {"user_id": [1]},
                                        {"binary_data_output": "yes"}, {"x": 2**70}])
    elif choice == 8:
        inp["parameters"] = rng.choice([random_json(rng), [], {"binary_data_size": -1},
                                        {"binary_data_size": "8"}, {"binary_data_size": 2**70},
                                        {"shared_memory_region": 5},
                                        {"shared_memory_region": "r", "shared_memory_byte_size": 4}])
    elif choice == 9:
        doc["outputs"] = rng.choice([random_json(rng), {}, [5], [{}], [{"name": 5}],
                                     [{"name": "SCORES", "parameters": {"binary_data": "x"}}],
                                     [{"name": "SCORES", "parameters": {"classification": -1}}],
                                     [{"name": "SCORES", "parameters": []}], [{"name": "NOPE"}]])
    elif choice == 10:
        doc["id"] = random_json(rng)
    elif choice == 11:
        doc["inputs"] = [inp, dict(inp)]
    elif choice == 12:
        doc["inputs"].append(rng.choice([5, "x", None, [], {"name": "ADAPTER_CONTROL"}]))
    elif choice == 13:
        return json.dumps(doc)[:-1] + ',"inputs":[{"name":"ADAPTER_CONTROL","shape":[1,1],' \
                                      '"datatype":"BYTES","data":["{\\"op\\":\\"status\\"}"]}]}'
    elif choice == 14:
        return '{"inputs":' + deep(rng) + "}"
    elif choice == 15:
        return deep(rng)
    elif choice == 16:
        inp["data"] = [[[[[[[[1.0]]]]]]]] * 64
        inp.get("parameters", {}).pop("binary_data_size", None)
    elif choice == 17:
        return json.dumps(doc).replace("FP32", "FP32\\ud800")
    elif choice == 18:
        return json.dumps(doc).replace(":", ": NaN, \"z\":", 1)
    elif choice == 19:
        return json.dumps(doc)[: rng.randint(0, 40)]
    elif choice == 20:
        return json.dumps(doc).replace('"inputs"', '"inputs": [], "inputs"')
    elif choice == 21:
        doc["x"] = rng.choice([0, "\u0000", [[[[]]]]])
        if doc["x"] == 0:
            return json.dumps(doc).replace('"x": 0', '"x": ' + rng.choice(["1e400", "-1E999", "9" * 400]))
    elif choice == 22:
        inp["shape"] = [rng.randint(0, 2**62) for _ in range(rng.randint(0, 70))]
    elif choice == 23:
        inp["name"] = rng.choice([random_json(rng), "", "x" * 10000, "ADAPTER", "ADAPTER_CONTROL"])
    elif choice == 24:
        return rng.choice(["[]", "null", "1", '"x"', "true", "{}", "", " ", "{\"inputs\": null}"])
    elif choice == 25:
        return json.dumps(doc).encode("utf-16").decode("latin-1")
    elif choice == 26:
        doc = [doc]
    elif choice == 27:
        inp["datatype"] = "BYTES"
        inp["data"] = rng.choice([[1, 2], ["a"] * inp["shape"][0] * 64, [["a"], "b"], [{"b64": "x"}]])
        inp.pop("parameters", None)
    elif choice == 28:
        inp["shape"] = [0, 64]
        inp["data"] = []
        inp.pop("parameters", None)
    else:
        doc["parameters"] = {"sequence_id": rng.choice([2**64, -5, "s", 1]), "sequence_start": 1}
    return doc


def http_case(rng: random.Random) -> tuple[str, str, dict, bytes]:
    """(method, path, headers, body) of one malformed (or odd) public HTTP request."""
    name = random_name(rng)
    roll = rng.random()
    if roll < 0.08:
        path = rng.choice([f"/v2/models/{name}", f"/v2/models/{name}/ready", f"/v2/models/{name}/config",
                           f"/v2/models/{name}/stats", f"/v2/models/{name}/versions/{rng.choice(['1', 'x', '99999999999999999999', '-1', ''])}",
                           f"/health/{name}", "/v2/" + name, "/" + name, "/v2/models//infer",
                           "/v2/repository/index", "/v2/models/cust001/trace/setting", "/metrics",
                           "/v2/health/ready", "/v2/models/cust001/versions/1/ready"])
        return rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]), path, {}, b""
    model = rng.choice(MODELS) if rng.random() < 0.8 else name
    version = rng.choice(["", "", "", "1", "2", "0", "x", "1.0", "99999999999999999999"])
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    headers = {"Content-Type": rng.choice(["application/json", "application/octet-stream", "text/plain",
                                           "application/json; charset=utf-16", ""])}
    binary = rng.random() < 0.5
    doc, tail = valid_request(rng, binary)
    mutated = _mutate(rng, doc) if rng.random() < 0.85 else doc
    header = (mutated if isinstance(mutated, str) else json.dumps(mutated)).encode("utf-8", "surrogatepass")
    if isinstance(mutated, str) and mutated and mutated[0] == "\xff":
        header = mutated.encode("latin-1")
    body = header + tail
    if tail:
        headers[HEADER_LENGTH] = str(len(header))
    roll = rng.random()
    if roll < 0.15:
        headers[HEADER_LENGTH] = rng.choice(["abc", "-1", "-0", "0", "1", "", "0x10", "1e3", "+3", "1.0",
                                             str(len(body) + 1), str(2**63), str(2**31), "9" * 40,
                                             str(len(header) - 1), str(len(header) + 1)])
    elif roll < 0.25:
        body = rng.randbytes(rng.randint(0, 2000))
    elif roll < 0.32:
        encoding = rng.choice(["gzip", "deflate", "br", "foo", "gzip, gzip", "identity", "GZIP"])
        headers["Content-Encoding"] = encoding
        if rng.random() < 0.6:
            body = gzip.compress(body) if "gzip" in encoding.lower() else zlib.compress(body)
        if rng.random() < 0.3:
            body = body[: len(body) // 2]
    elif roll < 0.35:
        headers["Accept-Encoding"] = rng.choice(["gzip", "deflate", "br", "x;q=abc", "gzip;q=-1"])
    elif roll < 0.38:
        headers["x-user-id"] = rng.choice(["", "u" * 5000, "ü", "1"])
    elif roll < 0.40:
        body = b"[" * (MAX_REQUEST_BYTES // 2) + b"]" * (MAX_REQUEST_BYTES // 2)
    return "POST", path, headers, body


def raw_http_case(rng: random.Random) -> tuple[bytes, bool]:
    """Bytes no HTTP client library would send: broken request lines, headers, framing; and
    whether their framing promises more bytes than they carry (a server may wait for those)."""
    body = json.dumps({"inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32",
                                   "data": [0.5] * 64}]}).encode()
    path = rng.choice(["/v2/models/cust001/infer", "/v2/models/cust001", "/v2", "*", "x", "/%zz", "//"])
    line = rng.choice([f"POST {path} HTTP/1.1", f"POST {path} HTTP/9.9", f"POST {path}", "GARBAGE",
                       f"P\x00ST {path} HTTP/1.1", f"POST {path} HTTP/1.1 extra", f"POST {path}\tHTTP/1.1"])
    headers = ["Host: x"]
    framing = rng.randrange(8)
    promises_more = False
    if framing == 0:
        length = rng.choice(['-1', 'abc', '1e3', str(len(body) + 50), '99999999999999999999'])
        headers.append(f"Content-Length: {length}")
        promises_more = length.isdigit()
    elif framing == 1:
        headers.append("Transfer-Encoding: chunked")
        body = rng.choice([b"zz\r\nabc\r\n0\r\n\r\n", b"5\r\nab\r\n0\r\n\r\n", b"ffffffffffffffffff\r\n"])
        promises_more = body.startswith(b"ffff")
    elif framing == 2:
        headers += [f"Content-Length: {len(body)}", "Transfer-Encoding: chunked"]
    elif framing == 3:
        headers += [f"Content-Length: {len(body)}", f"Content-Length: {len(body) + 1}"]
    elif framing == 4:
        headers += [f"Content-Length: {len(body)}", rng.choice(["Bad Header: x", "X-\x00: y", ": empty",
                                                                "X: " + "a" * 10000, "no-colon"])]
    elif framing == 5:
        headers += [f"Content-Length: {len(body)}", f"{HEADER_LENGTH}: {rng.choice(['abc', '-5', '٣'])}"]
    elif framing == 6:
        headers += [f"Content-Length: {len(body)}", "Content-Encoding: gzip"]
    else:
        headers += [f"Content-Length: {len(body)}"] + [f"X-{i}: {i}" for i in range(rng.choice([10, 200]))]
    raw = ("\r\n".join([line, *headers]) + "\r\n\r\n").encode("utf-8", "surrogatepass") + body
    return raw, promises_more


@dataclass
class RawAnswer:
    """What came back on a socket: the response's status and message, or why there was none."""

    status: int | None  # None: no response (see ``outcome``)
    message: bytes  # the start of the response's body
    outcome: str  # "answered", "reset", "closed" (without a response), "waiting" or "not HTTP"
    elapsed: float
    first_line: str = ""


def _send_raw(address: str, raw: bytes, wait_s: float = HANG_S, half_close: bool = False) -> RawAnswer:
    """Write ``raw`` and read the response's head and the start of its body.

    The sending side stays open, as an HTTP client keeps it, unless ``half_close``: the
    request's own framing says where it ends, so an answer the server writes can be read."""
    host, port = address.rsplit(":", 1)
    start = time.monotonic()
    answer, outcome = b"", "closed"
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        try:
            try:
                sock.sendall(raw)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server stopped reading; an answer it wrote first is still readable
            while not _has_message(answer):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            else:
                outcome = "answered"
        except ConnectionResetError:
            outcome = "reset"
        except TimeoutError:
            outcome = "waiting"
    elapsed = time.monotonic() - start
    head, sep, body = answer.partition(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0].decode(errors="replace")
    parts = first.split()
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        return RawAnswer(None, body[:300], "not HTTP" if sep else outcome, elapsed, first)
    return RawAnswer(int(parts[1]), body[:300], "answered", elapsed, first)


def _has_message(answer: bytes) -> bool:
    """The response's head is complete and its body has started (or is declared empty)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    return bool(body) or re.search(rb"(?im)^content-length:\s*0\s*$", head) is not None


# ---------------------------------------------------------------------------- gRPC cases
def _infer_request(rng: random.Random) -> service_pb2.ModelInferRequest:
    rows = rng.randint(1, 3)
    req = service_pb2.ModelInferRequest(model_name=rng.choice(MODELS))
    inp = req.inputs.add(name="FEATURES", datatype="FP32", shape=[rows, 64])
    data = np.asarray([[rng.random() for _ in range(64)] for _ in range(rows)], np.float32)
    if rng.random() < 0.5:
        req.raw_input_contents.append(data.tobytes())
    else:
        inp.contents.fp32_contents.extend(data.flatten().tolist())
    return req


def _stream_message(rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:
        return _infer_request(rng).SerializeToString()
    while True:
        method, payload, _ = grpc_case(rng)
        if method == "ModelInfer":
            return payload


def grpc_case(rng: random.Random) -> tuple[str, bytes | list[bytes], object]:
    """(method, serialized request(s), response deserializer) of one malformed gRPC call;
    ModelStreamInfer gets a list of messages."""
    roll = rng.random()
    if roll < 0.05:
        return "ModelStreamInfer", [_stream_message(rng) for _ in range(rng.randint(1, 3))], None
    if roll < 0.12:
        method = rng.choice(["ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics"])
        cls = getattr(service_pb2, method + "Request")
        msg = cls(name=random_name(rng), version=rng.choice(["", "1", "x", "-1", "99999999999999999999"]))
        return method, msg.SerializeToString(), getattr(service_pb2, method + "Response").FromString
    if roll < 0.15:
        method = rng.choice(["RepositoryModelLoad", "RepositoryIndex", "SystemSharedMemoryRegister",
                             "LogSettings", "TraceSetting", "ServerLive", "ServerReady", "ServerMetadata"])
        return method, rng.randbytes(rng.randint(0, 40)) if rng.random() < 0.5 else b"", None
    if roll < 0.30:
        return "ModelInfer", rng.randbytes(rng.randint(0, 3000)), None
    req = _infer_request(rng)
    inp = req.inputs[0]
    choice = rng.randrange(16)
    if choice == 0:
        req.model_name = random_name(rng)
    elif choice == 1:
        req.model_version = rng.choice(["x", "-1", "99999999999999999999", "1.0", "0"])
    elif choice == 2:
        del inp.shape[:]
        inp.shape.extend(rng.choice([[], [-1, 64], [2**62, 2**62], [0], [1] * 70, [2**63 - 1], [-(2**63)]]))
    elif choice == 3:
        inp.datatype = rng.choice(["", "fp32", "BYTES", "INT8", "BOOL", "FP16", "x" * 300])
    elif choice == 4:
        del req.raw_input_contents[:]
        req.raw_input_contents.append(rng.randbytes(rng.randint(0, 600)))
    elif choice == 5:
        req.raw_input_contents.append(b"extra")
    elif choice == 6:
        inp.name = rng.choice(["", "ADAPTER_CONTROL", "ADAPTER", "NOPE", "x" * 5000])
    elif choice == 7:
        req.parameters["adapter"].string_param = rng.choice(["", "acme", "../x", "x" * 1000])
    elif choice == 8:
        req.parameters[rng.choice(["priority", "timeout", "sequence_id", "triton_x"])].int64_param = -1
    elif choice == 9:
        req.inputs.add(name="FEATURES", datatype="FP32", shape=[1, 64])
    elif choice == 10:
        req.outputs.add(name=rng.choice(["", "NOPE", "SCORES"])).parameters["classification"].int64_param = -1
    elif choice == 11:
        inp.contents.bytes_contents.append(b"x")
    elif choice == 12:
        inp.parameters["shared_memory_region"].string_param = "nope"
    elif choice == 13:
        req.parameters["user_id"].string_param = "u" * rng.choice([0, 1, 5000])
    elif choice == 14:
        raw = req.SerializeToString()
        return "ModelInfer", raw[: rng.randint(0, len(raw))], None
    else:
        raw = bytearray(req.SerializeToString())
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return "ModelInfer", bytes(raw), None
    return "ModelInfer", req.SerializeToString(), None


# ---------------------------------------------------------------------------- the tests
FEATURES_JSON = {"name": "FEATURES", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}


def _with(**fields) -> dict:
    return {"inputs": [dict(FEATURES_JSON, **fields)]}


def _without(key: str) -> dict:
    return {"inputs": [{k: v for k, v in FEATURES_JSON.items() if k != key}]}


def _binary(size: int, tail: bytes) -> tuple[dict, bytes]:
    header = json.dumps({"inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32",
                                     "parameters": {"binary_data_size": size}}]}).encode()
    return {HEADER_LENGTH: str(len(header))}, header + tail


# (case, headers, body, words the 400's message must contain): each was a 500 (or worse) before.
MALFORMED = [
    ("deep array nesting", {}, b"[" * 100000 + b"]" * 100000, "nested deeper than 64"),
    ("deep object nesting", {}, b'{"inputs":' + b'{"a":' * 5000 + b"1" + b"}" * 5001, "nested deeper"),
    ("header length not a number", {HEADER_LENGTH: "abc"}, json.dumps(_with()).encode(),
     "Unable to parse Inference-Header-Content-Length"),
    ("negative header length", {HEADER_LENGTH: "-1"}, json.dumps(_with()).encode(),
     "Unable to parse Inference-Header-Content-Length"),
    ("header length beyond the body", {HEADER_LENGTH: "100000"}, json.dumps(_with()).encode(),
     "inference header size should be in range"),
    ("shape is not an array", {}, json.dumps(_with(shape="1,64")).encode(), "Unable to parse 'shape'"),
    ("shape with a negative dimension", {}, json.dumps(_with(shape=[-1, 64])).encode(),
     "Unable to parse 'shape'"),
    ("no name", {}, json.dumps(_without("name")).encode(), "Unable to parse 'name'"),
    ("no datatype", {}, json.dumps(_without("datatype")).encode(), "Unable to parse 'datatype'"),
    ("no inputs", {}, b"{}", "Unable to parse 'inputs'"),
    ("inputs not an array", {}, b'{"inputs": 1.5}', "Unable to parse 'inputs'"),
    ("input not an object", {}, b'{"inputs": [5]}', "Unable to parse 'inputs'"),
    ("data shorter than the shape", {}, json.dumps(_with(data=[0.5] * 63)).encode(),
     "Shape does not match true shape of 'data' field"),
    ("data is a string", {}, json.dumps(_with(data="0.5")).encode(), "Unable to parse 'data'"),
    ("number too big for INT8", {}, json.dumps(_with(datatype="INT8", data=[300] * 64)).encode(),
     "out of range for INT8"),
    ("number too big for a double", {}, json.dumps(_with(data=[1.0] * 64)).encode().replace(b"1.0", b"1e400", 1),
     "too big to be stored in a double"),
    ("NaN literal", {}, json.dumps(_with(data=[float("nan")] * 64)).encode(), "NaN"),
    ("unknown datatype", {}, json.dumps(_with(datatype="FLOAT")).encode(), "invalid datatype"),
    ("body is an array", {}, b"[1, 2]", "must be a JSON object"),
    ("body is not UTF-8", {}, json.dumps(_with()).encode("utf-16"), "not valid UTF-8"),
    ("parameters not an object", {}, json.dumps(dict(_with(), parameters=[1])).encode(),
     "Unable to parse 'parameters'"),
    ("sequence_start not a boolean", {},
     json.dumps(dict(_with(), parameters={"sequence_start": 1})).encode(), "sequence_start"),
    ("id not a string", {}, json.dumps(dict(_with(), id=5)).encode(), "Unable to parse 'id'"),
    ("outputs not an array", {}, json.dumps(dict(_with(), outputs={"name": "SCORES"})).encode(),
     "Unable to parse 'outputs'"),
    ("output name not a string", {}, json.dumps(dict(_with(), outputs=[{"name": 5}])).encode(),
     "Unable to parse 'name' of output 0"),
    ("binary_data_size not a number", {}, json.dumps(_with(parameters={"binary_data_size": "256"})).encode(),
     "binary_data_size"),
    ("binary_data_size beyond the body", *_binary(256, b"\0" * 100), "binary_data_size"),
    ("binary_data_size too big for uint64", *_binary(2**70, b""), "binary_data_size"),
    ("huge shape with JSON data", {}, json.dumps(_with(shape=[2**40, 2**40], data=[])).encode(),
     "Unable to parse 'shape'"),
    ("huge shape that fits int64", {}, json.dumps(_with(shape=[2**30, 64], data=[0.5])).encode(),
     "Shape does not match true shape of 'data' field"),
    ("empty body", {}, b"", "request body is empty"),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_http_request_is_400_with_the_reason(product, case):
    _, headers, body, words = case
    before = product.triton_pids()
    resp = requests.post(f"http://{product.endpoints['router_http']}/v2/models/cust001/infer",
                         data=body, headers=headers, timeout=30)
    assert resp.status_code == 400, resp.text[:500]
    assert words in resp.json()["error"], resp.json()
    assert product.triton_pids() == before, "the request crashed Triton"
    assert "Traceback" not in product.log_text()


def test_duplicate_keys_are_refused(product):
    """Python keeps the last of two keys, Triton the first: a body with two ``inputs`` could
    pass the router's ADAPTER_CONTROL check and reach Triton with it, and two ``parameters``
    could hide an adapter from the router's per-adapter routing and limits."""
    base = f"http://{product.endpoints['router_http']}/v2/models/cust001/infer"
    control = json.dumps([{"name": "ADAPTER_CONTROL", "shape": [1, 1], "datatype": "BYTES",
                           "data": ['{"op": "status"}']}])
    features = json.dumps(FEATURES_JSON)
    smuggled = f'{{"inputs": {control}, "inputs": [{features}]}}'
    resp = requests.post(base, data=smuggled, timeout=30)
    assert resp.status_code == 400 and "duplicate key 'inputs'" in resp.json()["error"], resp.text
    hidden = f'{{"parameters": {{"adapter": "acme"}}, "parameters": {{}}, "inputs": [{features}]}}'
    resp = requests.post(base, data=hidden, timeout=30)
    assert resp.status_code == 400 and "duplicate key 'parameters'" in resp.json()["error"], resp.text
    twice = features.replace('"name": "FEATURES"', '"name": "ADAPTER_CONTROL", "name": "FEATURES"')
    nested = f'{{"inputs": [{twice}]}}'
    resp = requests.post(base, data=nested, timeout=30)
    assert resp.status_code == 400 and "duplicate key 'name'" in resp.json()["error"], resp.text


@pytest.mark.parametrize("request_compression", ["gzip", "deflate", None])
@pytest.mark.parametrize("response_compression", ["gzip", "deflate", None])
def test_compressed_requests_and_responses_pass_through(product, request_compression, response_compression):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(product.endpoints["router_http"])
    data = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    grpcclient.InferenceServerClient(product.endpoints["router_grpc"]).infer("cust001", [_grpc_input(data)])
    direct = grpcclient.InferenceServerClient(product.endpoints["triton"][0]["grpc"])
    expected = direct.infer("cust001", [_grpc_input(data)]).as_numpy("SCORES")
    for binary in (True, False):
        x = httpclient.InferInput("FEATURES", [2, 64], "FP32")
        x.set_data_from_numpy(data, binary_data=binary)
        out = client.infer("cust001", [x], request_compression_algorithm=request_compression,
                           response_compression_algorithm=response_compression)
        assert out.as_numpy("SCORES").tobytes() == expected.tobytes()


def test_undecodable_compression_is_a_client_error(product):
    base = f"http://{product.endpoints['router_http']}/v2/models/cust001/infer"
    body = json.dumps(_with()).encode()
    resp = requests.post(base, data=gzip.compress(body)[:40], headers={"Content-Encoding": "gzip"}, timeout=30)
    assert resp.status_code == 400, resp.text
    resp = requests.post(base, data=b"x" * 40, headers={"Content-Encoding": "deflate"}, timeout=30)
    assert resp.status_code == 400, resp.text
    resp = requests.post(base, data=body, headers={"Content-Encoding": "compress"}, timeout=30)
    assert resp.status_code == 400 and "Unsupported compression type" in resp.json()["error"], resp.text
    assert "Traceback" not in product.log_text()


def _grpc_input(data: np.ndarray) -> grpcclient.InferInput:
    x = grpcclient.InferInput("FEATURES", list(data.shape), "FP32")
    x.set_data_from_numpy(data)
    return x


@pytest.fixture(scope="module")
def product(fleet_template, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    repo = root / "repository"
    shutil.copytree(fleet_template, repo)
    p = Product(root / "state", repo, "--max-loaded", "4",
                "--max-request-bytes", str(MAX_REQUEST_BYTES)).start()
    p.endpoints = p.json("endpoints")
    yield p
    p.stop()


def _send_http(session: requests.Session, base: str, case) -> tuple[int, float, str]:
    method, path, headers, body = case
    start = time.monotonic()
    try:
        resp = session.request(method, base + path, headers=headers, data=body, timeout=HANG_S + 5)
        status, text = resp.status_code, resp.text[:300]
    except requests.RequestException as exc:
        status, text = -1, repr(exc)[:300]
    return status, time.monotonic() - start, text


def test_fuzzed_http_requests_are_client_errors(product):
    tritons = product.triton_pids()
    rng = random.Random(SEED)
    cases = [http_case(rng) for _ in range(HTTP_CASES - RAW_HTTP_CASES)]
    raw_cases = [raw_http_case(rng) for _ in range(RAW_HTTP_CASES)]
    base = f"http://{product.endpoints['router_http']}"
    # cust001 loaded first: the cases measure refusals, not a cold load.
    valid = {"inputs": [{"name": "FEATURES", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
    assert requests.post(base + "/v2/models/cust001/infer", json=valid, timeout=60).status_code == 200

    def run(chunk):
        with requests.Session() as session:
            return [(case, *_send_http(session, base, case)) for case in chunk]

    with ThreadPoolExecutor(4) as pool:
        results = [r for chunk in pool.map(run, [cases[i::4] for i in range(4)]) for r in chunk]
    # An answer is a status with a message; a reset or a close without one is not (the
    # HTTP client raised, status -1).
    bad = [(c[0], c[1][:80], c[2], c[3][:200], status, text) for c, status, _, text in results
           if status >= 500 or status < 0 or (status >= 400 and not text.strip())]
    slow = [(c[1][:80], elapsed) for c, _, elapsed, _ in results if elapsed > HANG_S]
    for raw, promises_more in raw_cases:
        # A request whose framing promises bytes that never come may be waited for: the client
        # can only give up on it (after a shorter wait), but it must not be reset or dropped.
        answer = _send_raw(product.endpoints["router_http"], raw, 3.0 if promises_more else HANG_S)
        if answer.status is None:
            if not (promises_more and answer.outcome == "waiting"):
                bad.append(("raw", raw[:120], answer.outcome, answer.first_line))
        elif answer.status >= 500 or (answer.status >= 400 and not answer.message.strip()):
            bad.append(("raw", raw[:120], answer.status, answer.first_line, answer.message[:200]))
        if answer.elapsed > HANG_S:
            slow.append((raw[:80], answer.elapsed))
    assert not bad, (f"{len(bad)} of {HTTP_CASES} answered 5xx, without a message, or not at all "
                     f"(reset or closed): {bad[:5]}")
    assert not slow, slow[:5]
    assert sum(1 for r in results if 400 <= r[1] < 500) > len(cases) // 2  # the cases are mostly wrong
    assert product.triton_pids() == tritons, "a request crashed Triton"
    _assert_still_serving(product)


# A server error, or a connection or stream the server reset or closed instead of answering
# (the client sets a deadline but never cancels, so CANCELLED is the server's RST_STREAM).
# An oversize message is refused from its length prefix as RESOURCE_EXHAUSTED: an answer.
NOT_AN_ANSWER = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.CANCELLED, grpc.StatusCode.DATA_LOSS)
# Triton answers a shared-memory registration whose key opens nothing, or whose span is past
# the object's end, with INTERNAL; the router answers as Triton does (test_shared_memory).
TRITON_INTERNAL_ANSWERS = {"SystemSharedMemoryRegister": ("Unable to open shared memory region: ",
                                                          "Invalid shared memory region: ")}


def test_fuzzed_grpc_requests_are_client_errors(product):
    tritons = product.triton_pids()
    rng = random.Random(SEED + 1)
    cases = [grpc_case(rng) for _ in range(GRPC_CASES)]
    channel = grpc.insecure_channel(product.endpoints["router_grpc"])
    calls = {}
    codes: dict[str, int] = {}
    bad, slow = [], []

    def run(case):
        method, payload, _ = case
        call = calls.get(method)
        if call is None:
            kind = channel.stream_stream if method == "ModelStreamInfer" else channel.unary_unary
            call = calls[method] = kind(f"/inference.GRPCInferenceService/{method}",
                                        request_serializer=None, response_deserializer=None)
        start = time.monotonic()
        code, details = grpc.StatusCode.OK, ""
        try:
            if isinstance(payload, list):  # a stream: errors of single requests come in-band
                for raw in call(iter(payload), timeout=HANG_S):
                    error = service_pb2.ModelStreamInferResponse.FromString(raw).error_message
                    if "internal error" in error.lower() or "Traceback" in error:
                        code, details = grpc.StatusCode.INTERNAL, error
            else:
                call(payload, timeout=HANG_S)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        return method, payload, code, details, time.monotonic() - start

    try:
        with ThreadPoolExecutor(4) as pool:
            for method, payload, code, details, elapsed in pool.map(run, cases):
                codes[code.name] = codes.get(code.name, 0) + 1
                if code in NOT_AN_ANSWER and not (
                        code == grpc.StatusCode.INTERNAL
                        and details.startswith(TRITON_INTERNAL_ANSWERS.get(method, ()))):
                    bad.append((method, payload[:3], code.name, details[:200]))
                if code == grpc.StatusCode.DEADLINE_EXCEEDED or elapsed > HANG_S:
                    slow.append((method, payload[:3], elapsed))
    finally:
        channel.close()
    assert not bad, f"{len(bad)} of {len(cases)} answered {'/'.join(c.name for c in NOT_AN_ANSWER)}: {bad[:5]}"
    assert not slow, slow[:5]
    assert codes.get("INVALID_ARGUMENT", 0) > len(cases) // 4, codes
    assert product.triton_pids() == tritons, "a request crashed Triton"
    _assert_still_serving(product)


def test_request_of_a_client_that_half_closes_is_answered(product):
    """A client may close its sending side once its request is sent (``shutdown(SHUT_WR)``,
    ``nc -N``): the request is complete and must be answered like any other."""
    body = json.dumps(_with()).encode()
    raw = (f"POST /v2/models/cust001/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
           "\r\n").encode() + body
    answer = _send_raw(product.endpoints["router_http"], raw, half_close=True)
    assert answer.status == 200, answer


def _assert_still_serving(p) -> None:
    client = grpcclient.InferenceServerClient(p.endpoints["router_grpc"])
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.zeros((1, 64), np.float32))
    assert client.infer("cust002", [x]).as_numpy("SCORES").shape == (1, 1)
    status = p.mmctl("status")
    assert status.returncode == 0, status.stderr
    log = p.log_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:][:6000]
