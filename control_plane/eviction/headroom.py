"""Headroom: room a server keeps free for the next miss, so that miss loads at once
instead of waiting for an unload (``CachePlanner.headroom_target`` computes it)."""

from __future__ import annotations

from dataclasses import dataclass

# Headroom by default: one model's room, only on servers that hold at least this many models,
# so it never costs more than an eighth of a server's capacity.  On the replayed traces one
# slot less costs 0.6-3.1 points of hit ratio at 12-14 slots and at most 0.2 at 100 slots
# (python -m bench.policy_replay --quick --headroom 1), and it takes the unload (1.1-1.7 s
# with the python backend) off every miss that would have had to evict.
HEADROOM_DEFAULT_MODELS = 1
HEADROOM_MIN_CAPACITY_MODELS = 8
HEADROOM_MAX_FRACTION = 0.5  # an explicit headroom never takes more than half the budget


@dataclass(frozen=True)
class HeadroomSpec:
    """How much room a server keeps free for the next miss.

    ``models``: that many models' room (slots under a slot budget; that many times the
    median resident's size under a byte budget); None is the default:
    ``HEADROOM_DEFAULT_MODELS`` where at least ``HEADROOM_MIN_CAPACITY_MODELS`` models fit,
    else none.  ``bytes``: an explicit byte headroom instead of models x median size.
    0 turns headroom off."""

    models: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if self.models is not None and self.models < 0:
            raise ValueError(f"headroom models ({self.models}) must be >= 0")
        if self.bytes is not None and self.bytes < 0:
            raise ValueError(f"headroom bytes ({self.bytes}) must be >= 0")


@dataclass(frozen=True)
class Headroom:
    """Room to keep free on one server, as computed now: slots and bytes."""

    slots: int = 0
    bytes: int = 0

    def __bool__(self) -> bool:
        return self.slots > 0 or self.bytes > 0
