"""The route table: logical model name -> concrete model, with A/B, canary and shadow.

Owned by the control plane and read by the router in-process, so resolving a request is a
dictionary lookup and a hash, never a remote call.  A logical name ``base:adapter``
(``tinylm:acme``) resolves like ``base`` and carries the LoRA adapter to select; rate limits
and statistics stay per ``base:adapter``.  Persisted as JSON in the control
plane's SQLite state so experiments, canary progress and limits survive restarts.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol, Self

from domain.errors import InvalidModelName
from domain.names import validate_model_name
from domain.router_errors import InvalidRequest, ModelNotFound

BUCKETS = 10_000
ROUTES_KEY = "router.routes"
LIMITS_KEY = "router.limits"


ADAPTER_SEPARATOR = ":"


def split_adapter(name: str) -> tuple[str, str | None]:
    """``"tinylm:acme"`` -> ``("tinylm", "acme")`` (base model + LoRA adapter);
    ``"cust001"`` -> ``("cust001", None)``.  Each part follows the model-name rules, so a
    name with ``:`` never reaches Triton or the filesystem whole."""
    if ADAPTER_SEPARATOR not in name:
        return name, None
    base, _, adapter = name.partition(ADAPTER_SEPARATOR)
    try:
        validate_model_name(base)
        validate_model_name(adapter)
    except InvalidModelName:
        raise InvalidModelName(
            f"logical name {name!r} is invalid: write BASE:ADAPTER (e.g. tinylm:acme), each part "
            "letters, digits, '_', '-' and '.', starting with a letter or digit") from None
    return base, adapter


class AdapterKey(str):
    """Adapter ``adapter`` of LoRA base ``base``: the name clients send (``BASE:ADAPTER``),
    its parts kept, so code asks the key's parts and never splits the name again."""

    base: str
    adapter: str

    def __new__(cls, base: str, adapter: str) -> Self:
        key = super().__new__(cls, f"{base}{ADAPTER_SEPARATOR}{adapter}")
        key.base, key.adapter = base, adapter
        return key

    def __getnewargs__(self) -> tuple[str, str]:  # copies and pickles keep the parts
        return self.base, self.adapter

    @classmethod
    def parse(cls, name: str) -> AdapterKey | None:
        """``name``'s key when it names an adapter, None for a model's name; InvalidModelName
        for a part that breaks the model-name rules (``split_adapter``)."""
        if isinstance(name, AdapterKey):
            return name
        base, adapter = split_adapter(name)
        return None if adapter is None else cls(base, adapter)


def validate_logical_name(name: str) -> str:
    """A model name, or ``base:adapter``."""
    if isinstance(name, str) and ADAPTER_SEPARATOR in name:
        split_adapter(name)
    else:
        validate_model_name(name)
    return name


def bucket(experiment_id: str, user_id: str) -> int:
    """Deterministic bucket in [0, 10000) for a user in an experiment."""
    digest = hashlib.sha256(f"{experiment_id}:{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


# What each gate of a canary may be: a gate that can never fail (a NaN limit, 0 requests
# needed) would promote a candidate on no evidence.
_CANARY_GATES = {
    "stage_s": "seconds per stage, > 0", "check_interval_s": "seconds between checks, > 0",
    "max_error_rate": "a fraction from 0 to 1", "max_p99_ms": "milliseconds, > 0",
    "max_error_rate_ratio": "a ratio, > 0", "max_p99_ratio": "a ratio, > 0",
    "min_requests": "a whole number >= 1", "max_failed_checks": "a whole number >= 1",
}


def _check_canary_gates(options: dict) -> None:
    for key, value in options.items():
        what = _CANARY_GATES.get(key)
        if what is None or (value is None and key in ("max_p99_ms", "max_error_rate_ratio",
                                                      "max_p99_ratio")):
            continue
        if key in ("min_requests", "max_failed_checks"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        elif key == "max_error_rate":
            ok = isinstance(value, (int, float)) and 0 <= value <= 1
        else:
            ok = isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        if not ok:
            raise InvalidRequest(f"canary {key} is {value!r}; it must be {what}")


def _percent(value: float, what: str) -> float:
    if not 0 <= value <= 100:
        raise InvalidRequest(f"{what} ({value}) must be between 0 and 100")
    return float(value)


@dataclass
class Experiment:
    id: str
    control: str
    treatment: str
    treatment_percent: float
    sticky: bool = True
    enabled: bool = True
    created_at: float = field(default_factory=time.time)


@dataclass
class Canary:
    baseline: str
    candidate: str
    stages: list[float]
    stage_s: float
    check_interval_s: float = 30.0
    max_error_rate: float = 0.05
    max_p99_ms: float | None = None
    max_error_rate_ratio: float | None = 2.0  # candidate / baseline; None disables
    max_p99_ratio: float | None = None
    min_requests: int = 50
    max_failed_checks: int = 3
    stage_index: int = 0
    stage_started_at: float = 0.0  # wall clock
    last_check_at: float = 0.0
    failed_checks: int = 0
    status: str = "running"  # running | promoted | rolled_back | aborted
    history: list[dict] = field(default_factory=list)

    @property
    def percent(self) -> float:
        return self.stages[self.stage_index] if self.status == "running" else 0.0


@dataclass
class Shadow:
    model: str
    percent: float


@dataclass
class Route:
    name: str
    target: str | None  # None: the default (registry production version, else the name)
    experiment: Experiment | None = None
    canary: Canary | None = None
    shadow: Shadow | None = None

    @classmethod
    def from_dict(cls, d: dict) -> Route:
        return cls(
            name=d["name"], target=d["target"],
            experiment=Experiment(**d["experiment"]) if d.get("experiment") else None,
            canary=Canary(**d["canary"]) if d.get("canary") else None,
            shadow=Shadow(**d["shadow"]) if d.get("shadow") else None,
        )


# Read-only by convention, not frozen: a frozen dataclass sets each field through
# object.__setattr__, which costs ~0.1 us per field on every request here.
@dataclass(slots=True)
class Decision:
    logical: str
    model: str
    variant: str
    experiment: str = ""
    randomly_assigned: bool = False
    shadow: str | None = None
    scope: str = ""  # statistics scope: "exp:<id>", "canary:<name>" or "model:<name>"
    adapter: str | None = None  # LoRA adapter the request must carry (``base:adapter`` names)
    # The version to ask Triton for.  Empty for logical names, whose registry version picks
    # the concrete model instead; only a concrete name (--expose-versions) passes one on.
    version: str = ""


class KeyValueStore(Protocol):
    """Where the table is kept: the control plane's state store (or its background writer)."""

    def get(self, key: str, default: str | None = None) -> str | None: ...

    def put(self, key: str, value: str) -> None: ...


class RouteTable:
    def __init__(self, store: KeyValueStore | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time,
                 default_target: Callable[[str], str | None] | None = None,
                 unrouted: Callable[[str], str] | None = None):
        """``default_target(name)``: the concrete model a name without a route serves (the
        registry's production version, e.g. cust017 -> cust017.v3), or None.
        ``unrouted(name)``: what a name with neither serves, or raises when it serves nothing
        (``PublicNames.unrouted``); by default the model of that name."""
        self.store = store
        self.default_target = default_target
        self.unrouted = unrouted
        self.rng = rng or random.Random()
        self.clock = clock
        self.routes: dict[str, Route] = {}
        self.limits: dict[str, dict] = {}
        self.version = 0  # bumped on every change (lets callers cache)
        if store is not None:
            for d in json.loads(store.get(ROUTES_KEY, "[]")):
                route = Route.from_dict(d)
                self.routes[route.name] = route
            self.limits = json.loads(store.get(LIMITS_KEY, "{}"))

    def save(self) -> None:
        self.version += 1
        if self.store is not None:
            self.store.put(ROUTES_KEY, json.dumps([asdict(r) for r in self.routes.values()]))
            self.store.put(LIMITS_KEY, json.dumps(self.limits))

    def target_of(self, name: str) -> str:
        """What ``name`` serves outside experiments and canaries: an explicit alias, else the
        registry's production version, else the model of that name."""
        route = self.routes.get(name)
        if route is not None and route.target:
            return route.target
        target = self.default_target(name) if self.default_target is not None else None
        return target or name

    def _unrouted_target(self, name: str) -> str:
        """A name without a route: its production version, else ``unrouted``'s answer."""
        validate_model_name(name)
        target = self.default_target(name) if self.default_target is not None else None
        if target is not None:
            return target
        return self.unrouted(name) if self.unrouted is not None else name

    def primary(self, name: str) -> str:
        """The concrete model that answers for ``name`` when no request picks a variant:
        an experiment's control, a canary's baseline, else what the name serves.  Readiness,
        metadata and configuration describe this one (deterministic, no random draw)."""
        if ADAPTER_SEPARATOR in name:
            name = split_adapter(name)[0]
        route = self.routes.get(name)
        if route is None:
            return self._unrouted_target(name)
        if route.experiment is not None and route.experiment.enabled:
            return route.experiment.control
        if route.canary is not None and route.canary.status == "running":
            return route.canary.baseline
        return self.target_of(name)

    def route(self, name: str, create: bool = False) -> Route | None:
        route = self.routes.get(name)
        if route is None and create:
            route = self.routes[name] = Route(name, target=None)
        return route

    # ------------------------------------------------------------------ resolve
    def resolve(self, name: str, user_id: str | None) -> Decision:
        """Pick the concrete model for one request (no I/O).

        ``base:adapter`` resolves ``base`` as usual (aliases, experiments and canaries of the
        base apply) and carries the adapter; statistics and limits stay per ``base:adapter``.
        An empty ``user_id`` is no user id: anonymous, split at random (hashed, every empty
        one landed in the same arm of an experiment)."""
        user_id = user_id or None
        if ADAPTER_SEPARATOR in name:
            base, adapter = split_adapter(name)
            decision = self.resolve(base, user_id)
            scope = f"model:{name}" if decision.scope.startswith("model:") else decision.scope
            return replace(decision, logical=name, adapter=adapter, scope=scope)
        route = self.routes.get(name)
        if route is None:
            validate_model_name(name)
            target = self.default_target(name) if self.default_target is not None else None
            if target is None:
                target = self.unrouted(name) if self.unrouted is not None else name
            return Decision(name, target, "default", scope=f"model:{name}")
        shadow = None
        if route.shadow and route.shadow.percent > 0 and self.rng.random() * 100 < route.shadow.percent:
            shadow = route.shadow.model
        exp = route.experiment
        if exp is not None and exp.enabled:
            randomly = user_id is None or not exp.sticky
            point = self.rng.randrange(BUCKETS) if randomly else bucket(exp.id, user_id)
            treated = point < exp.treatment_percent * BUCKETS / 100
            variant = "treatment" if treated else "control"
            model = exp.treatment if treated else exp.control
            return Decision(name, model, variant, exp.id, randomly and exp.sticky, shadow,
                            scope=f"exp:{exp.id}")
        canary = route.canary
        if canary is not None and canary.status == "running":
            point = bucket(f"canary:{name}", user_id) if user_id else self.rng.randrange(BUCKETS)
            if point < canary.percent * BUCKETS / 100:
                return Decision(name, canary.candidate, "canary", shadow=shadow, scope=f"canary:{name}")
            return Decision(name, canary.baseline, "baseline", shadow=shadow, scope=f"canary:{name}")
        return Decision(name, self.target_of(name), "default", shadow=shadow, scope=f"model:{name}")

    # ------------------------------------------------------------------ changes
    def set_alias(self, name: str, target: str) -> Route:
        validate_model_name(name), validate_model_name(target)
        route = self.route(name, create=True)
        route.target = target
        self.save()
        return route

    def experiment_for(self, experiment_id: str) -> tuple[Route, Experiment]:
        for route in self.routes.values():
            if route.experiment and route.experiment.id == experiment_id:
                return route, route.experiment
        raise ModelNotFound(f"no experiment {experiment_id!r}; `mmctl experiment list` shows them")

    def create_experiment(self, experiment_id: str, control: str, treatment: str,
                          treatment_percent: float, sticky: bool = True, route_name: str | None = None) -> Experiment:
        for n in (experiment_id, control, treatment):
            validate_model_name(n)
        _percent(treatment_percent, "treatment percent")
        if any(r.experiment and r.experiment.id == experiment_id for r in self.routes.values()):
            raise InvalidRequest(f"experiment {experiment_id!r} already exists; delete it first")
        if route_name is not None:
            validate_model_name(route_name)
        route = self.route(route_name or control, create=True)
        if route.canary is not None and route.canary.status == "running":
            raise InvalidRequest(f"{route.name} has a running canary to {route.canary.candidate}; "
                                 "abort or promote it before an experiment")
        if route.experiment is not None:
            raise InvalidRequest(
                f"{route.name} already runs experiment {route.experiment.id!r}; delete it first")
        route.experiment = Experiment(experiment_id, control, treatment, treatment_percent, sticky,
                                      created_at=self.clock())
        self.save()
        return route.experiment

    def set_experiment_enabled(self, experiment_id: str, enabled: bool) -> Experiment:
        route, exp = self.experiment_for(experiment_id)
        if enabled and route.canary is not None and route.canary.status == "running":
            raise InvalidRequest(f"{route.name} has a running canary; abort or promote it first")
        exp.enabled = enabled
        self.save()
        return exp

    def delete_experiment(self, experiment_id: str) -> None:
        route, _ = self.experiment_for(experiment_id)
        route.experiment = None
        self.save()

    def start_canary(self, name: str, candidate: str, **options) -> Canary:
        validate_model_name(name), validate_model_name(candidate)
        route = self.route(name, create=True)
        if route.canary is not None and route.canary.status == "running":
            raise InvalidRequest(f"{name} already has a running canary to {route.canary.candidate}; "
                                 f"abort it first (mmctl canary abort {name})")
        if route.experiment is not None and route.experiment.enabled:
            raise InvalidRequest(
                f"{name} runs experiment {route.experiment.id!r}; disable or delete it before a "
                "canary (an experiment already splits this route's traffic)")
        stages = [_percent(float(s), "stage percent") for s in options.pop("stages", [1, 5, 10, 25, 50, 100])]
        if not stages or stages != sorted(stages):
            raise InvalidRequest(f"stages {stages} must be a non-empty increasing list of percentages")
        _check_canary_gates(options)
        now = self.clock()
        route.canary = Canary(baseline=self.target_of(name), candidate=candidate, stages=stages,
                              stage_started_at=now, last_check_at=now, **options)
        route.canary.history.append({"at": now, "decision": "start", "stage": 0,
                                     "percent": stages[0]})
        self.save()
        return route.canary

    def canary(self, name: str) -> Canary:
        route = self.routes.get(name)
        if route is None or route.canary is None:
            raise ModelNotFound(f"{name} has no canary; start one with mmctl canary start")
        return route.canary

    def set_shadow(self, name: str, shadow_model: str | None, percent: float = 0.0) -> Route:
        validate_model_name(name)
        route = self.route(name, create=True)
        if shadow_model is None:
            route.shadow = None
        else:
            validate_model_name(shadow_model)
            route.shadow = Shadow(shadow_model, _percent(percent, "shadow percent"))
        self.save()
        return route

    def set_limit(self, name: str, qps: float | None, burst: float | None = None) -> None:
        """Limit a model, a route or one adapter of a base (``tinylm:acme``)."""
        validate_logical_name(name)
        if qps is None:
            self.limits.pop(name, None)
        else:
            if qps <= 0:
                raise InvalidRequest(f"qps ({qps}) must be > 0")
            burst = burst if burst is not None else max(1.0, qps)
            if burst < 1:
                raise InvalidRequest(f"burst ({burst}) must be >= 1")
            self.limits[name] = {"qps": float(qps), "burst": float(burst)}
        self.save()

    def to_dict(self) -> list[dict]:
        return [asdict(r) for r in self.routes.values()]
