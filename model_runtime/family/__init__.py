"""The model-family runtime: fixed-size weight slots shared by the fine-tuned variants of
one architecture, run inside Triton's python backend.

Modules:
    protocol      the parameter, output and file names the control plane and router share
    layout        the tensors of a family's weights and their byte ranges (safetensors header)
    slots         K preallocated slots; a swap-in is one copy of a weights file's data section
                  (on CPU, a file in host RAM is read in place first and copied afterwards)
    mapped_files  the variants' files kept mapped between fills, and whether each is host RAM
    pinned_mappings  on a GPU, those mappings registered with CUDA for direct device copies
    triton_model  FamilyModel: the python model a family's model.py subclasses (the contract)

``slots`` and ``triton_model`` need torch and are imported on first use, so the router can
read ``protocol`` and the control plane ``layout`` without importing torch.
"""

from .layout import Layout, LayoutError, TensorSpec, read_layout
from .protocol import (
    CONTROL_PARAMETER,
    LAYOUT_FILE,
    SLOTS_PARAMETER,
    STATUS_OUTPUT,
    UNKNOWN_MODEL_PREFIX,
    VARIANT_PARAMETER,
)

_LAZY = {"SlotBank": "slots", "SlotError": "slots", "SwapIn": "slots",
         "FamilyInputError": "responses", "FamilyModel": "triton_model"}

__all__ = [
    "CONTROL_PARAMETER", "LAYOUT_FILE", "SLOTS_PARAMETER", "STATUS_OUTPUT",
    "UNKNOWN_MODEL_PREFIX", "VARIANT_PARAMETER", "FamilyInputError", "FamilyModel", "Layout",
    "LayoutError", "SlotBank", "SlotError", "SwapIn", "TensorSpec", "read_layout",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
