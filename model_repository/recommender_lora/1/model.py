"""recommender_lora: the recommender MLP as a LoRA base, one adapter per customer.

Same contract as ``model_repository/recommender`` (``FEATURES`` fp32 [batch, F] ->
``SCORES`` fp32 [batch, 1]) plus adapter selection: request parameter ``adapter`` or input
``ADAPTER`` (none = the base model).  LoRA applies to every ``layers.{i}`` linear layer.  The
runtime is the ``_lora`` package next to this file (a copy of ``model_runtime/lora`` made by
``control_plane/demo/lora.py``); see README.md.
"""

import os

import triton_python_backend_utils as pb_utils
from _lora.models import load_recommender
from _lora.runtime import parse_features, recommender_runner
from _lora.triton_glue import LoraTritonModel, input_array

WEIGHTS_FILE = "weights.safetensors"


class TritonPythonModel(LoraTritonModel):
    def build(self, version_dir):
        self.mlp = load_recommender(os.path.join(version_dir, WEIGHTS_FILE))
        return self.mlp, recommender_runner(self.mlp)

    def parse(self, request, parameters):
        features = parse_features(self.mlp, input_array(request, "FEATURES"))
        return features, features.shape[0]

    def outputs(self, scores):
        return [pb_utils.Tensor("SCORES", scores)]
