"""Rollout stage as eviction priority for models already loaded: a stage change re-ranks a
resident model in its server's planner without a reload."""

from __future__ import annotations

from collections.abc import Callable

from control_plane.eviction import DEFAULT_PRIORITY, STAGE_PRIORITY
from control_plane.registry.registered_versions import Registry


def resident_priority_updater(manager) -> Callable[[str, str], None]:
    """A stage-change listener that re-prioritises a loaded model in its server's planner.

    ``registry.on_stage_change(resident_priority_updater(manager))``: promoting a loaded
    shadow to production stops it being the first to go, without a reload.
    """

    def update(name: str, stage: str) -> None:
        manager.set_priority(name, STAGE_PRIORITY.get(stage, DEFAULT_PRIORITY))

    return update


def apply_stage_priorities(manager, registry: Registry) -> None:
    """Set every loaded model's eviction priority from its stage.

    For models adopted from Triton's index at start, which the manager admits with the
    default priority; call after ``manager.start()``.
    """
    update = resident_priority_updater(manager)
    for server in manager.servers.values():
        for name in list(server.planner.residents):
            mv = registry.by_name(name)
            if mv is not None:
                update(name, mv.stage)
