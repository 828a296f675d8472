"""``FamilyInstance``: what one server's control plane knows of a family model it serves,
and the one place that moves it between named states.

Plain data and an ``asyncio.Lock``: no I/O.  ``FamilyAdmin`` (slot_control.py) holds one
per family on its server and is its only writer.

States and why they change (``FAMILY_TRANSITIONS`` lists every change; ``move`` checks it)::

    ABSENT  --its load API call---------> LOADING --loaded, variants copied back--> SERVING
    ABSENT  --its process answers-------> SERVING   (loaded by an earlier control plane)
    SERVING --more variants than slots--> GROWING --grown, or its load failed-----> SERVING
    any     --"is not healthy"----------> DEAD    --the next command loads it-----> LOADING
    DEAD    --its process answers-------> SERVING   (loaded again by another control plane)
    any     --"unknown model"-----------> ABSENT    (unloaded, Triton restarted, never loaded)

A load that fails goes back to where it started: ABSENT (nothing loaded), DEAD (Triton
keeps the dead instance) or, from GROWING, SERVING (Triton keeps the old instance).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from dataclasses import dataclass, field

from control_plane.manager.records import STRICT_ENV, IllegalTransition
from control_plane.triton.admin import WarmupPlan

log = logging.getLogger(__name__)


class FamilyState(str, enum.Enum):
    ABSENT = "absent"  # not loaded here as far as this control plane knows: nothing is known
    LOADING = "loading"  # its load API call, then the variants it held copied back
    SERVING = "serving"  # loaded, its process alive; slots and residents as last answered
    GROWING = "growing"  # loaded again with more slots, then its variants copied back
    DEAD = "dead"  # its process died; the next command loads it again with what it held


_F = FamilyState
# Every change of a family instance's state, and why.  Staying in a state is always allowed.
FAMILY_TRANSITIONS: dict[FamilyState, frozenset[FamilyState]] = {
    # a variant's first load here (or the reconcile's); its process answered (adopted: loaded
    # by an earlier control plane); found with its process dead
    _F.ABSENT: frozenset({_F.LOADING, _F.SERVING, _F.DEAD}),
    # loaded and its variants copied back; the load failed or the family vanished meanwhile;
    # its process died (or the reload of a dead one failed: Triton keeps the dead instance)
    _F.LOADING: frozenset({_F.SERVING, _F.ABSENT, _F.DEAD}),
    # more variants than slots; unloaded behind this control plane's back; its process died
    _F.SERVING: frozenset({_F.GROWING, _F.ABSENT, _F.DEAD}),
    # grown (or the load with more slots failed: Triton keeps the old instance); unloaded
    # meanwhile; its process died
    _F.GROWING: frozenset({_F.SERVING, _F.ABSENT, _F.DEAD}),
    # loaded again by the next command; its process answered (loaded again by another control
    # plane); unloaded, or its Triton restarted
    _F.DEAD: frozenset({_F.LOADING, _F.SERVING, _F.ABSENT}),
}
# States in which the instance is being loaded: a load that fails moves it back out of them.
IN_PROGRESS = frozenset({_F.LOADING, _F.GROWING})


@dataclass(eq=False)
class FamilyInstance:
    """One family model on one server.  ``server``: its gRPC URL, for messages.

    ``lock``: held around everything that changes its slots or loads it (fill, evict, load,
    grow, recovery), so a status read under it is what the next step acts on; a process that
    dies meanwhile fails the next command, which then loads it again."""

    family: str
    server: str
    state: FamilyState = FamilyState.ABSENT
    slots: int | None = None  # slots of its loaded instance; None: not known
    # The variants its slots held at its last answer: when its process died, what is copied
    # back once it is loaded again.
    resident: set[str] = field(default_factory=set)
    plan: WarmupPlan | None = None  # the inputs a control request carries, from its config
    instance_id: str = ""  # the process of its last answer (a new process: empty slots)
    warmed: bool = False  # a variant warmed its code up since that process started
    usage: dict | None = None  # variant -> [inferences, last in ms], as last read
    usage_read_at: float = 0.0  # monotonic time ``usage`` was read
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def move(self, to: FamilyState, why: str = "") -> None:
        """Change the state; the change must be one ``FAMILY_TRANSITIONS`` lists (with
        MMS_STRICT_TRANSITIONS=1 another raises ``IllegalTransition``; otherwise it is logged
        and made: the next command acts on what Triton answers).  ABSENT forgets everything
        known of its slots."""
        now = self.state
        if to != now and to not in FAMILY_TRANSITIONS[now]:
            message = (f"family {self.family} on {self.server}: illegal state change "
                       f"{now.value} -> {to.value}")
            if os.environ.get(STRICT_ENV) == "1":
                raise IllegalTransition(message)
            log.error("%s (made anyway; please report it)", message)
        if to != now:
            log.debug("family %s on %s: %s -> %s%s", self.family, self.server, now.value,
                      to.value, f" ({why})" if why else "")
        self.state = to
        if to is FamilyState.ABSENT:
            self.slots, self.plan, self.usage = None, None, None
            self.resident = set()

    def loaded(self, slots: int) -> None:
        """Its load API call succeeded: a process with ``slots`` empty slots, whose config is
        read again for the next control request."""
        self.slots, self.plan = slots, None

    def observe(self, answer: dict) -> None:
        """Record a control answer of its process.  An answer proves it loaded and alive: an
        instance not known loaded (ABSENT, DEAD) is SERVING now; one being loaded stays so
        until its load ends."""
        self.resident = set(answer.get("resident", ()))
        instance_id = answer.get("instance", "")
        if instance_id != self.instance_id:
            self.instance_id, self.warmed = instance_id, False
        self.slots = int(answer.get("slots", 0))
        if self.state in (FamilyState.ABSENT, FamilyState.DEAD):
            self.move(FamilyState.SERVING, "its process answered")

    def mark_warmed(self, instance_id: str) -> None:
        """A warm-up that started while ``instance_id`` served succeeded: that process's code
        is warm (a swap changes only the weights in a slot).  A new process is not."""
        if instance_id and instance_id == self.instance_id:
            self.warmed = True

    @property
    def warm(self) -> bool:
        return bool(self.instance_id) and self.warmed

    def serving_status(self) -> dict | None:
        """Its slots and residents when it is SERVING (under ``lock``: what the next step acts
        on), else None: the caller asks its process (and loads it again if need be)."""
        return self.view() if self.state is FamilyState.SERVING else None

    def view(self) -> dict | None:
        """State, slots and resident variants as last known; None when its slots are not
        known (not loaded here, or its first load has not answered yet)."""
        if self.slots is None:
            return None
        return {"state": self.state.value, "slots": self.slots, "resident": sorted(self.resident)}
