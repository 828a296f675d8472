"""Device-resident LoRA weights for many adapters, applied per row in one forward pass.

For every LoRA-capable linear layer the bank keeps two stacked tensors, one slot per
resident adapter::

    a_t[module]  [slots + 1, in,  max_rank]    A^T of each adapter, zero-padded to max_rank
    b_t[module]  [slots + 1, max_rank, out]    (scale * B)^T, zero-padded

Slot 0 is all zeros and stands for "no adapter" (the base model).  A batch carries one slot
index per row; inside ``LoraBank.rows(index)`` every hooked linear layer adds
``x_n A_{s(n)}^T B_{s(n)}^T`` to row n of its base output, for all rows at once: the BGMV
form of Punica/S-LoRA (batched gather matrix-vector), two ops per layer whatever the number
of distinct adapters, instead of one forward per adapter.  On CPU the per-row products read
the slots in place through ``embedding_bag`` (sum mode, per-sample weights), which a
gather + ``bmm`` would first copy out per row (measured up to 20x slower for a one-shot
forward, at width 1024);
for rows with many positions (prefill) the copy pays off and gather + ``bmm`` is used.
A narrow layer (out <= max_rank / 4, e.g. a score head) also keeps each slot's product
``merged_t[module] = A^T B^T`` ``[slots + 1, in, out]``, no larger than the factors, and a
row reads that instead of shrinking and expanding.  The update is added to the layer's
output in place.
A batch whose adapted rows all use one adapter multiplies by that slot's weights directly
(base rows masked out).  Zero padding keeps lower-rank adapters exact: the padded rows of A
and columns of B are 0.

With 100 adapters in a batch the per-row kernels are bound by reading the adapters'
weights (each row reads its own: ~28 KB per row for the demo recommender), so the bank keeps
everything else off that path: all stacks in one buffer (on huge pages on Linux CPUs, fewer
TLB misses), 32-bit bag indices, the batch's bookkeeping made once per forward rather than
per layer and step, and no fresh multi-MB tensor per layer and step in prefill (the update
added in place, large gathers in a reused buffer): such tensors were page-faulted in each
time, about a quarter of a mixed tinylm batch's CPU time.

The bank is a plain tensor store.  Which adapter owns which slot is the cache's business
(``cache.AdapterCache``); the bank is not thread-safe, and the cache serializes writes and
forwards with its lock.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from .peft import LoraAdapter


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool) -> None:
    try:
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)
    except (AttributeError, TypeError, NotImplementedError):  # older torch: one copy each
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=non_blocking)


# From this many positions per row on (a prompt's tokens in prefill), gather + bmm is faster
# than embedding_bag on CPU (measured: 2x faster at 20 positions, about even at 4).
_BMM_MIN_POSITIONS = 4
_HUGE_PAGE_BYTES = 2 << 20
# A layer with out_features * this <= max_rank also keeps merged per-slot weights.
_MERGED_MAX_OUT_PER_RANK = 4
# Gathers from this size on go to the bank's reused buffer (a fresh one this large is
# returned to the OS when freed, and faulted in again next time).
_REUSED_GATHER_MIN_BYTES = 1 << 20
# Distinct (batch size, width) offset tensors kept; past it the cache starts over.
_MAX_CACHED_OFFSETS = 64


def _zeroed_storage(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One zeroed buffer for all of a bank's stacked tensors.

    A CPU bank of a huge page or more is anonymous memory advised for transparent huge
    pages: a mixed batch reads a few KB from each of a hundred slots of every layer, each
    on its own 4 KB page, while one TLB entry covers 2 MB (measured: the demo recommender's
    100-adapter batch about 3% faster, a small gain on a noisy shared machine).  Where that
    is not available (not Linux, THP off) it is ordinary memory."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if device.type == "cpu" and numel * itemsize >= _HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            # Private: shared anonymous memory is shmem, which THP leaves alone by default.
            region = mmap.mmap(-1, numel * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)
            return torch.frombuffer(region, dtype=dtype, count=numel)  # zero-filled by the OS
        except (OSError, ValueError):
            pass
    return torch.zeros(numel, device=device, dtype=dtype)


class _Layer:
    """One hooked layer's stacked weights and the views its kernels read, made once."""

    __slots__ = ("a_rows", "a_t", "b_rows", "b_t", "in_features", "merged", "out_features", "rank")

    def __init__(self, a_t: torch.Tensor, b_t: torch.Tensor, merged: torch.Tensor | None):
        slots, self.in_features, self.rank = a_t.shape
        self.out_features = b_t.shape[2]
        self.a_t, self.b_t, self.merged = a_t, b_t, merged
        # [(slots + 1) * width, ...] views: an embedding_bag bag of ``width`` rows is one
        # slot's matrix.
        self.a_rows = a_t.view(slots * self.in_features, self.rank)
        self.b_rows = b_t.view(slots * self.rank, self.out_features)


class _RowContext:
    """The slot of each row of the batch being computed, and what the kernels need for it.

    * Every adapted row uses the same adapter: ``(x @ A^T) @ B^T`` on that slot's weights,
      base rows masked out (dense; no per-row work at all).
    * Rows use different adapters: each row multiplies by its own slot's matrices, read in
      place from the stacked bank by ``embedding_bag`` (one "bag" per row = its slot's
      ``in`` rows of A^T, weighted by the row's activations), then the same for B^T.  That
      is BGMV without materialising per-row copies of the weights, two ops per layer for
      the whole batch.  Rows with many positions (prefill) gather their weights once and
      use ``bmm`` instead.

    Everything that depends only on the batch (the bags, which layers it touches) is made
    once here and shared by every layer and every decoding step of the forward: at 100
    adapters per batch the per-call bookkeeping cost as much as the small kernels.
    """

    def __init__(
        self, bank: LoraBank, index: torch.Tensor, used_slots: frozenset[int], has_base_rows: bool
    ):
        self.bank = bank
        self.index = index
        self.rows = index.shape[0]
        self.used_slots = used_slots
        self.uniform_slot: int | None = None
        self.base_rows: torch.Tensor | None = None
        if bank.dense_uniform and len(used_slots) == 1:
            self.uniform_slot = next(iter(used_slots))
            if has_base_rows:
                self.base_rows = index == 0
        self._touches: dict[str, bool] = {}
        self._bags: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._slots: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def touches(self, module: str) -> bool:
        touched = self._touches.get(module)
        if touched is None:
            touched = not self.used_slots.isdisjoint(self.bank.module_slots[module])
            self._touches[module] = touched
        return touched

    def slots(self, positions: int, dtype: torch.dtype) -> torch.Tensor:
        """The slot of every ``[row, position]``, row-major, as ``dtype``."""
        key = (positions, dtype)
        slots = self._slots.get(key)
        if slots is None:
            slots = self.index if positions == 1 else self.index.repeat_interleave(positions)
            slots = self._slots[key] = slots.to(dtype)
        return slots

    def bags(self, width: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, offsets)`` for ``embedding_bag`` over a ``[(slots + 1) * width, ...]``
        view of a stacked tensor: bag ``n`` (row-major ``[row, position]``) is rows
        ``slot[n] * width ... + width - 1``, ``width`` entries each."""
        key = (width, positions)
        bags = self._bags.get(key)
        if bags is None:
            count = self.rows * positions
            # 32-bit where it fits: the kernels read these indices beside the weights, and at
            # 64 bits they were about an eighth of the bytes a mixed recommender batch reads.
            small = max(self.bank.num_slots + 1, count) * width < 2**31
            dtype = torch.int32 if small else torch.long
            # slot * width + column, computed rather than looked up in a table, which would
            # be one more thing to read from memory.
            indices = torch.add(
                self.bank.bag_columns(width, dtype), self.slots(positions, dtype)[:, None], alpha=width
            ).view(-1)
            bags = self._bags[key] = (indices, self.bank.bag_offsets(count, width, dtype))
        return bags


class LoraBank:
    def __init__(
        self,
        targets: Mapping[str, tuple[int, int]],
        num_slots: int,
        max_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be >= 1")
        if max_rank < 1:
            raise ValueError(f"max_rank ({max_rank}) must be >= 1")
        self.targets = dict(targets)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        # Narrow layers (a score head: out <= max_rank / 4) also keep each slot's product
        # A^T B^T ``[slots + 1, in, out]``: per row that is one small gather + bmm instead of
        # a shrink and an expand over ``in + max_rank`` bag entries (measured 3x faster for
        # out = 1, and no faster from out = 16 on).
        shapes: list[tuple[str, str, tuple[int, int, int]]] = []
        for m, (out, inp) in self.targets.items():
            shapes += [("a", m, (num_slots + 1, inp, max_rank)), ("b", m, (num_slots + 1, max_rank, out))]
            if out * _MERGED_MAX_OUT_PER_RANK <= max_rank:
                shapes.append(("merged", m, (num_slots + 1, inp, out)))
        storage = _zeroed_storage(sum(math.prod(shape) for *_, shape in shapes), self.device, dtype)
        self.a_t: dict[str, torch.Tensor] = {}
        self.b_t: dict[str, torch.Tensor] = {}
        self.merged_t: dict[str, torch.Tensor] = {}
        stacks = {"a": self.a_t, "b": self.b_t, "merged": self.merged_t}
        offset = 0
        for kind, m, shape in shapes:
            numel = math.prod(shape)
            stacks[kind][m] = storage[offset : offset + numel].view(shape)
            offset += numel
        # module -> slots whose adapter has weights for it; layers no resident adapter
        # touches cost nothing.
        self.module_slots: dict[str, set[int]] = {m: set() for m in self.targets}
        # Per-slot views, made once: indexing costs more than the copies in a swap-in.
        self._slot_views = [{}] + [
            {m: (self.a_t[m][slot], self.b_t[m][slot]) for m in self.targets}
            for slot in range(1, num_slots + 1)
        ]
        self._layers = {
            m: _Layer(self.a_t[m], self.b_t[m], self.merged_t.get(m)) for m in self.targets
        }
        # Dense path for single-adapter batches; False forces per-row BGMV (benchmarks).
        self.dense_uniform = True
        self._ctx: _RowContext | None = None
        # (width, dtype) -> 0, 1, ..., width - 1: the columns of a bag.
        self._bag_columns: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # (bags, width) -> embedding_bag offsets 0, width, 2 * width, ...: batches repeat sizes.
        self._bag_offsets: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        # Reused for the per-row weights that prefill gathers: a fresh multi-MB tensor per
        # layer and step is returned to the OS and faulted in again, which cost more CPU
        # (in the kernel) than the copy itself.
        self._gather_buffer = torch.empty(0, device=self.device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        stacks = (*self.a_t.values(), *self.b_t.values(), *self.merged_t.values())
        return sum(t.nbytes for t in stacks)

    def slot_nbytes(self) -> int:
        return self.nbytes // (self.num_slots + 1)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (host -> device when the bank is on a GPU).

        The adapter must already be validated against ``targets`` (``peft.read_adapter``).
        All tensors go in one ``_foreach`` call (a Python loop over the layers cost 10x more
        than the copies themselves); on a GPU the copies are issued non-blocking from pinned
        host memory and the caller synchronizes (``synchronize``) before the slot is read.
        """
        if not 1 <= slot <= self.num_slots:
            raise IndexError(f"slot {slot} is outside 1..{self.num_slots}")
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        zero: list[torch.Tensor] = []
        transposed = adapter.transposed()
        for module, (a_slot, b_slot) in self._slot_views[slot].items():
            pair = transposed.get(module)
            if pair is None:
                if slot in self.module_slots[module]:  # the previous owner adapted this layer
                    zero += [a_slot, b_slot]
                    self.module_slots[module].discard(slot)
                continue
            a_t, b_t = pair
            r = a_t.shape[1]
            if r == self.max_rank:
                dst += [a_slot, b_slot]
            else:
                dst += [a_slot[:, :r], b_slot[:r, :]]
                zero += [a_slot[:, r:], b_slot[r:, :]]
            src += [a_t, b_t]
            self.module_slots[module].add(slot)
        if zero:
            torch._foreach_zero_(zero)
        if dst:
            _copy_all(dst, src, non_blocking=self.device.type == "cuda")
        for module, merged in self.merged_t.items():  # after the copies, on the same stream
            a_slot, b_slot = self._slot_views[slot][module]
            torch.mm(a_slot, b_slot, out=merged[slot])

    def clear(self, slot: int) -> None:
        for module in self.targets:
            if slot in self.module_slots[module]:
                self.a_t[module][slot].zero_()
                self.b_t[module][slot].zero_()
                if module in self.merged_t:
                    self.merged_t[module][slot].zero_()
                self.module_slots[module].discard(slot)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def rows(self, index: torch.Tensor) -> Iterator[None]:
        """Within the block, hooked layers add each row's LoRA update (``index[i]`` = slot of
        row ``i``; 0 = base).  An all-zero index skips LoRA entirely."""
        if index.dim() != 1:
            raise ValueError(f"row index must be 1-D, got shape {list(index.shape)}")
        # The distinct slots, from the host copy when there is one (no device round trip).
        present = frozenset(index.tolist())
        used = present - {0}
        previous = self._ctx
        self._ctx = (
            _RowContext(self, index.to(self.device, torch.long), used, has_base_rows=0 in present)
            if used else None
        )
        try:
            yield
        finally:
            self._ctx = previous

    def bag_columns(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        columns = self._bag_columns.get((width, dtype))
        if columns is None:
            columns = torch.arange(width, device=self.device, dtype=dtype)
            self._bag_columns[(width, dtype)] = columns
        return columns

    def bag_offsets(self, bags: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``0, width, 2 * width, ...`` (``bags`` of them) in the indices' dtype."""
        key = (bags, width, dtype)
        offsets = self._bag_offsets.get(key)
        if offsets is None:
            if len(self._bag_offsets) >= _MAX_CACHED_OFFSETS:
                self._bag_offsets.clear()
            offsets = torch.arange(0, bags * width, width, device=self.device, dtype=dtype)
            self._bag_offsets[key] = offsets
        return offsets

    def _gathered(self, stacked: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``stacked[slots]``; a large one is written into the reused gather buffer."""
        shape = (slots.shape[0], *stacked.shape[1:])
        numel = shape[0] * shape[1] * shape[2]
        if numel * stacked.element_size() < _REUSED_GATHER_MIN_BYTES:
            # A small fresh tensor comes from memory the allocator just freed, still in cache;
            # the reused buffer, cold after other work, cost more in write misses (measured
            # 11 us against 3 us for a recommender layer).
            return stacked.index_select(0, slots)
        if self._gather_buffer.numel() < numel:
            self._gather_buffer = torch.empty(numel, device=self.device, dtype=self.dtype)
        out = self._gather_buffer[:numel].view(shape)
        return torch.index_select(stacked, 0, slots, out=out)

    def delta(self, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA update of ``module`` for input ``x`` ``[rows, ..., in]``, or None."""
        ctx = self._ctx
        if ctx is None or not ctx.touches(module):
            return None
        out_features = self.b_t[module].shape[2]
        return self.add_update(module, x, x.new_zeros(*x.shape[:-1], out_features))

    def add_update(self, module: str, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """``output`` (``module``'s base output for input ``x``) plus the LoRA update of each
        row.  The update is added in place where autograd allows it: one activation-sized
        tensor less per layer."""
        ctx = self._ctx
        if ctx is None or not ctx.touches(module):
            return output
        rows = x.shape[0]
        if rows != ctx.rows:
            raise RuntimeError(
                f"{module}: input has {rows} rows but the LoRA row index has {ctx.rows}"
            )
        layer = self._layers[module]
        if ctx.uniform_slot is not None:
            out = (x @ layer.a_t[ctx.uniform_slot]) @ layer.b_t[ctx.uniform_slot]
            if ctx.base_rows is not None:
                # Set, not multiplied by 0: an adapter's infinite update times 0 is NaN, and
                # a base row beside it must get the base model's answer whatever it does.
                out.masked_fill_(ctx.base_rows.view(rows, *([1] * (x.dim() - 1))), 0)
            return output + out
        in_features, out_features = layer.in_features, layer.out_features
        positions = x.numel() // (rows * in_features)
        in_place = not output.requires_grad and output.is_contiguous()
        if layer.merged is not None or positions >= _BMM_MIN_POSITIONS:
            # Many positions per row (prefill): copying each row's weights out once and
            # reusing them across its positions in a bmm beats reading them per position.
            # Merged weights are read once per row anyway, and are small by construction.
            x3 = x.reshape(rows, positions, in_features)
            if layer.merged is not None:
                xa, b_rows = x3, self._gathered(layer.merged, ctx.index)
            else:
                xa = torch.bmm(x3, self._gathered(layer.a_t, ctx.index))
                b_rows = self._gathered(layer.b_t, ctx.index)
            if in_place:
                output.view(rows, positions, out_features).baddbmm_(xa, b_rows)
                return output
            return output + torch.bmm(xa, b_rows).view(output.shape)
        indices, offsets = ctx.bags(in_features, positions)
        xa = torch.embedding_bag(
            layer.a_rows, indices, offsets, False, 0, False, x.reshape(-1)
        )[0]
        indices, offsets = ctx.bags(layer.rank, positions)
        out = torch.embedding_bag(
            layer.b_rows, indices, offsets, False, 0, False, xa.view(-1)
        )[0].view(output.shape)
        return output.add_(out) if in_place else output + out

    def attach(self, model: nn.Module) -> list:
        """Hook every target ``nn.Linear`` of ``model``: output += this bank's row update.

        The model keeps its plain module tree (and so PEFT's module names); the hooks are
        inert outside ``rows``.  Returns the hook handles (``handle.remove()`` detaches).
        """
        modules = dict(model.named_modules())
        handles = []
        for name in self.targets:
            module = modules.get(name)
            if not isinstance(module, nn.Linear):
                raise TypeError(f"{name!r} is not an nn.Linear of {type(model).__name__}")

            def hook(_module, inputs, output, _name=name):
                return self.add_update(_name, inputs[0], output)

            handles.append(module.register_forward_hook(hook))
        return handles
