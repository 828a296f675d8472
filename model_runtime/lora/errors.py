"""Errors raised by the LoRA runtime.

    LoraError                          base; unexpected -> INTERNAL
    +-- InvalidRequest                 a request's inputs or parameters are wrong -> INVALID_ARG
    |   +-- InvalidAdapterName         name with '..', '/', whitespace, shell chars -> INVALID_ARG
    +-- AdapterNotFound                not staged in the adapter directory, or disabled -> NOT_FOUND
    |   +-- AdapterNotLoaded           not in a device slot where the control plane decides -> NOT_FOUND
    +-- AdapterRefused                 malformed files, or made for another base -> INVALID_ARG
    +-- AdapterCapacityExhausted       every device slot holds a pinned adapter -> UNAVAILABLE
    +-- RuntimeClosing                 the model is being unloaded -> UNAVAILABLE

This package is copied into each LoRA model folder and imported by the Triton stub, so it
must not import the rest of ``control_plane``.  ``code`` is the stable string the control
plane keys on (status JSON, admin API); ``triton_code`` names the ``pb_utils.TritonError``
code a model returns for the error, mapped in one place (``triton_glue``).
"""


class LoraError(Exception):
    code = "internal"
    triton_code = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        return {"error": self.code, "message": self.message}


class InvalidRequest(LoraError):
    code = "invalid_input"
    triton_code = "INVALID_ARG"


class InvalidAdapterName(InvalidRequest):
    code = "invalid_adapter_name"


class AdapterNotFound(LoraError):
    code = "adapter_not_found"
    triton_code = "NOT_FOUND"


class AdapterNotLoaded(AdapterNotFound):
    """Where the control plane decides which adapters hold the slots, a request named one in
    none.  Worded as Triton words a model that is not loaded, which is what the router sends
    again once it has had it loaded."""

    code = "adapter_not_loaded"


class AdapterRefused(LoraError):
    code = "adapter_refused"
    triton_code = "INVALID_ARG"


class AdapterCapacityExhausted(LoraError):
    code = "capacity_exhausted"
    triton_code = "UNAVAILABLE"


class RuntimeClosing(LoraError):
    code = "unavailable"
    triton_code = "UNAVAILABLE"
