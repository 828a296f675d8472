"""The PEFT adapter layout without torch: its file names, ``adapter_config.json`` read and
validated (``LoraConfig``), the weights' keys, shapes, dtypes and ranks checked against a
base's linear layers (``pair_factors``), and ``check_adapter``: the whole check, values
included, on numpy.

The control plane stages adapters with ``check_adapter`` (its install has no torch); the
model loads them with ``peft.read_adapter``, which runs the same checks on the tensors it
serves.  Both refuse with ``AdapterRefused`` in the same words.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, deserialize, safe_open

from .errors import AdapterRefused
from .names import validate_adapter_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
# The dtypes a LoRA factor may be stored in, by their safetensors names (what PEFT saves;
# float8 has no isfinite).
WEIGHT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
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


def refused(name: str, reason: str) -> AdapterRefused:
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
            raise refused(name, f"{CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise refused(name, f"peft_type is {peft_type!r}; only LORA adapters are served")
        r = raw.get("r")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise refused(name, f"'r' must be a positive integer, got {r!r}")
        alpha = raw.get("lora_alpha", r)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise refused(name, f"'lora_alpha' must be a number, got {alpha!r}")
        for flag, reason in _REFUSED_FLAGS.items():
            if raw.get(flag):
                raise refused(name, reason)
        bias = raw.get("bias", "none")
        if bias not in (None, "none"):
            raise refused(name, f"bias={bias!r} is not supported (only 'none')")
        if raw.get("modules_to_save"):
            raise refused(
                name, f"modules_to_save={raw['modules_to_save']!r} is not supported: "
                "an adapter may only add low-rank updates"
            )
        targets = raw.get("target_modules")
        if isinstance(targets, list):
            if not all(isinstance(t, str) and t for t in targets):
                raise refused(name, f"'target_modules' must be a list of names, got {targets!r}")
            targets = tuple(targets)
        elif targets is not None and not isinstance(targets, str):
            raise refused(name, f"'target_modules' must be a list or a regex string, got {targets!r}")
        rank_pattern = raw.get("rank_pattern") or {}
        alpha_pattern = raw.get("alpha_pattern") or {}
        if not isinstance(rank_pattern, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in rank_pattern.values()
        ):
            raise refused(name, f"'rank_pattern' must map patterns to positive ints, got {rank_pattern!r}")
        if not isinstance(alpha_pattern, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in alpha_pattern.values()
        ):
            raise refused(name, f"'alpha_pattern' must map patterns to finite numbers, got {alpha_pattern!r}")
        # Patterns are compiled here, where a bad one is refused with the file's name (re.error
        # later was an internal error on every request naming the adapter).
        for where, pattern in [("target_modules", targets if isinstance(targets, str) else None),
                               *(("rank_pattern", k) for k in rank_pattern),
                               *(("alpha_pattern", k) for k in alpha_pattern)]:
            if pattern is None:
                continue
            if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
                raise refused(name, f"{where} pattern {str(pattern)[:80]!r} must be a regular "
                            f"expression of at most {MAX_PATTERN_CHARS} characters")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise refused(name, f"{where} pattern {pattern!r} is not a regular expression: {exc}") from None
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


def read_config(path: Path, name: str) -> LoraConfig:
    """``path``'s ``adapter_config.json``, validated."""
    config_path = path / CONFIG_FILE
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise refused(name, f"{config_path} is missing (not a PEFT adapter directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refused(name, f"{config_path} is not valid JSON: {exc}") from None
    return LoraConfig.from_dict(raw, name)


def weights_path(path: Path, name: str) -> Path:
    """``path``'s weights file; a pickled one is refused (loading it can run code)."""
    found = path / WEIGHTS_FILE
    if not found.exists():
        if (path / PICKLE_WEIGHTS_FILE).exists():
            raise refused(
                name, f"only {PICKLE_WEIGHTS_FILE} found; pickled weights are not loaded (they can "
                f"run code): save with safe_serialization=True to get {WEIGHTS_FILE}"
            )
        raise refused(name, f"{found} is missing")
    return found


def unreadable(name: str, path: Path, exc: Exception) -> AdapterRefused:
    return refused(name, f"{path} is not a readable safetensors file: {exc}")


def pair_factors(
    name: str,
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    config: LoraConfig,
    targets: Mapping[str, tuple[int, int]],
    *,
    weights_file: Path,
    max_rank: int | None = None,
    all_linear_excluded: Iterable[str] = (),
    base_name: str = "this base",
) -> dict[str, tuple[str, str]]:
    """``module -> (lora_A key, lora_B key)`` of an adapter whose weights file holds
    ``tensors`` (``key -> (shape, safetensors dtype name)``), for a base whose LoRA-capable
    linear layers are ``targets`` (``module -> (out_features, in_features)``); raises
    AdapterRefused on the first key, module, shape, rank or dtype that does not fit."""
    pairs: dict[str, dict[str, str]] = {}
    for key in tensors:
        for marker, reason in _UNSUPPORTED_KEYS:
            if marker in key:
                raise refused(name, f"{reason} (tensor {key!r})")
        match = _KEY_RE.match(key)
        if match is None:
            raise refused(
                name, f"unexpected tensor {key!r}: expected base_model.model.<module>.lora_A.weight "
                "or .lora_B.weight"
            )
        pairs.setdefault(match["module"], {})[match["which"]] = key
    if not pairs:
        raise refused(name, f"{weights_file} holds no LoRA tensors")

    excluded = tuple(all_linear_excluded)
    if config.target_modules is not None and not any(
        target_matches(config.target_modules, m, excluded) for m in targets
    ):
        raise refused(
            name, f"target_modules {config.target_modules!r} name no linear layer of {base_name} "
            f"(its layers: {', '.join(sorted(targets))}); was it made for another base "
            f"({config.base_model_name_or_path or 'unknown'})?"
        )

    factors: dict[str, tuple[str, str]] = {}
    for module in sorted(pairs):
        pair = pairs[module]
        if module not in targets:
            raise refused(
                name, f"module {module!r} is not a linear layer of {base_name}; the adapter was "
                f"made for another base ({config.base_model_name_or_path or 'unknown'})"
            )
        missing = {"A", "B"} - set(pair)
        if missing:
            raise refused(name, f"module {module!r} has no lora_{missing.pop()} tensor")
        (a_shape, a_dtype), (b_shape, b_dtype) = tensors[pair["A"]], tensors[pair["B"]]
        out_features, in_features = targets[module]
        r = config.rank_for(module)
        if len(a_shape) != 2 or len(b_shape) != 2:
            raise refused(name, f"{module}: lora_A/lora_B must be 2-D, got {list(a_shape)} and "
                          f"{list(b_shape)}")
        if tuple(a_shape) != (r, in_features) or tuple(b_shape) != (out_features, r):
            raise refused(
                name, f"{module}: lora_A is {list(a_shape)} and lora_B is {list(b_shape)}, but "
                f"{base_name} expects [{r}, {in_features}] and [{out_features}, {r}] for r={r} "
                "(shape mismatch: an adapter for another base, or a wrong 'r')"
            )
        if max_rank is not None and r > max_rank:
            raise refused(
                name, f"{module}: rank {r} exceeds this model's max_lora_rank {max_rank}; "
                "raise max_lora_rank in the model config"
            )
        if a_dtype not in WEIGHT_DTYPES or b_dtype not in WEIGHT_DTYPES:
            raise refused(name, f"{module}: tensors must be floating point (float16, bfloat16, "
                          f"float32 or float64), got {a_dtype}/{b_dtype}")
        factors[module] = (pair["A"], pair["B"])
    return factors


def not_finite(name: str, module: str, scale: float, dtype: str) -> AdapterRefused:
    return refused(name, f"{module}: weights contain NaN or infinity, or overflow once "
                   f"scaled by alpha / r ({scale:g}) in {dtype}")


@dataclass(frozen=True)
class CheckedAdapter:
    """What ``check_adapter`` found: the adapter's config, its largest rank and the bytes
    its factors take where they are served in float32."""

    name: str
    config: LoraConfig
    rank: int
    nbytes: int


def _as_float64(dtype: str, data: bytes, shape: list[int]) -> np.ndarray:
    """A float factor's little-endian bytes as float64 (bfloat16: the high half of a float32)."""
    if dtype == "BF16":
        values = (np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4")
    else:
        values = np.frombuffer(data, {"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype])
    return values.astype(np.float64).reshape(shape)


def check_adapter(
    path: Path | str,
    targets: Mapping[str, tuple[int, int]],
    *,
    name: str | None = None,
    max_rank: int | None = None,
    all_linear_excluded: Iterable[str] = (),
    base_name: str = "this base",
) -> CheckedAdapter:
    """``peft.read_adapter``'s checks without torch, for the adapter's factors as the model
    serves them by default (float32, B scaled by alpha / r): raises AdapterRefused in its
    words, or says what was found."""
    path = Path(path)
    name = validate_adapter_name(name if name is not None else path.name)
    config = read_config(path, name)
    weights = weights_path(path, name)
    try:  # the header first: an adapter that does not fit is refused before its bytes are read
        with safe_open(str(weights), framework="numpy") as header:
            slices = {key: header.get_slice(key) for key in header.keys()}  # noqa: SIM118 (no mapping)
            specs = {key: (tuple(s.get_shape()), s.get_dtype()) for key, s in slices.items()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise unreadable(name, weights, exc) from None
    factors = pair_factors(
        name, specs, config, targets, weights_file=weights, max_rank=max_rank,
        all_linear_excluded=all_linear_excluded, base_name=base_name)
    try:  # the factors' bytes (numpy has no bfloat16: read as bytes and widened here)
        tensors = dict(deserialize(weights.read_bytes()))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise unreadable(name, weights, exc) from None
    nbytes = 0
    for module, (a_key, b_key) in factors.items():
        a, b = tensors[a_key], tensors[b_key]
        scale = config.scale_for(module)
        with np.errstate(over="ignore", invalid="ignore"):
            a_served = _as_float64(a["dtype"], a["data"], a["shape"]).astype(np.float32)
            b_served = (_as_float64(b["dtype"], b["data"], b["shape"]) * scale).astype(np.float32)
        if not (np.isfinite(a_served).all() and np.isfinite(b_served).all()):
            raise not_finite(name, module, scale, "float32")
        nbytes += a_served.nbytes + b_served.nbytes
    return CheckedAdapter(name, config, max(config.rank_for(m) for m in factors), nbytes)
