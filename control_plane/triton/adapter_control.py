"""LoRA models' control commands (``TritonAdmin.adapter_control``): over the control socket a
model's process named, else as an inference carrying only ``ADAPTER_CONTROL``."""

from __future__ import annotations

import json

import numpy as np
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from control_plane.triton.control_socket import ControlSockets
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
    OperationTimeout,
)
from domain.tracing import traced

# The LoRA models' control input and the output that answers it (model_repository/tinylm).
ADAPTER_CONTROL_INPUT = "ADAPTER_CONTROL"
ADAPTER_STATUS_OUTPUT = "ADAPTER_STATUS"


def _adapter_refusal(model: str, command: dict, code: str, msg: str) -> ControlPlaneError:
    """A LoRA model's refusal of a control command (its Triton error code and message), from
    a request's error or a control socket's answer."""
    if "NOT_FOUND" in code:
        return ModelNotFound(msg)
    if "INVALID_ARG" in code:
        return InvalidInput(msg)
    if "UNAVAILABLE" in code and "slot" in msg:
        return CapacityExhausted(msg)
    return ModelLoadFailed(f"{model} failed {command.get('op')!r}: {msg}")


class AdapterControl:
    """``TritonAdmin``'s part for LoRA models (it sets ``control_sockets`` up, and gives
    ``client``, ``timeouts``, ``grpc_url`` and ``_unavailable``)."""

    control_sockets: ControlSockets

    @traced("triton.adapter_control")
    async def adapter_control(self, model: str, command: dict, timeout_s: float | None = None,
                              key: str | None = None) -> dict:
        """Send one LoRA control command (``{"op": "status" | "sync" | "load" | "unload", ...}``)
        and return the model's JSON answer: over the control socket its process named in an
        earlier answer when ``key`` (the control plane's, ``model_runtime.control_socket``) is
        given, so the command runs beside the batches Triton executes; else, or when that
        socket is gone, as an inference carrying only ADAPTER_CONTROL.

        The model's error codes map to control-plane errors: NOT_FOUND -> ModelNotFound (an
        unknown adapter, or the model is not loaded), INVALID_ARG -> InvalidInput (bad name, a
        refused adapter, a pinned one), UNAVAILABLE with a slot message -> CapacityExhausted
        (every device slot pinned); an unreachable server -> TritonUnavailable."""
        timeout_s = self.timeouts.load_s if timeout_s is None else timeout_s
        if key is not None:
            try:
                answer = await self.control_sockets.send(model, {**command, "key": key}, timeout_s)
            except TimeoutError:
                raise OperationTimeout(
                    f"{model} did not answer {command.get('op')!r} within {timeout_s:.0f}s") from None
            if answer is not None:
                if "error" in answer:
                    raise _adapter_refusal(model, command, str(answer.get("code", "")),
                                           str(answer["error"]))
                self.control_sockets.learn(model, answer)
                return answer
        answer = await self._adapter_control_request(model, command, timeout_s)
        if key is not None:
            self.control_sockets.learn(model, answer)
        return answer

    async def _adapter_control_request(self, model: str, command: dict, timeout_s: float) -> dict:
        control = InferInput(ADAPTER_CONTROL_INPUT, [1, 1], "BYTES")
        control.set_data_from_numpy(np.array([[json.dumps(command).encode()]], dtype=np.object_))
        try:
            result = await self.client.infer(model, [control], client_timeout=timeout_s)
        except InferenceServerException as exc:
            status = str(exc.status() or "")
            msg = (exc.message() or str(exc)).strip()
            if "DEADLINE" in status:
                raise OperationTimeout(
                    f"{model} did not answer {command.get('op')!r} within {timeout_s:.0f}s") from exc
            if ("UNAVAILABLE" in status and "slot" not in msg) or "DEADLINE_EXCEEDED" in status:
                raise self._unavailable(exc) from exc
            raise _adapter_refusal(model, command, status, msg) from exc
        raw = result.as_numpy(ADAPTER_STATUS_OUTPUT)
        if raw is None or raw.size != 1:
            raise ModelLoadFailed(f"{model} did not answer with one {ADAPTER_STATUS_OUTPUT} string")
        value = raw.reshape(-1)[0]
        try:
            return json.loads(value.decode() if isinstance(value, bytes) else value)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadFailed(f"{model} answered {ADAPTER_STATUS_OUTPUT} that is not JSON: {exc}") from exc
