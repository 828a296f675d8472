"""What the demo recommender computes, with plain tensor ops: tests compare served scores
with it.  One implementation, shared with the benchmarks: control_plane/demo/reference.py."""

from __future__ import annotations

from control_plane.demo.reference import (
    ReferenceAnswers,
    expected_scores,
    load_weights,
    mlp_scores,
    scores_match,
    weights_path,
)

__all__ = ["ReferenceAnswers", "expected_scores", "load_weights", "mlp_scores", "scores_match",
           "weights_path"]
