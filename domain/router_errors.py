"""Errors of the data plane, each with its gRPC code and HTTP status (mapped in one place).

    RouterError                 INTERNAL / 500
    +-- ModelNotFound           NOT_FOUND / 404
    |   +-- UnknownModel        NOT_FOUND / 404, in Triton's words for the name the client asked
    +-- InvalidRequest          INVALID_ARGUMENT / 400
    |   +-- InvalidVersion      INVALID_ARGUMENT / 400, Triton's words for a non-numeric version
    |   +-- ModelUnavailable    INVALID_ARGUMENT / 400, Triton's statistics answer for a model
    |                           that is not loaded
    +-- PayloadTooLarge         RESOURCE_EXHAUSTED / 413
    +-- RateLimited             RESOURCE_EXHAUSTED / 429 (+ Retry-After)
    +-- PermissionDenied        PERMISSION_DENIED / 403
    +-- BackendUnavailable      UNAVAILABLE / 503
    +-- RequestTimeout          DEADLINE_EXCEEDED / 504
    +-- NoSuchPath              NOT_FOUND / 404, Triton's answer for a URL it does not route
    +-- UpstreamError           Triton's own code and message (shape, datatype, ...), passed on
                                with the name the client asked for
"""

from __future__ import annotations

import grpc

from domain import errors as cp


class RouterError(Exception):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ModelNotFound(RouterError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class InvalidRequest(RouterError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


# Triton's own texts (measured on tritonserver 2.51): clients match on them (the official
# examples check for "Request for unknown model"), so the router answers with the same words.
class UnknownModel(ModelNotFound):
    """No model of that name (or version) is served, worded as Triton words it."""

    def __init__(self, name: str, version: str = "", no_versions: bool = False):
        if version:
            message = f"Request for unknown model: '{name}' version {version} is not found"
        elif no_versions:
            message = f"Request for unknown model: '{name}' has no available versions"
        else:
            message = f"Request for unknown model: '{name}' is not found"
        super().__init__(message)
        self.name = name
        self.version = version

    def for_statistics(self) -> ModelUnavailable:
        """Triton's statistics API words the same case differently (and as INVALID_ARGUMENT)."""
        return ModelUnavailable(self.name, self.version)


class ModelUnavailable(InvalidRequest):
    """Statistics of a model (version) that is not loaded."""

    def __init__(self, name: str, version: str = ""):
        if version:
            super().__init__(f"requested model version is not available for model '{name}'")
        else:
            super().__init__(f"requested model '{name}' is not available")


class InvalidVersion(InvalidRequest):
    """A model version that is not a whole number >= 0 (Triton parses it with std::stol)."""

    def __init__(self, version: str):
        # A long one is cut: the answer is never much larger than what the client sent.
        shown = version if len(version) <= 40 else version[:40] + f"... ({len(version)} characters)"
        if version.startswith("-") and version[1:].isdigit():
            super().__init__(f"invalid model version specified '{shown}' , version should be an "
                             "integral value > 0")
        else:
            super().__init__(f"failed to get model version from specified version string '{shown}' "
                             "(details: stol), version should be an integral value > 0")
        self.version = version


MAX_VERSION = 2**63 - 1  # std::stol's range on Triton's 64-bit builds


def parse_version(version: str) -> str:
    """The client's model version: "" (none) or ASCII digits within int64, as a canonical
    number string ("01" -> "1", as Triton reads it).  Anything else is refused with Triton's
    words: it is looked up and spliced into URLs, so only digits pass."""
    if not version:
        return ""
    # Leading zeros off before int(): a string of over 4,300 digits is a ValueError there.
    digits = version.lstrip("0") or "0"
    if (version.isascii() and version.isdigit() and len(digits) <= len(str(MAX_VERSION))
            and int(digits) <= MAX_VERSION):
        return digits
    raise InvalidVersion(version)


class PayloadTooLarge(RouterError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class RateLimited(RouterError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineTooShort(RateLimited):
    """A request whose deadline ends before its model could be loaded: refused at once,
    instead of failing when the deadline passes (its load is started for the retry)."""


class PermissionDenied(RouterError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class BackendUnavailable(RouterError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class RequestTimeout(RouterError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class NoSuchPath(RouterError):
    """Triton answers a URL it has no route for (``/versions/abc/ready``) with this."""
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404

    def __init__(self):
        super().__init__("Not Found")


# Triton's HTTP status for each of its error codes (its HTTP front end maps them this way;
# any other code is a 400).  A call the router forwarded over gRPC for an HTTP client
# answers with the status Triton's HTTP front end would have given.
TRITON_HTTP_STATUS = {grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.INTERNAL: 500,
                      grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.UNIMPLEMENTED: 501,
                      grpc.StatusCode.DEADLINE_EXCEEDED: 504}


class UpstreamError(RouterError):
    """Triton's answer to a forwarded call, its status code kept (and on HTTP, the status
    Triton's HTTP front end gives that code)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.grpc_code = code
        self.http_status = TRITON_HTTP_STATUS.get(code, 400)


def from_control_plane(exc: cp.ControlPlaneError) -> RouterError:
    """Translate a control-plane error met on the data path."""
    if isinstance(exc, cp.ModelNotFound):
        return ModelNotFound(exc.message)
    if isinstance(exc, cp.InvalidInput):
        return InvalidRequest(exc.message)
    if isinstance(exc, cp.TritonUnavailable):
        return BackendUnavailable(exc.message)
    if isinstance(exc, cp.OperationTimeout):
        return RequestTimeout(exc.message)
    if isinstance(exc, (cp.CapacityExhausted, cp.ModelLoadFailed)):
        return BackendUnavailable(exc.message)
    return RouterError(exc.message)
