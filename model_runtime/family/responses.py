"""What the family model answers with: Triton's per-request errors (built inside Triton's
python stub, where ``triton_python_backend_utils`` is importable), the refusals of control
commands, and the reading of its config's parameters (triton_model.py)."""

from __future__ import annotations


class ControlRefused(Exception):
    """A control command that is refused; ``code`` is the Triton error code it answers with."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class FamilyInputError(ValueError):
    """Bad input in one request; only that request fails."""


def _pb():
    import triton_python_backend_utils as pb_utils  # only importable inside Triton's stub

    return pb_utils


def _error(message: str, code: str | None = None):
    pb_utils = _pb()
    error_code = getattr(pb_utils.TritonError, code, None) if code else None
    error = (pb_utils.TritonError(message, error_code) if error_code is not None
             else pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(error=error)


def _describe(command: dict) -> str:
    """A control command for an error message: its operation and variant, never its key."""
    return f"{command.get('op')!r} of {command.get('variant')!r}" if isinstance(command, dict) else "?"


def _parameter(config: dict, key: str, default: str | None = None) -> str | None:
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return value if value not in (None, "") else default
