"""Checking public HTTP inference requests (router/frontends/http_request.py): pure, no sockets."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import threading
import zlib

import pytest

from domain.router_errors import InvalidRequest, PayloadTooLarge
from router.frontends import http_request
from router.frontends.http_request import (
    MAX_GZIP_MEMBERS,
    MAX_JSON_DEPTH,
    decode_body,
    parse_header_length,
    parse_infer_request,
    read_infer_request,
    with_adapter,
)
from router.frontends.http_request_checks import flat_row_major

FEATURES = {"name": "FEATURES", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3, 4.5]]}


def body(**top) -> bytes:
    return json.dumps({"inputs": [FEATURES], **top}).encode()


def tensor(**fields) -> bytes:
    return json.dumps({"inputs": [dict(FEATURES, **fields)]}).encode()


def refused(raw: bytes, header_length: str | None = None) -> str:
    with pytest.raises(InvalidRequest) as info:
        parse_infer_request(raw, header_length)
    return info.value.message


# ---------------------------------------------------------------------------- valid requests
def test_a_valid_json_request_is_forwarded_byte_for_byte():
    raw = body(id="r1", parameters={"user_id": "u1", "priority": 2, "flag": True},
               outputs=[{"name": "SCORES", "parameters": {"binary_data": True}}])
    request = parse_infer_request(raw, None)
    assert request.body is raw and request.header_length is None
    assert request.input_names == ["FEATURES"] and request.parameters["user_id"] == "u1"


def test_binary_tensors_after_the_header():
    header = json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": "INT32",
                                     "parameters": {"binary_data_size": 8}}]}).encode()
    request = parse_infer_request(header + b"\0" * 8, str(len(header)))
    assert request.header_length == len(header) and request.body.endswith(b"\0" * 8)


def test_raw_binary_request_passes_through():
    """Inference-Header-Content-Length 0 is Triton's raw request: the body is the input."""
    request = parse_infer_request(b"\x01\x02\x03", "0")
    assert request.header_length == 0 and request.doc == {} and request.input_names == []


@pytest.mark.parametrize("data, datatype, shape", [
    ([True, False], "BOOL", [2]), ([-128, 127], "INT8", [2]), ([0, 2**64 - 1], "UINT64", [2]),
    ([1, 2.5], "FP64", [2]), (["a", ""], "BYTES", [2]), ([[1], 2], "INT32", [2]),
    ([], "FP32", [0, 3]), ([3.4e38], "FP32", [1]),
])
def test_data_that_fits_its_datatype(data, datatype, shape):
    parse_infer_request(tensor(data=data, datatype=datatype, shape=shape), None)


def test_nesting_up_to_the_limit_is_accepted():
    depth = MAX_JSON_DEPTH - 4  # {"inputs": [{"data": ...}]} uses the first levels
    data = 1.0
    for _ in range(depth):
        data = [data]
    parse_infer_request(tensor(data=data, shape=[1] * depth), None)


def _row_major(data) -> list:
    """The order Triton reads nested data in, written the obvious (recursive) way."""
    return [leaf for item in data for leaf in (_row_major(item) if isinstance(item, list) else [item])]


def test_nested_data_is_read_in_row_major_order():
    rng = random.Random(29)

    def nested(depth: int, arrays: float, width: int):
        if depth == 0 or rng.random() > arrays:
            return rng.randrange(100)
        return [nested(depth - 1, arrays, width) for _ in range(rng.randrange(width))]

    for arrays, width in ((0.9, 3), (0.5, 6), (0.2, 20), (0.05, 40)):
        for _ in range(60):
            data = [nested(6, arrays, width) for _ in range(rng.randrange(width))]
            assert flat_row_major(data) == _row_major(data), data
    deep = list(range(1000)) + [[[[1000, [1001]], 1002]]] + [[1003, 1004]] * 3
    assert flat_row_major(deep) == list(range(1003)) + [1003, 1004] * 3


def test_brackets_inside_strings_do_not_count_as_nesting():
    text = "[" * 500 + '\\"' + "{" * 500
    parse_infer_request(body(id=text), None)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("raw, header_length, words", [
    (body(), "abc", "Unable to parse Inference-Header-Content-Length, got: 'abc'"),
    (body(), "-1", "Unable to parse Inference-Header-Content-Length"),
    (body(), "1e3", "Unable to parse Inference-Header-Content-Length"),
    (body(), "\u0663", "Unable to parse Inference-Header-Content-Length"),
    (body(), "100000", "inference header size should be in range"),
    (b"", None, "request body is empty"),
    (b"  ", None, "request body is empty"),
    (b"[1]", None, "must be a JSON object, got an array"),
    (b'"x"', None, "must be a JSON object"),
    (b"null", None, "must be a JSON object, got null"),
    (b"5", None, "must be a JSON object, got number 5"),
    (b"1e400", None, "too big to be stored in a double"),
    (b"{not json", None, "not valid JSON"),
    (body().decode().encode("utf-16"), None, "not valid UTF-8"),
    (b"\xef\xbb\xbf" + body(), None, "not valid JSON"),  # a BOM: rapidjson refuses it too
    (b"[" * 100000 + b"]" * 100000, None, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (b'{"a":' * 70 + b"1" + b"}" * 70, None, "nested deeper"),
    (b'{"inputs": [], "inputs": []}', None, "duplicate key 'inputs'"),
    (b'{"inputs": [{"name": "A", "name": "B"}]}', None, "duplicate key 'name'"),
    (b'{"inputs": [], "x": NaN}', None, "NaN is not a JSON number"),
    (b'{"inputs": [], "x": -Infinity}', None, "-Infinity is not a JSON number"),
    (b'{"inputs": [], "x": 1e400}', None, "too big to be stored in a double"),
    (b'{"inputs": [], "x": ' + b"9" * 400 + b"}", None, "too big to be stored in a double"),
    (b'{"inputs": [], "x": "\\ud800"}', None, "unpaired UTF-16 surrogate"),
    (b'{"inputs": [], "x": "\\udc00\\ud800"}', None, "unpaired UTF-16 surrogate"),
    (b"{}", None, "Unable to parse 'inputs': the request has no 'inputs' array"),
    (b'{"inputs": {}}', None, "Unable to parse 'inputs': expected an array, got an object"),
    (b'{"inputs": [null]}', None, "input 0 must be a JSON object, got null"),
    (body(id=5), None, "Unable to parse 'id': expected a string, got number 5"),
    (body(parameters=[]), None, "Unable to parse 'parameters': expected a JSON object"),
    (body(parameters={"priority": -1}), None, "Unable to parse 'priority'"),
    (body(parameters={"timeout": "5"}), None, "Unable to parse 'timeout'"),
    (body(parameters={"sequence_id": 1.5}), None, "Unable to parse 'sequence_id'"),
    (body(parameters={"sequence_end": 1}), None, "Unable to parse 'sequence_end'"),
    (body(parameters={"binary_data_output": "yes"}), None, "Unable to parse 'binary_data_output'"),
    (body(parameters={"triton_enable_empty_final_response": True}), None, "reserved for Triton"),
    (body(parameters={"x": [1]}), None, "parameter 'x' has invalid type"),
    (body(parameters={"x": 2**63}), None, "parameter 'x' has invalid type"),
    (body(parameters={"adapter": 5}), None, "parameter 'adapter' must be a string"),
    (body(outputs={}), None, "Unable to parse 'outputs': expected an array"),
    (body(outputs=[5]), None, "output 0 must be a JSON object"),
    (body(outputs=[{}]), None, "Unable to parse 'name' of output 0: expected a string, got nothing"),
    (body(outputs=[{"name": "S", "parameters": []}]), None, "Unable to parse 'parameters' of output 'S'"),
    (body(outputs=[{"name": "S", "parameters": {"binary_data": 1}}]), None, "Unable to parse 'binary_data'"),
    (body(outputs=[{"name": "S", "parameters": {"classification": -1}}]), None,
     "Unable to set 'classification'"),
])
def test_malformed_requests_are_refused_with_the_reason(raw, header_length, words):
    assert words in refused(raw, header_length)


@pytest.mark.parametrize("fields, words", [
    ({"name": 5}, "Unable to parse 'name' of input 0: expected a string, got number 5"),
    ({"name": None}, "Unable to parse 'name' of input 0"),
    ({"datatype": None}, "Unable to parse 'datatype' of input 'FEATURES'"),
    ({"datatype": "FLOAT"}, "invalid datatype for input 'FEATURES': 'FLOAT'; expected one of BOOL"),
    ({"shape": "2,2"}, ("Unable to parse 'shape' of input 'FEATURES': expected an array of non-negative "
                       "integers, got string '2,2'")),
    ({"shape": [2, -2]}, "got [2, -2]"),
    ({"shape": [2, 2.0]}, "Unable to parse 'shape'"),
    ({"shape": [True, 4]}, "Unable to parse 'shape'"),
    ({"shape": [2**63, 1]}, "Unable to parse 'shape'"),
    ({"shape": [2**31, 2**31], "data": []}, "holds more data than any request can carry"),
    ({"data": [1, 2, 3]}, ("Shape does not match true shape of 'data' field (input 'FEATURES' has shape "
                          "[2, 2], 4 elements, but 'data' holds 3)")),
    ({"data": [[1, 2], [3, 4], [5]]}, "Shape does not match true shape of 'data' field"),
    ({"data": "1234"}, "Unable to parse 'data' of input 'FEATURES': expected an array"),
    ({"data": [1, 2, "3", 4]}, "FP32, but 'data' holds string '3'"),
    ({"data": [1, 2, None, 4]}, "FP32, but 'data' holds null"),
    ({"data": [1, 2, True, 4]}, "FP32, but 'data' holds boolean true"),
    ({"data": [1, 2, {}, 4]}, "FP32, but 'data' holds an object"),
    ({"data": [1, 2, 3, 4e38]}, "out of range for FP32"),
    ({"data": [1, 2, 3, 10**40]}, "out of range for FP32"),
    ({"datatype": "INT8", "data": [1, 2, 3, 300]}, "value 300 of input 'FEATURES' is out of range for INT8"),
    ({"datatype": "UINT8", "data": [1, 2, 3, -1]}, "value -1 of input 'FEATURES' is out of range for UINT8"),
    ({"datatype": "INT64", "data": [1, 2, 3, 2**63]}, "out of range for INT64"),
    ({"datatype": "INT32", "data": [1, 2, 3, 4.5]}, "INT32, but 'data' holds number 4.5"),
    ({"datatype": "BOOL", "data": [1, 0, 1, 0]}, "BOOL, but 'data' holds number 1"),
    ({"datatype": "BYTES", "data": [1, 2, 3, 4]}, "BYTES, but 'data' holds number 1"),
    ({"datatype": "FP16"}, "receiving FP16 data via JSON is not supported"),
    ({"parameters": []}, "Unable to parse 'parameters' of input 'FEATURES'"),
    ({"parameters": {"binary_data_size": "16"}}, "Unable to parse 'binary_data_size' of input 'FEATURES'"),
    ({"parameters": {"binary_data_size": 16}}, "set 'data' 'binary_data_size'"),
    ({"parameters": {"shared_memory_region": 5}}, "Unable to parse 'shared_memory_region'"),
])
def test_malformed_inputs_are_refused_with_the_reason(fields, words):
    assert words in refused(tensor(**fields))


def test_an_input_needs_exactly_one_data_source():
    raw = json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32"}]}).encode()
    assert "Input must set only one of the following fields" in refused(raw)
    assert "But no field is set" in refused(raw)


def _binary_request(sizes: list[int], tail: bytes) -> tuple[bytes, str]:
    header = json.dumps({"inputs": [{"name": f"X{i}", "shape": [size // 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": size}}
                                    for i, size in enumerate(sizes)]}).encode()
    return header + tail, str(len(header))


def test_binary_sizes_must_add_up_to_the_bytes_after_the_header():
    parse_infer_request(*_binary_request([8, 4], b"\0" * 12))
    assert "add up to 12 bytes, but the body has the 11 bytes" in refused(*_binary_request([8, 4], b"\0" * 11))
    assert "add up to 8 bytes" in refused(*_binary_request([8], b"\0" * 9))
    raw, _ = _binary_request([8], b"")
    assert "send Inference-Header-Content-Length with binary data" in refused(raw)
    plain = tensor()
    assert "no input has 'binary_data_size'" in refused(plain + b"\0\0", str(len(plain)))


def test_header_length_is_a_byte_count_within_the_body():
    assert parse_header_length(None, 10) is None
    assert parse_header_length("10", 10) == 10
    assert parse_header_length(" 7 ", 10) == 7
    with pytest.raises(InvalidRequest, match=r"should be in range \(0, 10\), got: 11"):
        parse_header_length("11", 10)


def test_deep_nesting_is_refused_without_recursion():
    """The scan refuses nesting before the parser could recurse: no RecursionError even
    for nesting far past Python's recursion limit."""
    for raw in (b"[" * 1_000_000, b'{"a":' * 200_000, b'{"inputs":' + b"[" * 65 + b"]" * 65 + b"}"):
        assert "nested deeper" in refused(raw)


# ---------------------------------------------------------------------------- adapters
def test_with_adapter_sets_the_parameter_and_keeps_binary_tensors():
    raw, length = _binary_request([8], b"\1" * 8)
    request = parse_infer_request(raw, length)
    new_body, new_length = with_adapter(request, "acme", "tinylm:acme")
    header = json.loads(new_body[:new_length])
    assert header["parameters"] == {"adapter": "acme"} and new_body[new_length:] == b"\1" * 8
    assert request.doc.get("parameters") is None  # the checked request is left as it was


def test_with_adapter_refuses_a_contradicting_parameter_and_raw_requests():
    request = parse_infer_request(body(parameters={"adapter": "other"}), None)
    with pytest.raises(InvalidRequest, match="selects adapter 'acme' but the request parameter adapter is 'other'"):
        with_adapter(request, "acme", "tinylm:acme")
    new_body, new_length = with_adapter(parse_infer_request(body(parameters={"adapter": "acme"}), None),
                                        "acme", "tinylm:acme")
    assert new_length is None and json.loads(new_body)["parameters"]["adapter"] == "acme"
    with pytest.raises(InvalidRequest, match="raw binary request"):
        with_adapter(parse_infer_request(b"\0" * 4, "0"), "acme", "tinylm:acme")


# ---------------------------------------------------------------------------- compression
def test_gzip_and_deflate_bodies_are_decoded():
    raw = body()
    assert decode_body(gzip.compress(raw), "gzip", 1 << 20) == raw
    assert decode_body(gzip.compress(raw[:10]) + gzip.compress(raw[10:]), "gzip", 1 << 20) == raw
    assert decode_body(zlib.compress(raw), "deflate", 1 << 20) == raw
    raw_deflate = zlib.compressobj(wbits=-15)
    assert decode_body(raw_deflate.compress(raw) + raw_deflate.flush(), "deflate", 1 << 20) == raw
    assert decode_body(raw, "", 1) == raw


@pytest.mark.parametrize("encoded, encoding, words", [
    (gzip.compress(b"x" * 1000, mtime=0)[:20], "gzip", "ends inside its gzip stream"),
    (zlib.compress(b"x" * 1000)[:10], "deflate", "ends inside its deflate stream"),
    (b"not compressed at all", "gzip", "not valid gzip data"),
    (zlib.compress(b"x") + b"tail", "deflate", "4 bytes after its deflate stream"),
])
def test_broken_compressed_bodies_are_refused(encoded, encoding, words):
    with pytest.raises(InvalidRequest, match=words):
        decode_body(encoded, encoding, 1 << 20)


def test_a_compressed_body_may_not_inflate_past_the_limit():
    bomb = gzip.compress(b"\0" * (4 << 20))
    with pytest.raises(PayloadTooLarge, match="inflates past the router's limit of 1048576 bytes"):
        decode_body(bomb, "gzip", 1 << 20)


def test_gzip_members_after_one_another_are_decoded_up_to_a_limit():
    raw = os.urandom(300_000)  # members longer than the slices the decompressor is fed
    pieces = [raw[i:i + 7_000] for i in range(0, 7_000 * (MAX_GZIP_MEMBERS - 1), 7_000)]
    pieces.append(raw[len(b"".join(pieces)):])
    assert len(pieces) == MAX_GZIP_MEMBERS
    assert decode_body(b"".join(map(gzip.compress, pieces)), "gzip", 1 << 20) == raw
    with pytest.raises(InvalidRequest, match=f"more than {MAX_GZIP_MEMBERS} members .*one gzip stream"):
        decode_body(gzip.compress(b"") * (MAX_GZIP_MEMBERS + 1), "gzip", 1 << 20)


def test_the_inflate_limit_counts_every_member():
    member = gzip.compress(b"\0" * (300 << 10))
    assert len(decode_body(member * 3, "gzip", 1 << 20)) == 900 << 10
    with pytest.raises(PayloadTooLarge, match="inflates past the router's limit of 1048576 bytes"):
        decode_body(member * 4, "gzip", 1 << 20)


@pytest.mark.parametrize("value, expected", [(None, ""), ("identity", ""), ("GZIP", "gzip"),
                                             (" deflate ", "deflate")])
def test_content_encodings(value, expected):
    assert http_request.content_encoding(value) == expected


@pytest.mark.parametrize("value", ["br", "compress", "gzip, gzip", "x"])
def test_unsupported_content_encodings_are_refused(value):
    with pytest.raises(InvalidRequest, match="Unsupported compression type"):
        http_request.content_encoding(value)


# ---------------------------------------------------------------------------- off the loop
def _parsed_on(raw: bytes, encoding: str | None = None) -> str:
    seen = []
    real = http_request.parse_infer_request

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    http_request.parse_infer_request = spy
    try:
        asyncio.run(read_infer_request(raw, encoding, None, 1 << 30))
    finally:
        http_request.parse_infer_request = real
    return "loop" if seen == [threading.main_thread().name] else "thread"


def test_large_or_compressed_bodies_are_parsed_off_the_event_loop():
    small = body()
    large = tensor(shape=[1, 100_000], data=[0.25] * 100_000)
    assert len(large) > http_request.PARSE_IN_THREAD_BYTES
    assert _parsed_on(small) == "loop"
    assert _parsed_on(large) == "thread"
    assert _parsed_on(gzip.compress(small), "gzip") == "thread"
