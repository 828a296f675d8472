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
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from .errors import InvalidRequest, LoraError
from .runtime import LoraSettings, adapter_from, build_server
from .server import Job

log = logging.getLogger(__name__)


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
            text = json.dumps(status, sort_keys=True).encode()
            out = pb_utils.Tensor("ADAPTER_STATUS", np.array([[text]], dtype=object))
            response = pb_utils.InferenceResponse(output_tensors=[out])
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
