"""Parse and check one KServe v2 HTTP inference request before it is forwarded to Triton.

Why the router checks what Triton checks again: Triton's HTTP front end answers most
malformed JSON requests with HTTP 500 (its JSON accessors report INTERNAL errors), and a
``shape`` whose element count disagrees with ``data`` makes it allocate the shape's size
before reading the data, which aborts the whole server (std::bad_alloc, std::length_error).
So every request is refused here with a 400 and a message that says what is wrong, using
Triton's wording where Triton has one ("Unable to parse 'shape'", ...).

What is forwarded is exactly what was checked: the body is parsed as Triton's parser
(rapidjson) would read it (``router.frontends.strict_json``), so no request means one thing here and
another there; the parsed header is then checked field by field
(``router.frontends.http_request_checks``).  This module decodes the body (Content-Encoding,
Inference-Header-Content-Length) and puts the two together.

Everything here is pure (bytes and header values in, an ``InferRequest`` or
``InvalidRequest`` out) except ``read_infer_request``, which moves large or compressed
bodies off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from dataclasses import dataclass, field

from domain.router_errors import InvalidRequest, PayloadTooLarge
from router.frontends.http_request_checks import (
    DATATYPES,
    FLOAT_MAX,
    HEADER_LENGTH,
    INT_RANGES,
    ITEM_BYTES,
    check_request,
    json_kind,
)
from router.frontends.strict_json import MAX_JSON_DEPTH, loads

# Names imported from here since before the JSON reading and the checks had modules of
# their own.
__all__ = [
    "DATATYPES",
    "FLOAT_MAX",
    "HEADER_LENGTH",
    "INT_RANGES",
    "ITEM_BYTES",
    "MAX_GZIP_MEMBERS",
    "MAX_JSON_DEPTH",
    "PARSE_IN_THREAD_BYTES",
    "InferRequest",
    "check_adapter",
    "content_encoding",
    "decode_body",
    "loads",
    "parse_header_length",
    "parse_infer_request",
    "read_infer_request",
    "with_adapter",
    "with_parameters",
]

# Bodies larger than this are parsed in a worker thread, not on the serving event loop.
PARSE_IN_THREAD_BYTES = 256 * 1024
# gzip streams one after another in one body: clients send one, concatenated files a few.
# Each member costs a decompressor, so their number is bounded, not only the bytes.
MAX_GZIP_MEMBERS = 64
# Compressed bytes fed to the decompressor at a time: a member's end copies what is left of
# the slice, never the rest of the body.
_INFLATE_SLICE_BYTES = 64 * 1024


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
    left the handler waiting for a body that never ended.

    The work is linear in the body's bytes: the input is fed in slices of a memoryview (a
    member's end copies at most one slice, as ``unused_data``), the output is counted as it
    comes out (no decompression bomb), and a gzip body may hold at most
    ``MAX_GZIP_MEMBERS`` members."""
    if not encoding:
        return body
    # deflate is the zlib format (RFC 9110); some clients send raw deflate, told apart by
    # the zlib header's compression-method nibble.
    wbits = 31 if encoding == "gzip" else (15 if body[:1] and body[0] & 0x0F == 8 else -15)
    view = memoryview(body)
    parts: list[bytes] = []
    produced = at = members = 0
    while True:
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise InvalidRequest(f"gzip request body has more than {MAX_GZIP_MEMBERS} members (gzip "
                                 "streams one after another); compress the whole body as one gzip "
                                 "stream, or send it uncompressed")
        inflater = zlib.decompressobj(wbits)
        while not inflater.eof and at < len(body):
            chunk = view[at:at + _INFLATE_SLICE_BYTES]
            at += len(chunk)
            try:
                # At most one byte past the limit comes out: enough to know it is past.
                out = inflater.decompress(chunk, limit_bytes + 1 - produced)
            except zlib.error as exc:
                raise InvalidRequest(f"request body is not valid {encoding} data ({exc}); compress "
                                     "the whole body, or send it uncompressed") from None
            produced += len(out)
            if produced > limit_bytes:
                raise PayloadTooLarge(f"request body inflates past the router's limit of {limit_bytes} "
                                      "bytes; send smaller batches")
            parts.append(out)
        if not inflater.eof:
            raise InvalidRequest(f"request body ends inside its {encoding} stream; send the whole body")
        at -= len(inflater.unused_data)  # where the next member (or trailing bytes) starts
        if at == len(body) or encoding != "gzip":  # a gzip body may hold several members
            break
    if at < len(body):
        raise InvalidRequest(f"request body has {len(body) - at} bytes after its {encoding} stream")
    return b"".join(parts)


def parse_header_length(value: str | None, body_bytes: int) -> int | None:
    """Inference-Header-Content-Length as a number of bytes, checked against the body."""
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        raise InvalidRequest(f"Unable to parse {HEADER_LENGTH}, got: {value[:40]!r}; it must be the "
                             "byte size of the JSON header that starts the body")
    # Leading zeros off before int(): a string of over 4,300 digits is a ValueError there.
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(body_bytes)) or int(digits) > body_bytes:
        shown = digits if len(digits) <= 40 else f"{digits[:40]}... ({len(digits)} digits)"
        raise InvalidRequest(f"inference header size should be in range (0, {body_bytes}), got: {shown} "
                             f"({HEADER_LENGTH} is larger than the {body_bytes}-byte body)")
    return int(digits)


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
        raise InvalidRequest(f"the inference request must be a JSON object, got {json_kind(doc)}")
    parameters = check_request(doc, len(body) - len(header))
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


def check_adapter(request: InferRequest, adapter: str, logical: str) -> None:
    """A ``base:adapter`` name needs a JSON header to carry the adapter, and a parameter
    ``adapter`` naming another one is a contradiction, not a choice."""
    if request.header_length == 0:
        raise InvalidRequest(f"model name {logical!r} selects an adapter, which a raw binary request "
                             f"({HEADER_LENGTH}: 0) cannot carry; send a JSON header")
    given = request.parameters.get("adapter")
    if given not in (None, "", adapter):
        raise InvalidRequest(
            f"model name {logical!r} selects adapter {adapter!r} but the request "
            f"parameter adapter is {given!r}; send one of them")


def with_adapter(request: InferRequest, adapter: str, logical: str) -> tuple[bytes, int | None]:
    """The body with ``parameters.adapter`` set for a ``base:adapter`` model name, and its
    header length: the JSON header is re-serialized, binary tensors after it are kept."""
    check_adapter(request, adapter, logical)
    return with_parameters(request, {"adapter": adapter})


def with_parameters(request: InferRequest, parameters: dict[str, str]) -> tuple[bytes, int | None]:
    """The body with ``parameters`` added to the JSON header's (replacing the client's), and
    its header length: the header is re-serialized, binary tensors after it are kept."""
    if request.header_length == 0:
        raise InvalidRequest(f"this model needs request parameters, which a raw binary request "
                             f"({HEADER_LENGTH}: 0) cannot carry; send a JSON header")
    doc = dict(request.doc, parameters=dict(request.parameters, **parameters))
    header = json.dumps(doc, separators=(",", ":")).encode()
    if request.header_length is None:
        return header, None
    return header + request.body[request.header_length:], len(header)
