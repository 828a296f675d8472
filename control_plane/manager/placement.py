"""Which Triton server (device, GPU or MIG slice) a model is loaded on: filters + ordering keys.

Placement is pure: ``choose(request, candidates)`` takes plain data about each server and
returns the decision or raises a clear error; ``Placer.place`` builds that data from the
manager's servers and their planners (``CachePlanner.plan`` changes nothing) and is what
``ModelManager._place`` calls.

Filters (each small and named; each says why it rejected a server):

    server_up            the Triton answers
    device_big_enough    the model is not larger than the device's whole budget
    sla_isolation        gold SLA -> an isolated device (MIG slice / dedicated GPU); a device
                         reserved for an SLA class takes only that class
    tenant_affinity      a device restricted to some tenants takes only their models
    fits_free_or_evictable  the planner can make room (free bytes/slots, or evictable
                         models; pinned and busy ones never count)

Ordering keys, applied in this order to the servers that pass (lower is better):

    already_warm         the artifact is already in that server's repository
    fewest_victims       fewer models evicted
    family_there         a variant goes where its family is loaded (no second copy of its slots)
    shared_for_non_gold  non-gold models stay off isolated devices while shared ones fit
    spread_pinned        a pinned model goes where fewer pinned models are
    least_loaded         lowest used fraction of the budget (bytes, else slots)
    server name          a stable tie-break

A model larger than every device gets CapacityExhausted naming the largest device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from control_plane.manager.records import CopyKey, PoolKey
from domain.errors import CapacityExhausted, ControlPlaneError, TritonUnavailable
from domain.stages import DEFAULT_SLA

log = logging.getLogger(__name__)

GOLD = "gold"


@dataclass(frozen=True)
class PlacementRequest:
    model: str
    size_bytes: int
    sla: str = DEFAULT_SLA
    tenant: str | None = None
    pinned: bool = False


@dataclass
class Candidate:
    """What placement needs to know about one server, as plain data."""

    server: str
    address: str = ""
    up: bool = True
    device: str = "cpu"
    capacity_bytes: int | None = None
    used_bytes: int = 0
    max_slots: int | None = None
    used_slots: int = 0
    pinned_models: int = 0
    isolated: bool = False
    reserved_for_sla: str | None = None
    tenants: frozenset[str] | None = None
    warm: bool = True
    victims: tuple[str, ...] = ()
    plan_error: ControlPlaneError | None = None  # the planner could not make room
    new_pool: bool = False  # a variant whose family would be loaded there (a process start)

    @property
    def load_fraction(self) -> float:
        if self.capacity_bytes:
            return self.used_bytes / self.capacity_bytes
        if self.max_slots:
            return self.used_slots / self.max_slots
        return 0.0


# --------------------------------------------------------------------------- filters
Filter = Callable[[PlacementRequest, Candidate], "str | None"]


def server_up(req: PlacementRequest, c: Candidate) -> str | None:
    if not c.up:
        return f"server {c.server} ({c.address}) is down" if c.address else f"server {c.server} is down"
    return None


def device_big_enough(req: PlacementRequest, c: Candidate) -> str | None:
    if c.capacity_bytes is not None and req.size_bytes > c.capacity_bytes:
        return (f"{req.model} needs {req.size_bytes} bytes but the whole budget of {c.server} "
                f"({c.device}) is {c.capacity_bytes} bytes")
    if c.max_slots is not None and c.max_slots < 1:
        return f"{c.server} takes no models (max_loaded {c.max_slots})"
    return None


def sla_isolation(req: PlacementRequest, c: Candidate) -> str | None:
    if req.sla == GOLD and not c.isolated:
        return (f"SLA {GOLD} needs an isolated device (a MIG slice or a dedicated GPU); "
                f"{c.server} ({c.device}) is shared")
    if c.reserved_for_sla is not None and req.sla != c.reserved_for_sla:
        return f"{c.server} is reserved for SLA {c.reserved_for_sla} models; {req.model} is {req.sla}"
    return None


def tenant_affinity(req: PlacementRequest, c: Candidate) -> str | None:
    if c.tenants is not None and req.tenant not in c.tenants:
        return (f"{c.server} serves tenants {sorted(c.tenants)} only; {req.model} belongs to "
                f"{req.tenant or 'no tenant'}")
    return None


def fits_free_or_evictable(req: PlacementRequest, c: Candidate) -> str | None:
    return c.plan_error.message if c.plan_error is not None else None


DEFAULT_FILTERS: tuple[tuple[str, Filter], ...] = (
    ("server_up", server_up),
    ("device_big_enough", device_big_enough),
    ("sla_isolation", sla_isolation),
    ("tenant_affinity", tenant_affinity),
    ("fits_free_or_evictable", fits_free_or_evictable),
)

# --------------------------------------------------------------------------- keys
Key = Callable[[PlacementRequest, Candidate], Any]

DEFAULT_KEYS: tuple[tuple[str, Key], ...] = (
    ("already_warm", lambda req, c: 0 if c.warm else 1),
    ("fewest_victims", lambda req, c: len(c.victims)),
    ("family_there", lambda req, c: 1 if c.new_pool else 0),
    ("shared_for_non_gold", lambda req, c: 1 if (req.sla != GOLD and c.isolated) else 0),
    ("spread_pinned", lambda req, c: c.pinned_models if req.pinned else 0),
    ("least_loaded", lambda req, c: c.load_fraction),
    ("server", lambda req, c: c.server),
)


@dataclass
class Decision:
    server: str
    victims: list[str]
    rejected: dict[str, tuple[str, str]] = field(default_factory=dict)  # server -> (filter, why)
    ranking: list[str] = field(default_factory=list)


def choose(req: PlacementRequest, candidates: Sequence[Candidate],
           filters: Sequence[tuple[str, Filter]] = DEFAULT_FILTERS,
           keys: Sequence[tuple[str, Key]] = DEFAULT_KEYS) -> Decision:
    """The best server for ``req``, or a clear error saying why none would do."""
    if not candidates:
        raise TritonUnavailable("the fleet has no Triton servers; start one (mmctl up) or attach one")
    passed: list[Candidate] = []
    rejected: dict[str, tuple[str, str]] = {}
    for c in candidates:
        for fname, f in filters:
            why = f(req, c)
            if why is not None:
                rejected[c.server] = (fname, why)
                log.debug("placement of %s: %s rejected by %s: %s", req.model, c.server, fname, why)
                break
        else:
            passed.append(c)
    if passed:
        passed.sort(key=lambda c: tuple(k(req, c) for _, k in keys))
        best = passed[0]
        return Decision(best.server, list(best.victims), rejected, [c.server for c in passed])
    raise _no_server_error(req, candidates, rejected)


def _no_server_error(req: PlacementRequest, candidates: Sequence[Candidate],
                     rejected: dict[str, tuple[str, str]]) -> ControlPlaneError:
    by_filter = {fname for fname, _ in rejected.values()}
    if req.sla == GOLD and not any(c.isolated for c in candidates):
        # Nothing the operator does at run time helps: the fleet itself lacks the device.
        shared = ", ".join(f"{c.server} ({c.device})" for c in candidates)
        return CapacityExhausted(
            f"{req.model} has SLA {GOLD}, which runs only on an isolated device (a MIG slice), "
            f"and this fleet has none: {shared} are shared; split a GPU into MIG slices "
            "(nvidia-smi mig -cgi PROFILE -C) and restart mmctl up, or register the model with "
            "another SLA class (mmctl registry add ... --sla silver)")
    if len(candidates) == 1:
        c = candidates[0]
        fname, why = rejected[c.server]
        if fname == "fits_free_or_evictable" and c.plan_error is not None:
            return c.plan_error  # the planner's own message (names the pinned models)
        if fname == "server_up":
            return TritonUnavailable(why)
        return CapacityExhausted(why + _hint(fname))
    if by_filter == {"server_up"}:
        return TritonUnavailable(f"no Triton server is up to load {req.model}: "
                                 + "; ".join(why for _, why in rejected.values()))
    if by_filter == {"device_big_enough"}:
        largest = max(candidates, key=lambda c: c.capacity_bytes or 0)
        return CapacityExhausted(
            f"{req.model} needs {req.size_bytes} bytes but it fits on no device of the fleet: the "
            f"largest is {largest.server} ({largest.device}) with {largest.capacity_bytes} bytes; "
            "give it a bigger device or MIG slice, or shrink the model")
    fits = [c for c in candidates if rejected[c.server][0] == "fits_free_or_evictable"]
    if len(fits) == 1 and by_filter <= {"fits_free_or_evictable", "server_up"}:
        return fits[0].plan_error or CapacityExhausted(rejected[fits[0].server][1])
    details = "; ".join(f"{s}: {why} [{fname}]" for s, (fname, why) in sorted(rejected.items()))
    return CapacityExhausted(f"no server can take {req.model} ({req.size_bytes} bytes, SLA {req.sla}"
                   f"{', tenant ' + req.tenant if req.tenant else ''}): {details}")


def _hint(fname: str) -> str:
    return {
        "device_big_enough": "; give it a bigger device or MIG slice, or shrink the model",
        "sla_isolation": "; add an isolated device (MIG slice) or change the model's SLA class",
        "tenant_affinity": "; add the tenant to a device's tenants or remove the restriction",
    }.get(fname, "")


# --------------------------------------------------------------------------- manager glue
@dataclass(frozen=True)
class ServerLabels:
    """Placement facts about a server that its ServerSpec does not carry."""

    isolated: bool = False
    reserved_for_sla: str | None = None
    tenants: frozenset[str] | None = None

    @classmethod
    def from_device(cls, device) -> ServerLabels:
        return cls(device.isolated, device.reserved_for_sla, device.tenants)


@dataclass(frozen=True)
class ModelFacts:
    sla: str = DEFAULT_SLA
    tenant: str | None = None


class Placer:
    """Builds candidates from the manager's servers and calls ``choose``.

    ``facts(model)`` gives a model's SLA class and tenant (from the registry); ``labels``
    maps server name -> ServerLabels; ``warm_on(server, model)`` says whether that server's
    repository already holds the model (default: one shared warm repository, always True).
    """

    def __init__(self, facts: Callable[[str], ModelFacts] | None = None,
                 labels: dict[str, ServerLabels] | None = None,
                 warm_on: Callable[[str, str], bool] | None = None,
                 filters: Sequence[tuple[str, Filter]] = DEFAULT_FILTERS,
                 keys: Sequence[tuple[str, Key]] = DEFAULT_KEYS):
        self.facts = facts or (lambda _name: ModelFacts())
        self.labels = labels or {}
        self.warm_on = warm_on
        self.filters = filters
        self.keys = keys

    def candidate(self, server, name: str, size_bytes: int, extra_copy: bool = False) -> Candidate:
        """``extra_copy``: the candidate for one more copy of ``name`` (planned under its
        copy's key, whose priority lets it evict only other extra copies)."""
        spec, planner = server.spec, server.planner
        labels = self.labels.get(server.name, ServerLabels())
        victims: tuple[str, ...] = ()
        plan_error: ControlPlaneError | None = None
        new_pool = False
        if server.up:
            # A family's variant takes a slot of its family there (the family's whole slots
            # when it is not loaded there yet); so does each extra copy of a variant.
            pool = server.admin.slot_pool(name)
            key = CopyKey(name, server.name) if extra_copy else name
            try:
                if pool is None:
                    plan = planner.plan(key, size_bytes)
                else:  # a slot's bytes, whatever the variant's file holds beside them
                    plan = planner.plan(key, pool.slot_bytes, pool=PoolKey(pool.name, server.name),
                                        pool_slots=pool.slots)
                victims = tuple(plan.victims)
                new_pool = pool is not None and PoolKey(pool.name, server.name) not in planner.residents
            except CapacityExhausted as exc:
                plan_error = exc
        return Candidate(
            server=server.name, address=spec.grpc_url, up=server.up, device=spec.device,
            capacity_bytes=planner.capacity.max_bytes, used_bytes=planner.used_bytes,
            max_slots=planner.capacity.max_slots, used_slots=planner.used_slots,
            pinned_models=sum(1 for r in planner.residents.values() if r.pinned),
            isolated=labels.isolated, reserved_for_sla=labels.reserved_for_sla,
            tenants=labels.tenants,
            warm=self.warm_on(server.name, name) if self.warm_on is not None else True,
            victims=victims, plan_error=plan_error, new_pool=new_pool)

    def place(self, name: str, size_bytes: int, servers: Iterable, pinned: bool = False,
              extra_copy: bool = False):
        """(server, victims) for ``name`` (``extra_copy``: one more copy of it, on one of
        ``servers``); raises CapacityExhausted / TritonUnavailable.  A model's own copy goes
        where no extra copy of it is (one Triton model per server, one record), unless every
        server holds one."""
        servers = list(servers)
        if not extra_copy:
            servers = [s for s in servers if CopyKey(name, s.name) not in s.planner.residents] or servers
        facts = self.facts(name)
        req = PlacementRequest(name, size_bytes, facts.sla, facts.tenant, pinned)
        decision = choose(req, [self.candidate(s, name, size_bytes, extra_copy) for s in servers],
                          self.filters, self.keys)
        chosen = next(s for s in servers if s.name == decision.server)
        if decision.rejected:
            log.info("placed %s on %s (rejected: %s)", name, chosen.name,
                     {s: f"{f}: {why}" for s, (f, why) in decision.rejected.items()})
        return chosen, decision.victims


def registry_facts(registry) -> Callable[[str], ModelFacts]:
    """``facts`` for Placer from the registry (unregistered names: default SLA, no tenant)."""

    def facts(name: str) -> ModelFacts:
        mv = registry.by_name(name)
        return ModelFacts(mv.sla, mv.tenant) if mv is not None else ModelFacts()

    return facts


# --------------------------------------------------------------------------- measured size
def plan_measured(planner, name: str, measured_bytes: int) -> list[str]:
    """Victims to evict so that ``name``, already resident in ``planner`` with the size that
    was reserved for it, fits at ``measured_bytes`` (what NVML measured once it was loaded).

    Pure: changes nothing.  Empty when it fits as measured (or the server has no byte budget);
    raises CapacityExhausted when nothing evictable makes room, so the caller unloads it
    rather than let the device run out of memory."""
    resident = planner.residents.get(name)
    cap = planner.capacity
    if resident is None or cap.max_bytes is None:
        return []
    extra = measured_bytes - resident.size_bytes
    if planner.used_bytes + extra <= cap.max_bytes:
        return []
    if measured_bytes > cap.max_bytes:
        raise CapacityExhausted(
            f"{name} measured {measured_bytes} bytes on the device once loaded (NVML), more than "
            f"the whole budget of its server ({cap.max_bytes} bytes; {resident.size_bytes} were "
            "reserved from its files); it was unloaded: give it a larger device or MIG slice "
            "(mmctl up --device-budget), or shrink the model")
    # The model already holds its slot: it needs bytes only.  Synchronous, so no other task
    # sees the slot limit lifted.
    max_slots, cap.max_slots = cap.max_slots, None
    try:
        return list(planner.plan(name, extra).victims)
    except CapacityExhausted as exc:
        raise CapacityExhausted(
            f"{name} measured {measured_bytes} bytes on the device once loaded (NVML), "
            f"{extra} more than the {resident.size_bytes} reserved, and nothing evictable "
            f"makes room ({exc.message}); it was unloaded") from exc
    finally:
        cap.max_slots = max_slots


# --------------------------------------------------------------------------- instance kind
KIND_CPU = "KIND_CPU"
KIND_GPU = "KIND_GPU"
_RETARGETED_KINDS = (KIND_CPU, KIND_GPU, "KIND_AUTO")  # KIND_MODEL: the model places itself


def instance_kind_config(config_text: str, kind: str) -> str | None:
    """The load API's config override that runs a model's instances as ``kind``
    (``KIND_GPU`` on a GPU or MIG server, ``KIND_CPU`` on a CPU one), as JSON; None when its
    config.pbtxt already says so (loaded as it is) or Triton should report the config's
    own error.

    The one config.pbtxt stays the only copy: the override is derived from it at each load,
    so an edit of the file is what the next load sees."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(config_text, config)
    except text_format.ParseError:
        return None  # Triton's own load error names the problem better
    target = model_config_pb2.ModelInstanceGroup.Kind.Value(kind)
    changed = False
    # No instance_group (and ensembles, which have none): Triton's default already follows
    # the server, one instance per visible GPU, else on CPU.
    for group in config.instance_group:
        if model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) not in _RETARGETED_KINDS:
            continue
        if group.kind != target:
            group.kind = target
            changed = True
        if kind == KIND_CPU and group.gpus:
            del group.gpus[:]  # GPU ids mean nothing on a CPU server
            changed = True
    if not changed:
        return None
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


def instance_kind_override(repository, kind: str) -> Callable[[str], str | None]:
    """``load_config`` for TritonAdmin: the override for ``model`` read from its config.pbtxt
    in ``repository`` (Triton's repository, the warm tier), or None (load it as it is)."""
    from pathlib import Path

    root = Path(repository)

    def load_config(model: str) -> str | None:
        try:
            text = (root / model / "config.pbtxt").read_text()
        except OSError:
            return None  # Triton says what is missing
        return instance_kind_config(text, kind)

    return load_config
