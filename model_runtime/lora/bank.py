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
A batch whose adapted rows all use one adapter multiplies by that slot's weights directly
(base rows masked out).  Zero padding keeps lower-rank adapters exact: the padded rows of A
and columns of B are 0.

The bank is a plain tensor store.  Which adapter owns which slot is the cache's business
(``cache.AdapterCache``); the bank is not thread-safe, and the cache serializes writes and
forwards with its lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
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
    """

    def __init__(self, bank: LoraBank, index: torch.Tensor):
        self.bank = bank
        self.index = index
        self.used_slots = {int(s) for s in torch.unique(index).tolist()} - {0}
        self.uniform_slot: int | None = None
        self.row_mask: torch.Tensor | None = None
        if bank.dense_uniform and len(self.used_slots) == 1:
            self.uniform_slot = next(iter(self.used_slots))
            if bool((index == 0).any()):
                self.row_mask = (index != 0).to(bank.dtype)
        self._bags: dict[tuple[int, int], torch.Tensor] = {}

    def touches(self, module: str) -> bool:
        return bool(self.used_slots & self.bank.module_slots[module])

    def bags(self, width: int, positions: int) -> torch.Tensor:
        """``[rows * positions, width]`` indices into a ``[(slots + 1) * width, ...]`` view of
        a stacked tensor: row n's bag is rows ``slot[n] * width ... + width - 1``."""
        key = (width, positions)
        bags = self._bags.get(key)
        if bags is None:
            slots = self.index if positions == 1 else self.index.repeat_interleave(positions)
            bags = slots[:, None] * width + torch.arange(width, device=slots.device)[None, :]
            self._bags[key] = bags
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
        self.a_t = {
            m: torch.zeros(num_slots + 1, inp, max_rank, device=self.device, dtype=dtype)
            for m, (out, inp) in self.targets.items()
        }
        self.b_t = {
            m: torch.zeros(num_slots + 1, max_rank, out, device=self.device, dtype=dtype)
            for m, (out, inp) in self.targets.items()
        }
        # module -> slots whose adapter has weights for it; layers no resident adapter
        # touches cost nothing.
        self.module_slots: dict[str, set[int]] = {m: set() for m in self.targets}
        # Per-slot views, made once: indexing costs more than the copies in a swap-in.
        self._slot_views = [{}] + [
            {m: (self.a_t[m][slot], self.b_t[m][slot]) for m in self.targets}
            for slot in range(1, num_slots + 1)
        ]
        # Dense path for single-adapter batches; False forces per-row BGMV (benchmarks).
        self.dense_uniform = True
        self._ctx: _RowContext | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.a_t.values()) + sum(t.nbytes for t in self.b_t.values())

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

    def clear(self, slot: int) -> None:
        for module in self.targets:
            if slot in self.module_slots[module]:
                self.a_t[module][slot].zero_()
                self.b_t[module][slot].zero_()
                self.module_slots[module].discard(slot)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def rows(self, index: torch.Tensor) -> Iterator[None]:
        """Within the block, hooked layers add each row's LoRA update (``index[i]`` = slot of
        row ``i``; 0 = base).  An all-zero index skips LoRA entirely."""
        index = index.to(self.device, torch.long)
        if index.dim() != 1:
            raise ValueError(f"row index must be 1-D, got shape {list(index.shape)}")
        previous = self._ctx
        self._ctx = _RowContext(self, index) if bool((index != 0).any()) else None
        try:
            yield
        finally:
            self._ctx = previous

    def delta(self, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA update of ``module`` for input ``x`` ``[rows, ..., in]``, or None."""
        ctx = self._ctx
        if ctx is None or not ctx.touches(module):
            return None
        rows = x.shape[0]
        if rows != ctx.index.shape[0]:
            raise RuntimeError(
                f"{module}: input has {rows} rows but the LoRA row index has {ctx.index.shape[0]}"
            )
        a_t, b_t = self.a_t[module], self.b_t[module]
        if ctx.uniform_slot is not None:
            out = (x @ a_t[ctx.uniform_slot]) @ b_t[ctx.uniform_slot]
            if ctx.row_mask is not None:
                out = out * ctx.row_mask.view(rows, *([1] * (x.dim() - 1)))
            return out
        slots, in_features, rank = a_t.shape
        out_features = b_t.shape[2]
        positions = x[0].numel() // in_features
        if positions >= _BMM_MIN_POSITIONS:
            # Many positions per row (prefill): copying each row's weights out once and
            # reusing them across its positions in a bmm beats reading them per position.
            x3 = x.reshape(rows, positions, in_features)
            out = torch.bmm(
                torch.bmm(x3, a_t.index_select(0, ctx.index)), b_t.index_select(0, ctx.index)
            )
            return out.reshape(*x.shape[:-1], out_features)
        flat = x.reshape(rows * positions, in_features)
        xa = F.embedding_bag(
            ctx.bags(in_features, positions),
            a_t.view(slots * in_features, rank),
            per_sample_weights=flat,
            mode="sum",
        )
        out = F.embedding_bag(
            ctx.bags(rank, positions),
            b_t.view(slots * rank, out_features),
            per_sample_weights=xa,
            mode="sum",
        )
        return out.reshape(*x.shape[:-1], out_features)

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
                delta = self.delta(_name, inputs[0])
                return output if delta is None else output + delta

            handles.append(module.register_forward_hook(hook))
        return handles
