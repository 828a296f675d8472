"""Triton's shared-memory endpoints of KServe v2 HTTP on the public port: system shared
memory for clients on the router's host, every call from a peer not on loopback refused
(``router.frontends.shared_memory``), CUDA shared memory refused as Triton refuses a handle it
cannot open, with what to use instead."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import grpc
from aiohttp import web

from domain.router_errors import InvalidRequest, PermissionDenied
from router.frontends.http_request_checks import json_kind
from router.frontends.shared_memory import SharedMemoryError, cuda_refusal, refuse_remote
from router.frontends.strict_json import loads

if TYPE_CHECKING:  # the assembly builds the router these ports serve
    from router.frontends.public_router import PublicRouter


def _json(doc) -> web.Response:
    return web.json_response(doc, dumps=lambda d: json.dumps(d, separators=(",", ":")))


def _check_register_body(doc) -> None:
    """Triton's body: {"key": ..., "offset": ..., "byte_size": ...}, in Triton's words."""
    if not isinstance(doc, dict):
        raise InvalidRequest(f"Shared memory register request must be a JSON object, got {json_kind(doc)}")
    for field, kind in (("key", str), ("offset", int), ("byte_size", int)):
        if field not in doc:
            if field == "offset":
                continue
            raise InvalidRequest(f"Shared memory register request has no '{field}' field")
        value = doc[field]
        if not isinstance(value, kind) or type(value) is bool or (kind is int and not 0 <= value <= UINT64_MAX):
            raise InvalidRequest(f"Unable to parse '{field}' of the shared memory register request: "
                                 f"expected {'a string' if kind is str else 'an unsigned integer'}, "
                                 f"got {json_kind(value)}")


UINT64_MAX = 2**64 - 1
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/]")


def _check_cuda_register_body(doc) -> None:
    """Triton's checks of {"raw_handle": {"b64": ...}, "byte_size": ..., "device_id": ...},
    in its order, codes and words (tritonserver 2.51, measured): what its JSON reader
    refuses is a 500, a missing handle or one that is not 64 bytes a 400."""
    def unreadable(message: str) -> SharedMemoryError:
        return SharedMemoryError(grpc.StatusCode.INTERNAL, message)

    if not isinstance(doc, dict) or "raw_handle" not in doc:
        raise InvalidRequest("Shared memory register request has no 'raw_handle' field")
    handle = doc["raw_handle"]
    if not isinstance(handle, dict) or "b64" not in handle:
        raise unreadable("attempt to access non-existing object member 'b64'")
    if not isinstance(handle["b64"], str):
        raise unreadable("attempt to access JSON non-string as string")
    for field in ("byte_size", "device_id"):
        if field not in doc:
            raise unreadable(f"attempt to access non-existing object member '{field}'")
        value = doc[field]
        if type(value) is not int or not 0 <= value <= UINT64_MAX:
            raise unreadable("attempt to access JSON non-unsigned-integer as unsigned-integer")
    # Triton's base64 decoder skips what is not of the alphabet ('=' included).
    chars = len(_NOT_BASE64.sub("", handle["b64"]))
    if chars // 4 * 3 + max(chars % 4 - 1, 0) != CUDA_IPC_HANDLE_BYTES:
        raise InvalidRequest("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")


def shared_memory_routes(router: PublicRouter) -> list[web.RouteDef]:
    memory = router.shared_memory

    def loopback_only(request: web.Request) -> None:
        try:
            refuse_remote(request.remote)
        except PermissionDenied:
            router.metrics.refused.labels("systemsharedmemory").inc()
            raise

    async def status(request: web.Request) -> web.Response:
        loopback_only(request)
        return _json([r.as_json() for r in memory.status(request.match_info.get("name", ""))])

    async def register(request: web.Request) -> web.Response:
        loopback_only(request)
        doc = loads(await request.read() or b"{}")
        _check_register_body(doc)
        memory.register(request.match_info["name"], doc["key"], doc.get("offset", 0), doc["byte_size"])
        return web.Response(status=200)

    async def unregister(request: web.Request) -> web.Response:
        loopback_only(request)
        memory.unregister(request.match_info.get("name", ""))
        return web.Response(status=200)

    async def cuda_status(request: web.Request) -> web.Response:
        name = request.match_info.get("name")
        if name:  # nothing is ever registered
            raise SharedMemoryError(grpc.StatusCode.NOT_FOUND,
                                    f"Unable to find cuda shared memory region: '{name}'")
        return _json([])

    async def cuda_register(request: web.Request) -> web.Response:
        router.metrics.refused.labels("cudasharedmemory").inc()
        _check_cuda_register_body(loads(await request.read() or b"{}"))
        raise cuda_refusal()

    async def nothing_registered(request: web.Request) -> web.Response:
        return web.Response(status=200)  # unregistering what was never registered

    system, cuda = "/v2/systemsharedmemory", "/v2/cudasharedmemory"
    return [
        web.get(f"{system}/status", status),
        web.get(f"{system}/region/{{name}}/status", status),
        web.post(f"{system}/region/{{name}}/register", register),
        web.post(f"{system}/region/{{name}}/unregister", unregister),
        web.post(f"{system}/unregister", unregister),
        web.get(f"{cuda}/status", cuda_status),
        web.get(f"{cuda}/region/{{name}}/status", cuda_status),
        web.post(f"{cuda}/region/{{name}}/register", cuda_register),
        web.post(f"{cuda}/region/{{name}}/unregister", nothing_registered),
        web.post(f"{cuda}/unregister", nothing_registered),
    ]
