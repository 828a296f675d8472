"""The routing decision: which name a request asks for (adapter checks), which concrete
model serves it (aliases, experiments, canaries and shadows, from ``router.rollouts.routes``) and
the rate limits it spends.  No I/O.  Mixed into ``router.serving.core.Router``."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from control_plane.domain import errors as cp
from control_plane.domain.errors import ControlPlaneError
from router.rollouts.routes import Decision
from router.serving.errors import InvalidRequest, PermissionDenied, from_control_plane


class Deciding:
    """Needs ``table`` (RouteTable), ``limiter`` (router.limits) and, from
    ``router.serving.answers.Answers``, ``_resolve`` and ``_invalid_name``."""

    def check_limits(self, *names: str) -> None:
        self.limiter.check(names)

    @staticmethod
    def limited_names(decision: Decision) -> tuple[str, ...]:
        """The names whose limits a request spends: the name asked for and the model it reaches."""
        if decision.model == decision.logical:
            return (decision.logical,)
        return (decision.logical, decision.model)

    def decide(self, logical: str, user_id: str | None, version: str = "") -> Decision:
        """Route one request (``version``: parsed with ``parse_version``) and apply the rate
        limits of the name and of the model it reaches (this process's buckets)."""
        decision = self.route(logical, user_id, version)
        self.limiter.check(self.limited_names(decision))
        return decision

    def route(self, logical: str, user_id: str | None, version: str = "") -> Decision:
        """Route one request; no limits applied."""
        if version:
            decision = self._resolve(logical, user_id, version)
        else:  # the common case, inline: no version, route by name
            try:
                decision = self.table.resolve(logical, user_id)
            except cp.InvalidModelName as exc:
                raise self._invalid_name(logical, exc) from None
            except ControlPlaneError as exc:
                raise from_control_plane(exc) from exc
        return decision

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
    def _adapter_param(request: service_pb2.ModelInferRequest) -> str | None:
        param = request.parameters.get("adapter")
        return param.string_param if param is not None and param.string_param else None

    @staticmethod
    def _check_adapter_parameter(request: service_pb2.ModelInferRequest, decision: Decision) -> None:
        """``tinylm:acme`` with parameter ``adapter=other`` is a contradiction, not a choice."""
        param = request.parameters.get("adapter")
        if param is not None and param.string_param and param.string_param != decision.adapter:
            raise InvalidRequest(
                f"model name {decision.logical!r} selects adapter {decision.adapter!r} but the request "
                f"parameter adapter is {param.string_param!r}; send one of them")
