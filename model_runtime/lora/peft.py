"""Read and write LoRA adapters in the PEFT on-disk layout.

An adapter is a directory holding ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``base_model_name_or_path``, ...) and ``adapter_model.safetensors`` whose
keys are ``base_model.model.<module>.lora_A.weight`` (shape ``[r, in]``) and
``...lora_B.weight`` (shape ``[out, r]``), exactly what ``PeftModel.save_pretrained`` writes
for a model whose ``nn.Linear`` layers are named ``<module>``.  Adapters trained with PEFT on
the bases in ``models`` therefore load unchanged.

``read_adapter`` validates everything against the base's linear layers before a tensor
reaches the serving path, and raises ``AdapterRefused`` with the reason: a malformed or
missing file, a feature this runtime does not serve (DoRA, embeddings, biases,
``modules_to_save``), or an adapter made for another base (unknown module, shape mismatch).
The control plane runs the same checks without torch (``peft_files.check_adapter``) when an
adapter is added, so bad uploads fail at ``mmctl adapter add`` instead of at the first
request.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .names import validate_adapter_name
from .peft_files import (  # noqa: F401  (the layout's names, read here too)
    CONFIG_FILE,
    PICKLE_WEIGHTS_FILE,
    WEIGHTS_FILE,
    LoraConfig,
    adapter_signature,
    not_finite,
    pair_factors,
    read_config,
    target_matches,
    unreadable,
    weights_path,
)

# The safetensors names of the torch dtypes a factor may be stored in (peft_files.WEIGHT_DTYPES).
DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
               torch.float64: "F64"}


@dataclass
class LoraAdapter:
    """One validated adapter in host memory.

    ``weights[module] = (A, B_scaled)`` with ``A`` ``[r, in]`` and ``B_scaled = scale * B``
    ``[out, r]``: the scale is folded in once at load, so the batched kernel needs no per-row
    scaling and ``x A^T B_scaled^T == scale * (x A^T) B^T``.
    """

    name: str
    config: LoraConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    source: Path | None = None
    signature: tuple = ()

    def transposed(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``module -> (A^T, B_scaled^T)`` views, the bank's layout (made once, no copies)."""
        cached = self.__dict__.get("_transposed")
        if cached is None:
            cached = {m: (a.t(), b.t()) for m, (a, b) in self.weights.items()}
            self.__dict__["_transposed"] = cached
        return cached

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def to(self, device: torch.device | str, pin_memory: bool = False) -> LoraAdapter:
        moved = {}
        for module, (a, b) in self.weights.items():
            a, b = a.to(device), b.to(device)
            if pin_memory:
                a, b = a.pin_memory(), b.pin_memory()
            moved[module] = (a, b)
        return LoraAdapter(self.name, self.config, moved, self.source, self.signature)


def read_adapter(
    path: Path | str,
    targets: Mapping[str, tuple[int, int]],
    *,
    name: str | None = None,
    max_rank: int | None = None,
    dtype: torch.dtype = torch.float32,
    all_linear_excluded: Iterable[str] = (),
    base_name: str = "this base",
) -> LoraAdapter:
    """Load and validate the PEFT adapter in ``path`` for a base whose LoRA-capable linear
    layers are ``targets`` (``module -> (out_features, in_features)``).

    Raises AdapterRefused naming the file and the reason; never returns a partial adapter.
    """
    path = Path(path)
    name = validate_adapter_name(name if name is not None else path.name)
    signature = adapter_signature(path)
    config = read_config(path, name)
    weights_file = weights_path(path, name)
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise unreadable(name, weights_file, exc) from None
    factors = pair_factors(
        name, {k: (tuple(t.shape), DTYPE_NAMES.get(t.dtype, str(t.dtype))) for k, t in tensors.items()},
        config, targets, weights_file=weights_file, max_rank=max_rank,
        all_linear_excluded=all_linear_excluded, base_name=base_name)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a_key, b_key) in factors.items():
        a, b = tensors[a_key], tensors[b_key]
        scale = config.scale_for(module)
        a_served = a.to(dtype).contiguous()
        b_served = (b.to(torch.float64) * scale).to(dtype).contiguous()
        # Checked as served (scaled, in the model's dtype): finite weights scaled by a huge
        # alpha, or beyond float16's range, overflow to infinity too.
        if not (torch.isfinite(a_served).all() and torch.isfinite(b_served).all()):
            raise not_finite(name, module, scale, str(dtype).removeprefix("torch."))
        weights[module] = (a_served, b_served)
    return LoraAdapter(name, config, weights, path, signature)


def write_adapter(
    path: Path | str,
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    r: int,
    lora_alpha: float,
    target_modules: list[str] | str,
    base_model_name_or_path: str,
    extra_config: Mapping | None = None,
) -> Path:
    """Write ``modules[name] = (A [r, in], B [out, r])`` as a PEFT adapter directory, the way
    ``PeftModel.save_pretrained`` lays it out.  The directory appears atomically."""
    path = Path(path)
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    config.update(extra_config or {})
    tensors = {}
    for module, (a, b) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().contiguous()
    tmp = path.parent / f".{path.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def merged_state_dict(
    base: Mapping[str, torch.Tensor], adapter: LoraAdapter
) -> dict[str, torch.Tensor]:
    """The base weights with the adapter merged in: ``W + (alpha / r) * B @ A`` per module.
    The reference the batched path is tested against."""
    merged = {k: v.clone() for k, v in base.items()}
    for module, (a, b_scaled) in adapter.weights.items():
        key = f"{module}.weight"
        w = merged[key]
        merged[key] = (w.to(torch.float64) + b_scaled.to(torch.float64) @ a.to(torch.float64)).to(w.dtype)
    return merged
