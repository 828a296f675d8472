"""The recommender demo model in a real tritonserver answers what its weights file says."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from safetensors.torch import load_file

from control_plane.demo.fleet import WEIGHTS_FILE
from tests.reference import mlp_scores

pytestmark = pytest.mark.integration


def reference_scores(weights_path, features: np.ndarray) -> np.ndarray:
    """The MLP computed here with plain tensor ops: relu hidden layers, sigmoid output."""
    return mlp_scores(load_file(str(weights_path)), features)


def test_scores_match_the_weights_file(triton, repository):
    """Built without a random initialisation (its weights are the file's tensors), the
    model still computes exactly the MLP its file describes, for two customers."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    rng = np.random.default_rng(7)
    for name in ("cust001", "cust002"):
        client.load_model(name)
        weights = repository / name / "1" / WEIGHTS_FILE
        dim = load_file(str(weights))["layers.0.weight"].shape[1]
        features = rng.standard_normal((5, dim)).astype(np.float32)
        x = grpcclient.InferInput("FEATURES", list(features.shape), "FP32")
        x.set_data_from_numpy(features)
        got = client.infer(name, [x]).as_numpy("SCORES")
        np.testing.assert_allclose(got, reference_scores(weights, features), rtol=1e-5, atol=1e-6)
        client.unload_model(name)
