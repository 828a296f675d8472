"""Model families: fine-tuned variants of one architecture served by one Triton model with
fixed-size weight slots.

A family is a Triton model folder (its code once) plus ``family.json`` (the slot layout,
from the base weights) and ``1/_mms_family`` (the runtime, ``model_runtime.family``).  A
variant is a folder with ``weights.safetensors`` and ``variant.json``.  To the model
manager a variant is a model like any other (LRU, pins, placement, rollout stages) that
takes a slot of its family and, like a model, its slot's bytes and one place of the
server's budget (``SlotPool``: the family model itself costs nothing, and is unloaded
once no variant is left in it):
``FamilyAdmin`` carries out its loads and unloads as slot fills and frees in the family
model instead of Triton loads, loading the family model itself through Triton's load API
the first time one of its variants is placed on a server.

Modules:
    family_catalog  which families exist, which family a variant belongs to, slots per server
    folders         writing and checking family and variant folders (registration)
    added_families  families added with ``mmctl family add``: recorded, restored at each start
    slot_control    FamilyAdmin: TritonAdmin whose load/unload/index of a variant are slot
                    operations
    instance        FamilyInstance: one family model on one server, its named states
"""

from control_plane.families.family_catalog import Family, FamilyCatalog, family_slots
from control_plane.families.folders import (
    VARIANT_FILE,
    WEIGHTS_FILE,
    check_variant_weights,
    refresh_family_runtime,
    write_family,
    write_variant,
)

__all__ = ["VARIANT_FILE", "WEIGHTS_FILE", "Family", "FamilyCatalog", "check_variant_weights",
           "family_slots", "refresh_family_runtime", "write_family", "write_variant"]
