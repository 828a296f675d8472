"""The oracle of the tests and benchmarks: what a demo recommender (a customer's model, or
a family's variant) answers, computed from its own weights file with plain tensor ops, and
whether a served answer matches it.  Not part of the product (its install leaves it out).

Tests and benchmarks check answers with these and nothing else: a weights file is read from
the repository Triton serves from (not regenerated from the fleet's seeds), so a variant that
answers with another variant's weights, or with a slot half overwritten, is caught.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from control_plane.demo.fleet import WEIGHTS_FILE

# The python backend runs the same float32 ops as mlp_scores, in another order on some
# CPUs (oneDNN picks kernels by shape): a few units in the last place, never 1e-4.
REL_TOLERANCE = 1e-4
ABS_TOLERANCE = 1e-6


def mlp_scores(weights: dict[str, torch.Tensor], features: np.ndarray) -> np.ndarray:
    """relu hidden layers, sigmoid output, over ``layers.{i}.weight`` / ``.bias``."""
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    layers = len([k for k in weights if k.endswith(".weight")])
    for i in range(layers):
        x = x @ weights[f"layers.{i}.weight"].T + weights[f"layers.{i}.bias"]
        x = torch.relu(x) if i < layers - 1 else torch.sigmoid(x)
    return x.numpy()


def weights_path(repository: Path, name: str, layout: str = "family") -> Path:
    """Where ``name``'s weights lie in a repository: a family variant's folder holds the file
    itself, a separate model's its version 1."""
    if layout not in ("family", "models"):
        raise ValueError(f"layout must be 'family' or 'models', not {layout!r}")
    folder = Path(repository) / name
    return folder / WEIGHTS_FILE if layout == "family" else folder / "1" / WEIGHTS_FILE


def load_weights(repository: Path, name: str, layout: str = "family") -> dict[str, torch.Tensor]:
    """``name``'s weights as Triton reads them (fails with FileNotFoundError naming the file)."""
    path = weights_path(repository, name, layout)
    if not path.is_file():
        raise FileNotFoundError(f"no weights for {name!r} at {path}")
    return load_file(str(path))


def expected_scores(repository: Path, name: str, features: np.ndarray,
                    layout: str = "family") -> np.ndarray:
    """What ``name`` must answer for ``features`` (shape [batch, feature_dim])."""
    return mlp_scores(load_weights(repository, name, layout), features)


def scores_match(answer, expected) -> bool:
    """A served SCORES tensor (or one score) against the reference, element by element."""
    got = np.asarray(answer, dtype=np.float64)
    want = np.asarray(expected, dtype=np.float64)
    if got.shape != want.shape:
        return False
    return all(math.isclose(a, b, rel_tol=REL_TOLERANCE, abs_tol=ABS_TOLERANCE)
               for a, b in zip(got.ravel().tolist(), want.ravel().tolist(), strict=True))


class ReferenceAnswers:
    """Each checked model's weights, read from the repository on its first answer and kept;
    ``check`` compares one answer for one request.  Cheap per request (a few small matrix
    products), so a soak can check every answer it gets.  Safe to share between threads."""

    def __init__(self, repository: Path, names: list[str], layout: str = "family"):
        self.repository = Path(repository)
        self.layout = layout
        self.names = frozenset(names)
        self._weights: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.names:
            raise KeyError(f"{name!r} is not one of the models whose answers are checked")
        with self._lock:
            if name not in self._weights:
                self._weights[name] = load_weights(self.repository, name, self.layout)
            return self._weights[name]

    def expected(self, name: str, features: np.ndarray) -> np.ndarray:
        return mlp_scores(self.weights(name), features)

    def check(self, name: str, features: np.ndarray, answer) -> str | None:
        """None when ``answer`` is ``name``'s; else what is wrong, with both values."""
        want = self.expected(name, features)
        if scores_match(answer, want):
            return None
        got = np.asarray(answer)
        return (f"wrong answer from {name}: got {got.ravel()[:4].tolist()} (shape {list(got.shape)}),"
                f" its weights give {want.ravel()[:4].tolist()} (shape {list(want.shape)})")
