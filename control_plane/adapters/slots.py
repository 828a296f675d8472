"""``AdapterSlots``: which LoRA adapters hold the device slots of each loaded base, decided
by the model manager like its models.

An adapter is an entry of the manager named ``BASE:ADAPTER`` (the name clients use).  Each
base loaded on a server has ``max_device_adapters`` slots there; the entries in them are the
residents of a ``CachePlanner`` of that (base, server) with the manager's eviction policy, a
budget of that many slots, the adapters' pins (``mmctl adapter pin``) and the requests on
their way (an adapter loaded for a request is not a victim until the router says it was
answered, as a model is not).  The model's own adapter cache decides nothing: its manifest
says ``residency: control_plane`` and it fills a slot only when told which adapters to evict
(``{"op": "load", "adapter", "evict"}``: one control request per miss).

The router sees adapters as it sees models: ``ready_server_of("tinylm:acme")`` is the server
whose base holds it in a slot (published to the workers as a placement), a miss is an
ensure of ``tinylm:acme`` (the base is loaded first if need be), and a request that meets its
adapter gone (``AdapterNotLoaded``, worded as Triton's "unknown model") is ensured and sent
again.

What the model answers is the truth: every control answer (and the adapter manager's status
polls) rebuilds the planner's residents from the adapters it reports in a slot, so pins and
unloads made by the manifest, a base loaded again with empty slots, or a load that failed
are seen as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from control_plane.adapters.base import describe_base
from control_plane.eviction import CachePlanner, Capacity, Resident, make_policy
from control_plane.families.family_catalog import control_key
from control_plane.manager.request_holds import RequestHolds
from control_plane.manager.room import Turns
from domain.errors import CapacityExhausted, ControlPlaneError, ModelLoadFailed, ModelNotFound
from domain.routes import AdapterKey

log = logging.getLogger(__name__)

# The model's status names an adapter in a device slot so.
DEVICE_TIER = "device"
# Its tiers as ``mmctl status`` names a model's: in a slot, in host memory, only on disk.
ADAPTER_TIERS = {DEVICE_TIER: "hot", "host": "warm", "loading": "warm"}
GONE_TIERS = ("missing", "disabled")  # removed (or being removed): not listed


def adapter_key(name: str) -> AdapterKey:
    """``name`` (``BASE:ADAPTER``, or its key already) as an adapter's key; ModelNotFound when
    it names no adapter, InvalidModelName when a part is no valid name."""
    key = AdapterKey.parse(name)
    if key is None:
        raise ModelNotFound(f"{name} names no adapter (BASE:ADAPTER)")
    return key


# How often a load waiting for a busy slot looks again anyway (a hold that expired).
BUSY_RECHECK_S = 0.5
# Ensures of the base for one adapter miss: once more when the base left its server under
# the fill.
ENSURE_ATTEMPTS = 2
MAX_DESCRIBED_BASES = 1024  # bases whose description is kept between misses


class SlotsBusy(CapacityExhausted):
    """Every slot holds an adapter that is pinned or that a request is on its way to, and
    not all are pinned: one frees up once its requests are answered."""


@dataclass
class BaseSlots:
    """One base's adapter slots on one server."""

    base: str
    server: str
    planner: CachePlanner
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    status: dict = field(default_factory=dict)  # the model's last answer


class AdapterSlots:
    """The manager's part for adapters: places them into their base's slots (``place``),
    serves the router's misses (``ensure_for_request``), takes use (``touch``) and the end
    of requests (``requests_answered``), and says where each one is (``ready_server_of``).

    ``manager``: the ModelManager (its servers, the base's copies, its request holds and its
    state-change listeners); ``repository``: where the bases' folders are (which models are
    LoRA bases, which adapters exist)."""

    def __init__(self, manager, repository, policy: str | None = None,
                 on_its_way_s: float | None = None, clock: Callable[[], float] = time.time,
                 on_status: Callable[[str, dict], None] = lambda _base, _status: None,
                 evictions: dict[str, int] | None = None):
        self.manager = manager
        self.repository = repository
        self.policy = policy or manager.config.policy
        self.on_its_way_s = on_its_way_s if on_its_way_s is not None else manager.config.on_its_way_s
        self.clock = clock
        self.slots: dict[tuple[str, str], BaseSlots] = {}  # (base, server) -> its slots
        # Entries (BASE:ADAPTER) that requests on their way were ensured for: no victims.
        self.holds = RequestHolds(self.on_its_way_s, on_first=lambda name: self._set_evictable(name, False),
                                  on_last=self._last_hold_ended)
        # base -> adapters evicted for others (the adapters' metrics read it)
        self.evictions: dict[str, int] = evictions if evictions is not None else {}
        self.capacity_wait_s = getattr(manager.config, "capacity_wait_s", 120.0)
        # (base, server) -> the adapter loads waiting for a slot there, oldest first: when an
        # adapter's holds end, the oldest tries again at once (one per slot freed).
        self._turns: dict[tuple[str, str], Turns] = {}
        self.on_status = on_status  # a base's whole status, as its model reported it
        # The key of the models' control sockets (commands beside their batches).
        self.key = control_key(Path(repository))
        # base -> (its config's and folder's stamps, describe_base of it): a miss reads two
        # stamps instead of parsing the config and listing the folder.
        self._described: dict[str, tuple[tuple, object]] = {}
        manager.on_state_change(self._model_moved)

    # ------------------------------------------------------------------ where
    def servers_holding(self, name: str) -> list[str]:
        """The servers where entry ``name`` is in a slot of its base (READY there)."""
        key = adapter_key(name)
        base, adapter = key.base, key.adapter
        found = []
        for (held_base, server), slots in self.slots.items():
            if held_base == base and adapter in slots.planner.residents:
                found.append(server)
        return sorted(found)

    def ready_server_of(self, name: str):
        servers = self.servers_holding(name)
        for where in servers:
            server = self.manager.servers.get(where)
            if server is not None and server.up:
                return server
        return None

    def copy_servers_of(self, name: str) -> list[str]:
        server = self.ready_server_of(name)
        return [] if server is None else [server.name]

    def base_of(self, name: str) -> tuple[str, str]:
        """(base, adapter) of entry ``name``; ModelNotFound when the base is no LoRA base or
        the adapter is not in its adapter directory."""
        key = adapter_key(name)
        base, adapter = key.base, key.adapter
        try:
            described = self._describe(base)
        except ControlPlaneError as exc:
            raise ModelNotFound(f"unknown model {name!r}: {exc.message}") from None
        if not (described.adapter_dir / adapter).is_dir():
            raise ModelNotFound(f"unknown adapter {adapter!r} for {base}; `mmctl adapter list {base}` "
                                "shows them, `mmctl adapter add` adds one")
        return base, adapter

    def _describe(self, base: str):
        """``describe_base``, kept while the base's config.pbtxt and folder are unchanged."""
        folder = Path(self.repository) / base  # base: a valid model name (AdapterKey.parse)
        try:
            stamps = tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in (
                (folder / "config.pbtxt").stat(), folder.stat()))
        except OSError:
            stamps = None
        kept = self._described.get(base)
        if stamps is not None and kept is not None and kept[0] == stamps:
            return kept[1]
        described = describe_base(self.repository, base)
        if stamps is not None:
            if len(self._described) >= MAX_DESCRIBED_BASES:
                self._described.clear()
            self._described[base] = (stamps, described)
        return described

    # ------------------------------------------------------------------ requests
    async def ensure_for_request(self, name: str, unreachable: str | None = None,
                                 owner: str | None = None):
        """The server where ``name``'s base is READY with the adapter in a slot, for a request
        about to be sent there.  The base is held as the manager holds a model for a
        request, and the adapter is no victim until ``requests_answered`` (or
        ``on_its_way_s``); ``owner``: the router worker asking, whose answers end its own
        holds only."""
        base, adapter = self.base_of(name)
        handle = self.holds.hold(name, owner)
        try:
            for attempt in range(ENSURE_ATTEMPTS):
                server = await self.manager.ensure_for_request(base, unreachable=unreachable, owner=owner)
                try:
                    await self.place(server, base, adapter)
                    return server
                except ModelNotFound:
                    self.manager.requests_answered(base, 1, owner=owner)  # this attempt's hold of the base
                    if attempt + 1 == ENSURE_ATTEMPTS or server.name in self.manager.copy_servers_of(base):
                        raise
                    # The base left its server under the fill (an unload): it is ensured
                    # again, as a request that meets its model unloaded is sent again.
                except BaseException:
                    self.manager.requests_answered(base, 1, owner=owner)
                    raise
            raise AssertionError("unreachable")
        except BaseException:
            self.holds.end(name, handle)
            raise

    def requests_answered(self, name: str, count: int = 1, owner: str | None = None) -> int:
        """Requests that ensured ``name`` for ``owner`` were answered: their holds on the
        adapter and on its base end (another worker's never do)."""
        ended = self.holds.answered(name, count, owner)
        self.manager.requests_answered(adapter_key(name).base, ended, owner=owner)
        return ended

    def touch(self, name: str) -> None:
        key = adapter_key(name)
        base, adapter = key.base, key.adapter
        now = self.clock()
        for (held_base, _server), slots in self.slots.items():
            if held_base == base and adapter in slots.planner.residents:
                slots.planner.touch(adapter, now)

    def _last_hold_ended(self, name: str) -> None:
        self._set_evictable(name, True)
        base = adapter_key(name).base
        for (held_base, _server), turns in self._turns.items():
            if held_base == base:
                turns.wake_oldest()

    def _set_evictable(self, name: str, evictable: bool) -> None:
        key = adapter_key(name)
        base, adapter = key.base, key.adapter
        for (held_base, _server), slots in self.slots.items():
            if held_base == base:
                slots.planner.update(adapter, evictable=evictable)

    # ------------------------------------------------------------------ placing
    async def place(self, server, base: str, adapter: str) -> dict:
        """``adapter`` into a slot of ``base`` on ``server`` (READY there), evicting the
        adapters the policy picks when every slot is taken; the model's answer.  One control
        request; the slots' first use after the base's load asks the model for them first.
        When every slot holds an adapter a request is on its way to, it waits for one of
        them to be answered (at most the manager's ``capacity_wait_s``), as a model's load
        waits for room; when they are all pinned it is refused at once."""
        deadline = time.monotonic() + self.capacity_wait_s
        turns = self._turns.setdefault((base, server.name), Turns())
        place = turns.place()  # among the loads waiting for these slots
        try:
            await place.behind_promised(min(self.capacity_wait_s, BUSY_RECHECK_S))
            while True:
                place.trying()
                try:
                    return await self._place_once(server, base, adapter)
                except SlotsBusy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    # Woken for a slot that another load took first: the next in line may
                    # fit where this one did not.
                    place.pass_on()
                    await asyncio.wait({place.turn()}, timeout=min(left, BUSY_RECHECK_S))
        finally:
            place.leave()

    async def _place_once(self, server, base: str, adapter: str) -> dict:
        slots = await self._slots(server, base)
        async with slots.lock:
            for attempt in range(2):
                victims = []
                if adapter not in slots.planner.residents:
                    victims = self._victims(slots, adapter)
                try:
                    status = await server.admin.adapter_control(
                        base, {"op": "load", "adapter": adapter, "evict": victims, "answer": "slots"},
                        key=self.key)
                except CapacityExhausted:
                    if attempt:
                        raise
                    # What this control plane knew of the slots was stale (the base was loaded
                    # again, a pin arrived): read them, plan again.
                    self.observe(base, server.name, await server.admin.adapter_control(
                        base, {"op": "status"}, key=self.key))
                    continue
                if victims:
                    self.evictions[base] = self.evictions.get(base, 0) + len(victims)
                if victims:
                    log.info("adapter %s:%s into a slot on %s, evicting %s", base, adapter,
                             server.name, ", ".join(victims))
                self.observe(base, server.name, status)
                if adapter not in slots.planner.residents:
                    raise ModelLoadFailed(f"{base} did not report adapter {adapter!r} in a slot after "
                                          "loading it; retry")
                return status
        raise AssertionError("unreachable")

    def _victims(self, slots: BaseSlots, adapter: str) -> list[str]:
        try:
            return slots.planner.plan(adapter, 0).victims
        except CapacityExhausted:
            residents = slots.planner.residents.values()
            pinned = sorted(r.key for r in residents if r.pinned)
            busy = sorted(r.key for r in residents if not r.pinned and not r.evictable)
            raise (SlotsBusy if busy else CapacityExhausted)(
                f"no adapter slot of {slots.base} on {slots.server} for {adapter!r}: its "
                f"{slots.planner.capacity.max_slots} slot(s) hold pinned adapters "
                f"({', '.join(pinned) or 'none'}) and adapters requests are on their way to "
                f"({', '.join(busy) or 'none'}); unpin one (mmctl adapter unpin) or raise the "
                "base's max_device_adapters") from None

    async def _slots(self, server, base: str) -> BaseSlots:
        """The slots of ``base`` on ``server``, asked of the model the first time after its
        load."""
        key = (base, server.name)
        slots = self.slots.get(key)
        if slots is None:
            self.observe(base, server.name, await server.admin.adapter_control(
                base, {"op": "status"}, key=self.key))
            slots = self.slots.get(key)
            if slots is None:
                raise ModelLoadFailed(f"{base} left {server.name} before its adapter slots could be "
                                      "read; retry")
        return slots

    def observe(self, base: str, server: str, status: dict) -> None:
        """The model's answer about its adapters (a control request or a status poll): the
        slots' residents become what it reports in a slot."""
        if not status.get("partial"):  # the slots alone say nothing of the other adapters
            self.on_status(base, status)
        slots = self.slots.get((base, server))
        if slots is None:
            if server not in self.manager.copy_servers_of(base):
                return  # not READY there (any more): its slots went with it
            capacity = Capacity(max_slots=max(1, int(status.get("max_device_adapters") or 1)))
            slots = self.slots[(base, server)] = BaseSlots(
                base, server, CachePlanner(make_policy(self.policy), capacity))
        if status.get("partial"):  # the listing keeps the other adapters' last known rows
            known = {a["name"]: a for a in slots.status.get("adapters", [])}
            for a in known.values():
                if a.get("tier") == DEVICE_TIER:
                    known[a["name"]] = {**a, "tier": "host", "slot": None}  # left its slot
            for a in status.get("adapters", []):
                known[a["name"]] = {**known.get(a["name"], {}), **a}
            slots.status = {**slots.status, **{k: v for k, v in status.items() if k != "adapters"},
                            "adapters": sorted(known.values(), key=lambda a: a["name"]),
                            "partial": False}
        else:
            slots.status = status
        planner, now = slots.planner, self.clock()
        in_slots = {a["name"]: bool(a.get("pinned")) for a in status.get("adapters", [])
                    if a.get("tier") == DEVICE_TIER}
        changed = []
        for adapter in list(planner.residents):
            if adapter not in in_slots:
                planner.remove(adapter)
                changed.append(adapter)
        for adapter, pinned in in_slots.items():
            resident = planner.residents.get(adapter)
            if resident is None:
                held = AdapterKey(base, adapter) in self.holds
                planner.admit(Resident(adapter, 0, pinned=pinned, evictable=not held), now)
                changed.append(adapter)
            elif resident.pinned != pinned:
                planner.update(adapter, pinned=pinned)
        for adapter in changed:
            self.manager.announce_moved(AdapterKey(base, adapter))

    def _model_moved(self, name: str) -> None:
        """A model's state changed: a base no longer READY on a server took its adapters
        with it (loaded again, its slots start empty)."""
        if isinstance(name, AdapterKey):
            return
        for (base, where) in [k for k in self.slots if k[0] == name]:
            if where not in self.manager.copy_servers_of(name):
                slots = self.slots.pop((base, where))
                server = self.manager.servers.get(where)
                if server is not None:  # its process goes: nothing more over its socket
                    asyncio.get_running_loop().create_task(server.admin.control_sockets.forget(base))
                for adapter in slots.planner.residents:
                    self.manager.announce_moved(AdapterKey(base, adapter))

    # ------------------------------------------------------------------ status
    def rows(self) -> list[dict]:
        """Every adapter of every base loaded somewhere, as ``mmctl status`` lists a model:
        ``BASE:ADAPTER``, ready (in a slot of its base on ``server``) or warm, and its tier:
        hot (a device slot), warm (the model's host memory), cold (its adapter directory).
        An adapter of a base with copies is listed once per server that holds the base."""
        rows = []
        for (base, server), slots in sorted(self.slots.items()):
            for a in slots.status.get("adapters", []):
                if a.get("tier") in GONE_TIERS:
                    continue
                name = AdapterKey(base, a["name"])
                in_slot = a["name"] in slots.planner.residents
                rows.append({
                    "model": name,
                    "kind": "adapter",
                    "base": base,
                    "state": "ready" if in_slot else "warm",
                    "server": server if in_slot else None,
                    "copies": [],
                    "replicas": 1,
                    "tier": ADAPTER_TIERS.get(a.get("tier"), "cold"),
                    "pinned": bool(a.get("pinned")),
                    "slot": a.get("slot") if in_slot else None,
                    "last_used": a.get("last_used_unix"),
                    "load_time_s": a.get("load_time_s"),
                    "memory_bytes": a.get("bytes") or 0,
                    "failure": a.get("error"),
                    "copies_note": (f"adapter slot {a.get('slot')} of {base} on {server}" if in_slot
                                    else f"adapter of {base}"),
                    "requests": a.get("requests") or 0,
                    "inflight": self.holds.count(name),
                    "healthy": in_slot,
                })
        return rows

    def slot_use(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(base, server) -> (slots holding adapters, slots)."""
        return {key: (len(s.planner.residents), s.planner.capacity.max_slots or 0)
                for key, s in self.slots.items()}
