"""What the demo recommender computes, with plain tensor ops: tests compare served scores
with it."""

from __future__ import annotations

import numpy as np
import torch


def mlp_scores(weights: dict[str, torch.Tensor], features: np.ndarray) -> np.ndarray:
    """relu hidden layers, sigmoid output, over ``layers.{i}.weight`` / ``.bias``."""
    x = torch.from_numpy(features)
    layers = len([k for k in weights if k.endswith(".weight")])
    for i in range(layers):
        x = x @ weights[f"layers.{i}.weight"].T + weights[f"layers.{i}.bias"]
        x = torch.relu(x) if i < layers - 1 else torch.sigmoid(x)
    return x.numpy()
