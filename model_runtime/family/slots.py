"""``SlotBank``: K preallocated, fixed-size weight slots and what each holds.

Each slot is one flat byte buffer of the family's ``data_bytes``, allocated once when the
family model loads (device memory on a GPU instance, host memory on CPU), with a typed view
per tensor at its byte range.  A variant's swap-in is one copy of its weights file's data
section into the slot's buffer: no allocation, no new module, no process start.

The module built over a slot's views (``FamilyModel.build``) is built once per slot and
reads whatever the slot holds, so a copy is all a swap-in takes.

Not thread-safe on its own: the family model calls it from ``execute``, which Triton runs
one batch at a time per instance, so a slot is never written while a batch reads it.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import torch

from .layout import Layout, LayoutError, read_layout

TORCH_DTYPES = {"F64": torch.float64, "I64": torch.int64, "F32": torch.float32,
                "I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
for _name, _dtype in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _dtype):
        TORCH_DTYPES[_name] = getattr(torch, _dtype)


class SlotError(RuntimeError):
    """A swap-in that cannot happen: no free slot, or weights that are not the family's."""


@dataclass
class SwapIn:
    slot: int
    bytes: int
    seconds: float


class SlotBank:
    def __init__(self, layout: Layout, count: int, device: torch.device):
        if count < 1:
            raise SlotError(f"a family needs at least one slot (got {count})")
        missing = sorted({t.dtype for t in layout.tensors} - set(TORCH_DTYPES))
        if missing:
            raise SlotError(f"this torch cannot hold {', '.join(missing)} tensors")
        self.layout = layout
        self.device = device
        # torch.empty: on CPU the pages are committed by the first copy into a slot, so
        # unused slots cost address space only; on a GPU all K are allocated here, once.
        self.buffers = [torch.empty(layout.data_bytes, dtype=torch.uint8, device=device)
                        for _ in range(count)]
        self.holder: list[str | None] = [None] * count
        self.slot_of: dict[str, int] = {}

    @property
    def count(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return self.layout.data_bytes * self.count

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """One typed tensor per weight, viewing its byte range of the slot's buffer."""
        buffer = self.buffers[slot]
        return {t.name: buffer[t.begin:t.end].view(TORCH_DTYPES[t.dtype]).view(t.shape)
                for t in self.layout.tensors}

    def free_slot(self) -> int | None:
        for i, holder in enumerate(self.holder):
            if holder is None:
                return i
        return None

    def fill(self, variant: str, path: str | os.PathLike) -> SwapIn:
        """Copy the data section of the weights file at ``path`` into a free slot.

        The file is mapped, not read: from a host-DRAM warm tier (tmpfs) the copy into the
        slot is the only pass over the bytes.  Raises SlotError when no slot is free or the
        file does not have the family's layout (checked before anything is written)."""
        if variant in self.slot_of:
            return SwapIn(self.slot_of[variant], 0, 0.0)
        slot = self.free_slot()
        if slot is None:
            raise SlotError(f"all {self.count} slots hold variants ({', '.join(self.slot_of)}); "
                            "evict one first")
        try:
            layout, offset = read_layout(path)
        except LayoutError as exc:
            raise SlotError(str(exc)) from None
        why = self.layout.mismatch(layout)
        if why is not None:
            raise SlotError(f"{variant}'s weights do not fit this family's slots: {why}")
        started = time.perf_counter()
        with open(path, "rb") as f:
            # ACCESS_COPY: a private mapping torch may wrap as writable; nothing is written.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            source = torch.frombuffer(mapped, dtype=torch.uint8, count=layout.data_bytes,
                                      offset=offset)
            self.buffers[slot].copy_(source)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            del source
        finally:
            mapped.close()
        self.holder[slot] = variant
        self.slot_of[variant] = slot
        return SwapIn(slot, layout.data_bytes, time.perf_counter() - started)

    def release(self, variant: str) -> int | None:
        """Free the slot ``variant`` holds (its bytes stay until the next fill); None if it
        held none."""
        slot = self.slot_of.pop(variant, None)
        if slot is not None:
            self.holder[slot] = None
        return slot
