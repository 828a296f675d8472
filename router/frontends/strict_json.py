"""JSON as Triton's parser (rapidjson) reads it, refusing what the two would read
differently or what Triton cannot read: duplicate keys (Python keeps the last, rapidjson the
first), NaN and Infinity literals, numbers beyond a double, lone UTF-16 surrogates and text
that is not UTF-8.  JSON nested deeper than ``MAX_JSON_DEPTH`` is refused by a scan before
parsing, so no parser recursion limit is ever reached.  Pure: bytes in, a document or
``InvalidRequest`` out."""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from domain.router_errors import InvalidRequest

# Levels of arrays/objects: a request needs 3 + the tensor's rank ({"inputs": [{"data": ...}]}).
MAX_JSON_DEPTH = 64
# rapidjson refuses numbers whose magnitude reaches this while parsing ("Number too big").
DOUBLE_MAX = 1.7976931348623157e308

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
            if largest > DOUBLE_MAX:
                shown = "an infinite value" if largest == math.inf else f"{str(largest)[:20]}..."
                raise InvalidRequest(f"request JSON has a number too big to be stored in a double "
                                     f"({shown}); send numbers within +-{DOUBLE_MAX:g}")
        if kinds & _CONTAINER_TYPES:
            stack += [v for v in values if type(v) in _CONTAINER_TYPES]


def _check_surrogates(doc: Any) -> None:
    """rapidjson refuses a lone UTF-16 surrogate escape (\\ud800); Python decodes it."""
    try:
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("request JSON has a string with an unpaired UTF-16 surrogate escape "
                             "(\\uD800-\\uDFFF); send valid Unicode") from None
