"""How a Triton inference request names system shared memory: the parameters of its inputs
and outputs (``shared_memory_region``, ``_offset``, ``_byte_size``), found in a typed
request, an HTTP request's JSON, or serialized bytes without parsing their tensors."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
SHM_PARAMETERS = (REGION, OFFSET, BYTE_SIZE)
# The parameter's name as it appears in a serialized request that names a region.
REGION_MARK = REGION.encode()


def uses_shared_memory(request: service_pb2.ModelInferRequest) -> bool:
    return (any(REGION in t.parameters for t in request.inputs)
            or any(REGION in t.parameters for t in request.outputs))


def json_uses_shared_memory(doc: dict) -> bool:
    return any(REGION in (t.get("parameters") or {})
               for t in (*doc.get("inputs", ()), *doc.get("outputs", ())) if isinstance(t, dict))


_WHOLE_SEARCH_BYTES = 8192


def names_region(raw: bytes) -> bool:
    """Whether ``REGION_MARK`` is in the inputs or outputs (fields 5 and 6) of serialized
    request ``raw``: a walk over its top-level fields that skips the tensor contents
    (field 7), the bulk of a request.  Small or malformed bytes: a search of them all (in C,
    faster than the walk below a few kilobytes)."""
    pos, end = 0, len(raw)
    if end <= _WHOLE_SEARCH_BYTES:
        return REGION_MARK in raw
    try:
        while pos < end:
            tag, pos = _varint(raw, pos)
            wire = tag & 7
            if wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                length, pos = _varint(raw, pos)
                if tag >> 3 in (5, 6) and raw.find(REGION_MARK, pos, pos + length) != -1:
                    return True
                pos += length
            else:
                return REGION_MARK in raw
    except IndexError:
        return REGION_MARK in raw
    return False


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def grpc_place(params) -> tuple[str, int, int]:
    return (params[REGION].string_param,
            params[OFFSET].int64_param if OFFSET in params else 0,
            params[BYTE_SIZE].int64_param if BYTE_SIZE in params else 0)
