"""Which loaded models to evict: pure policy code, no sockets, no clock of its own.

The control plane and the benchmark replay (``bench/policy_replay.py``) run this same code.

* An ``EvictionPolicy`` only ranks resident keys: it is told about every request
  (``touch``), admissions and removals, and yields resident keys best-victim-first.
  Per-request work is O(1) amortized (``gdsf``: O(log n) in the number of residents).
* ``CachePlanner`` adds what every policy must respect: pinned keys are never evicted,
  rollout stage priority (shadow before canary before production) comes before the
  policy's own order, a shadow newcomer may evict only shadow (or retired) models
  (``victim_priority_limit``), and capacity is a byte budget and/or a slot count.  ``plan`` returns
  the victims to free room for a new key, or raises CapacityExhausted naming the pinned
  keys and the budget; it changes nothing until the caller commits.
* A resident marked ``leaving`` is being unloaded: ``used_bytes`` still counts it (the
  memory is not free until the server confirms it gone), but ``plan`` counts its room as
  already free, because it is promised (to the load that evicted it, or to the headroom).
  So two misses close together never evict two models for the room of one.
* Headroom (``HeadroomSpec``, ``headroom_target``, ``headroom_victims``): room a server
  keeps free for the next miss, so that miss loads at once instead of waiting for an
  unload.  The policy picks who leaves to restore it, with the same rules (pins, busy,
  stage priority); a serving newcomer may use the headroom, a shadow may not (it would
  make the headroom evict a serving model on its behalf).

A model server must load whatever is requested, so no policy here refuses admission.  A
frequency-aware policy expresses doubt about a newcomer by ranking it as an early victim:
W-TinyLFU keeps it in a small window whose tail must out-score the main area's weakest
model to stay; GDSF gives it a low priority until it is requested again.

Policies (``POLICIES``; ``make_policy(name, **options)``):

* ``lru``           least recently used first.  The default (``DEFAULT_POLICY``): the
                    behaviour the product documents and operators expect.
* ``wtinylfu``      W-TinyLFU: a window LRU for newcomers and a segmented-LRU main area,
                    admission between them decided by a count-min sketch with aging;
                    scores weighted by the square root of the load cost.  It beats LRU on
                    the skewed trace replays (bench/policy_replay.py; table in README.md).
* ``wtinylfu-hits`` the same ranked by frequency alone: most hits, more load seconds.
* ``gdsf``          GreedyDual-Size-Frequency with sketch frequencies: priority
                    ``L + frequency * load_cost_s / size``, L inflating to each victim's.

Calling convention the policies are tuned for: ``touch`` once per request, hit or miss
(on a miss before or after ``plan``, as long as it is once); ``admit`` when the load
starts or ends; ``remove`` once a model is gone.  Victims may stay resident (marked not
evictable) until their unload completes, before or after the newcomer's ``admit``.
Extra touches (e.g. one per statistics poll on top of one per request) inflate a model's
frequency; recency-only callers do no harm to ``lru``.

Modules:
    policy     the EvictionPolicy interface and LRUPolicy (the default)
    frequency  W-TinyLFU (two weightings) and GDSF
    catalog    POLICIES by name, DEFAULT_POLICY, make_policy
    headroom   HeadroomSpec, Headroom and the default headroom
    planner    stage priorities, Resident, Capacity, EvictionPlan, CachePlanner
"""

from control_plane.eviction.entries import (
    DEFAULT_PRIORITY,
    EXTRA_COPY_PRIORITY,
    SHADOW_PRIORITY,
    STAGE_PRIORITY,
    Capacity,
    EvictionPlan,
    Resident,
    victim_priority_limit,
)
from control_plane.eviction.frequency import GDSFPolicy, WTinyLFUHitsPolicy, WTinyLFUPolicy
from control_plane.eviction.headroom import (
    HEADROOM_DEFAULT_MODELS,
    HEADROOM_MAX_FRACTION,
    HEADROOM_MIN_CAPACITY_MODELS,
    Headroom,
    HeadroomSpec,
)
from control_plane.eviction.planner import CachePlanner
from control_plane.eviction.policies_by_name import DEFAULT_POLICY, POLICIES, make_policy
from control_plane.eviction.policy import EvictionPolicy, LRUPolicy

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_PRIORITY",
    "EXTRA_COPY_PRIORITY",
    "HEADROOM_DEFAULT_MODELS",
    "HEADROOM_MAX_FRACTION",
    "HEADROOM_MIN_CAPACITY_MODELS",
    "POLICIES",
    "SHADOW_PRIORITY",
    "STAGE_PRIORITY",
    "CachePlanner",
    "Capacity",
    "EvictionPlan",
    "EvictionPolicy",
    "GDSFPolicy",
    "Headroom",
    "HeadroomSpec",
    "LRUPolicy",
    "Resident",
    "WTinyLFUHitsPolicy",
    "WTinyLFUPolicy",
    "make_policy",
    "victim_priority_limit",
]
