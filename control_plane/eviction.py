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
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any, ClassVar

from .errors import CapacityExhausted
from .eviction_sketch import FrequencySketch

# Rollout stage -> eviction priority; lower is evicted first, pinned is never evicted.
STAGE_PRIORITY = {"shadow": 0, "canary": 1, "registered": 2, "production": 2, "retired": 0}
DEFAULT_PRIORITY = 2
SHADOW_PRIORITY = STAGE_PRIORITY["shadow"]


def victim_priority_limit(priority: int) -> int | None:
    """The highest stage priority a newcomer of ``priority`` may evict; None: any.

    A shadow (or a retired model) may evict only shadow or retired models: mirrored traffic
    must never take the room of a model that serves clients (canary included)."""
    return SHADOW_PRIORITY if priority <= SHADOW_PRIORITY else None


class EvictionPolicy(ABC):
    """Ranks resident keys for eviction.  Implementations keep per-request work O(1)."""

    name: ClassVar[str]

    @abstractmethod
    def touch(self, key: str, now: float) -> None:
        """A request for ``key`` (resident or not) at time ``now``."""

    @abstractmethod
    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        """``key`` became resident.  ``size_bytes`` 0 means size does not matter (slots)."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """``key`` left the cache (evicted or unloaded); unknown keys are ignored."""

    @abstractmethod
    def victim_order(self) -> Iterator[str]:
        """Resident keys, best victim first.  Lazy: callers stop once they have enough.

        The iterator reads live state: do not touch/admit/remove while holding it.
        """

    def __contains__(self, key: str) -> bool:  # pragma: no cover - overridden
        return key in set(self.victim_order())


class LRUPolicy(EvictionPolicy):
    """Least recently used first: an OrderedDict, O(1) per request."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim_order(self) -> Iterator[str]:
        # Lazy over the live dict: planning never mutates it while iterating.
        return iter(self._order)

    def __contains__(self, key: str) -> bool:
        return key in self._order


def _weight(size_bytes: int, load_cost_s: float) -> float:
    """Value of keeping a model per unit of capacity, per request: load seconds per byte.

    With a slot budget (size_bytes 0) every model costs one slot and only the load cost
    counts.  A non-positive load cost still gets a small weight so frequency decides.
    """
    cost_s = load_cost_s if load_cost_s > 0 else 1e-3
    return cost_s / size_bytes if size_bytes > 0 else cost_s


class WTinyLFUPolicy(EvictionPolicy):
    """W-TinyLFU with forced admission and load-cost-weighted scores.

    Layout (all LRU-ordered OrderedDicts): a *window* of ``window_fraction`` of the
    residents takes every newcomer; the *main* area is a segmented LRU (``probation`` and
    ``protected``, the latter ``protected_fraction`` of main).  When a new model arrives and
    room is needed, the window's oldest entry (the candidate) competes with the weakest of
    main's ``incumbents`` oldest entries: the lower ``score`` is the victim, ties evict the
    candidate.  A surviving candidate moves to probation on the next ``admit``; a probation
    hit promotes to protected, whose overflow is demoted back to probation.

    Looking at a few incumbents instead of only the oldest keeps one formerly popular model
    (high but fading count) from blocking every newcomer after a popularity shift.

    ``score`` = sketch frequency * (load seconds, per byte under a byte budget) **
    ``cost_exponent``.  1 aims at the fewest seconds spent loading, 0 at the most hits; the
    default 0.5 (a model 4x slower to load counts as if requested 2x as often) measured
    best on both together (bench/policy_replay.py: hit ratio about 0.9x Belady's and about
    30% fewer load seconds than LRU on 1,000-model traces).

    The sketch's counters halve every ``sample_size`` requests and saturate at ``count_cap``
    times a resident's fair share of that period: the cap bounds how long a model that
    stopped being requested keeps its place.

    O(1) amortized per request: a few dict operations plus the sketch's ``depth`` counters;
    ``victim_order`` costs O(incumbents) per key it yields.
    """

    name = "wtinylfu"

    def __init__(
        self,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
        incumbents: int = 8,
        sample_size: int = 16384,
        count_cap: float = 2.0,
        sketch_width: int = 4096,
        cost_exponent: float = 0.5,
    ) -> None:
        if not 0.0 < window_fraction < 1.0:
            raise ValueError(f"window_fraction ({window_fraction}) must be in (0, 1)")
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(f"protected_fraction ({protected_fraction}) must be in [0, 1)")
        if incumbents < 1:
            raise ValueError(f"incumbents ({incumbents}) must be >= 1")
        if count_cap <= 0:
            raise ValueError(f"count_cap ({count_cap}) must be > 0")
        if cost_exponent < 0:
            raise ValueError(f"cost_exponent ({cost_exponent}) must be >= 0")
        self.window_fraction = window_fraction
        self.protected_fraction = protected_fraction
        self.incumbents = incumbents
        self.cost_exponent = cost_exponent
        self.count_cap = count_cap
        self.sketch = FrequencySketch(width=sketch_width, sample_size=sample_size)
        self._window: OrderedDict[str, None] = OrderedDict()
        self._probation: OrderedDict[str, None] = OrderedDict()
        self._protected: OrderedDict[str, None] = OrderedDict()
        self._weight: dict[str, float] = {}

    # -- sizes ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._weight)

    def _window_target(self) -> int:
        return max(1, int(self.window_fraction * len(self._weight)))

    def _protected_target(self) -> int:
        return int(self.protected_fraction * (len(self._weight) - self._window_target()))

    def score(self, key: str) -> float:
        """Relative value of keeping ``key``: recent frequency times its cost weight."""
        return self.sketch.estimate(key) * self._weight.get(key, 1.0)

    def _scorer(self) -> Callable[[str], float]:
        # ``score`` with the lookups bound once: victim_order calls it ~incumbents times.
        counters, indexes = self.sketch.table, self.sketch.indexes
        weight = self._weight
        return lambda key: min(map(counters.__getitem__, indexes(key))) * weight[key]

    # -- events -----------------------------------------------------------------------
    def touch(self, key: str, now: float) -> None:
        self.sketch.increment(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            self._protected[key] = None
            if len(self._protected) > self._protected_target():
                demoted, _ = self._protected.popitem(last=False)
                self._probation[demoted] = None

    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        self.remove(key)
        self._weight[key] = _weight(size_bytes, load_cost_s) ** self.cost_exponent
        self._window[key] = None
        self._resize_cap()
        target = self._window_target()
        while len(self._window) > target:
            candidate, _ = self._window.popitem(last=False)
            self._probation[candidate] = None

    def remove(self, key: str) -> None:
        if self._weight.pop(key, None) is None:
            return
        self._resize_cap()
        for segment in (self._window, self._probation, self._protected):
            if key in segment:
                del segment[key]
                return

    def _resize_cap(self) -> None:
        # Counters saturate at count_cap times a resident's fair share of a sample period:
        # well above the counts near the eviction boundary, so the ranking there is intact,
        # and only a few halvings away from it, so a model that stopped being requested
        # loses its place within a few sample periods.
        sketch = self.sketch
        share = sketch.sample_size / max(1, len(self._weight))
        sketch.max_count = max(15, int(self.count_cap * share))

    def _main_order(self) -> Iterator[tuple[str, float]]:
        """Main area weakest-first among a sliding group of its ``incumbents`` oldest."""
        score = self._scorer()
        keys = chain(self._probation, self._protected)
        group = [(key, score(key)) for key in islice(keys, self.incumbents)]
        while group:
            weakest, low = 0, group[0][1]
            for i in range(1, len(group)):
                if group[i][1] < low:  # strict: the oldest wins ties
                    weakest, low = i, group[i][1]
            yield group.pop(weakest)
            refill = next(keys, None)
            if refill is not None:
                group.append((refill, score(refill)))

    def victim_order(self) -> Iterator[str]:
        # Merge the window (oldest first) with main's order: at each step the lower score
        # goes first, the window on ties (TinyLFU admits a candidate only if it is better).
        score = self._scorer()
        window = iter(self._window)
        main = self._main_order()
        candidate = next(window, None)
        candidate_score = score(candidate) if candidate is not None else 0.0
        incumbent, incumbent_score = next(main, (None, 0.0))
        while candidate is not None or incumbent is not None:
            if incumbent is None or (candidate is not None and candidate_score <= incumbent_score):
                yield candidate  # type: ignore[misc]
                candidate = next(window, None)
                if candidate is not None:
                    candidate_score = score(candidate)
            else:
                yield incumbent
                incumbent, incumbent_score = next(main, (None, 0.0))

    def __contains__(self, key: str) -> bool:
        return key in self._weight


class WTinyLFUHitsPolicy(WTinyLFUPolicy):
    """W-TinyLFU ranking by frequency alone (``cost_exponent`` 0): the most hits, more
    load seconds than ``wtinylfu`` when load costs differ between models."""

    name = "wtinylfu-hits"

    def __init__(self, **options: Any) -> None:
        options.setdefault("cost_exponent", 0.0)
        super().__init__(**options)


class GDSFPolicy(EvictionPolicy):
    """GreedyDual-Size-Frequency: evict the lowest ``L + frequency * load_cost_s / size``.

    ``frequency`` comes from an aging count-min sketch, so a model keeps its history across
    evictions.  ``L`` (the inflation value) rises to the priority of each removed model, so
    models that stop being requested age out behind newcomers.  An administrative unload of
    a hot model also raises ``L``; that only makes the policy favour recency for a while.

    A binary heap with lazy deletion: O(log n) per request for resident keys (n residents),
    stale entries compacted when they outnumber live ones.
    """

    name = "gdsf"

    def __init__(self, sample_size: int = 32768, sketch_width: int = 4096) -> None:
        self.sketch = FrequencySketch(width=sketch_width, sample_size=sample_size)
        self.inflation = 0.0
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, tuple[float, int]] = {}  # key -> (priority, seq) of its entry
        self._weight: dict[str, float] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def _push(self, key: str) -> None:
        priority = self.inflation + self.sketch.estimate(key) * self._weight[key]
        self._seq += 1
        self._live[key] = (priority, self._seq)
        heapq.heappush(self._heap, (priority, self._seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(p, s, k) for k, (p, s) in self._live.items()]
            heapq.heapify(self._heap)

    def touch(self, key: str, now: float) -> None:
        self.sketch.increment(key)
        if key in self._live:
            self._push(key)

    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        self._weight[key] = _weight(size_bytes, load_cost_s)
        self._push(key)

    def remove(self, key: str) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        del self._weight[key]
        self.inflation = max(self.inflation, entry[0])
        if not self._live:
            self._heap.clear()

    def victim_order(self) -> Iterator[str]:
        # Walk the heap in priority order without popping: a frontier heap of indexes
        # whose parents were visited; stale entries are skipped but their subtrees kept.
        heap, live = self._heap, self._live
        if not heap:
            return
        frontier = [(heap[0][0], heap[0][1], 0)]
        size = len(heap)
        while frontier:
            _, _, i = heapq.heappop(frontier)
            priority, seq, key = heap[i]
            if live.get(key) == (priority, seq):
                yield key
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    entry = heap[child]
                    heapq.heappush(frontier, (entry[0], entry[1], child))

    def __contains__(self, key: str) -> bool:
        return key in self._live


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


_TRACKED_FIELDS = frozenset({"size_bytes", "pinned", "priority", "evictable", "leaving"})


@dataclass
class Resident:
    """A loaded (or loading) model as the planner sees it.

    Fields may be changed in place (``planner.residents[k].evictable = False``): while the
    resident belongs to a planner, each change updates that planner's running totals, so
    ``used_bytes`` and planning stay O(1).  A Resident belongs to one planner at a time.
    """

    key: str
    size_bytes: int = 0
    pinned: bool = False
    priority: int = DEFAULT_PRIORITY
    evictable: bool = True  # False while loading/unloading/serving-only-by-lease etc.
    # Being unloaded: still counted in used_bytes until it is removed (the server confirmed
    # it gone), but its room is promised and counts as free when planning.  A model whose
    # unload failed is not leaving: it holds its room.
    leaving: bool = False
    _planner: ClassVar[CachePlanner | None] = None  # set per instance by CachePlanner.admit

    def __setattr__(self, name: str, value: Any) -> None:
        planner = self._planner
        if (planner is not None and name in _TRACKED_FIELDS
                and planner.residents.get(self.key) is self):
            planner._uncount(self)
            object.__setattr__(self, name, value)
            planner._count(self)
        else:
            object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles are plain values, not members of the planner.
        state = dict(self.__dict__)
        state.pop("_planner", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass
class Capacity:
    max_bytes: int | None = None
    max_slots: int | None = None

    def describe(self) -> str:
        parts = []
        if self.max_slots is not None:
            parts.append(f"{self.max_slots} models")
        if self.max_bytes is not None:
            parts.append(f"{self.max_bytes} bytes")
        return " and ".join(parts) or "unlimited"


@dataclass
class EvictionPlan:
    victims: list[str] = field(default_factory=list)
    freed_bytes: int = 0


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


class CachePlanner:
    """Capacity + pins + stage priority around a policy.  Not thread-safe: one owner.

    Keeps running totals (bytes used, evictable residents per priority) so ``used_bytes``
    is O(1) and ``plan`` walks the policy's victim order once, usually stopping at the
    first key.
    """

    def __init__(self, policy: EvictionPolicy, capacity: Capacity,
                 priority_of: Callable[[str], int] | None = None,
                 headroom: HeadroomSpec | None = None):
        self.policy = policy
        self.capacity = capacity
        # Stage priority of a newcomer (registry.stage_priority): a shadow evicts shadows only.
        self.priority_of = priority_of
        self.headroom = headroom if headroom is not None else HeadroomSpec(models=0)
        self.residents: dict[str, Resident] = {}
        self._used_bytes = 0
        self._leaving_bytes = 0
        self._leaving_slots = 0
        self._evictable: dict[int, int] = {}  # priority -> residents neither pinned nor busy

    # -- running totals (called by Resident.__setattr__) --------------------------------
    def _count(self, r: Resident) -> None:
        self._used_bytes += r.size_bytes
        if r.leaving:
            self._leaving_bytes += r.size_bytes
            self._leaving_slots += 1
        if r.evictable and not r.pinned:
            self._evictable[r.priority] = self._evictable.get(r.priority, 0) + 1

    def _uncount(self, r: Resident) -> None:
        self._used_bytes -= r.size_bytes
        if r.leaving:
            self._leaving_bytes -= r.size_bytes
            self._leaving_slots -= 1
        if r.evictable and not r.pinned:
            left = self._evictable[r.priority] - 1
            if left:
                self._evictable[r.priority] = left
            else:
                del self._evictable[r.priority]

    # -- bookkeeping ------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def used_slots(self) -> int:
        return len(self.residents)

    @property
    def committed_bytes(self) -> int:
        """Bytes held once every unload in progress completes (leaving residents left out)."""
        return self._used_bytes - self._leaving_bytes

    @property
    def committed_slots(self) -> int:
        return len(self.residents) - self._leaving_slots

    def touch(self, key: str, now: float) -> None:
        self.policy.touch(key, now)

    def admit(self, resident: Resident, now: float, load_cost_s: float = 1.0) -> None:
        """Record ``resident`` as loaded; re-admitting a key replaces its old entry.

        Raises ValueError if this Resident object is already held by another planner.
        """
        owner = resident._planner
        if owner is not None and owner is not self:
            raise ValueError(
                f"Resident {resident.key!r} already belongs to another CachePlanner; "
                "remove it there first or admit a new Resident"
            )
        old = self.residents.get(resident.key)
        if old is not None and old is not resident:
            self._release(old)
        elif old is resident:
            self._uncount(resident)
        self.residents[resident.key] = resident
        object.__setattr__(resident, "_planner", self)
        self._count(resident)
        # The policy weighs size only when bytes are what runs out.
        size_bytes = resident.size_bytes if self.capacity.max_bytes is not None else 0
        self.policy.admit(resident.key, now, size_bytes, load_cost_s)

    def remove(self, key: str) -> None:
        r = self.residents.pop(key, None)
        if r is not None:
            self._release(r)
        self.policy.remove(key)

    def _release(self, r: Resident) -> None:
        self._uncount(r)
        object.__setattr__(r, "_planner", None)

    # -- decisions --------------------------------------------------------------------
    def fits_at_all(self, size_bytes: int) -> bool:
        cap = self.capacity
        if cap.max_slots is not None and cap.max_slots < 1:
            return False
        return cap.max_bytes is None or size_bytes <= cap.max_bytes

    def plan(self, key: str, size_bytes: int) -> EvictionPlan:
        """Victims that make room for ``key``; raises CapacityExhausted if none can.

        Victims come lowest stage priority first, then in the policy's order; pinned and
        busy (not evictable) residents are skipped.  One pass over ``victim_order``: keys
        of a higher priority level are held back until every evictable key of the lower
        levels has been seen (the running counts say when).
        """
        cap = self.capacity
        if not self.fits_at_all(size_bytes):
            raise CapacityExhausted(
                f"{key} needs {size_bytes} bytes but the whole budget is {cap.describe()}; "
                "raise --memory-budget / --max-loaded or place it on a larger device"
            )
        limit = victim_priority_limit(
            self.priority_of(key) if self.priority_of is not None else DEFAULT_PRIORITY)
        # Room that leaving residents free is already promised: count it as free.  A shadow
        # leaves the headroom alone (restoring it would evict a serving model for it).
        reserve = self.headroom_target() if limit is not None else Headroom()
        need_bytes = 0
        if cap.max_bytes is not None:
            need_bytes = max(0, self.committed_bytes + size_bytes + reserve.bytes - cap.max_bytes)
        need_slots = 0
        if cap.max_slots is not None:
            need_slots = max(0, self.committed_slots + 1 + reserve.slots - cap.max_slots)
        if need_bytes <= 0 and need_slots <= 0:
            return EvictionPlan()
        evictable = sum(n for p, n in self._evictable.items() if limit is None or p <= limit)
        if need_slots <= evictable:
            plan = self._collect(key, need_bytes, need_slots, limit)
            if plan is not None:
                return plan
        if limit is not None:
            raise self._exhausted_for_shadow(key, size_bytes, limit)
        raise self._exhausted(key, size_bytes)

    def headroom_target(self) -> Headroom:
        """The room this server keeps free now (see ``HeadroomSpec``); pure."""
        spec, cap = self.headroom, self.capacity
        slots = size = 0
        if cap.max_slots is not None:
            n = spec.models
            if n is None:
                n = HEADROOM_DEFAULT_MODELS if cap.max_slots >= HEADROOM_MIN_CAPACITY_MODELS else 0
            slots = min(n, int(cap.max_slots * HEADROOM_MAX_FRACTION))
        if cap.max_bytes is not None:
            if spec.bytes is not None:
                size = spec.bytes
            elif spec.models != 0:
                sizes = sorted(r.size_bytes for r in self.residents.values() if r.size_bytes > 0)
                typical = sizes[len(sizes) // 2] if sizes else 0
                n = spec.models
                if n is None:
                    fits = cap.max_bytes // typical if typical else 0
                    n = HEADROOM_DEFAULT_MODELS if fits >= HEADROOM_MIN_CAPACITY_MODELS else 0
                size = n * typical
            size = min(size, int(cap.max_bytes * HEADROOM_MAX_FRACTION))
        return Headroom(slots, size)

    def headroom_victims(self) -> list[str]:
        """Residents to unload so that the headroom is free once they are gone; pure.

        The policy's order with the usual rules (never pinned or busy ones, lowest stage
        priority first); leaving residents count as gone.  Empty when the headroom is free,
        when what is evictable cannot restore all of it (evicting for part of it would cost
        hits and still leave the next miss waiting), or when it would take the last
        evictable model: with everything else pinned or busy, that one is what a newcomer
        just loaded (``mmctl load`` must not see it leave at once), and the next miss would
        have to evict it anyway."""
        target = self.headroom_target()
        if not target:
            return []
        cap = self.capacity
        need_bytes = need_slots = 0
        if cap.max_bytes is not None and target.bytes:
            need_bytes = max(0, self.committed_bytes + target.bytes - cap.max_bytes)
        if cap.max_slots is not None and target.slots:
            need_slots = max(0, self.committed_slots + target.slots - cap.max_slots)
        if need_bytes <= 0 and need_slots <= 0:
            return []
        evictable = sum(self._evictable.values())
        if need_slots >= evictable:
            return []
        plan = self._collect(None, need_bytes, need_slots)
        if plan is None or len(plan.victims) >= evictable:
            return []
        return plan.victims

    def _collect(self, key: str | None, need_bytes: int, need_slots: int,
                 limit: int | None = None) -> EvictionPlan | None:
        residents = self.residents
        levels = sorted(p for p in self._evictable if limit is None or p <= limit)
        if not levels:
            return None
        if len(levels) == 1:  # the usual case: one stage priority among evictable residents
            victims: list[str] = []
            freed = 0
            for candidate in self.policy.victim_order():
                r = residents.get(candidate)
                if r is None or r.pinned or not r.evictable or candidate == key:
                    continue
                if limit is not None and r.priority > limit:
                    continue
                victims.append(candidate)
                freed += r.size_bytes
                if freed >= need_bytes and len(victims) >= need_slots:
                    return EvictionPlan(victims, freed)
            return None
        expected = [self._evictable[p] for p in levels]
        buckets: dict[int, list[Resident]] = {p: [] for p in levels}
        victims = []
        freed = 0
        level = taken = 0

        def drain(final: bool) -> bool:
            """Take ready keys in order; True once the need is met."""
            nonlocal level, taken, freed
            while level < len(levels):
                bucket = buckets[levels[level]]
                while taken < len(bucket):
                    r = bucket[taken]
                    taken += 1
                    victims.append(r.key)
                    freed += r.size_bytes
                    if freed >= need_bytes and len(victims) >= need_slots:
                        return True
                if not final and taken < expected[level]:
                    return False  # more keys of this level may still come
                level += 1
                taken = 0
            return False

        for candidate in self.policy.victim_order():
            r = residents.get(candidate)
            if r is None or r.pinned or not r.evictable or candidate == key:
                continue
            bucket = buckets.get(r.priority)
            if bucket is None:  # above the limit, or priority changed mid-walk
                continue
            bucket.append(r)
            if drain(final=False):
                return EvictionPlan(victims, freed)
        if drain(final=True):
            return EvictionPlan(victims, freed)
        return None

    def _exhausted(self, key: str, size_bytes: int) -> CapacityExhausted:
        cap = self.capacity
        pinned = sorted(k for k, r in self.residents.items() if r.pinned)
        busy = sorted(k for k, r in self.residents.items() if not r.evictable and not r.pinned)
        detail = f"pinned: {', '.join(pinned) or 'none'}"
        if busy:
            detail += f"; busy loading/unloading: {', '.join(busy)}"
        return CapacityExhausted(
            f"no room for {key} ({size_bytes} bytes): budget is {cap.describe()}, "
            f"{self.used_slots} loaded using {self.used_bytes} bytes, and nothing evictable is "
            f"left ({detail}); unpin a model (mmctl unpin NAME) or raise the budget"
        )

    def _exhausted_for_shadow(self, key: str, size_bytes: int, limit: int) -> CapacityExhausted:
        serving = sorted(k for k, r in self.residents.items() if r.priority > limit)
        cap = self.capacity
        return CapacityExhausted(
            f"no room for shadow {key} ({size_bytes} bytes): a shadow may evict only other "
            f"shadow or retired models, and the budget ({cap.describe()}, {self.used_slots} "
            f"loaded using {self.used_bytes} bytes) is held by models that serve traffic "
            f"({', '.join(serving) or 'none'}) or by shadows that are busy or pinned; the "
            "shadow is skipped until room frees up; raise the budget or add a device"
        )
