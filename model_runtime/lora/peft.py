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
The control plane can call it when an adapter is added, so bad uploads fail at
``mmctl adapter add`` instead of at the first request.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import AdapterRefused
from .names import validate_adapter_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
# The dtypes a LoRA factor may be stored in (what PEFT saves; float8 has no isfinite).
WEIGHT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# A PEFT pattern names a module, a few dozen characters: a long one is no module's name.
MAX_PATTERN_CHARS = 256

# PEFT strips the adapter name ("default") when it saves; older files may still carry it.
_KEY_RE = re.compile(
    r"^base_model\.model\.(?P<module>.+?)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[A-Za-z0-9_\-]+))?"
    r"\.weight$"
)
_UNSUPPORTED_KEYS = (
    ("lora_embedding_", "LoRA on embedding layers is not supported (only nn.Linear targets)"),
    ("lora_magnitude_vector", "DoRA adapters (use_dora) are not supported"),
)

# adapter_config.json fields that change the math; anything else (dropout, init, task type,
# revision...) only matters for training and is ignored.
_REFUSED_FLAGS = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2 Conv1D layout) are not supported",
}


def _fail(name: str, reason: str) -> AdapterRefused:
    return AdapterRefused(f"adapter {name!r} refused: {reason}")


@dataclass(frozen=True)
class LoraConfig:
    """The fields of ``adapter_config.json`` that decide the forward pass, validated."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None
    base_model_name_or_path: str | None = None
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: object, name: str = "?") -> LoraConfig:
        if not isinstance(raw, dict):
            raise _fail(name, f"{CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise _fail(name, f"peft_type is {peft_type!r}; only LORA adapters are served")
        r = raw.get("r")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise _fail(name, f"'r' must be a positive integer, got {r!r}")
        alpha = raw.get("lora_alpha", r)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise _fail(name, f"'lora_alpha' must be a number, got {alpha!r}")
        for flag, reason in _REFUSED_FLAGS.items():
            if raw.get(flag):
                raise _fail(name, reason)
        bias = raw.get("bias", "none")
        if bias not in (None, "none"):
            raise _fail(name, f"bias={bias!r} is not supported (only 'none')")
        if raw.get("modules_to_save"):
            raise _fail(
                name, f"modules_to_save={raw['modules_to_save']!r} is not supported: "
                "an adapter may only add low-rank updates"
            )
        targets = raw.get("target_modules")
        if isinstance(targets, list):
            if not all(isinstance(t, str) and t for t in targets):
                raise _fail(name, f"'target_modules' must be a list of names, got {targets!r}")
            targets = tuple(targets)
        elif targets is not None and not isinstance(targets, str):
            raise _fail(name, f"'target_modules' must be a list or a regex string, got {targets!r}")
        rank_pattern = raw.get("rank_pattern") or {}
        alpha_pattern = raw.get("alpha_pattern") or {}
        if not isinstance(rank_pattern, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in rank_pattern.values()
        ):
            raise _fail(name, f"'rank_pattern' must map patterns to positive ints, got {rank_pattern!r}")
        if not isinstance(alpha_pattern, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in alpha_pattern.values()
        ):
            raise _fail(name, f"'alpha_pattern' must map patterns to finite numbers, got {alpha_pattern!r}")
        # Patterns are compiled here, where a bad one is refused with the file's name (re.error
        # later was an internal error on every request naming the adapter).
        for where, pattern in [("target_modules", targets if isinstance(targets, str) else None),
                               *(("rank_pattern", k) for k in rank_pattern),
                               *(("alpha_pattern", k) for k in alpha_pattern)]:
            if pattern is None:
                continue
            if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
                raise _fail(name, f"{where} pattern {str(pattern)[:80]!r} must be a regular "
                            f"expression of at most {MAX_PATTERN_CHARS} characters")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise _fail(name, f"{where} pattern {pattern!r} is not a regular expression: {exc}") from None
        base = raw.get("base_model_name_or_path")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets,
            base_model_name_or_path=str(base) if base else None,
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=dict(rank_pattern),
            alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        )

    @staticmethod
    def _pattern_value(patterns: Mapping, module: str):
        # PEFT matches a pattern against the end of the dotted module name.
        for key, value in patterns.items():
            if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
                return value
        return None

    def rank_for(self, module: str) -> int:
        value = self._pattern_value(self.rank_pattern, module)
        return self.r if value is None else int(value)

    def alpha_for(self, module: str) -> float:
        value = self._pattern_value(self.alpha_pattern, module)
        return self.lora_alpha if value is None else float(value)

    def scale_for(self, module: str) -> float:
        """alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA, as PEFT computes it."""
        r = self.rank_for(module)
        alpha = self.alpha_for(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def target_matches(
    target_modules: tuple[str, ...] | str | None,
    module: str,
    all_linear_excluded: Iterable[str] = (),
) -> bool:
    """PEFT's rule: a regex string must match the whole name; a list entry must equal the name
    or its dotted suffix; ``"all-linear"`` takes every linear layer but the output head."""
    if target_modules is None:
        return True
    if target_modules == "all-linear" or target_modules == ("all-linear",):
        return module not in set(all_linear_excluded)
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith("." + t) for t in target_modules)


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


def adapter_signature(path: Path) -> tuple:
    """Changes when the adapter's files are replaced (re-staged); used to retry a refusal."""
    sig = []
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (path / file).stat()
            sig.append((file, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            sig.append((file, None))
    return tuple(sig)


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
    config_path = path / CONFIG_FILE
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise _fail(name, f"{config_path} is missing (not a PEFT adapter directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(name, f"{config_path} is not valid JSON: {exc}") from None
    config = LoraConfig.from_dict(raw, name)

    weights_path = path / WEIGHTS_FILE
    if not weights_path.exists():
        if (path / PICKLE_WEIGHTS_FILE).exists():
            raise _fail(
                name, f"only {PICKLE_WEIGHTS_FILE} found; pickled weights are not loaded (they can "
                f"run code): save with safe_serialization=True to get {WEIGHTS_FILE}"
            )
        raise _fail(name, f"{weights_path} is missing")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _fail(name, f"{weights_path} is not a readable safetensors file: {exc}") from None

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for marker, reason in _UNSUPPORTED_KEYS:
            if marker in key:
                raise _fail(name, f"{reason} (tensor {key!r})")
        match = _KEY_RE.match(key)
        if match is None:
            raise _fail(
                name, f"unexpected tensor {key!r}: expected base_model.model.<module>.lora_A.weight "
                "or .lora_B.weight"
            )
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise _fail(name, f"{weights_path} holds no LoRA tensors")

    excluded = tuple(all_linear_excluded)
    if config.target_modules is not None and not any(
        target_matches(config.target_modules, m, excluded) for m in targets
    ):
        raise _fail(
            name, f"target_modules {config.target_modules!r} name no linear layer of {base_name} "
            f"(its layers: {', '.join(sorted(targets))}); was it made for another base "
            f"({config.base_model_name_or_path or 'unknown'})?"
        )

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in sorted(pairs):
        pair = pairs[module]
        if module not in targets:
            raise _fail(
                name, f"module {module!r} is not a linear layer of {base_name}; the adapter was "
                f"made for another base ({config.base_model_name_or_path or 'unknown'})"
            )
        missing = {"A", "B"} - set(pair)
        if missing:
            raise _fail(name, f"module {module!r} has no lora_{missing.pop()} tensor")
        a, b = pair["A"], pair["B"]
        out_features, in_features = targets[module]
        r = config.rank_for(module)
        if a.dim() != 2 or b.dim() != 2:
            raise _fail(name, f"{module}: lora_A/lora_B must be 2-D, got {list(a.shape)} and {list(b.shape)}")
        if tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise _fail(
                name, f"{module}: lora_A is {list(a.shape)} and lora_B is {list(b.shape)}, but "
                f"{base_name} expects [{r}, {in_features}] and [{out_features}, {r}] for r={r} "
                "(shape mismatch: an adapter for another base, or a wrong 'r')"
            )
        if max_rank is not None and r > max_rank:
            raise _fail(
                name, f"{module}: rank {r} exceeds this model's max_lora_rank {max_rank}; "
                "raise max_lora_rank in the model config"
            )
        if a.dtype not in WEIGHT_DTYPES or b.dtype not in WEIGHT_DTYPES:
            raise _fail(name, f"{module}: tensors must be floating point (float16, bfloat16, "
                        f"float32 or float64), got {a.dtype}/{b.dtype}")
        scale = config.scale_for(module)
        a_served = a.to(dtype).contiguous()
        b_served = (b.to(torch.float64) * scale).to(dtype).contiguous()
        # Checked as served (scaled, in the model's dtype): finite weights scaled by a huge
        # alpha, or beyond float16's range, overflow to infinity too.
        if not (torch.isfinite(a_served).all() and torch.isfinite(b_served).all()):
            raise _fail(name, f"{module}: weights contain NaN or infinity, or overflow once "
                        f"scaled by alpha / r ({scale:g}) in {dtype}")
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
