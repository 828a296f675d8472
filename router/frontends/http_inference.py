"""KServe v2 HTTP inference: a codec around the inference pipeline
(``router.serving.inference_pipeline``), as gRPC's are (``router.frontends.grpc_inference``).

The body (JSON, or JSON header + binary tensors) is checked (``router.frontends.http_request``)
and forwarded to the chosen Triton's HTTP endpoint unchanged, except that the parameters the
router sets (``adapter``, a family variant's ``mms_variant``) are added to its JSON header;
the answer's JSON header gains the routing parameters (``model``, ``variant``,
``experiment``, ``adapter``) and the name the client asked for.  Tensors in system shared
memory are read and written by the router and sent inline.

One deadline bounds a request and all its resends: the router's ``request_timeout_s`` (an
HTTP request carries no deadline of its own).  Triton's ``timeout`` request parameter is not
one: Triton applies it only to the time a request may wait in a scheduler's queue, where the
model's queue policy allows it, and otherwise ignores it; it is passed on to Triton with the
rest of the request, so a client that sets it gets what Triton would give it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from domain import tracing
from domain.router_errors import (
    BackendUnavailable,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    RouterError,
)
from router.frontends.http_request import (
    HEADER_LENGTH,
    InferRequest,
    check_adapter,
    read_infer_request,
    with_parameters,
)
from router.frontends.http_shadow import primary_outputs, shadow_request
from router.frontends.shared_memory import SystemSharedMemory
from router.frontends.shared_memory_requests import json_uses_shared_memory
from router.serving.ensure_and_resend import Resend
from router.serving.inference_pipeline import (
    InferencePipeline,
    Naming,
    Target,
    refuse_family_control,
    user_id_of,
)
from router.serving.server_lookup import Call
from router.serving.serving_state import UNLOADED_PREFIX, ServerAddress

if TYPE_CHECKING:  # the assembly builds the router these ports serve
    from router.frontends.public_router import PublicRouter

UNLOADED_BODY = ('{"error":"' + UNLOADED_PREFIX).encode()

log = logging.getLogger(__name__)


# The HTTP client's deadline for one inference, in milliseconds (gRPC clients set their
# call's deadline): a request whose model cannot load in time is refused at once (429).
TIMEOUT_HEADER = "X-Request-Timeout-Ms"


def request_timeout_s(headers, limit_s: float) -> float | None:
    """The deadline ``TIMEOUT_HEADER`` gives, capped by the router's own ``limit_s``; None
    without the header.  InvalidRequest for a value that is not a positive number."""
    text = headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        ms = float(text)
    except ValueError:
        ms = float("nan")
    if not ms > 0 or ms == float("inf"):
        raise InvalidRequest(f"header {TIMEOUT_HEADER} is the request's deadline in milliseconds, "
                             f"a number > 0; got {text[:40]!r}")
    return min(ms / 1000.0, limit_s)


class HttpExchange:
    """One HTTP inference: its checked body, Triton's answer, renamed."""

    __slots__ = ("content_type", "output_places", "parsed", "path", "pipeline", "session",
                 "shared_memory", "timeout_s")

    def __init__(self, pipeline: InferencePipeline, session: aiohttp.ClientSession,
                 shared_memory: SystemSharedMemory, parsed: InferRequest, content_type: str,
                 timeout_s: float):
        self.pipeline = pipeline
        self.session = session
        self.shared_memory = shared_memory
        self.parsed = parsed
        self.content_type = content_type
        self.timeout_s = timeout_s  # the deadline, for its error message
        self.output_places: dict = {}
        self.path = ""

    def outgoing(self, call: Call, target: Target):
        self.path = (f"/v2/models/{target.model}"
                     + (f"/versions/{target.version}" if target.version else "") + "/infer")
        parsed = self.parsed
        if json_uses_shared_memory(parsed.doc):
            parsed, self.output_places = self._inline_shared_memory(parsed)
            self.parsed = parsed
        body, header_length = parsed.body, parsed.header_length
        decision = call.decision
        if decision.adapter is not None:
            check_adapter(parsed, decision.adapter, decision.logical)
        if target.parameters:
            body, header_length = with_parameters(parsed, target.parameters)
        # Accept-Encoding is not passed on: Triton would compress on loopback and the
        # session would decompress again.
        headers = {"Content-Type": self.content_type}
        if header_length is not None:
            headers[HEADER_LENGTH] = str(header_length)
        return body, headers

    def _inline_shared_memory(self, parsed: InferRequest):
        """The request with its shared-memory inputs as binary tensors, and where its
        shared-memory outputs go (``router.frontends.shared_memory``)."""
        binary = parsed.body[parsed.header_length:] if parsed.header_length else b""
        doc, binary, places = self.shared_memory.inline_json(parsed.doc, binary)
        header = json.dumps(doc, separators=(",", ":")).encode()
        return replace(parsed, doc=doc, body=header + binary,
                       header_length=len(header) if binary else None), places

    async def attempt(self, server: ServerAddress, message, left_s: float):
        body, headers = message
        async with self.session.post(f"http://{server.http_url}{self.path}", data=body,
                                     headers=tracing.inject(dict(headers)) if tracing.enabled() else headers,
                                     timeout=aiohttp.ClientTimeout(total=left_s)) as resp:
            return (await resp.read(), resp.status, resp.headers.get(HEADER_LENGTH),
                    resp.headers.get("Content-Type", "application/json"))

    @staticmethod
    def resend_for(outcome) -> Resend | None:
        if isinstance(outcome, aiohttp.ClientConnectionError):
            return Resend.UNREACHABLE  # its server is down: placed on one that is up, sent there
        if isinstance(outcome, tuple) and outcome[1] == 404 and outcome[0].startswith(UNLOADED_BODY):
            return Resend.UNLOADED  # unloaded between placement and send: loaded again
        return None

    def failure(self, call: Call, exc: BaseException, asked: str) -> RouterError | None:
        if isinstance(exc, aiohttp.ClientConnectionError):
            call.code = "UNAVAILABLE"
            log.warning("Triton %s at %s is unavailable for %s: %s", call.server.name,
                        call.server.http_url, asked, exc)
            return BackendUnavailable(f"the server of '{asked}' is unavailable; the control "
                                      "plane restarts it, retry shortly")
        if isinstance(exc, TimeoutError):
            call.code = "DEADLINE_EXCEEDED"
            deadline = (f"{self.timeout_s:.0f}s" if self.timeout_s >= 1
                        else f"{self.timeout_s * 1000:.0f} ms")
            return RequestTimeout(f"Triton did not answer within the request's deadline of "
                                  f"{deadline}")
        return None

    def answer(self, call: Call, answer, naming: Naming, mirrored: bool):
        payload, status, resp_header_len, content_type = answer
        if status != 200:
            call.code = "INVALID_ARGUMENT" if status == 400 else f"HTTP_{status}"
            # Triton's message about the concrete model, about the one the client asked for.
            payload = self.pipeline.public_text(payload.decode(errors="replace"), call,
                                                naming.model).encode()
            return web.Response(body=payload, status=status, content_type="application/json"), None
        n = int(resp_header_len) if resp_header_len else len(payload)
        out = json.loads(payload[:n])
        binary = payload[n:]
        primary = primary_outputs(out, binary) if mirrored else None
        if self.output_places:
            binary = self.shared_memory.deliver_json(out, binary, self.output_places)
            resp_header_len = resp_header_len if binary else None
        if naming.routing is not None:
            out.setdefault("parameters", {}).update(naming.routing)
        out["model_name"] = naming.model
        if naming.version is not None:
            out["model_version"] = naming.version
        header = json.dumps(out, separators=(",", ":")).encode()
        resp_headers = {}
        if resp_header_len:
            resp_headers[HEADER_LENGTH] = str(len(header))
        return web.Response(body=header + binary, status=200, headers=resp_headers,
                            content_type=content_type.split(";")[0] if binary else "application/json"
                            ), primary

    def shadow_request(self, call: Call, target: Target):
        return shadow_request(self.parsed, target)


async def infer(router: PublicRouter, session: aiohttp.ClientSession, request: web.Request,
                version: str) -> web.Response:
    """POST /v2/models/{model}[/versions/{version}]/infer (``version``: the URL's, checked).
    The router's parts are read only once the request passed the checks that need none."""
    limit_bytes = router.config.max_request_bytes
    if request.content_length is not None and request.content_length > limit_bytes:
        # Refused from the header, before the body is read into memory.
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the router's "
                              f"limit of {limit_bytes} bytes; send smaller batches")
    # A gzip/deflate body is forwarded decompressed and without its Content-Encoding, so
    # Inference-Header-Content-Length (a size in the decompressed body) stays right.
    parsed = await read_infer_request(await request.read(), request.headers.get("Content-Encoding"),
                                      request.headers.get(HEADER_LENGTH), limit_bytes)
    params = parsed.parameters
    refuse_family_control(params)  # model control is refused before shared memory is read
    shared_memory = router.shared_memory
    shared_memory.admit_json(parsed.doc, len(parsed.body), request.remote, limit_bytes)
    user_id = user_id_of(params.get("user_id"), request.headers.get("x-user-id"))
    pipeline = router.pipeline
    inference = pipeline.inference(request.match_info["model"], version, params, parsed.input_names,
                                   params.get("adapter") or None,
                                   user_id,
                                   request_timeout_s(request.headers, router.config.request_timeout_s),
                                   lambda: request.headers)
    exchange = HttpExchange(pipeline, session, shared_memory, parsed,
                            request.headers.get("Content-Type", "application/json"),
                            router.config.request_timeout_s)
    return await pipeline.infer(inference, exchange)
