"""LoRA models' control commands (``TritonAdmin.adapter_control``): over the control socket a
model's process named, else as an inference carrying only ``ADAPTER_CONTROL``."""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from control_plane.triton.control_socket import ControlSocket
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
    OperationTimeout,
)
from domain.tracing import traced

log = logging.getLogger(__name__)

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
    """``TritonAdmin``'s part for LoRA models (it sets ``adapter_sockets`` and
    ``_gone_sockets`` up, and gives ``client``, ``timeouts``, ``grpc_url`` and
    ``_unavailable``)."""

    adapter_sockets: dict[str, ControlSocket]
    _gone_sockets: set[str]

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
        channel = self.adapter_sockets.get(model) if key is not None else None
        if channel is not None:
            try:
                answer = await channel.send({**command, "key": key}, timeout_s)
            except TimeoutError:
                await self.forget_adapter_socket(model)
                raise OperationTimeout(
                    f"{model} did not answer {command.get('op')!r} within {timeout_s:.0f}s") from None
            except (OSError, EOFError, ValueError) as exc:
                # Its process is gone or was replaced: the request path reaches the one Triton
                # serves now, whose answer names its socket.
                log.info("%s on %s: control socket %s: %s; sending as a request", model,
                         self.grpc_url, channel.name, exc)
                await self.forget_adapter_socket(model)
            else:
                if "error" in answer:
                    raise _adapter_refusal(model, command, str(answer.get("code", "")),
                                           str(answer["error"]))
                self._learn_adapter_socket(model, answer)
                return answer
        answer = await self._adapter_control_request(model, command, timeout_s)
        if key is not None:
            self._learn_adapter_socket(model, answer)
        return answer

    def _learn_adapter_socket(self, model: str, answer: dict) -> None:
        name = answer.get("control_socket")
        current = self.adapter_sockets.get(model)
        if not name or (current is not None and current.name == name) or name in self._gone_sockets:
            return
        if current is not None:
            asyncio.get_running_loop().create_task(current.close())
        self.adapter_sockets[model] = ControlSocket(name)

    async def forget_adapter_socket(self, model: str) -> None:
        """Send ``model``'s commands through Triton until an answer names a socket again (its
        process is gone or being replaced: nothing more over the socket it had)."""
        channel = self.adapter_sockets.pop(model, None)
        if channel is not None:
            self._never_again(channel.name)
            await channel.close()

    def _never_again(self, name: str) -> None:
        """Send nothing more over socket ``name`` (its process is gone or being replaced); a
        family's sockets (``FamilyAdmin``) and a LoRA model's share the set."""
        if len(self._gone_sockets) >= 1024:  # names of processes long gone
            self._gone_sockets.clear()
        self._gone_sockets.add(name)

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
