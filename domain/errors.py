"""Errors raised by the control plane.

    ControlPlaneError                 base; unexpected -> HTTP 500
    +-- InvalidInput                  bad argument or config -> 400
    |   +-- InvalidModelName          name with '..', '/', whitespace, shell chars -> 400
    +-- ModelNotFound                 not in any repository / registry -> 404
    +-- CapacityExhausted             everything pinned and no room -> 507
    +-- ModelLoadFailed               Triton refused the load or the warm-up failed -> 502
    +-- TritonUnavailable             a Triton server cannot be reached -> 503
    +-- OperationTimeout              load/unload/drain took too long -> 504

Every message says what was wrong and what to do about it.  The HTTP status for each class
lives in ``http_status`` so the admin API maps errors in one place.
"""


class ControlPlaneError(Exception):
    http_status = 500
    code = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        return {"error": self.code, "message": self.message}


class InvalidInput(ControlPlaneError):
    http_status = 400
    code = "invalid_input"


class InvalidModelName(InvalidInput):
    code = "invalid_model_name"


class ModelNotFound(ControlPlaneError):
    http_status = 404
    code = "model_not_found"


class CapacityExhausted(ControlPlaneError):
    http_status = 507
    code = "capacity_exhausted"


class ModelLoadFailed(ControlPlaneError):
    http_status = 502
    code = "load_failed"


class TritonUnavailable(ControlPlaneError):
    http_status = 503
    code = "triton_unavailable"


class OperationTimeout(ControlPlaneError):
    http_status = 504
    code = "timeout"


class EvictionFailed(OperationTimeout):
    """A load's victims did not leave in time: its reservation was given back."""


ERRORS_BY_CODE = {
    cls.code: cls
    for cls in (
        ControlPlaneError,
        InvalidInput,
        InvalidModelName,
        ModelNotFound,
        CapacityExhausted,
        ModelLoadFailed,
        TritonUnavailable,
        OperationTimeout,
    )
}
