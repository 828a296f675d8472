"""Errors of the data plane, each with its gRPC code and HTTP status (mapped in one place).

    RouterError                 INTERNAL / 500
    +-- ModelNotFound           NOT_FOUND / 404
    +-- InvalidRequest          INVALID_ARGUMENT / 400
    +-- PayloadTooLarge         RESOURCE_EXHAUSTED / 413
    +-- RateLimited             RESOURCE_EXHAUSTED / 429 (+ Retry-After)
    +-- PermissionDenied        PERMISSION_DENIED / 403
    +-- BackendUnavailable      UNAVAILABLE / 503
    +-- RequestTimeout          DEADLINE_EXCEEDED / 504
"""

from __future__ import annotations

import grpc

from control_plane import errors as cp


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


class PayloadTooLarge(RouterError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class RateLimited(RouterError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PermissionDenied(RouterError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class BackendUnavailable(RouterError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class RequestTimeout(RouterError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


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
