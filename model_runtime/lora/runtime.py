"""Assemble a LoRA model's runtime from its config parameters, and the per-base pieces.

Pure Python + torch: the Triton glue converts wire tensors to the payloads here and back,
and unit tests build the very same runtime without Triton.

Model config parameters (``parameters { key: ... value: { string_value: ... } }``):

    adapter_dir            adapter directory; relative paths are relative to the model folder
                           (default "adapters")
    max_device_adapters    device slots, i.e. adapters resident at once (default 8)
    max_host_adapters      adapters kept in host memory behind the slots (default 64)
    max_lora_rank          largest rank served; the bank pads every adapter to it (default 16)
    manifest_poll_s        how often the manifest file is checked for changes (default 0.5)
    dtype                  float32 | float64 | float16 | bfloat16 (default float32)
    default_max_new_tokens tinylm: budget when a request names none (default 32)
    max_new_tokens_limit   tinylm: the largest budget a request may ask for (default 128)
    adapter_load_delay_s   test hook: sleep this long in every cold load (default 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .bank import LoraBank
from .cache import AdapterCache, AdapterSource
from .errors import InvalidRequest
from .manifest import ManifestWatcher
from .models import RecommenderMLP, TinyLM, linear_targets
from .names import validate_adapter_name
from .server import BatchServer, Job

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _int(params: Mapping[str, str], key: str, default: int, minimum: int) -> int:
    raw = params.get(key, "")
    try:
        value = int(raw) if str(raw).strip() else default
    except ValueError:
        raise InvalidRequest(f"model parameter {key}={raw!r} is not an integer") from None
    if value < minimum:
        raise InvalidRequest(f"model parameter {key} ({value}) must be >= {minimum}")
    return value


def _float(params: Mapping[str, str], key: str, default: float) -> float:
    raw = params.get(key, "")
    try:
        value = float(raw) if str(raw).strip() else default
    except ValueError:
        raise InvalidRequest(f"model parameter {key}={raw!r} is not a number") from None
    if value < 0:
        raise InvalidRequest(f"model parameter {key} ({value}) must be >= 0")
    return value


@dataclass(frozen=True)
class LoraSettings:
    adapter_dir: Path
    max_device_adapters: int = 8
    max_host_adapters: int = 64
    max_lora_rank: int = 16
    manifest_poll_s: float = 0.5
    dtype: torch.dtype = torch.float32
    default_max_new_tokens: int = 32
    max_new_tokens_limit: int = 128
    adapter_load_delay_s: float = 0.0

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model_dir: Path | str) -> LoraSettings:
        """Parse and validate a model config's string parameters once, at initialize."""
        dtype_name = params.get("dtype", "") or "float32"
        if dtype_name not in DTYPES:
            raise InvalidRequest(f"model parameter dtype={dtype_name!r}; use one of {sorted(DTYPES)}")
        adapter_dir = Path(params.get("adapter_dir", "") or "adapters")
        if not adapter_dir.is_absolute():
            adapter_dir = Path(model_dir) / adapter_dir
        settings = cls(
            adapter_dir=adapter_dir,
            max_device_adapters=_int(params, "max_device_adapters", cls.max_device_adapters, 1),
            max_host_adapters=_int(params, "max_host_adapters", cls.max_host_adapters, 1),
            max_lora_rank=_int(params, "max_lora_rank", cls.max_lora_rank, 1),
            manifest_poll_s=_float(params, "manifest_poll_s", cls.manifest_poll_s),
            dtype=DTYPES[dtype_name],
            default_max_new_tokens=_int(params, "default_max_new_tokens", cls.default_max_new_tokens, 0),
            max_new_tokens_limit=_int(params, "max_new_tokens_limit", cls.max_new_tokens_limit, 0),
            adapter_load_delay_s=_float(params, "adapter_load_delay_s", 0.0),
        )
        if settings.default_max_new_tokens > settings.max_new_tokens_limit:
            raise InvalidRequest(
                f"default_max_new_tokens ({settings.default_max_new_tokens}) must be <= "
                f"max_new_tokens_limit ({settings.max_new_tokens_limit})"
            )
        return settings


def build_server(
    model: nn.Module,
    runner,
    settings: LoraSettings,
    *,
    base_name: str,
    device: torch.device | str = "cpu",
    start_watcher: bool = True,
    **cache_kwargs,
) -> BatchServer:
    """Bank over every nn.Linear of ``model`` + cache + manifest watcher + batch server.
    The manifest is applied once before this returns (its pins start loading)."""
    model = model.to(device=device, dtype=settings.dtype).eval()
    bank = LoraBank(
        linear_targets(model),
        settings.max_device_adapters,
        settings.max_lora_rank,
        device=device,
        dtype=settings.dtype,
    )
    bank.attach(model)
    cache = AdapterCache(
        bank,
        AdapterSource(settings.adapter_dir),
        max_host_adapters=settings.max_host_adapters,
        base_name=base_name,
        all_linear_excluded=getattr(model, "output_layers", ()),
        load_delay_s=settings.adapter_load_delay_s,
        **cache_kwargs,
    )

    def on_manifest_error(error):
        cache.manifest_error = None if error is None else error.message

    watcher = ManifestWatcher(
        settings.adapter_dir, cache.apply_manifest, on_manifest_error, settings.manifest_poll_s
    )
    server = BatchServer(cache, runner, watcher=watcher)
    watcher.step(force=True)
    if start_watcher and settings.manifest_poll_s > 0:
        watcher.start()
    return server


# ---------------------------------------------------------------------- request parsing

def _strings(values: np.ndarray | None, what: str) -> list[bytes] | None:
    if values is None:
        return None
    out = []
    for v in np.asarray(values, dtype=object).reshape(-1):
        if isinstance(v, str):
            v = v.encode()
        if not isinstance(v, (bytes, bytearray)):
            raise InvalidRequest(f"{what} must hold strings, got {type(v).__name__}")
        out.append(bytes(v))
    return out


def adapter_from(parameters: Mapping[str, Any], adapter_input: np.ndarray | None) -> str | None:
    """The adapter a request names: parameter ``adapter`` and/or input ``ADAPTER`` (every row
    the same).  Empty or absent = the base model."""
    names = set()
    param = parameters.get("adapter")
    if param is not None:
        if not isinstance(param, str):
            raise InvalidRequest(f"request parameter 'adapter' must be a string, got {param!r}")
        names.add(param)
    values = _strings(adapter_input, "ADAPTER")
    if values:
        decoded = set()
        for v in values:
            try:
                decoded.add(v.decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidRequest("ADAPTER must be UTF-8") from None
        if len(decoded) > 1:
            raise InvalidRequest(
                f"ADAPTER rows name different adapters {sorted(decoded)}; send one request per adapter"
            )
        names |= decoded
    if len(names) > 1:
        raise InvalidRequest(
            f"the 'adapter' parameter and the ADAPTER input disagree: {sorted(names)}"
        )
    name = names.pop() if names else ""
    return validate_adapter_name(name) if name else None


# ---------------------------------------------------------------------- tinylm

@dataclass
class TextPayload:
    prompts: list[bytes]
    max_new_tokens: list[int]


def parse_text_request(
    model: TinyLM,
    settings: LoraSettings,
    text: np.ndarray | None,
    max_new_tokens_input: np.ndarray | None,
    parameters: Mapping[str, Any],
) -> TextPayload:
    prompts = _strings(text, "TEXT")
    if not prompts:
        raise InvalidRequest("input TEXT is required (one prompt per row)")
    budget: list[int]
    if max_new_tokens_input is not None:
        flat = np.asarray(max_new_tokens_input).reshape(-1)
        if flat.size == 1:
            budget = [int(flat[0])] * len(prompts)
        elif flat.size == len(prompts):
            budget = [int(v) for v in flat]
        else:
            raise InvalidRequest(
                f"MAX_NEW_TOKENS has {flat.size} values for {len(prompts)} prompts"
            )
    elif parameters.get("max_new_tokens") is not None:
        raw = parameters["max_new_tokens"]
        try:
            budget = [int(raw)] * len(prompts)
        except (TypeError, ValueError):
            raise InvalidRequest(f"request parameter max_new_tokens={raw!r} is not an integer") from None
    else:
        budget = [settings.default_max_new_tokens] * len(prompts)
    for n in budget:
        if not 0 <= n <= settings.max_new_tokens_limit:
            raise InvalidRequest(f"max_new_tokens ({n}) must be in 0..{settings.max_new_tokens_limit}")
    context = model.cfg.max_seq_len
    for prompt, n in zip(prompts, budget):
        if len(prompt) + 1 + n > context:  # +1: the BOS token
            raise InvalidRequest(
                f"prompt ({len(prompt)} bytes) + max_new_tokens ({n}) exceeds the context "
                f"length {context - 1}"
            )
    return TextPayload(prompts, budget)


def tinylm_runner(model: TinyLM):
    def run(jobs: Sequence[Job]) -> list[list[bytes]]:
        prompts = [p for job in jobs for p in job.payload.prompts]
        budgets = [n for job in jobs for n in job.payload.max_new_tokens]
        texts = model.generate(prompts, budgets)
        out, offset = [], 0
        for job in jobs:
            out.append(texts[offset : offset + job.rows])
            offset += job.rows
        return out

    return run


# ---------------------------------------------------------------------- recommender

def parse_features(model: RecommenderMLP, features: np.ndarray | None) -> np.ndarray:
    if features is None:
        raise InvalidRequest("input FEATURES is required")
    dim = model.feature_dim
    if features.ndim != 2 or features.shape[1] != dim:
        raise InvalidRequest(f"FEATURES must have shape [batch, {dim}], got {list(features.shape)}")
    return np.ascontiguousarray(features, dtype=np.float32)


def recommender_runner(model: RecommenderMLP):
    def run(jobs: Sequence[Job]) -> list[np.ndarray]:
        weight = model.layers[0].weight
        x = torch.from_numpy(np.concatenate([job.payload for job in jobs]))
        scores = model(x.to(weight.device, weight.dtype)).float().cpu().numpy()
        out, offset = [], 0
        for job in jobs:
            out.append(scores[offset : offset + job.rows])
            offset += job.rows
        return out

    return run
