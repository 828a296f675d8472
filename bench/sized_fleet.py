"""Demo fleets at a chosen size, written cheaply, and their answers checked against the
weights files (``bench.seed_scenario``, ``bench.family_swap --light-fleet``)."""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient
from tritonclient.grpc import InferInput

from control_plane.demo.fleet import (
    DELTA_SCALE,
    DEMO_FAMILY,
    FAMILY_TEMPLATE_DIR,
    WEIGHTS_FILE,
    FleetSpec,
    base_weights,
    render_family_config,
    write_model,
)
from control_plane.families import write_family, write_variant
from model_runtime.family.layout import read_layout
from tests.reference import load_weights, mlp_scores, scores_match


def varied_weights(spec: FleetSpec, name: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``name``'s own first and last layer (weights and biases): the base's plus a seeded
    delta.  A few MB however wide the hidden layers are, so a sized fleet costs one random
    draw of the big layers, not one per customer."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    out = {}
    for i in (0, spec.hidden_layers):
        bound = DELTA_SCALE / math.sqrt(base[f"layers.{i}.weight"].shape[1])
        for key in (f"layers.{i}.weight", f"layers.{i}.bias"):
            delta = (torch.rand(base[key].shape, generator=gen) * 2 - 1) * bound
            out[key] = (base[key] + delta).contiguous()
    return out


def write_sized_fleet(repository: Path, spec: FleetSpec, layout: str,
                      threads: int = min(16, os.cpu_count() or 1)) -> None:
    """Every customer of ``spec`` (hidden layers shared, first and last layer their own),
    as separate models or as the demo family's variants.  A variant is a copy of the first
    customer's weights file (the same layout, so the same header) with its own layers'
    bytes written over, ``threads`` at a time: the copies are the only pass over the big
    layers."""
    repository.mkdir(parents=True, exist_ok=True)
    base = base_weights(spec)
    names = spec.names()
    if layout == "models":
        for name in names:
            write_model(repository, name, spec, {**base, **varied_weights(spec, name, base)})
        return
    template = write_variant(repository, names[0], DEMO_FAMILY,
                             {**base, **varied_weights(spec, names[0], base)}) / WEIGHTS_FILE
    write_family(repository, DEMO_FAMILY, config_text=render_family_config(spec),
                 version_files=FAMILY_TEMPLATE_DIR / "1", base_weights=template)
    layout_, data_offset = read_layout(template)
    ranges = layout_.by_name()

    def one(name: str) -> None:
        folder = write_variant(repository, name, DEMO_FAMILY, template)
        with open(folder / WEIGHTS_FILE, "r+b") as f:
            for key, tensor in varied_weights(spec, name, base).items():
                f.seek(data_offset + ranges[key].begin)
                f.write(tensor.numpy().tobytes())

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, names[1:]))


def check_answers(url: str, repository: Path, names: list[str], layout: str, feature_dim: int) -> list[dict]:
    """Each of ``names`` asked once through the router, its SCORES against the reference
    MLP over its weights file in the repository (what Triton serves from)."""
    client = grpcclient.InferenceServerClient(url)
    features = np.ones((1, feature_dim), np.float32)
    x = InferInput("FEATURES", list(features.shape), "FP32")
    x.set_data_from_numpy(features)
    rows = []
    try:
        for name in names:
            # One variant's weights at a time: a sized fleet's are hundreds of MB each.
            expected = float(mlp_scores(load_weights(repository, name, layout), features)[0, 0])
            try:
                got = client.infer(name, [x], outputs=[grpcclient.InferRequestedOutput("SCORES")],
                                   client_timeout=120)
                answer, error = float(got.as_numpy("SCORES")[0, 0]), None
            except Exception as exc:  # noqa: BLE001  (a failed check is a result)
                answer, error = None, str(exc)[:200]
            rows.append({"model": name, "expected": expected, "answer": answer, "error": error,
                         "ok": answer is not None and scores_match(answer, expected)})
    finally:
        client.close()
    return rows
