"""What a miss is told when no plan frees room for it (``CachePlanner.plan``): the
budget, what is loaded, and what holds the room (pinned entries, busy ones), so the user
knows what to unpin or raise."""

from __future__ import annotations

from typing import Protocol

from control_plane.eviction.entries import SHADOW_PRIORITY, Capacity, Resident
from domain.errors import CapacityExhausted


class RoomView(Protocol):
    """What these messages read of a server's planner (``CachePlanner``)."""

    capacity: Capacity
    residents: dict[str, Resident]

    @property
    def used_slots(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...


def exhausted(planner: RoomView, key: str, size_bytes: int) -> CapacityExhausted:
    """Nothing evictable is left for ``key``: what holds the room, and what to do."""
    cap = planner.capacity
    return CapacityExhausted(
        f"no room for {key} ({size_bytes} bytes): budget is {cap.describe()}, "
        f"{planner.used_slots} loaded using {planner.used_bytes} bytes, and nothing evictable is "
        f"left ({holders(r for r in planner.residents.values() if not r.holds)}); unpin a "
        "model (mmctl unpin NAME) or raise the budget")


def exhausted_in_pool(planner: RoomView, key: str, pool: str, slots: int) -> CapacityExhausted:
    """Every slot of ``key``'s family ``pool`` holds a variant that cannot leave."""
    return CapacityExhausted(
        f"no room for {key}: all {slots} slots of its family {pool} on this server hold "
        f"variants that cannot leave ({holders(r for r in planner.residents.values() if r.pool == pool)}); "
        "unpin a model (mmctl unpin NAME) or raise the budget")


def exhausted_for_shadow(planner: RoomView, key: str, size_bytes: int,
                         limit: int) -> CapacityExhausted:
    """A shadow or extra copy (victims of priority ``limit`` at most) found no room."""
    serving = sorted(k for k, r in planner.residents.items() if r.priority > limit)
    cap = planner.capacity
    if limit < SHADOW_PRIORITY:
        return CapacityExhausted(
            f"no room for the extra copy {key} ({size_bytes} bytes): an extra copy takes "
            f"free room or the room of other extra copies only, and the budget "
            f"({cap.describe()}, {planner.used_slots} loaded using {planner.used_bytes} bytes, "
            f"headroom kept free) is held by models' own copies ({', '.join(serving) or 'none'}); "
            "it is added when room frees up; raise the budget or add a device")
    return CapacityExhausted(
        f"no room for shadow {key} ({size_bytes} bytes): a shadow may evict only other "
        f"shadow or retired models, and the budget ({cap.describe()}, {planner.used_slots} "
        f"loaded using {planner.used_bytes} bytes) is held by models that serve traffic "
        f"({', '.join(serving) or 'none'}) or by shadows that are busy or pinned; the "
        "shadow is skipped until room frees up; raise the budget or add a device"
    )


def holders(residents) -> str:
    """What holds the room: the pinned entries, and those busy serving, loading or unloading."""
    residents = list(residents)
    pinned = sorted(r.key for r in residents if r.pinned)
    busy = sorted(r.key for r in residents if not r.evictable and not r.pinned)
    detail = f"pinned: {', '.join(pinned) or 'none'}"
    return detail + (f"; busy serving, loading or unloading: {', '.join(busy)}" if busy else "")
