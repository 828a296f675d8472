"""The recommender MLP as a model family: every per-customer fine-tune shares this code and
one Triton model, each in a weight slot (see model_runtime/family/triton_model.py for the
contract this file fills in).

Same contract as model_repository/recommender: ``FEATURES`` fp32 [batch, F] -> ``SCORES``
fp32 [batch, 1]; a wrong shape fails that request only.
"""

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from _mms_family import FamilyInputError, FamilyModel


class RecommenderMLP(torch.nn.Module):
    """features -> [Linear -> ReLU] * n -> Linear(1) -> sigmoid score."""

    def __init__(self, weights):
        super().__init__()
        layer_count = len([k for k in weights if k.endswith(".weight")])
        self.layers = torch.nn.ModuleList()
        with torch.device("meta"):  # no storage: the slot's tensors become the parameters
            for i in range(layer_count):
                w = weights[f"layers.{i}.weight"]
                self.layers.append(torch.nn.Linear(w.shape[1], w.shape[0]))
        self.load_state_dict(weights, assign=True)

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return torch.sigmoid(self.layers[-1](x))


class TritonPythonModel(FamilyModel):
    def build(self, weights):
        module = RecommenderMLP(weights).eval()
        self.feature_dim = module.layers[0].in_features
        return module

    def parse(self, request):
        features = pb_utils.get_input_tensor_by_name(request, "FEATURES").as_numpy()
        if features.ndim != 2 or features.shape[1] != self.feature_dim:
            raise FamilyInputError(
                f"FEATURES must have shape [batch, {self.feature_dim}], got {list(features.shape)}")
        return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))

    def outputs(self, rows):
        return [pb_utils.Tensor("SCORES", rows.numpy())]
