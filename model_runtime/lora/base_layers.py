"""A LoRA base's linear layers, read from its weights file's header without torch: what the
control plane checks an adapter against when it is added (its install has no torch).

Every ``nn.Linear`` of the bases in ``models`` has a bias and a 2-D weight; their other
layers do not (embeddings have no bias, layer norms a 1-D weight).  So the layers a LoRA
adapter can target are the ``<module>.weight`` of shape ``[out, in]`` beside a
``<module>.bias`` of shape ``[out]``, the same as ``models.linear_targets`` finds on the
loaded module (a unit test holds the two to it).
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

# The layers PEFT's ``target_modules="all-linear"`` leaves out, per base kind: the output
# head (``models.TinyLM.output_layers``, ``models.RecommenderMLP.output_layers``).
OUTPUT_LAYERS: dict[str, tuple[str, ...]] = {"tinylm": ("lm_head",), "recommender": ()}


def linear_layers(weights_file: Path | str) -> dict[str, tuple[int, int]]:
    """``module -> (out_features, in_features)`` of the base's linear layers."""
    with safe_open(str(weights_file), framework="numpy") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    layers = {}
    for key, shape in shapes.items():
        module, _, part = key.rpartition(".")
        if part == "weight" and len(shape) == 2 and shapes.get(f"{module}.bias") == (shape[0],):
            layers[module] = (shape[0], shape[1])
    return layers
