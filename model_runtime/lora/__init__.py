"""LoRA multi-adapter serving: one base model, many PEFT adapters, mixed-adapter batches.

Torch, no Triton: the LoRA model folders (``model_repository/tinylm``,
``model_repository/recommender_lora``) get a copy of this package as ``<version>/_lora``
(``control_plane.demo.lora`` writes it), and the control plane imports its torch-free
modules directly to check adapters (``peft_files``, ``base_layers``) and write the manifest.
It must therefore never import the rest of ``control_plane``.

Modules:
    peft       read (as served, in torch) and write adapters in the PEFT layout
    peft_files the PEFT layout without torch: config, keys and shapes, ``check_adapter``
    base_layers  a base's linear layers from its weights file's header (no torch)
    bank       stacked per-slot LoRA weights, per-row gather + bmm (BGMV) via forward hooks
    policy     pure LRU-with-pinning for the device and host tiers
    cache      device slots -> host memory -> adapter directory, background cold loads
    cache_control  the cache's load/pin/unload/disable operations and manifest apply
    leases     what the cache hands out: batch leases, Futures, per-adapter statistics
    source     the adapter directory, the cache's cold tier
    manifest   the control plane's desired state (pinned/preload/disabled), watched by models
    server     transport-free serving core: batches, deferred cold loads, control ops
    runtime    settings from model config parameters, per-base parsing and runners
    models     TinyLM (byte-level causal LM) and RecommenderMLP
    errors     LoraError tree with the Triton error code of each class
"""

from .errors import (
    AdapterCapacityExhausted,
    AdapterNotFound,
    AdapterRefused,
    InvalidAdapterName,
    InvalidRequest,
    LoraError,
    RuntimeClosing,
)
from .manifest import (
    MANIFEST_FILE,
    RESIDENCY_CONTROL_PLANE,
    RESIDENCY_MODEL,
    Manifest,
    read_manifest,
    write_manifest,
)
from .names import validate_adapter_name
from .peft_files import CONFIG_FILE, WEIGHTS_FILE, LoraConfig, check_adapter

# The PEFT files' reading as served and their writing import torch: loaded at their first
# use, so that the control plane (whose install has no torch) imports the rest alone.
_PEFT_NAMES = frozenset({"LoraAdapter", "read_adapter", "write_adapter"})


def __getattr__(name: str):
    if name in _PEFT_NAMES:
        from . import peft

        return getattr(peft, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONFIG_FILE",
    "MANIFEST_FILE",
    "RESIDENCY_CONTROL_PLANE",
    "RESIDENCY_MODEL",
    "WEIGHTS_FILE",
    "AdapterCapacityExhausted",
    "AdapterNotFound",
    "AdapterRefused",
    "InvalidAdapterName",
    "InvalidRequest",
    "LoraAdapter",
    "LoraConfig",
    "LoraError",
    "Manifest",
    "RuntimeClosing",
    "check_adapter",
    "read_adapter",
    "read_manifest",
    "validate_adapter_name",
    "write_adapter",
    "write_manifest",
]
