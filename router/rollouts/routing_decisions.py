"""The routing decision: which name a request asks for (adapter checks), which concrete
model serves it (aliases, experiments, canaries and shadows, from ``domain.routes``),
the name and version the client knows it by, and the rate limits it spends.  No I/O.

``Decider`` owns the route table, the registry's public names and the rate limiter; every
other part of the router reads them through it, so a router worker's new snapshot
(``Router.table`` / ``Router.names``) reaches all of them at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from dataclasses import replace
from typing import Protocol

from tritonclient.grpc import service_pb2

from domain import errors as cp
from domain.errors import ControlPlaneError
from domain.public_names import PublicNames
from domain.router_errors import (
    InvalidRequest,
    PermissionDenied,
    RouterError,
    UnknownModel,
    from_control_plane,
)
from domain.routes import ADAPTER_SEPARATOR, Decision, RouteTable, split_adapter

UNROUTED_CACHE_MAX = 4096  # decisions kept for names without a route


class Limiter(Protocol):
    """Rate limits by name: ``router.rollouts.limits.LocalLimiter`` (this process's buckets)
    or ``router.serving.state_client.GrantedLimiter`` (tokens from the control plane)."""

    def acquire(self, names: Iterable[str]) -> Awaitable[None] | None:
        """Spend one token of each name's limit; RateLimited when one has none.  None when
        nothing is left to wait for (no limit applies, or it was spent at once)."""


class Decider:
    """``table``: the routes; ``names``: the registry's public names (None: every name is
    served as it is, with Triton's own versions); ``limiter``: the rate limits."""

    def __init__(self, table: RouteTable, names: PublicNames | None, limiter: Limiter):
        self.table = table
        self.names = names
        self.limiter = limiter
        # Decisions of names without a route (most requests): the same for every request
        # while the table and the names they were made from stand (``_unrouted_valid``).
        self._unrouted: dict[str, Decision] = {}
        self._unrouted_of: tuple = (None, -1, None, -1)  # (table, version, names, generation)

    # ------------------------------------------------------------------ requests
    @staticmethod
    def limited_names(decision: Decision) -> tuple[str, ...]:
        """The names whose limits a request spends: the name asked for, the name without its
        adapter (``chat:acme`` spends ``chat``'s limit too: any adapter would otherwise get
        round a limit on its base's name) and the model it reaches."""
        logical, model = decision.logical, decision.model
        if decision.adapter is None:  # most requests: no tuple built through a dict
            return (logical,) if model == logical else (logical, model)
        names = dict.fromkeys((logical, split_adapter(logical)[0], model))
        return tuple(names)

    def admit(self, decision: Decision) -> Awaitable[None] | None:
        """Spend the limits of the name and of the model it reaches (RateLimited): await
        what it returns, unless None (no limit is set, most requests: nothing to await).
        The limiter's own coroutine, not wrapped in another."""
        return self.limiter.acquire(self.limited_names(decision))

    def route(self, logical: str, user_id: str | None, version: str = "") -> Decision:
        """Route one request (``version``: parsed with ``parse_version``); no limits
        applied (``admit`` spends them)."""
        if version:
            return self.resolve(logical, user_id, version)
        table = self.table  # the common case, inline: no version, route by name
        cacheable = ADAPTER_SEPARATOR not in logical and logical not in table.routes
        if cacheable:
            if self._unrouted_valid(table):
                decision = self._unrouted.get(logical)
                if decision is not None:
                    return decision
            else:
                cacheable = False
        try:
            decision = table.resolve(logical, user_id)
        except cp.InvalidModelName as exc:
            raise self.invalid_name(logical, exc) from None
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from exc
        if cacheable:
            if len(self._unrouted) >= UNROUTED_CACHE_MAX:  # clients choose the names
                self._unrouted.clear()
            self._unrouted[logical] = decision
        return decision

    def _unrouted_valid(self, table: RouteTable) -> bool:
        """Whether the kept decisions of names without a route were made from ``table`` and
        the names as they are now (a route table bumps its version on every change, public
        names their generation on every refresh; a router worker gets new ones of both with
        each snapshot); forgets them when not.  A table whose default targets come from
        names the decider does not hold keeps nothing: it could not tell their changes."""
        names = self.names
        if names is None and (table.default_target is not None or table.unrouted is not None):
            return False
        generation = -1 if names is None else names.generation
        of = self._unrouted_of
        if of[0] is table and of[1] == table.version and of[2] is names and of[3] == generation:
            return True
        self._unrouted.clear()
        self._unrouted_of = (table, table.version, names, generation)
        return True

    @staticmethod
    def public_name(model_name: str, input_names, adapter_param: str | None) -> str:
        """The logical name a public request asks for, after the adapter checks.

        Adapter control (``ADAPTER_CONTROL``) is model control: never from the public port.
        An adapter chosen by request parameter is routed and rate-limited as ``base:adapter``
        so the per-adapter limit cannot be bypassed; the ``ADAPTER`` input is refused here
        because the router could not see which adapter it names."""
        for name in input_names:
            if name == "ADAPTER_CONTROL":
                raise PermissionDenied(
                    "ADAPTER_CONTROL is adapter management, not available on the public port; "
                    "use mmctl adapter load/unload/pin")
            if name == "ADAPTER":
                raise InvalidRequest(
                    f"select the adapter with the model name {model_name}:NAME or the request "
                    "parameter adapter=NAME (the ADAPTER input is not accepted by the router)")
        if adapter_param and ":" not in model_name:
            return f"{model_name}:{adapter_param}"
        return model_name

    @staticmethod
    def adapter_param(request: service_pb2.ModelInferRequest) -> str | None:
        param = request.parameters.get("adapter")
        return param.string_param if param is not None and param.string_param else None

    @staticmethod
    def check_adapter_parameter(request: service_pb2.ModelInferRequest, decision: Decision) -> None:
        """``tinylm:acme`` with parameter ``adapter=other`` is a contradiction, not a choice."""
        param = request.parameters.get("adapter")
        if param is not None and param.string_param and param.string_param != decision.adapter:
            raise InvalidRequest(
                f"model name {decision.logical!r} selects adapter {decision.adapter!r} but the request "
                f"parameter adapter is {param.string_param!r}; send one of them")

    # ------------------------------------------------------------------ names and versions
    def resolve(self, name: str, user_id: str | None, version: str = "",
                primary: bool = False) -> Decision:
        """The decision for ``name`` (``primary``: the deterministic one that readiness and
        metadata describe).  A name clients may not use, or an invalid one, is an unknown
        model, in Triton's words."""
        try:
            if version:
                return self._versioned(name, version)
            if primary:
                return Decision(name, self.table.primary(name), "default", scope=f"model:{name}")
            return self.table.resolve(name, user_id)
        except cp.InvalidModelName as exc:
            raise self.invalid_name(name, exc) from None
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from exc

    def decide_without_limits(self, logical: str) -> Decision:
        """What ``logical`` is answered by for readiness, metadata and health checks."""
        return self.resolve(logical, None, primary=True)

    @staticmethod
    def invalid_name(name: str, exc: cp.InvalidModelName) -> RouterError:
        """A name that cannot be a model: Triton's unknown model.  A malformed ``base:adapter``
        (the router's own syntax, no Triton answer to copy) says how to write it."""
        if ADAPTER_SEPARATOR in name:
            return from_control_plane(exc)
        return UnknownModel(name)

    def _versioned(self, name: str, version: str) -> Decision:
        """``name`` at registry version ``version``: that version's concrete model, outside
        experiments and canaries (the client chose it).  A route that is not a registry
        model has the version of what it serves."""
        base, adapter = split_adapter(name) if ADAPTER_SEPARATOR in name else (name, None)
        names = self.names
        if names is None:  # no registry: Triton's own versions
            return replace(self.table.resolve(name, None), version=version)
        concrete = names.by_version.get((base, version))
        if concrete is None:
            if base in self.table.routes:
                concrete = self.table.primary(base)
                if names.public.get(concrete, ("", ""))[1] != version:
                    raise UnknownModel(base, version)
            elif base in names.models:
                raise UnknownModel(base, version)
            elif names.expose_concrete:
                return replace(self.table.resolve(name, None), version=version)
            else:
                raise UnknownModel(base)
        return Decision(name, concrete, "default", scope=f"model:{name}", adapter=adapter)

    def public_identity(self, decision: Decision) -> tuple[str, str | None]:
        """(model, version) by which a client knows the concrete model that served it: the
        registry's model and version when the client asked for a logical name; the concrete
        name and None (Triton's own version stands) for an exposed concrete name."""
        names = self.names
        if names is not None and not decision.version:
            base = decision.logical.partition(ADAPTER_SEPARATOR)[0]
            if base in names.models or base in self.table.routes:
                found = names.public.get(decision.model)
                if found is not None:
                    return found
        return decision.model, None

    @staticmethod
    def public_text(text: str, concrete: str, asked: str, carrier: str | None = None) -> str:
        """Triton's message about ``concrete`` (or ``carrier``, the family model serving it)
        as one about the model the client asked for (Triton quotes model names: 'simple.v2')."""
        if carrier is not None:
            text = text.replace(f"'{carrier}'", f"'{asked}'")
        if concrete == asked:
            return text
        return text.replace(f"'{concrete}'", f"'{asked}'")
