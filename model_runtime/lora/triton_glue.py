"""Triton python-backend glue shared by the LoRA models.  Imported only inside the stub
(it needs ``triton_python_backend_utils``); everything it calls is unit-tested without it.

Thin transport: each request becomes a ``server.Job`` (or a control command) and each result
a response.  Every response goes through the request's response sender, which Triton allows
for non-decoupled models when exactly one final response is sent: requests that wait for a
cold adapter are answered after ``execute`` has returned, so the next batch does not wait
for the disk.

Requests:
    adapter       request parameter (or input ADAPTER, the same on every row); none = base
    ADAPTER_CONTROL  input, one JSON string: {"op": "status" | "sync" | "load" | "unload",
                  "adapter": ...}; answered in output ADAPTER_STATUS (JSON)

The same commands come over the model's control socket (``control_socket`` in its status;
``model_runtime.control_socket``), with the control plane's key, and run beside the batches
Triton executes instead of queueing behind them.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import uuid
from functools import partial

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from .errors import InvalidRequest, LoraError
from .runtime import LoraSettings, adapter_from, build_server
from .server import Job

try:  # the copy in a model folder carries the control socket beside this package's modules
    from .control_socket import ControlSocketServer, read_control_key
except ImportError:  # the source tree
    from ..control_socket import ControlSocketServer, read_control_key

log = logging.getLogger(__name__)

# How long a command on the control socket waits for its answer (a cold load from disk).
SOCKET_COMMAND_S = 120.0


def triton_error(error: LoraError):
    code = getattr(pb_utils.TritonError, error.triton_code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(error.message, code)


def input_array(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class LoraTritonModel:
    """Base of the LoRA models' ``TritonPythonModel``.  Subclasses implement ``build``
    (load the base, return ``(model, runner)``), ``parse`` (request -> ``(payload, rows)``)
    and ``outputs`` (one job's result -> output tensors)."""

    def build(self, version_dir: str):  # pragma: no cover - abstract
        raise NotImplementedError

    def parse(self, request, parameters: dict):  # pragma: no cover - abstract
        raise NotImplementedError

    def outputs(self, result) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.model_config = json.loads(args["model_config"])
        params = {
            key: value.get("string_value", "")
            for key, value in self.model_config.get("parameters", {}).items()
        }
        if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
            self.device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
        else:
            self.device = torch.device("cpu")
        model_dir = args["model_repository"]
        self.settings = LoraSettings.from_parameters(params, model_dir)
        model, runner = self.build(os.path.join(model_dir, args["model_version"]))
        self.server = build_server(
            model, runner, self.settings, base_name=args["model_name"], device=self.device
        )
        # The control plane's commands also come over a socket of this process, beside the
        # batches Triton runs: keyed with the key it keeps in Triton's repository.
        self.control_key = read_control_key(os.path.dirname(os.path.abspath(model_dir)))
        self._control_server = ControlSocketServer(
            f"mms-lora-{args['model_name']}-{uuid.uuid4().hex[:12]}", self._socket_command,
            what=f"LoRA model {args['model_name']}")
        self.control_socket = self._control_server.name
        log.info(
            "%s ready on %s: %d device slots, %d host adapters, max rank %d, adapters in %s",
            args["model_name"], self.device, self.settings.max_device_adapters,
            self.settings.max_host_adapters, self.settings.max_lora_rank, self.settings.adapter_dir,
        )

    def execute(self, requests):
        jobs = []
        for request in requests:
            sender = request.get_response_sender()
            try:
                parameters = json.loads(request.parameters() or "{}")
                control = input_array(request, "ADAPTER_CONTROL")
                if control is not None:
                    self.server.control(self._control_command(control), partial(self._send_status, sender))
                    continue
                adapter = adapter_from(parameters, input_array(request, "ADAPTER"))
                payload, rows = self.parse(request, parameters)
                jobs.append(Job(adapter, payload, partial(self._send, sender), rows))
            except LoraError as exc:
                self._send(sender, None, exc)
            except Exception as exc:  # a response is owed whatever happened
                log.exception("parsing a request failed")
                self._send(sender, None, LoraError(f"internal error: {exc}"))
        if jobs:
            self.server.submit(jobs)

    @staticmethod
    def _control_command(values: np.ndarray) -> dict:
        flat = np.asarray(values, dtype=object).reshape(-1)
        if flat.size != 1:
            raise InvalidRequest(f"ADAPTER_CONTROL takes one JSON string, got {flat.size}")
        raw = flat[0]
        try:
            return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"ADAPTER_CONTROL is not valid JSON: {exc}") from None

    def _socket_command(self, line: str) -> dict:
        """A command from the control socket: run as one that came as a request, with the key
        checked first; its answer (the status), or the refusal with its Triton code."""
        try:
            command = json.loads(line)
        except json.JSONDecodeError as exc:
            return {"error": f"ADAPTER_CONTROL is not valid JSON: {exc}", "code": "INVALID_ARG"}
        if not isinstance(command, dict) or self.control_key is None or not hmac.compare_digest(
                str(command.pop("key", "")), self.control_key):
            return {"error": "adapter control refused: wrong or missing key", "code": "INVALID_ARG"}
        done, box = threading.Event(), {}

        def reply(status, error) -> None:
            box["status"], box["error"] = status, error
            done.set()

        self.server.control(command, reply)
        if not done.wait(SOCKET_COMMAND_S):
            return {"error": f"{command.get('op')!r} did not finish within {SOCKET_COMMAND_S:.0f}s",
                    "code": "INTERNAL"}
        if box["error"] is not None:
            return {"error": box["error"].message, "code": box["error"].triton_code}
        return {**box["status"], "control_socket": self.control_socket}

    def _send(self, sender, result, error: LoraError | None) -> None:
        if error is not None:
            response = pb_utils.InferenceResponse(error=triton_error(error))
        else:
            response = pb_utils.InferenceResponse(output_tensors=self.outputs(result))
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send_status(self, sender, status, error: LoraError | None) -> None:
        if error is not None:
            response = pb_utils.InferenceResponse(error=triton_error(error))
        else:
            text = json.dumps({**status, "control_socket": self.control_socket}, sort_keys=True).encode()
            out = pb_utils.Tensor("ADAPTER_STATUS", np.array([[text]], dtype=object))
            response = pb_utils.InferenceResponse(output_tensors=[out])
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        control = getattr(self, "_control_server", None)
        if control is not None:
            control.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
