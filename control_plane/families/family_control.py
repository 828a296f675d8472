"""``FamilyControl``: the commands a server's control plane sends to its family models
(status, fill a slot, evict), and what it knows of each family model there.

A command goes over the control socket the family's process named in an earlier answer, so
a fill runs beside the batch Triton executes; without one, or when its process is gone, it
goes as an inference request of the family model through Triton, whose answer says which
(not loaded, died) and names the socket of the process serving now.  ``FamilyAdmin``
(slot_control.py) builds the loads and unloads of variants on these commands.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from tritonclient.grpc import InferRequestedOutput
from tritonclient.utils import InferenceServerException

from control_plane.families.family_catalog import WEIGHTS_FILE, Family, FamilyCatalog
from control_plane.families.instance import FamilyInstance, FamilyState
from control_plane.triton.admin import (
    Timeouts,
    TritonAdmin,
    WarmupPlan,
    synthetic_inputs,
    warmup_plan,
)
from domain import tracing
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
    OperationTimeout,
)
from model_runtime.family.protocol import CONTROL_PARAMETER, STATUS_OUTPUT

log = logging.getLogger(__name__)

# Triton's python backend about a stub process that died; it does not start a new one.
UNHEALTHY_STUB = "is not healthy"


class FamilyUnhealthy(ModelLoadFailed):
    """The family model's process died; a load of the family model starts a new one."""


class FamilyControl(TritonAdmin):
    """TritonAdmin for one server that sends commands to the models of ``families``.

    ``slots_for(family)``: how many slots the family gets on this server (sized from the
    server's budget, ``catalog.family_slots``)."""

    def __init__(self, grpc_url: str, families: FamilyCatalog,
                 slots_for: Callable[[Family], int], timeouts: Timeouts | None = None,
                 load_config: Callable[[str], str | None] | None = None,
                 headers: dict[str, str] | None = None, guard: Callable[[], None] | None = None):
        super().__init__(grpc_url, timeouts or Timeouts(), load_config, headers, guard)
        self.families = families
        self.slots_for = slots_for
        self.instances: dict[str, FamilyInstance] = {}  # family -> its model on this server

    def instance(self, family: str) -> FamilyInstance:
        """What this server's control plane knows of ``family``'s model (ABSENT at first)."""
        found = self.instances.get(family)
        if found is None:
            found = self.instances[family] = FamilyInstance(family, self.grpc_url)
        return found

    def _not_loaded(self, family: Family) -> ModelNotFound:
        """The family model is not loaded here: nothing known of its slots holds."""
        self.instance(family.name).move(FamilyState.ABSENT, "Triton does not have it")
        return ModelNotFound(f"family {family.name} is not loaded on {self.grpc_url}")

    async def _plan(self, family: Family) -> WarmupPlan:
        instance = self.instance(family.name)
        plan = instance.plan
        if plan is None:
            try:
                resp = await self.client.get_model_config(family.name,
                                                          client_timeout=self.timeouts.health_s)
            except InferenceServerException as exc:
                msg = exc.message() or str(exc)
                if "unknown model" in msg.lower() or "not found" in msg.lower():
                    raise self._not_loaded(family) from exc
                raise self._translate(exc, "read the config of", family.name, self.timeouts.health_s) from exc
            plan = instance.plan = warmup_plan(resp.config)
        return plan

    async def control(self, family: Family, command: dict) -> dict:
        """One control command to the family model; its JSON status.  Over the control socket
        its process named (a fill then runs beside the batch Triton executes), else, or when
        that socket is gone, as a request through Triton.  ModelNotFound when the family is
        not loaded here; InvalidInput / CapacityExhausted for refused commands."""
        keyed = {**command, "key": self.families.control_key}
        with tracing.span(f"family.{command.get('op')}", tracing.SpanKind.CLIENT,
                          model=command.get("variant"), family=family.name,
                          evicting=",".join(command.get("evict", ())) or None,
                          server=self.grpc_url) as span:
            try:
                # Without a socket, or its process gone or replaced, the request through
                # Triton says which (not loaded, died) and names the new process's socket.
                answer = await self.control_sockets.send(family.name, keyed, self.timeouts.load_s)
            except TimeoutError:
                raise OperationTimeout(f"family {family.name} on {self.grpc_url} did not answer "
                                       f"{command.get('op')!r} within {self.timeouts.load_s:.0f}s") from None
            if answer is not None:
                if span is not None:
                    span.set_attribute("mms.path", "socket")
                if "error" in answer:
                    raise self._refused(family, command, str(answer.get("code", "")),
                                        str(answer["error"]))
                self._observe(family, answer)
                return answer
            answer = await self._control_request(family, command, keyed)
            self._observe(family, answer)
            return answer

    async def _control_request(self, family: Family, command: dict, keyed: dict) -> dict:
        """A control command as an inference request of the family model, through Triton."""
        plan = await self._plan(family)
        try:
            result = await self.client.infer(
                family.name, synthetic_inputs(plan), outputs=[InferRequestedOutput(STATUS_OUTPUT)],
                parameters={CONTROL_PARAMETER: json.dumps(keyed)},
                headers=tracing.inject() or None, client_timeout=self.timeouts.load_s)
        except InferenceServerException as exc:
            status = str(exc.status() or "")
            msg = (exc.message() or str(exc)).strip()
            if "NOT_FOUND" in status or "unknown model" in msg.lower():
                raise self._not_loaded(family) from exc
            if UNHEALTHY_STUB in msg:
                self.instance(family.name).move(FamilyState.DEAD, "its process died")
                raise FamilyUnhealthy(f"the process of family {family.name} on {self.grpc_url} "
                                      f"died ({msg})") from exc
            if ("UNAVAILABLE" in status and ("Socket closed" in msg or "connect" in msg.lower())) \
                    or ("UNAVAILABLE" not in status and "INVALID_ARG" not in status):
                raise self._translate(exc, command.get("op", "control"), family.name,
                                      self.timeouts.load_s) from exc
            raise self._refused(family, command, status, msg) from exc
        raw = result.as_numpy(STATUS_OUTPUT)
        value = raw.reshape(-1)[0]
        return json.loads(value.decode() if isinstance(value, bytes) else value)

    @staticmethod
    def _refused(family: Family, command: dict, code: str, msg: str) -> ControlPlaneError:
        """The family model's refusal of a command (its Triton error code and message)."""
        if "UNAVAILABLE" in code and "slots hold" in msg:
            return CapacityExhausted(msg)
        if "INVALID_ARG" in code:
            return InvalidInput(msg)
        return ModelLoadFailed(f"family {family.name} failed {command.get('op')!r}: {msg}")

    def _observe(self, family: Family, answer: dict) -> None:
        """What its process answered: its slots, and the control socket it named."""
        self.instance(family.name).observe(answer)
        self.control_sockets.learn(family.name, answer)

    async def _fill(self, family: Family, variant: str, evict: list[str] = ()) -> dict:
        """Copy ``variant`` into a free slot, freeing the slots of ``evict`` first (the same
        request: no batch runs in between)."""
        path = self.families.repository / variant / WEIGHTS_FILE
        command = {"op": "load", "variant": variant, "path": str(path)}
        if evict:
            command["evict"] = list(evict)
        return await self.control(family, command)
