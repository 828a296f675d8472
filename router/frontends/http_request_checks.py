"""The checks of a KServe v2 JSON inference request's header, before Triton sees it: the
request's id and parameters, each input's name, datatype, shape, parameters and data (count
and value ranges), the binary data sizes against the bytes that follow the header, and the
outputs.  Messages use Triton's wording where Triton has one ("Unable to parse 'shape'",
...) and say what to send instead.  Pure: a parsed document in, ``InvalidRequest`` out."""

from __future__ import annotations

from itertools import chain
from typing import Any

from domain.router_errors import InvalidRequest
from router.frontends.strict_json import DOUBLE_MAX

HEADER_LENGTH = "Inference-Header-Content-Length"
_INT64 = (-(2**63), 2**63 - 1)
_UINT64_MAX = 2**64 - 1

INT_RANGES = {
    "INT8": (-(2**7), 2**7 - 1), "INT16": (-(2**15), 2**15 - 1), "INT32": (-(2**31), 2**31 - 1),
    "INT64": _INT64, "UINT8": (0, 2**8 - 1), "UINT16": (0, 2**16 - 1), "UINT32": (0, 2**32 - 1),
    "UINT64": (0, _UINT64_MAX),
}
FLOAT_MAX = {"FP32": 3.4028234663852886e38, "FP64": DOUBLE_MAX}
ITEM_BYTES = {"BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2, "BF16": 2,
              "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8, "FP64": 8}
DATATYPES = (*ITEM_BYTES, "BYTES")
# Request parameters Triton reads itself, with the JSON type it requires.
_TRITON_PARAMETERS = {"sequence_start": "bool", "sequence_end": "bool", "priority": "uint",
                      "timeout": "uint", "binary_data_output": "bool"}


def json_kind(value: Any) -> str:
    """How a message names a JSON value the request holds (type, and a short excerpt)."""
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


def check_request(doc: dict, binary_bytes: int) -> dict:
    """Check the whole JSON header; returns the request parameters (a dict)."""
    if "id" in doc and not isinstance(doc["id"], str):
        raise InvalidRequest(f"Unable to parse 'id': expected a string, got {json_kind(doc['id'])}")
    parameters = _check_parameters(doc.get("parameters", {}))
    if "inputs" not in doc:
        raise InvalidRequest("Unable to parse 'inputs': the request has no 'inputs' array")
    inputs = doc["inputs"]
    if not isinstance(inputs, list):
        raise InvalidRequest(f"Unable to parse 'inputs': expected an array, got {json_kind(inputs)}")
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
        raise InvalidRequest(f"Unable to parse 'parameters': expected a JSON object, got {json_kind(params)}")
    for key, value in params.items():
        if key.startswith("triton_"):
            raise InvalidRequest("parameter keys starting with 'triton_' are reserved for Triton usage "
                                 f"and should not be specified (got {key!r})")
        want = _TRITON_PARAMETERS.get(key)
        if key == "sequence_id":
            if not (isinstance(value, str) or _is_uint(value)):
                raise InvalidRequest(f"Unable to parse 'sequence_id': expected an unsigned integer or a "
                                     f"string, got {json_kind(value)}")
        elif want == "bool":
            if type(value) is not bool:
                raise InvalidRequest(f"Unable to parse '{key}': expected true or false, got {json_kind(value)}")
        elif want == "uint":
            if not _is_uint(value):
                raise InvalidRequest(f"Unable to parse '{key}': expected an unsigned integer, "
                                     f"got {json_kind(value)}")
        elif key == "adapter":
            if not isinstance(value, str):
                raise InvalidRequest(f"parameter 'adapter' must be a string naming a LoRA adapter, "
                                     f"got {json_kind(value)}")
        elif not (isinstance(value, str) or type(value) is bool or type(value) is float
                  or (type(value) is int and _INT64[0] <= value <= _INT64[1])):
            # A float is Triton's double parameter (gRPC double_param), passed on to the model.
            raise InvalidRequest(f"parameter {key!r} has invalid type. It should be either 'int', "
                                 f"'bool', or 'string' (got {json_kind(value)})")
    return params


def _check_tensor_parameters(what: str, params: Any, output: bool) -> None:
    if not isinstance(params, dict):
        raise InvalidRequest(f"Unable to parse 'parameters' of {what}: expected a JSON object, "
                             f"got {json_kind(params)}")
    for key in ("shared_memory_offset", "shared_memory_byte_size") + (
            ("classification",) if output else ("binary_data_size",)):
        if key in params and not _is_uint(params[key]):
            verb = "set" if key == "classification" else "parse"
            raise InvalidRequest(f"Unable to {verb} '{key}' of {what}: expected an unsigned integer, "
                                 f"got {json_kind(params[key])}")
    if "shared_memory_region" in params and not isinstance(params["shared_memory_region"], str):
        raise InvalidRequest(f"Unable to parse 'shared_memory_region' of {what}: expected a string, "
                             f"got {json_kind(params['shared_memory_region'])}")
    if output and "binary_data" in params and type(params["binary_data"]) is not bool:
        raise InvalidRequest(f"Unable to parse 'binary_data' of {what}: expected true or false, "
                             f"got {json_kind(params['binary_data'])}")


def _tensor_name(kind: str, index: int, tensor: Any) -> str:
    """The name of input or output (``kind``) number ``index``; refuses a tensor that is not a
    JSON object or has no string name."""
    if not isinstance(tensor, dict):
        raise InvalidRequest(f"Unable to parse '{kind}s': {kind} {index} must be a JSON object, "
                             f"got {json_kind(tensor)}")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(f"Unable to parse 'name' of {kind} {index}: expected a string, "
                             f"got {json_kind(name) if 'name' in tensor else 'nothing'}")
    return name


def shape_text(shape: list) -> str:
    """A shape for an error message: its first 8 dimensions (an answer is never larger than
    the request that a long shape came in)."""
    text = "[" + ", ".join(map(str, shape[:8])) + (", ..." if len(shape) > 8 else "") + "]"
    return text[:200]


def _elements(shape: list[int], item_bytes: int) -> int | None:
    """The element count of ``shape``, or None when its bytes overflow int64, as Triton counts
    them (a shape that overflows is refused before Triton sees it).  Multiplied one dimension
    at a time and stopped at the overflow: ``math.prod`` of a long shape of huge dimensions
    builds a number of millions of digits first, in one call that holds the GIL (minutes of
    a worker's CPU for one request)."""
    if 0 in shape:
        return 0
    elements = 1
    for dim in shape:
        elements *= dim
        if elements * item_bytes > _INT64[1]:
            return None
    return elements


def _check_input(index: int, tensor: Any) -> int:
    """Check one input; returns its binary_data_size (0 when its data is not binary)."""
    what = f"input {_tensor_name('input', index, tensor)!r}"
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidRequest(f"Unable to parse 'datatype' of {what}: expected a string, "
                             f"got {json_kind(datatype) if 'datatype' in tensor else 'nothing'}")
    if datatype not in DATATYPES:
        raise InvalidRequest(f"invalid datatype for {what}: {datatype[:40]!r}; expected one of "
                             + ", ".join(DATATYPES))
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(_is_uint(d, _INT64[1]) for d in shape):
        got = shape_text(shape) if isinstance(shape, list) else (
            json_kind(shape) if "shape" in tensor else "nothing")
        raise InvalidRequest(f"Unable to parse 'shape' of {what}: expected an array of non-negative "
                             f"integers, got {got}")
    elements = _elements(shape, ITEM_BYTES.get(datatype, 1))
    if elements is None:
        raise InvalidRequest(f"Unable to parse 'shape' of {what}: {shape_text(shape)} holds more "
                             "data than any request can carry")
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


def flat_row_major(data: list) -> list:
    """Nested JSON arrays in row-major order, as Triton reads them (any nesting, ragged too:
    only the element count is checked against the shape).

    One walk with an explicit stack (no recursion, so no depth limit to hit) that puts each
    element in the result once: the work is linear in the body's bytes however deep the
    nesting (flattening level by level copied every finished element again at each level).
    Runs of plain values and arrays of arrays are copied by C loops, not element by element."""
    kinds = list(map(type, data))
    arrays = kinds.count(list)
    if not arrays:
        return data  # already flat: the common case, nothing to copy
    flat: list = []
    # Arrays still to walk, the next on top: (array, its elements' types, how many of them
    # are arrays, where to go on: -1 before the array is looked at as a whole).
    todo: list[tuple[list, list, int, int]] = [(data, kinds, arrays, -1)]
    while todo:
        items, kinds, arrays, start = todo.pop()
        if start < 0:
            if not arrays:
                flat.extend(items)
                continue
            merged = _one_level(items, arrays)
            if merged is not None:
                kinds = list(map(type, merged))
                todo.append((merged, kinds, kinds.count(list), -1))
                continue
            start = 0
        try:
            nested = kinds.index(list, start)
        except ValueError:
            flat.extend(items[start:])
            continue
        flat.extend(items[start:nested])
        todo.append((items, kinds, arrays, nested + 1))
        child = items[nested]
        child_kinds = list(map(type, child))
        todo.append((child, child_kinds, child_kinds.count(list), -1))
    return flat


def _one_level(items: list, arrays: int) -> list | None:
    """``items`` with its ``arrays`` arrays opened one level, when that costs less than
    walking to each of them (None otherwise).  Each array is opened once, and at most 8
    other elements are copied per array opened: the walk stays linear."""
    if arrays == len(items):
        return list(chain.from_iterable(items))  # an array of arrays: a C loop
    if arrays * 8 < len(items):
        return None
    merged: list = []
    for item in items:
        if type(item) is list:
            merged.extend(item)
        else:
            merged.append(item)
    return merged


def _check_data(what: str, datatype: str, shape: list[int], elements: int, data: Any) -> None:
    if datatype in ("FP16", "BF16"):
        raise InvalidRequest(f"receiving {datatype} data via JSON is not supported. Please use the "
                             f"binary data format for {what}")
    if not isinstance(data, list):
        raise InvalidRequest(f"Unable to parse 'data' of {what}: expected an array, got {json_kind(data)}")
    flat = flat_row_major(data)
    types = set(map(type, flat))
    if len(flat) != elements:
        raise InvalidRequest(
            f"Unable to parse 'data': Shape does not match true shape of 'data' field ({what} has "
            f"shape {shape_text(shape)}, {elements} elements, but 'data' holds {len(flat)})")
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
                             f"{json_kind(odd)}")
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
        raise InvalidRequest(f"Unable to parse 'outputs': expected an array, got {json_kind(outputs)}")
    for index, output in enumerate(outputs):
        name = _tensor_name("output", index, output)
        _check_tensor_parameters(f"output {name!r}", output.get("parameters", {}), output=True)
