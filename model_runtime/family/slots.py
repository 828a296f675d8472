"""``SlotBank``: up to K fixed-size weight slots and what each holds.

Each slot is one flat byte buffer of the family's ``data_bytes`` (device memory on a GPU
instance, host memory on CPU), with a typed view per tensor at its byte range.  Slots are
elastic: a slot's buffer is allocated when a variant first fills it and returned
(``release(..., keep_memory=False)``) when the control plane gives its room to something
else, so a family holds the memory of the variants in it, not of K.  A variant's swap-in
into a slot that has its buffer is one read of its weights file's data section into it: no
allocation, no new module, no process start.

The module built over a slot's views (``FamilyModel.build``) reads whatever the slot holds,
so a copy is all a swap-in into an allocated slot takes; a slot given a new buffer gets its
module built again.

On CPU a variant's file that is host RAM already (tmpfs, ramfs: the default warm tier) and of
16 MiB or more is not copied before the miss is answered: the slot reads the file's kept mapping in place
(``reads_in_place``), and the family builds that slot's module again over the mapping's
views.  A fill out of a file mapped before is then no work on the bytes (a new mapping pays
its page faults on first read, less than a copy).  The mapping's 4 KiB pages make a forward
pass that reads all its weights about 7% slower than out of the slot's own memory (huge
pages), so the family copies the slot's bytes into its buffer afterwards, off the miss's
path (``settle``: in parts, given up as soon as the slot is wanted again), and its batches
read the buffer from then on.  The mapping is read-only: a model that writes its weights
faults its process instead of changing the warm tier.  A file on a disk is copied at once,
so that a hit never waits on the disk.

Not thread-safe on its own: the family model (triton_model.py) serializes its changes and
writes a slot only while no batch reads it.
"""

from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from .layout import Layout, LayoutError, read_layout
from .mapped_files import SWEEP_S, MappedFile, MappedFiles
from .pinned_mappings import PinnedMappings

TORCH_DTYPES = {"F64": torch.float64, "I64": torch.int64, "F32": torch.float32,
                "I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
for _name, _dtype in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _dtype):
        TORCH_DTYPES[_name] = getattr(torch, _dtype)


# A swap-in copies its file in parts of PART_BYTES, READ_THREADS at once (the copies release
# the GIL), out of the file's mapping (mapped_files.py: a memcpy once the mapping is kept),
# or with preadv where a file cannot be mapped.  On a GPU each part's copy to the device
# starts as soon as the part is in host memory, so the device copies overlap the parts
# after them (python -m bench.slot_fill compares the two reads, thread counts and the overlap).
READ_THREADS = max(1, min(16, os.cpu_count() or 1))
PART_BYTES = 16 << 20
# A slot reads a mapping in place only where every tensor starts aligned to its elements:
# the data section (the mapping is page-aligned) at a multiple of the largest element size.
IN_PLACE_ALIGNMENT = 8
# ... and only a file at least this large: reading in place means building the slot's module
# again (0.4-0.9 ms for the demo MLPs on the 2-core machine), which costs about what a copy
# of 16 MiB out of a kept mapping does there (about 20 GB/s with 2 threads).
IN_PLACE_MIN_BYTES = 16 << 20


class SlotError(RuntimeError):
    """A swap-in that cannot happen: no free slot, or weights that are not the family's."""


@dataclass
class SwapIn:
    slot: int
    bytes: int
    seconds: float


class SlotBank:
    def __init__(self, layout: Layout, count: int, device: torch.device,
                 read_threads: int = READ_THREADS, overlap_copies: bool = True,
                 files: MappedFiles | None = None, map_files: bool = True,
                 direct_copies: bool = True, in_place: bool = True):
        if count < 1:
            raise SlotError(f"a family needs at least one slot (got {count})")
        missing = sorted({t.dtype for t in layout.tensors} - set(TORCH_DTYPES))
        if missing:
            raise SlotError(f"this torch cannot hold {', '.join(missing)} tensors")
        self.layout = layout
        self.device = device
        # Allocated as variants arrive (``_buffer``) and dropped as the control plane frees
        # their room (``release``): None while a slot holds no memory.
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.holder: list[str | None] = [None] * count
        self.slot_of: dict[str, int] = {}
        # CPU: the mapping each slot reads in place instead of its buffer (None: its buffer).
        self.in_place = in_place and device.type == "cpu" and map_files
        self._read_in_place: list[np.ndarray | None] = [None] * count
        self._staging: torch.Tensor | None = None  # GPU: pinned host buffer of one slot
        self._copies = None  # GPU: the CUDA stream of the fills
        self.read_threads = max(1, read_threads)
        self.overlap_copies = overlap_copies
        self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="slot-read")
        # GPU: the kept mappings registered with CUDA, so a fill is one device copy straight
        # out of the warm tier (pinned_mappings.py); None: fills go through the staging buffer.
        self.pinned = (PinnedMappings() if device.type == "cuda" and direct_copies
                       and files is None and map_files else None)
        # The variants' files, kept mapped between fills (None: every fill reads with preadv).
        self.files = files if files is not None else self.new_mapped_files() if map_files else None

    def new_mapped_files(self, sweep_s: float | None = SWEEP_S) -> MappedFiles:
        """Mappings for this bank's fills; on a GPU each one kept is registered with CUDA
        (``pinned``) and unregistered once forgotten."""
        pinned = self.pinned
        return MappedFiles(sweep_s=sweep_s, on_keep=pinned and pinned.keep,
                           on_forget=pinned and pinned.forget)

    @property
    def count(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        """Bytes the slots' buffers hold now (the slots that have one)."""
        return self.layout.data_bytes * self.allocated

    @property
    def allocated(self) -> int:
        """Slots that hold a buffer now."""
        return sum(1 for b in self.buffers if b is not None)

    def has_memory(self, slot: int) -> bool:
        return self.buffers[slot] is not None

    def _buffer(self, slot: int) -> torch.Tensor:
        """``slot``'s buffer, allocated now if it has none (torch.empty: on CPU its pages are
        committed by the copy into it)."""
        buffer = self.buffers[slot]
        if buffer is None:
            buffer = self.buffers[slot] = torch.empty(self.layout.data_bytes, dtype=torch.uint8,
                                                      device=self.device)
        return buffer

    def drop_memory(self, slot: int) -> None:
        """Return ``slot``'s memory (it holds no variant).  A batch still reading it keeps
        its own reference until it ends; on a GPU the cached block goes back to the device."""
        self.buffers[slot] = None
        self._read_in_place[slot] = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """One typed tensor per weight, viewing its byte range of what the slot reads: its
        buffer, or the mapping it reads in place."""
        mapped = self._read_in_place[slot]
        buffer = self._buffer(slot) if mapped is None else _read_only_tensor(mapped)
        return {t.name: buffer[t.begin:t.end].view(TORCH_DTYPES[t.dtype]).view(t.shape)
                for t in self.layout.tensors}

    def reads_in_place(self, slot: int) -> bool:
        """Whether ``slot`` reads a file's mapping in place (its views are not its buffer's)."""
        return self._read_in_place[slot] is not None

    def settle(self, slot: int, given_up=lambda: False) -> bool:
        """Copy the mapping ``slot`` reads in place into its buffer, one part at a time,
        stopping as soon as ``given_up()``; True once the buffer holds the same bytes (then
        the slot reads its buffer: build its module again).  Runs beside batches that read
        the mapping; the caller makes sure no fill of the slot runs meanwhile."""
        source = self._read_in_place[slot]
        if source is None:
            return False
        target = self._buffer(slot).numpy()
        for start in range(0, len(source), PART_BYTES):
            if given_up():
                return False
            np.copyto(target[start:start + PART_BYTES], source[start:start + PART_BYTES])
        if given_up():
            return False
        self._read_in_place[slot] = None
        return True

    def free_slot(self) -> int | None:
        for i, holder in enumerate(self.holder):
            if holder is None:
                return i
        return None

    def fill(self, variant: str, path: str | os.PathLike) -> SwapIn:
        """Copy the data section of the weights file at ``path`` into a free slot (``check``,
        ``write``, ``assign`` in one call, for a caller that runs nothing beside it).
        Raises SlotError when no slot is free or the file does not have the family's layout
        (checked before anything is written); a read that fails leaves the slot free."""
        if variant in self.slot_of:
            return SwapIn(self.slot_of[variant], 0, 0.0)
        offset = self.check(variant, path)
        slot = self.free_slot()
        if slot is None:
            raise SlotError(f"all {self.count} slots hold variants ({', '.join(self.slot_of)}); "
                            "evict one first")
        seconds = self.write(slot, path, offset)
        self.assign(slot, variant)
        return SwapIn(slot, self.layout.data_bytes, seconds)

    def check(self, variant: str, path: str | os.PathLike) -> int:
        """The offset of the data section of ``variant``'s weights file; SlotError when the
        file is unreadable or its tensors are not this family's."""
        try:
            layout, offset = read_layout(path)
        except LayoutError as exc:
            raise SlotError(str(exc)) from None
        why = self.layout.mismatch(layout)
        if why is not None:
            raise SlotError(f"{variant}'s weights do not fit this family's slots: {why}")
        return offset

    def write(self, slot: int, path: str | os.PathLike, offset: int) -> float:
        """Copy the file's data section (from ``offset``) into ``slot``; its seconds.  The
        caller makes sure nothing reads the slot meanwhile and that it holds no variant.

        On CPU a file in host RAM is read in place (the slot's views become the mapping's:
        rebuild its module), and any other file is copied straight into the slot (out of its
        mapping, in parallel parts).  On a GPU the copy runs on a stream of its own, so a fill overlaps the forward passes of
        the other slots, and it returns once the copy is complete on the device: one device
        copy straight out of the file's mapping where that is registered with CUDA
        (pinned_mappings.py), else through a pinned staging buffer (allocated once), each
        part's device copy overlapping the host copies after it."""
        started = time.perf_counter()
        size = self.layout.data_bytes
        if self.device.type == "cpu":
            self._read_in_place[slot] = None
            mapped = self._mapping(path, offset, size)
            if (self.in_place and mapped is not None and mapped.in_memory
                    and offset % IN_PLACE_ALIGNMENT == 0 and size >= IN_PLACE_MIN_BYTES):
                self._read_in_place[slot] = mapped.array[offset:offset + size]
            else:
                self._read_into(mapped, path, offset, self._buffer(slot))
            return time.perf_counter() - started
        if self._copies is None:
            self._copies = torch.cuda.Stream(self.device)
        target, copies = self._buffer(slot), self._copies
        if self.pinned is not None:
            self.pinned.release_forgotten()  # between fills: no copy reads them
        mapped = self._mapping(path, offset, size)
        source = self._registered_source(mapped, offset)
        if source is not None:
            try:
                with torch.cuda.stream(copies):
                    target.copy_(source, non_blocking=True)
            finally:  # the mapping is not unregistered while a copy from it is queued
                copies.synchronize()
            return time.perf_counter() - started
        if self._staging is None:  # once: pinned host memory for the device copies
            self._staging = torch.empty(self.layout.data_bytes, dtype=torch.uint8, pin_memory=True)
        staging = self._staging

        def copy_part(start: int, end: int) -> None:  # asynchronous from pinned memory
            with torch.cuda.stream(copies):
                target[start:end].copy_(staging[start:end], non_blocking=True)

        try:
            self._read_into(mapped, path, offset, staging,
                            copy_part if self.overlap_copies else None)
            if not self.overlap_copies:
                copy_part(0, self.layout.data_bytes)
        finally:  # the staging buffer is not reused while a copy from it is queued
            copies.synchronize()
        return time.perf_counter() - started

    def _registered_source(self, mapped: MappedFile | None, offset: int) -> torch.Tensor | None:
        """The file's data section as a host tensor over its mapping when that is registered
        with CUDA (a device copy reads it in place), else None."""
        if mapped is None or self.pinned is None or not self.pinned.holds(mapped.array):
            return None
        return _read_only_tensor(mapped.array[offset:offset + self.layout.data_bytes])

    def assign(self, slot: int, variant: str) -> None:
        """``slot`` holds ``variant`` from now on (its bytes are written)."""
        self.holder[slot] = variant
        self.slot_of[variant] = slot

    def _read_into(self, mapped: MappedFile | None, path: str | os.PathLike, offset: int,
                   target: torch.Tensor, after_part=None) -> None:
        """Copy ``target.numel()`` bytes of the file from ``offset`` into ``target`` (host
        memory), out of its mapping ``mapped`` or read with preadv where it has none, in
        parts of ``PART_BYTES``, ``read_threads`` at once; ``after_part(start, end)`` is
        called as each part is in."""
        size = target.numel()
        if mapped is not None:
            source = mapped.array
            destination = target.numpy()

            def part(start: int) -> None:
                end = min(size, start + PART_BYTES)
                np.copyto(destination[start:end], source[offset + start:offset + end])
                if after_part is not None:
                    after_part(start, end)

            self._in_parts(size, part)
            return
        view = memoryview(target.numpy())
        fd = os.open(path, os.O_RDONLY)
        try:
            def read(start: int) -> None:
                end, done = min(size, start + PART_BYTES), start
                while done < end:
                    got = os.preadv(fd, [view[done:end]], offset + done)
                    if got <= 0:
                        raise SlotError(f"{path} ended at byte {offset + done}; copy it again")
                    done += got
                if after_part is not None:
                    after_part(start, end)

            self._in_parts(size, read)
        finally:
            os.close(fd)

    def _mapping(self, path: str | os.PathLike, offset: int, size: int) -> MappedFile | None:
        """The file's kept mapping, or None where the bank maps no files or the file system
        cannot map them (the file is read instead).  SlotError when the file ends before
        ``offset + size``."""
        if self.files is None:
            return None
        try:
            mapped = self.files.open(path)
        except (OSError, ValueError):  # a file system without mappings: read it
            return None
        if len(mapped.array) < offset + size:
            raise SlotError(f"{path} ended at byte {len(mapped.array)}; copy it again")
        return mapped

    def _in_parts(self, size: int, part) -> None:
        """``part(start)`` for each PART_BYTES of ``size``, ``read_threads`` at once."""
        if size <= PART_BYTES or self.read_threads == 1:
            for start in range(0, size, PART_BYTES):
                part(start)
            return
        futures = [self._readers.submit(part, start) for start in range(0, size, PART_BYTES)]
        wait(futures)  # every part, even after a failure: none may use a closed file
        for future in futures:
            future.result()

    def close(self) -> None:
        self._readers.shutdown(wait=False)
        if self.files is not None:
            self.files.close()
        if self.pinned is not None:  # after the mappings are forgotten; no fill runs now
            self.pinned.close()

    def release(self, variant: str, keep_memory: bool = True) -> int | None:
        """Free the slot ``variant`` holds; None if it held none.  ``keep_memory``: its
        buffer (or the mapping it reads) stays for the next fill (a swap that reuses it at
        once); else it is returned (``drop_memory``)."""
        slot = self.slot_of.pop(variant, None)
        if slot is not None:
            self.holder[slot] = None
            if not keep_memory:
                self.drop_memory(slot)
        return slot


def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over read-only memory (a mapping): read and copied from, never written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
