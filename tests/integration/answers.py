"""What each demo model must answer, from its own weights: traffic tests check every answer's
values with these, so that an answer from the wrong model (or a wrong variant's slot) fails
them, where a check of the answer's shape would pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from control_plane.demo.fleet import WEIGHTS_FILE, FleetSpec, customer_weights
from tests.reference import mlp_scores

FEATURE_DIM = 64
RTOL, ATOL = 1e-5, 1e-6


def features(rows: int = 1, seed: int = 0) -> np.ndarray:
    """Features whose scores differ from one customer to the next (all-ones features would
    do too, but varied rows also catch rows answered out of order)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, FEATURE_DIM)).astype(np.float32)


class Answers:
    """The reference answers of the models of one repository (their weights files), or of
    the demo family's variants (``family=True``: the weights `mmctl up` generates)."""

    def __init__(self, repository: Path | None = None, family: bool = False):
        assert (repository is None) == family, "give a repository, or family=True"
        self.repository = repository
        self._weights: dict[str, dict[str, torch.Tensor]] = {}

    def weights(self, model: str) -> dict[str, torch.Tensor]:
        if model not in self._weights:
            self._weights[model] = (
                customer_weights(FleetSpec(), model) if self.repository is None
                else load_file(str(self.repository / model / "1" / WEIGHTS_FILE)))
        return self._weights[model]

    def expected(self, model: str, x: np.ndarray) -> np.ndarray:
        return mlp_scores(self.weights(model), x)

    def matches(self, model: str, x: np.ndarray, scores: np.ndarray) -> bool:
        expected = self.expected(model, x)
        return scores.shape == expected.shape and bool(np.allclose(scores, expected, RTOL, ATOL))

    def assert_answer(self, model: str, x: np.ndarray, scores: np.ndarray) -> None:
        np.testing.assert_allclose(scores, self.expected(model, x), RTOL, ATOL,
                                   err_msg=f"not {model}'s answer")

    def which(self, candidates: list[str], x: np.ndarray, scores: np.ndarray) -> str | None:
        """The one candidate whose answer ``scores`` is, None when it is none of theirs."""
        found = [m for m in candidates if self.matches(m, x, scores)]
        assert len(found) <= 1, f"{found} answer alike: the check cannot tell them apart"
        return found[0] if found else None

    def assert_distinct(self, models: list[str], x: np.ndarray) -> None:
        """Every pair of ``models`` answers ``x`` differently beyond the tolerance: a value
        check over them tells one model from another."""
        for i, a in enumerate(models):
            for b in models[i + 1:]:
                assert not np.allclose(self.expected(a, x), self.expected(b, x), RTOL, ATOL), (a, b)
