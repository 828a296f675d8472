"""The policies by name (``--policy``) and the default one."""

from __future__ import annotations

from typing import Any

from control_plane.eviction.frequency import GDSFPolicy, WTinyLFUHitsPolicy, WTinyLFUPolicy
from control_plane.eviction.policy import EvictionPolicy, LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    WTinyLFUPolicy.name: WTinyLFUPolicy,
    WTinyLFUHitsPolicy.name: WTinyLFUHitsPolicy,
    GDSFPolicy.name: GDSFPolicy,
}
DEFAULT_POLICY = LRUPolicy.name  # what the product promises; the others are --policy choices


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """A fresh policy by name; ``options`` go to its constructor (e.g. ``sample_size``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(**options)
