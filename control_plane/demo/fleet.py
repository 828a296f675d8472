"""Generate the demo fleet: per-customer fine-tunes of one recommender base model.

``cust001``..``custNNN`` share the code in model_repository/recommender and differ in their
weights: base + a small per-customer delta, both from seeded generators, so the same
command always writes the same bytes.  Small by default (tests stay fast); ``size_mb``
widens the hidden layers to reach a target weight size (the seed scenario's 850 MB).
"""

from __future__ import annotations

import math
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from control_plane.demo import DEMO_MARKER, DEMO_VERSIONS
from domain import model_config
from domain.names import validate_model_name

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "recommender"
WEIGHTS_FILE = "weights.safetensors"
FEATURES_INPUT = "FEATURES"
BASE_SEED = 20261121
DELTA_SCALE = 0.05


@dataclass(frozen=True)
class FleetSpec:
    count: int = 50
    feature_dim: int = 64
    hidden_dim: int = 128
    hidden_layers: int = 2
    max_batch_size: int = 64
    instance_kind: str = "KIND_CPU"  # KIND_GPU when the fleet is for a GPU server
    prefix: str = "cust"
    extra_parameters: tuple[tuple[str, str], ...] = ()

    def names(self) -> list[str]:
        return [f"{self.prefix}{i:03d}" for i in range(1, self.count + 1)]


def hidden_dim_for_size(size_mb: float, feature_dim: int = 64, hidden_layers: int = 2) -> int:
    """Width whose fp32 weights take about ``size_mb`` MB: F*H + (L-1)*H^2 + H params."""
    params = size_mb * 1e6 / 4
    a, b, c = hidden_layers - 1, feature_dim + 1, -params
    if a == 0:
        return max(1, int(params / b))
    return max(1, int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))


def default_instance_kind() -> str:
    return "KIND_GPU" if torch.cuda.is_available() else "KIND_CPU"


def _layer_shapes(spec: FleetSpec) -> list[tuple[int, int]]:
    dims = [spec.feature_dim] + [spec.hidden_dim] * spec.hidden_layers + [1]
    return [(dims[i + 1], dims[i]) for i in range(len(dims) - 1)]


def _random_weights(spec: FleetSpec, seed: int, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i, (out_dim, in_dim) in enumerate(_layer_shapes(spec)):
        bound = scale / math.sqrt(in_dim)
        weights[f"layers.{i}.weight"] = (torch.rand(out_dim, in_dim, generator=gen) * 2 - 1) * bound
        weights[f"layers.{i}.bias"] = (torch.rand(out_dim, generator=gen) * 2 - 1) * bound
    return weights


def base_weights(spec: FleetSpec) -> dict[str, torch.Tensor]:
    return _random_weights(spec, BASE_SEED, 1.0)


def customer_weights(spec: FleetSpec, name: str, base: dict[str, torch.Tensor] | None = None):
    base = base if base is not None else base_weights(spec)
    delta = _random_weights(spec, zlib.crc32(name.encode()), DELTA_SCALE)
    return {k: (base[k] + delta[k]).contiguous() for k in base}


def render_config(spec: FleetSpec, name: str) -> str:
    """The template's config.pbtxt with this model's name, feature dimension, batch size,
    instance kind and extra parameters."""
    config = model_config.read_config(TEMPLATE_DIR / model_config.CONFIG_FILE)
    model_config.set_name(config, name)
    model_config.set_input_dims(config, FEATURES_INPUT, [spec.feature_dim])
    config.max_batch_size = spec.max_batch_size
    model_config.set_instance_kind(config, "KIND_CPU", spec.instance_kind)
    for key, value in spec.extra_parameters:
        model_config.set_parameter(config, key, value)
    return model_config.render_config(config)


def write_model(repository: Path, name: str, spec: FleetSpec, weights: dict[str, torch.Tensor]) -> Path:
    """Write one model folder atomically (a half-written folder is never visible by name)."""
    validate_model_name(name)
    final = repository / name
    tmp = repository / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "1").mkdir(parents=True)
    shutil.copy2(TEMPLATE_DIR / "1" / "model.py", tmp / "1" / "model.py")
    save_file(weights, str(tmp / "1" / WEIGHTS_FILE))
    (tmp / "config.pbtxt").write_text(render_config(spec, name))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


MODEL_REPOSITORY_DIR = TEMPLATE_DIR.parent
# Rollout drills on cust017: two healthy new versions and one that loads and warms up
# fine but then fails every other request (a bad canary).
DEMO_VARIANTS = (("cust017-v2", ()), ("cust017-v3", ()), ("cust017-faulty", (("fail_fraction", "0.5"),)))
def demo_spec(count: int, size_mb: float | None = None) -> FleetSpec:
    """The demo fleet's spec: ``count`` customers on this machine's instance kind, each
    ``size_mb`` of weights (None: the small default)."""
    spec = FleetSpec(count=count, instance_kind=default_instance_kind())
    if size_mb:
        spec = FleetSpec(count=count, instance_kind=spec.instance_kind, hidden_dim=hidden_dim_for_size(size_mb))
    return spec


def generate_extras(repository: Path, spec: FleetSpec = FleetSpec(), family: bool = False) -> list[str]:
    """The identity model and cust017's rollout variants, written if missing (``family``:
    the healthy ones are variants of the demo family, written by generate_family_fleet)."""
    written = []
    repository.mkdir(parents=True, exist_ok=True)
    (repository / DEMO_MARKER).write_text("written by the demo fleet: " + ", ".join(
        f"{folder} is version {version} of {model}" for folder, (model, version) in DEMO_VERSIONS.items()))
    if not (repository / "identity" / "config.pbtxt").exists():
        tmp = repository / ".identity.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(MODEL_REPOSITORY_DIR / "identity", tmp, ignore=shutil.ignore_patterns("README.md", "__pycache__"))
        tmp.rename(repository / "identity")
        written.append("identity")
    base = base_weights(spec)
    for name, params in DEMO_VARIANTS:
        if (repository / name).exists() or (family and name in FAMILY_VARIANTS):
            continue
        variant_spec = FleetSpec(**{**spec.__dict__, "extra_parameters": params})
        write_model(repository, name, variant_spec, customer_weights(spec, name, base))
        written.append(name)
    return written


def generate_fleet(repository: Path, spec: FleetSpec = FleetSpec(), overwrite: bool = False) -> list[str]:
    """Write every customer's model; existing folders are kept unless ``overwrite``."""
    repository.mkdir(parents=True, exist_ok=True)
    base = base_weights(spec)
    written = []
    for name in spec.names():
        if (repository / name / "config.pbtxt").exists() and not overwrite:
            continue
        write_model(repository, name, spec, customer_weights(spec, name, base))
        written.append(name)
    return written


FAMILY_TEMPLATE_DIR = MODEL_REPOSITORY_DIR / "recommender_family"
DEMO_FAMILY = "recommender"
# The rollout drills' healthy versions are variants too; cust017-faulty injects failures
# through its own config, so it stays a model of its own.
FAMILY_VARIANTS = ("cust017-v2", "cust017-v3")


def render_family_config(spec: FleetSpec) -> str:
    config = model_config.read_config(FAMILY_TEMPLATE_DIR / model_config.CONFIG_FILE)
    model_config.set_input_dims(config, FEATURES_INPUT, [spec.feature_dim])
    config.max_batch_size = spec.max_batch_size
    model_config.set_instance_kind(config, "KIND_CPU", spec.instance_kind)
    for key, value in spec.extra_parameters:
        model_config.set_parameter(config, key, value)
    return model_config.render_config(config)


def generate_family_fleet(repository: Path, spec: FleetSpec = FleetSpec(),
                          family: str = DEMO_FAMILY) -> list[str]:
    """The demo fleet as one model family: the family folder (the recommender's code once)
    and one variant folder per customer (weights only).  Folders present are kept."""
    from control_plane.families import write_family, write_variant

    repository.mkdir(parents=True, exist_ok=True)
    base = base_weights(spec)
    written = []
    if not (repository / family / "config.pbtxt").exists():
        base_file = repository / f".{family}.base.safetensors"
        save_file(base, str(base_file))
        try:
            write_family(repository, family, config_text=render_family_config(spec),
                         version_files=FAMILY_TEMPLATE_DIR / "1", base_weights=base_file)
        finally:
            base_file.unlink(missing_ok=True)
        written.append(family)
    for name in [*spec.names(), *FAMILY_VARIANTS]:
        if (repository / name).exists():
            continue
        write_variant(repository, name, family, customer_weights(spec, name, base))
        written.append(name)
    return written
