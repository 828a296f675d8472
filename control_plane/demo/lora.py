"""Generate the LoRA demo: the two LoRA base model folders and N PEFT adapters for each.

* ``tinylm``: ``model_repository/tinylm`` + ``1/weights.safetensors`` (seeded) + ``1/_lora``
  (a copy of ``model_runtime/lora``, so the folder is self-contained wherever it is staged).
* ``recommender_lora``: ``model_repository/recommender_lora`` + the fleet's recommender base
  weights (``demo_fleet.base_weights``) + ``1/_lora``.
* adapters ``cust001``..: PEFT directories in each model's adapter directory (default
  ``<model>/adapters``), deterministic per name, so the same command writes the same bytes.

    python -m control_plane.demo.lora --repository .state/repository --adapters 50
"""

from __future__ import annotations

import argparse
import math
import shutil
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from control_plane.demo.fleet import FEATURES_INPUT, FleetSpec, base_weights, default_instance_kind
from domain import model_config
from domain.names import validate_model_name
from model_runtime import copy_runtime
from model_runtime.lora.models import (
    RecommenderMLP,
    TinyLM,
    TinyLMConfig,
    linear_targets,
    save_tinylm,
    tinylm_random_weights,
)
from model_runtime.lora.peft import write_adapter

REPO_MODELS = Path(__file__).resolve().parents[2] / "model_repository"
LORA_PACKAGE = Path(__file__).resolve().parents[2] / "model_runtime" / "lora"
RUNTIME_DIR = "_lora"
WEIGHTS_FILE = "weights.safetensors"
ADAPTER_DIR = "adapters"
TINYLM_SEED = 20261122

TINYLM = "tinylm"
RECOMMENDER = "recommender_lora"
BASES = (TINYLM, RECOMMENDER)

# What the demo adapters adapt: the usual attention + MLP projections of the LM (PEFT
# suffix names), every layer of the recommender.
DEFAULT_TARGETS = {
    TINYLM: ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
    RECOMMENDER: ["layers.0", "layers.1", "layers.2"],
}


@dataclass(frozen=True)
class LoraDemoSpec:
    adapters: int = 8
    rank: int = 8
    prefix: str = "cust"
    instance_kind: str = "KIND_CPU"  # KIND_GPU when the models are for a GPU server
    tinylm: TinyLMConfig = field(default_factory=TinyLMConfig)
    recommender: FleetSpec = field(default_factory=FleetSpec)
    # Model config parameters for both models (see model_runtime/lora/runtime.py).
    parameters: Mapping[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [f"{self.prefix}{i:03d}" for i in range(1, self.adapters + 1)]


def tinylm_base_weights(cfg: TinyLMConfig | None = None) -> dict[str, torch.Tensor]:
    return tinylm_random_weights(cfg or TinyLMConfig(), TINYLM_SEED)


def base_targets(base: str, spec: LoraDemoSpec = LoraDemoSpec()) -> dict[str, tuple[int, int]]:
    """``module -> (out, in)`` of every LoRA-capable layer of ``base``."""
    if base == TINYLM:
        return linear_targets(TinyLM(spec.tinylm))
    if base == RECOMMENDER:
        return linear_targets(RecommenderMLP(base_weights(spec.recommender)))
    raise ValueError(f"unknown LoRA base {base!r}; use one of {BASES}")


def render_config(base: str, name: str, spec: LoraDemoSpec, parameters: Mapping[str, str]) -> str:
    """The base's template config.pbtxt with this model's name, instance kind, feature
    dimension (recommender) and parameters (``parameters`` over ``spec.parameters``)."""
    config = model_config.read_config(REPO_MODELS / base / model_config.CONFIG_FILE)
    model_config.set_name(config, name)
    model_config.set_instance_kind(config, "KIND_CPU", spec.instance_kind)
    if base == RECOMMENDER:
        model_config.set_input_dims(config, FEATURES_INPUT, [spec.recommender.feature_dim])
    for key, value in {**spec.parameters, **parameters}.items():
        model_config.set_parameter(config, key, value)
    return model_config.render_config(config)


def write_lora_model(
    repository: Path,
    base: str,
    spec: LoraDemoSpec = LoraDemoSpec(),
    name: str | None = None,
    parameters: Mapping[str, str] | None = None,
) -> Path:
    """Write one self-contained LoRA base model folder atomically (template config and
    model.py, generated base weights, a copy of the LoRA runtime, an empty adapters/).
    An existing ``adapters/`` folder is kept: adapters are staged separately."""
    name = validate_model_name(name or base)
    final = repository / name
    tmp = repository / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    version = tmp / "1"
    version.mkdir(parents=True)
    shutil.copy2(REPO_MODELS / base / "1" / "model.py", version / "model.py")
    copy_runtime(LORA_PACKAGE, version / RUNTIME_DIR)
    if base == TINYLM:
        save_tinylm(version / WEIGHTS_FILE, tinylm_base_weights(spec.tinylm), spec.tinylm)
    elif base == RECOMMENDER:
        save_file(base_weights(spec.recommender), str(version / WEIGHTS_FILE))
    else:
        raise ValueError(f"unknown LoRA base {base!r}; use one of {BASES}")
    (tmp / "config.pbtxt").write_text(render_config(base, name, spec, parameters or {}))
    if (final / ADAPTER_DIR).is_dir():
        shutil.move(str(final / ADAPTER_DIR), str(tmp / ADAPTER_DIR))
    else:
        (tmp / ADAPTER_DIR).mkdir()
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def demo_adapter_weights(
    targets: Mapping[str, tuple[int, int]],
    target_modules: list[str],
    name: str,
    rank: int,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Seeded by the adapter name.  B is not zero (as it would be right after PEFT's init)
    so every demo adapter visibly changes the output."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    weights = {}
    for module, (out_features, in_features) in sorted(targets.items()):
        if not any(module == t or module.endswith("." + t) for t in target_modules):
            continue
        a = torch.randn(rank, in_features, generator=gen) / math.sqrt(in_features)
        b = torch.randn(out_features, rank, generator=gen) * (0.25 / math.sqrt(rank))
        weights[module] = (a, b)
    return weights


def write_demo_adapter(
    adapter_dir: Path,
    base: str,
    name: str,
    rank: int = 8,
    spec: LoraDemoSpec = LoraDemoSpec(),
    target_modules: list[str] | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    target_modules = list(target_modules or DEFAULT_TARGETS[base])
    weights = demo_adapter_weights(base_targets(base, spec), target_modules, name, rank)
    return write_adapter(
        adapter_dir / name,
        weights,
        r=rank,
        lora_alpha=2 * rank,
        target_modules=target_modules,
        base_model_name_or_path=base_model_name_or_path or base,
    )


def generate_adapters(
    adapter_dir: Path, base: str, names: list[str], rank: int = 8, spec: LoraDemoSpec = LoraDemoSpec()
) -> list[str]:
    adapter_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        write_demo_adapter(adapter_dir, base, name, rank, spec)
    return names


def generate_lora_demo(repository: Path, spec: LoraDemoSpec = LoraDemoSpec()) -> dict[str, list[str]]:
    """Both LoRA bases and ``spec.adapters`` adapters for each; returns base -> adapter names."""
    repository.mkdir(parents=True, exist_ok=True)
    written = {}
    for base in BASES:
        folder = write_lora_model(repository, base, spec)
        written[base] = generate_adapters(folder / ADAPTER_DIR, base, spec.names(), spec.rank, spec)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True, help="Triton model repository")
    parser.add_argument("--adapters", type=int, default=8, help="adapters per base")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--instance-kind", default=default_instance_kind())
    args = parser.parse_args(argv)
    spec = LoraDemoSpec(adapters=args.adapters, rank=args.rank, instance_kind=args.instance_kind)
    for base, names in generate_lora_demo(args.repository, spec).items():
        print(f"{base}: {args.repository / base} with {len(names)} adapters")


if __name__ == "__main__":
    main()
