"""Recommender: an MLP that scores a feature vector, served by Triton's python backend.

Weights come from ``weights.safetensors`` next to this file, so every per-customer variant
shares this code and differs only in its weights.  Errors for one request are returned in
that request's response; the model never raises out of ``execute`` for bad input, so one
bad request does not fail the rest of a dynamic batch.
"""

import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from safetensors.torch import load_file


class RecommenderMLP(torch.nn.Module):
    """features -> [Linear -> ReLU] * n -> Linear(1) -> sigmoid score."""

    def __init__(self, weights):
        super().__init__()
        layer_count = len([k for k in weights if k.endswith(".weight")])
        self.layers = torch.nn.ModuleList()
        # Layers without storage, then the file's tensors become the parameters: no random
        # initialisation of weights the file replaces and no second copy of them (for a
        # 200 MB model that initialisation took 0.24 s of the load: bench/load_profile.py).
        with torch.device("meta"):
            for i in range(layer_count):
                w = weights[f"layers.{i}.weight"]
                self.layers.append(torch.nn.Linear(w.shape[1], w.shape[0]))
        self.load_state_dict(weights, assign=True)

    @property
    def feature_dim(self):
        return self.layers[0].in_features

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return torch.sigmoid(self.layers[-1](x))


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
            self.device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
        else:
            self.device = torch.device("cpu")
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        weights = load_file(os.path.join(version_dir, "weights.safetensors"))
        self.model = RecommenderMLP(weights).to(self.device).eval()
        params = self.model_config.get("parameters", {})
        # Fault injection for rollout drills: an artificial per-execute delay (in-flight and
        # slow-shadow behaviour), a fraction of requests answered with an error (a bad
        # canary) and a slow load (deadline drills).  All default to off.
        load_delay_s = float(params.get("load_delay_s", {}).get("string_value", "0") or 0)
        if load_delay_s:
            import time

            time.sleep(load_delay_s)
        self.delay_s = float(params.get("execute_delay_s", {}).get("string_value", "0") or 0)
        self.fail_fraction = float(params.get("fail_fraction", {}).get("string_value", "0") or 0)
        self.requests_seen = 0

    def execute(self, requests):
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        feature_dim = self.model.feature_dim
        batches, responses = [], [None] * len(requests)
        for i, request in enumerate(requests):
            self.requests_seen += 1
            if self.fail_fraction and (self.requests_seen * self.fail_fraction) % 1 < self.fail_fraction:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("injected failure (fail_fraction parameter)")
                )
                continue
            features = pb_utils.get_input_tensor_by_name(request, "FEATURES").as_numpy()
            if features.ndim != 2 or features.shape[1] != feature_dim:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(
                        f"FEATURES must have shape [batch, {feature_dim}], got {list(features.shape)}"
                    )
                )
                continue
            batches.append((i, features))
        if batches:
            # One forward pass for the whole dynamic batch, then split it back per request.
            stacked = torch.from_numpy(np.concatenate([f for _, f in batches]).astype(np.float32))
            with torch.inference_mode():
                scores = self.model(stacked.to(self.device)).cpu().numpy()
            offset = 0
            for i, features in batches:
                rows = features.shape[0]
                out = pb_utils.Tensor("SCORES", scores[offset : offset + rows])
                responses[i] = pb_utils.InferenceResponse(output_tensors=[out])
                offset += rows
        return responses

    def finalize(self):
        self.model = None
