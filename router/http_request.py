"""Parse and check one KServe v2 HTTP inference request before it is forwarded to Triton.

Why the router checks what Triton checks again: Triton's HTTP front end answers most
malformed JSON requests with HTTP 500 (its JSON accessors report INTERNAL errors), and a
``shape`` whose element count disagrees with ``data`` makes it allocate the shape's size
before reading the data, which aborts the whole server (std::bad_alloc, std::length_error).
So every request is refused here with a 400 and a message that says what is wrong, using
Triton's wording where Triton has one ("Unable to parse 'shape'", ...).

What is forwarded is exactly what was checked: the body is parsed as Triton's parser
(rapidjson) would read it, so no request means one thing here and another there.
Duplicate keys are refused (Python keeps the last, rapidjson the first), as are NaN and
Infinity literals, numbers beyond a double, lone UTF-16 surrogates and text that is not
UTF-8.  JSON nested deeper than ``MAX_JSON_DEPTH`` is refused by a scan before parsing,
so no parser recursion limit is ever reached.

Everything here is pure (bytes and header values in, an ``InferRequest`` or
``InvalidRequest`` out) except ``read_infer_request``, which moves large or compressed
bodies off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from router.errors import InvalidRequest, PayloadTooLarge

HEADER_LENGTH = "Inference-Header-Content-Length"
# Levels of arrays/objects: a request needs 3 + the tensor's rank ({"inputs": [{"data": ...}]}).
MAX_JSON_DEPTH = 64
# Bodies larger than this are parsed in a worker thread, not on the serving event loop.
PARSE_IN_THREAD_BYTES = 256 * 1024
# rapidjson refuses numbers whose magnitude reaches this while parsing ("Number too big").
_DOUBLE_MAX = 1.7976931348623157e308
_INT64 = (-(2**63), 2**63 - 1)
_UINT64_MAX = 2**64 - 1

INT_RANGES = {
    "INT8": (-(2**7), 2**7 - 1), "INT16": (-(2**15), 2**15 - 1), "INT32": (-(2**31), 2**31 - 1),
    "INT64": _INT64, "UINT8": (0, 2**8 - 1), "UINT16": (0, 2**16 - 1), "UINT32": (0, 2**32 - 1),
    "UINT64": (0, _UINT64_MAX),
}
FLOAT_MAX = {"FP32": 3.4028234663852886e38, "FP64": _DOUBLE_MAX}
ITEM_BYTES = {"BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2, "BF16": 2,
              "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8, "FP64": 8}
DATATYPES = (*ITEM_BYTES, "BYTES")
# Request parameters Triton reads itself, with the JSON type it requires.
_TRITON_PARAMETERS = {"sequence_start": "bool", "sequence_end": "bool", "priority": "uint",
                      "timeout": "uint", "binary_data_output": "bool"}

# The depth scan: drop escapes, then strings, then everything but brackets.
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [0] * 256
for _b in b"[{":
    _DEPTH_STEP[_b] = 1
for _b in b"]}":
    _DEPTH_STEP[_b] = -1
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_NUMBER_TYPES = frozenset({int, float})
_CONTAINER_TYPES = frozenset({list, dict})


class _Refused(ValueError):
    """Raised from inside json.loads hooks; carries the client-facing message."""


@dataclass(frozen=True)
class InferRequest:
    """A checked request: its JSON header and the body to forward.

    ``header_length`` is the Inference-Header-Content-Length to send: None when the whole
    body is JSON, 0 for Triton's raw binary request (the body is the model's one input)."""

    doc: dict
    body: bytes
    header_length: int | None = None
    parameters: dict = field(default_factory=dict)

    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.doc.get("inputs", ())]


# ---------------------------------------------------------------------------- entry points
def content_encoding(value: str | None) -> str:
    """The body's Content-Encoding: "" (none), "gzip" or "deflate", as Triton accepts."""
    encoding = (value or "").strip().lower()
    if encoding in ("", "identity"):
        return ""
    if encoding in ("gzip", "deflate"):
        return encoding
    raise InvalidRequest(f"Unsupported compression type {value!r}: send the body uncompressed or "
                         "with Content-Encoding gzip or deflate")


def decode_body(body: bytes, encoding: str, limit_bytes: int) -> bytes:
    """The body decompressed, refused when it is not whole or inflates past ``limit_bytes``.

    The router decompresses itself (aiohttp's automatic decoding is off): a truncated
    deflate body made aiohttp's parser fail after the handler had started reading, which
    left the handler waiting for a body that never ended."""
    if not encoding:
        return body
    # deflate is the zlib format (RFC 9110); some clients send raw deflate, told apart by
    # the zlib header's compression-method nibble.
    wbits = 31 if encoding == "gzip" else (15 if body[:1] and body[0] & 0x0F == 8 else -15)
    parts: list[bytes] = []
    left = body
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            parts.append(inflater.decompress(left, limit_bytes + 1 - sum(map(len, parts))))
        except zlib.error as exc:
            raise InvalidRequest(f"request body is not valid {encoding} data ({exc}); compress the "
                                 "whole body, or send it uncompressed") from None
        if inflater.unconsumed_tail or sum(map(len, parts)) > limit_bytes:
            raise PayloadTooLarge(f"request body inflates past the router's limit of {limit_bytes} "
                                  "bytes; send smaller batches")
        if not inflater.eof:
            raise InvalidRequest(f"request body ends inside its {encoding} stream; send the whole body")
        left = inflater.unused_data
        if not left or encoding != "gzip":  # a gzip body may hold several members
            break
    if left:
        raise InvalidRequest(f"request body has {len(left)} bytes after its {encoding} stream")
    return b"".join(parts)


def parse_header_length(value: str | None, body_bytes: int) -> int | None:
    """Inference-Header-Content-Length as a number of bytes, checked against the body."""
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        raise InvalidRequest(f"Unable to parse {HEADER_LENGTH}, got: {value!r}; it must be the byte "
                             "size of the JSON header that starts the body")
    length = int(text)
    if length > body_bytes:
        raise InvalidRequest(f"inference header size should be in range (0, {body_bytes}), got: {text} "
                             f"({HEADER_LENGTH} is larger than the {body_bytes}-byte body)")
    return length


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """Check one inference request body; raises InvalidRequest saying what is wrong."""
    length = parse_header_length(header_length, len(body))
    if length == 0:
        # Triton's raw binary request: the whole body is the single input's bytes.
        return InferRequest({}, body, 0)
    header = body if length is None else body[:length]
    if not header.strip():
        raise InvalidRequest("request body is empty: send a KServe v2 JSON inference request "
                             '({"inputs": [...]})')
    doc = loads(header)
    if not isinstance(doc, dict):
        raise InvalidRequest(f"the inference request must be a JSON object, got {_kind(doc)}")
    parameters = _check_request(doc, len(body) - len(header))
    return InferRequest(doc, body, length, parameters)


async def read_infer_request(body: bytes, content_encoding_value: str | None,
                             header_length: str | None, limit_bytes: int) -> InferRequest:
    """Decode and check a request body read from the wire.

    A large or compressed body is decoded and parsed in a worker thread, so that megabytes
    of JSON do not hold up every other request on the event loop."""
    encoding = content_encoding(content_encoding_value)
    if encoding or len(body) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(_decode_and_parse, body, encoding, header_length, limit_bytes)
    return parse_infer_request(body, header_length)


def _decode_and_parse(body: bytes, encoding: str, header_length: str | None,
                      limit_bytes: int) -> InferRequest:
    return parse_infer_request(decode_body(body, encoding, limit_bytes), header_length)


def with_adapter(request: InferRequest, adapter: str, logical: str) -> tuple[bytes, int | None]:
    """The body with ``parameters.adapter`` set for a ``base:adapter`` model name, and its
    header length: the JSON header is re-serialized, binary tensors after it are kept."""
    if request.header_length == 0:
        raise InvalidRequest(f"model name {logical!r} selects an adapter, which a raw binary request "
                             f"({HEADER_LENGTH}: 0) cannot carry; send a JSON header")
    given = request.parameters.get("adapter")
    if given not in (None, "", adapter):
        raise InvalidRequest(
            f"model name {logical!r} selects adapter {adapter!r} but the request "
            f"parameter adapter is {given!r}; send one of them")
    doc = dict(request.doc, parameters=dict(request.parameters, adapter=adapter))
    header = json.dumps(doc, separators=(",", ":")).encode()
    if request.header_length is None:
        return header, None
    return header + request.body[request.header_length:], len(header)


# ---------------------------------------------------------------------------- JSON text
def loads(text: bytes) -> Any:
    """JSON as rapidjson (Triton) reads it, or InvalidRequest for what the two would read
    differently or what Triton cannot read."""
    if _too_deep(text):
        raise InvalidRequest(f"request JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request JSON is not valid UTF-8 (byte {exc.start}): send UTF-8 text") from None
    try:
        doc = json.loads(decoded, object_pairs_hook=_object, parse_constant=_constant)
    except _Refused as exc:
        raise InvalidRequest(str(exc)) from None
    except RecursionError:  # only if the depth scan was fooled by malformed text
        raise InvalidRequest(f"request JSON is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    _check_numbers(doc)
    if _ESCAPED_SURROGATE.search(text) is not None:
        _check_surrogates(doc)
    return doc


def _too_deep(text: bytes) -> bool:
    if text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH:
        return False  # the common case: too few brackets to nest that deep
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", text)).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > MAX_JSON_DEPTH


def _object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {key!r} in a JSON object of the request: send each "
                               "key once")
            seen.add(key)
    return obj


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number: send finite numbers")


def _check_numbers(doc: Any) -> None:
    """rapidjson refuses a number beyond a double ("Number too big"), where Python reads
    an infinite float or a big int.  Checked list by list with C-speed builtins: the
    tensors' data arrays are most of a large body."""
    stack = [doc if type(doc) in _CONTAINER_TYPES else [doc]]
    while stack:
        container = stack.pop()
        values = container.values() if type(container) is dict else container
        kinds = set(map(type, values))
        if kinds & _NUMBER_TYPES:
            numbers = values if kinds <= _NUMBER_TYPES else [v for v in values if type(v) in _NUMBER_TYPES]
            largest = max(map(abs, numbers))
            if largest > _DOUBLE_MAX:
                shown = "an infinite value" if largest == math.inf else f"{str(largest)[:20]}..."
                raise InvalidRequest(f"request JSON has a number too big to be stored in a double "
                                     f"({shown}); send numbers within +-{_DOUBLE_MAX:g}")
        if kinds & _CONTAINER_TYPES:
            stack += [v for v in values if type(v) in _CONTAINER_TYPES]


def _check_surrogates(doc: Any) -> None:
    """rapidjson refuses a lone UTF-16 surrogate escape (\\ud800); Python decodes it."""
    try:
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("request JSON has a string with an unpaired UTF-16 surrogate escape "
                             "(\\uD800-\\uDFFF); send valid Unicode") from None


# ---------------------------------------------------------------------------- the request
def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return f"number {value!r}"[:60]
    if isinstance(value, str):
        return f"string {value[:40]!r}"
    return {list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _is_uint(value: Any, top: int = _UINT64_MAX) -> bool:
    return type(value) is int and 0 <= value <= top


def _check_request(doc: dict, binary_bytes: int) -> dict:
    """Check the whole JSON header; returns the request parameters (a dict)."""
    if "id" in doc and not isinstance(doc["id"], str):
        raise InvalidRequest(f"Unable to parse 'id': expected a string, got {_kind(doc['id'])}")
    parameters = _check_parameters(doc.get("parameters", {}))
    if "inputs" not in doc:
        raise InvalidRequest("Unable to parse 'inputs': the request has no 'inputs' array")
    inputs = doc["inputs"]
    if not isinstance(inputs, list):
        raise InvalidRequest(f"Unable to parse 'inputs': expected an array, got {_kind(inputs)}")
    binary_total = 0
    for index, tensor in enumerate(inputs):
        binary_total += _check_input(index, tensor)
    if binary_total != binary_bytes:
        if binary_bytes and not binary_total:
            raise InvalidRequest(
                f"{binary_bytes} bytes follow the JSON header but no input has 'binary_data_size' "
                f"in 'parameters'; set {HEADER_LENGTH} to the JSON header's byte size")
        where = (f"the {binary_bytes} bytes after the JSON header" if binary_bytes else
                 f"no bytes after the JSON header (send {HEADER_LENGTH} with binary data)")
        raise InvalidRequest(f"the inputs' 'binary_data_size' add up to {binary_total} bytes, but the "
                             f"body has {where}")
    if "outputs" in doc:
        _check_outputs(doc["outputs"])
    return parameters


def _check_parameters(params: Any) -> dict:
    if not isinstance(params, dict):
        raise InvalidRequest(f"Unable to parse 'parameters': expected a JSON object, got {_kind(params)}")
    for key, value in params.items():
        if key.startswith("triton_"):
            raise InvalidRequest("parameter keys starting with 'triton_' are reserved for Triton usage "
                                 f"and should not be specified (got {key!r})")
        want = _TRITON_PARAMETERS.get(key)
        if key == "sequence_id":
            if not (isinstance(value, str) or _is_uint(value)):
                raise InvalidRequest(f"Unable to parse 'sequence_id': expected an unsigned integer or a "
                                     f"string, got {_kind(value)}")
        elif want == "bool":
            if type(value) is not bool:
                raise InvalidRequest(f"Unable to parse '{key}': expected true or false, got {_kind(value)}")
        elif want == "uint":
            if not _is_uint(value):
                raise InvalidRequest(f"Unable to parse '{key}': expected an unsigned integer, "
                                     f"got {_kind(value)}")
        elif key == "adapter":
            if not isinstance(value, str):
                raise InvalidRequest(f"parameter 'adapter' must be a string naming a LoRA adapter, "
                                     f"got {_kind(value)}")
        elif not (isinstance(value, str) or type(value) is bool
                  or (type(value) is int and _INT64[0] <= value <= _INT64[1])):
            raise InvalidRequest(f"parameter {key!r} has invalid type. It should be either 'int', "
                                 f"'bool', or 'string' (got {_kind(value)})")
    return params


def _check_tensor_parameters(what: str, params: Any, output: bool) -> None:
    if not isinstance(params, dict):
        raise InvalidRequest(f"Unable to parse 'parameters' of {what}: expected a JSON object, "
                             f"got {_kind(params)}")
    for key in ("shared_memory_offset", "shared_memory_byte_size") + (
            ("classification",) if output else ("binary_data_size",)):
        if key in params and not _is_uint(params[key]):
            verb = "set" if key == "classification" else "parse"
            raise InvalidRequest(f"Unable to {verb} '{key}' of {what}: expected an unsigned integer, "
                                 f"got {_kind(params[key])}")
    if "shared_memory_region" in params and not isinstance(params["shared_memory_region"], str):
        raise InvalidRequest(f"Unable to parse 'shared_memory_region' of {what}: expected a string, "
                             f"got {_kind(params['shared_memory_region'])}")
    if output and "binary_data" in params and type(params["binary_data"]) is not bool:
        raise InvalidRequest(f"Unable to parse 'binary_data' of {what}: expected true or false, "
                             f"got {_kind(params['binary_data'])}")


def _tensor_name(kind: str, index: int, tensor: Any) -> str:
    """The name of input or output (``kind``) number ``index``; refuses a tensor that is not a
    JSON object or has no string name."""
    if not isinstance(tensor, dict):
        raise InvalidRequest(f"Unable to parse '{kind}s': {kind} {index} must be a JSON object, "
                             f"got {_kind(tensor)}")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(f"Unable to parse 'name' of {kind} {index}: expected a string, "
                             f"got {_kind(name) if 'name' in tensor else 'nothing'}")
    return name


def _check_input(index: int, tensor: Any) -> int:
    """Check one input; returns its binary_data_size (0 when its data is not binary)."""
    what = f"input {_tensor_name('input', index, tensor)!r}"
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidRequest(f"Unable to parse 'datatype' of {what}: expected a string, "
                             f"got {_kind(datatype) if 'datatype' in tensor else 'nothing'}")
    if datatype not in DATATYPES:
        raise InvalidRequest(f"invalid datatype for {what}: {datatype[:40]!r}; expected one of "
                             + ", ".join(DATATYPES))
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(_is_uint(d, _INT64[1]) for d in shape):
        got = _kind(shape) if "shape" in tensor else "nothing"
        if isinstance(shape, list):
            got = "[" + ", ".join(map(str, shape[:8])) + (", ..." if len(shape) > 8 else "") + "]"
        raise InvalidRequest(f"Unable to parse 'shape' of {what}: expected an array of non-negative "
                             f"integers, got {got[:200]}")
    elements = math.prod(shape)
    # Triton multiplies in int64: a shape that overflows it is refused before Triton sees it.
    if elements * ITEM_BYTES.get(datatype, 1) > _INT64[1]:
        raise InvalidRequest(f"Unable to parse 'shape' of {what}: {shape} holds more data than any "
                             "request can carry")
    params = tensor.get("parameters", {})
    _check_tensor_parameters(what, params, output=False)
    sources = [s for s, present in (("'data'", "data" in tensor),
                                    ("'binary_data_size'", "binary_data_size" in params),
                                    ("'shared_memory_region'", "shared_memory_region" in params))
               if present]
    if len(sources) != 1:
        raise InvalidRequest(
            "Input must set only one of the following fields: 'data', 'binary_data_size' in "
            "'parameters', 'shared_memory_region' in 'parameters'. But "
            + ("no field is set" if not sources else "set " + " ".join(sources)) + f" ({what})")
    if "data" in tensor:
        _check_data(what, datatype, shape, elements, tensor["data"])
    return params.get("binary_data_size", 0)


def _check_data(what: str, datatype: str, shape: list[int], elements: int, data: Any) -> None:
    if datatype in ("FP16", "BF16"):
        raise InvalidRequest(f"receiving {datatype} data via JSON is not supported. Please use the "
                             f"binary data format for {what}")
    if not isinstance(data, list):
        raise InvalidRequest(f"Unable to parse 'data' of {what}: expected an array, got {_kind(data)}")
    # Triton reads nested arrays in row-major order; flatten level by level (no recursion).
    flat = data
    types = set(map(type, flat))
    while list in types:
        nested: list = []
        for item in flat:
            if type(item) is list:
                nested.extend(item)
            else:
                nested.append(item)
        flat = nested
        types = set(map(type, flat))
    if len(flat) != elements:
        raise InvalidRequest(
            f"Unable to parse 'data': Shape does not match true shape of 'data' field ({what} has "
            f"shape {shape}, {elements} elements, but 'data' holds {len(flat)})")
    if not flat:
        return
    if datatype == "BOOL":
        allowed: set[type] = {bool}
    elif datatype == "BYTES":
        allowed = {str}
    elif datatype in INT_RANGES:
        allowed = {int}
    else:
        allowed = {int, float}
    if not types <= allowed:
        odd = next(v for v in flat if type(v) not in allowed)
        raise InvalidRequest(f"Unable to parse 'data': {what} is {datatype}, but 'data' holds "
                             f"{_kind(odd)}")
    if datatype in INT_RANGES:
        low, high = INT_RANGES[datatype]
        smallest, largest = min(flat), max(flat)
        if smallest < low or largest > high:
            odd = smallest if smallest < low else largest
            raise InvalidRequest(f"Unable to parse 'data': value {odd} of {what} is out of range for "
                                 f"{datatype} ({low}..{high})")
    elif datatype in FLOAT_MAX:
        largest = max(map(abs, flat))
        if largest > FLOAT_MAX[datatype]:
            raise InvalidRequest(f"Unable to parse 'data': value {largest!r} of {what} is out of range "
                                 f"for {datatype} (largest magnitude {FLOAT_MAX[datatype]:g})")


def _check_outputs(outputs: Any) -> None:
    if not isinstance(outputs, list):
        raise InvalidRequest(f"Unable to parse 'outputs': expected an array, got {_kind(outputs)}")
    for index, output in enumerate(outputs):
        name = _tensor_name("output", index, output)
        _check_tensor_parameters(f"output {name!r}", output.get("parameters", {}), output=True)
