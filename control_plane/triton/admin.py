"""The control plane's one interface to a Triton server's model-control API.

Wraps ``tritonclient.grpc.aio`` with separate timeouts for load, unload and health,
translates ``InferenceServerException`` once, and treats unloading a model that is not
loaded as success.  Nothing else in the control plane imports tritonclient.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import (
    MAX_GRPC_MESSAGE_SIZE,
    InferInput,
    model_config_pb2,
    service_pb2,
    service_pb2_grpc,
)
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from control_plane.triton.adapter_control import (
    ADAPTER_CONTROL_INPUT,
    AdapterControl,
)
from control_plane.triton.control_socket import ControlSockets
from domain.errors import (
    ControlPlaneError,
    ModelLoadFailed,
    ModelNotFound,
    OperationTimeout,
    TritonUnavailable,
)
from domain.tracing import traced

log = logging.getLogger(__name__)

# Inputs of the LoRA models (model_repository/tinylm) that select or control adapters rather
# than carry data: a warm-up leaves them out and so runs the base model.
ADAPTER_INPUT = "ADAPTER"


class TritonModelState(str, enum.Enum):
    READY = "READY"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"
    ABSENT = ""  # in the repository, never loaded

    @classmethod
    def parse(cls, value: str | None) -> TritonModelState:
        try:
            return cls(value or "")
        except ValueError:
            return cls.UNAVAILABLE


@dataclass(frozen=True)
class IndexEntry:
    name: str
    state: TritonModelState
    reason: str = ""


UNLOAD_POLL_MAX_S = 0.025  # longest pause between index polls while an unload frees memory
# A Triton restarted after a crash or a kill is reached again within a second, not after
# gRPC's default reconnect backoff (up to 120 s once a few connects failed): its liveness
# probe answers, and loads go there again.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass(frozen=True)
class Timeouts:
    load_s: float = 120.0
    unload_s: float = 60.0
    health_s: float = 5.0
    infer_s: float = 30.0


def _is_unavailable(exc: InferenceServerException) -> bool:
    status = str(exc.status() or "")
    return "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status


# config.pbtxt parameter that turns the control plane's synthetic warm-up off for a model:
#   parameters { key: "mms_warmup" value: { string_value: "false" } }
WARMUP_PARAMETER = "mms_warmup"
_OFF_VALUES = frozenset({"false", "0", "no", "off"})


@dataclass(frozen=True)
class WarmupInput:
    """One input of the synthetic warm-up request."""

    name: str
    shape: tuple[int, ...]
    datatype: str  # Triton's wire name: INT32, FP32, BYTES, ...

    def describe(self) -> str:
        fill = 'b"warmup"' if self.datatype == "BYTES" else "zeros"
        return f"{self.name} shape {list(self.shape)} {self.datatype} ({fill})"


@dataclass(frozen=True)
class WarmupPlan:
    """How a model is warmed up after Triton loads it.

    ``model_samples``: entries of the config's ``model_warmup``; Triton runs them itself
    during the load, so the control plane sends nothing.  ``synthetic_enabled``: False when
    the config's ``mms_warmup`` parameter turns the synthetic warm-up off.  ``inputs``: what
    the synthetic warm-up sends (optional LoRA control inputs left out: the base model runs).
    """

    model_samples: int = 0
    synthetic_enabled: bool = True
    inputs: tuple[WarmupInput, ...] = ()
    # Why no warm-up is needed: the code that serves the model is warm already (a family's
    # variant after the first one since the family model loaded: a swap changes weights only).
    warm_already: str | None = None


def warmup_plan(config: model_config_pb2.ModelConfig) -> WarmupPlan:
    """The warm-up a model asks for in its config (Triton's ModelConfig message)."""
    param = config.parameters.get(WARMUP_PARAMETER)
    enabled = param is None or param.string_value.strip().lower() not in _OFF_VALUES
    batched = config.max_batch_size > 0
    inputs = []
    for spec in config.input:
        if spec.name in (ADAPTER_INPUT, ADAPTER_CONTROL_INPUT) and spec.optional:
            continue
        dims = tuple(1 if d < 0 else int(d) for d in spec.dims)
        datatype = model_config_pb2.DataType.Name(spec.data_type).removeprefix("TYPE_")
        inputs.append(WarmupInput(spec.name, ((1,) if batched else ()) + dims,
                                  "BYTES" if datatype == "STRING" else datatype))
    return WarmupPlan(len(config.model_warmup), enabled, tuple(inputs))


def synthetic_inputs(plan: WarmupPlan) -> list[InferInput]:
    """The inputs of a synthetic request shaped by ``plan``: zeros, and b"warmup" strings."""
    inputs = []
    for spec in plan.inputs:
        if spec.datatype == "BYTES":
            data = np.full(spec.shape, b"warmup", dtype=np.object_)
        else:
            data = np.zeros(spec.shape, dtype=triton_to_np_dtype(spec.datatype))
        inp = InferInput(spec.name, list(spec.shape), spec.datatype)
        inp.set_data_from_numpy(data)
        inputs.append(inp)
    return inputs


ADMIN_KEY_HEADER = "admin-key"


def admin_key_headers(key: str | None) -> dict[str, str] | None:
    """The gRPC metadata that unlocks ``--grpc-restricted-protocol=model-repository:
    admin-key=<key>`` (Triton expects its ``triton-grpc-protocol-`` prefix on the key)."""
    return {f"triton-grpc-protocol-{ADMIN_KEY_HEADER}": key} if key else None


@dataclass(frozen=True)
class SlotPool:
    """Fixed-size slots a Triton model holds for the models placed in them: a model family's
    weight slots (``TritonAdmin.slot_pool``).  ``name``: the Triton model that holds them;
    ``slots``: how many a load of it would allocate now."""

    name: str
    slots: int
    slot_bytes: int


class TritonAdmin(AdapterControl):
    """Model control for one Triton server, addressed by its gRPC URL.

    ``headers``: sent with every model-repository call; a Triton started with
    ``--grpc-restricted-protocol=model-repository:admin-key=<key>`` takes load and unload
    only with ``{"admin-key": <key>}`` (mmctl --triton-admin-key), so processes that reach
    its ports for inference (router workers) cannot change what it has loaded.
    ``guard()``: called before each load and unload; raises when this control plane may not
    act (a leader whose lease may have run out).
    """

    def __init__(self, grpc_url: str, timeouts: Timeouts = Timeouts(),
                 load_config: Callable[[str], str | None] | None = None,
                 headers: dict[str, str] | None = None, guard: Callable[[], None] | None = None):
        self.grpc_url = grpc_url
        self.timeouts = timeouts
        self.headers = headers
        self.guard = guard
        # The load API's config override for a model on this server, or None to load its
        # config.pbtxt as it is (placement.instance_kind_override: run where placed).
        self.load_config = load_config
        self._client: grpcclient.InferenceServerClient | None = None
        # Triton's gRPC service itself, for what tritonclient does not ask: the index of
        # the loaded models only (RepositoryIndexRequest.ready).
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        # The control sockets of this server's family and LoRA models' processes.
        self.control_sockets = ControlSockets(grpc_url)

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.grpc_url, channel_args=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
                *RECONNECT_OPTIONS])
        return self._client

    @property
    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.grpc_url, options=RECONNECT_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        await self.control_sockets.close()
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None

    def _unavailable(self, exc: Exception) -> TritonUnavailable:
        if "protocol is restricted" in str(exc):
            return TritonUnavailable(
                f"Triton at {self.grpc_url} takes model control only with its admin key "
                f"({'the key given is wrong' if self.headers else 'none was given'}); start the "
                "control plane with the key its Tritons were started with: --triton-admin-key "
                "or MMS_TRITON_ADMIN_KEY (MMCTL_TRITON_ADMIN_KEY)")
        return TritonUnavailable(
            f"Triton at {self.grpc_url} is not reachable ({exc}); check that tritonserver is "
            "running (mmctl endpoints) and restart it with mmctl up"
        )

    def measured(self, model: str) -> bool:
        """Whether a load of ``model`` is measured on a GPU (its memory comes with the load
        and goes with the unload); FamilyAdmin says no for a family's variants."""
        return True

    # -- slots: a model family's weight slots (FamilyAdmin); Triton's own models have none --
    def slot_pool(self, model: str) -> SlotPool | None:
        """The slots ``model`` goes into on this server (a family's variant), or None: a
        model of its own."""
        return None

    def loaded_slots(self, family: str) -> int | None:
        """Slots of ``family``'s model loaded here as last known, or None when it is not."""
        return None

    def slot_pools(self) -> dict[str, SlotPool]:
        """The families loaded here with their slots (none on Triton's own admin)."""
        return {}

    def family_slots(self, family: str) -> dict | None:
        """What this server knows of ``family``'s model (state, slots, residents), or None."""
        return None

    async def unload_slots(self, family: str) -> None:
        """Unload ``family``'s model once no variant is left in its slots."""
        raise ModelNotFound(f"{family} is not a model family on {self.grpc_url}")

    def replaces_in_one(self, model: str, victims: list[str]) -> bool:
        """Whether ``load_replacing`` evicts ``victims`` and loads ``model`` in one request
        (FamilyAdmin: a variant replacing variants of its family, in their slots).  Triton
        loads and unloads models one call each."""
        return False

    async def load_replacing(self, model: str, victims: list[str]) -> None:
        """Unload ``victims`` and load ``model`` as one request (``replaces_in_one``)."""
        raise NotImplementedError(f"{self.grpc_url} loads {model} apart from its victims")

    async def is_live(self) -> bool:
        """Triton's ServerLive: answered by its front end even while every model instance
        computes, so a busy server answers and a frozen one does not.  False when it
        refuses or does not answer within ``timeouts.health_s`` (the manager's probes
        give it less: ``ManagerConfig.probe_timeout_s``)."""
        try:
            resp = await self.stub.ServerLive(service_pb2.ServerLiveRequest(),
                                              timeout=self.timeouts.health_s)
        except grpc.RpcError:
            return False
        return bool(resp.live)

    async def index(self, ready_only: bool = False) -> dict[str, IndexEntry]:
        """What this server has, by model (FamilyAdmin lists a family's variants here).
        ``ready_only``: only the models loaded and ready (Triton filters; a short answer
        however large the repository)."""
        return await self.triton_index(ready_only)

    @traced("triton.index")
    async def triton_index(self, ready_only: bool = False) -> dict[str, IndexEntry]:
        """Triton's own repository index."""
        try:
            # The protobuf as it is: a conversion to JSON costs more than the call itself
            # once the repository holds thousands of folders.
            resp = await self.stub.RepositoryIndex(
                service_pb2.RepositoryIndexRequest(ready=ready_only),
                metadata=tuple((self.headers or {}).items()), timeout=self.timeouts.health_s)
        except grpc.RpcError as exc:
            raise self._unavailable(InferenceServerException(
                msg=exc.details() or str(exc.code()), status=str(exc.code()))) from exc
        out = {}
        for m in resp.models:
            # Triton lists every folder, the warm tier's hidden staging and temporary ones
            # too; a name starting with "." is never a model (names.py refuses it).
            if m.name.startswith("."):
                continue
            out[m.name] = IndexEntry(m.name, TritonModelState.parse(m.state), m.reason)
        return out

    def _translate(self, exc: InferenceServerException, action: str, model: str,
                   timeout_s: float) -> ControlPlaneError:
        """The one mapping of a tritonclient error to the control plane's errors: a missed
        deadline is a timeout, an unreachable server is unavailable, the rest is Triton
        refusing ``action`` (``"load"``, ``"unload"``) for ``model``."""
        status = str(exc.status() or "")
        if "DEADLINE" in status:
            return OperationTimeout(
                f"Triton at {self.grpc_url} did not {action} {model} within {timeout_s:.0f}s")
        if "UNAVAILABLE" in status:
            return self._unavailable(exc)
        msg = (exc.message() or str(exc)).strip()
        return ModelLoadFailed(f"Triton failed to {action} {model}: {msg}")

    async def load(self, model: str) -> None:
        if self.guard is not None:
            self.guard()
        config = (await asyncio.to_thread(self.load_config, model)
                  if self.load_config is not None else None)
        await self.load_with(model, config)

    @traced("triton.load")
    async def load_with(self, model: str, config: str | None) -> None:
        """Triton's load of ``model`` with the load API's config override ``config`` (JSON;
        None: its config.pbtxt as it is), its refusals translated once."""
        try:
            await self.client.load_model(model, headers=self.headers, config=config,
                                         client_timeout=self.timeouts.load_s)
        except InferenceServerException as exc:
            msg = exc.message() or str(exc)
            if "failed to poll from model repository" in msg or "no version is available" in msg:
                raise ModelNotFound(f"{model} is not in Triton's model repository: {msg}") from exc
            raise self._translate(exc, "load", model, self.timeouts.load_s) from exc

    @traced("triton.unload")
    async def unload(self, model: str) -> None:
        """Ask Triton to unload; returns before memory is freed (see wait_unavailable)."""
        if self.guard is not None:
            self.guard()
        try:
            await self.client.unload_model(model, headers=self.headers,
                                           client_timeout=self.timeouts.unload_s)
        except InferenceServerException as exc:
            msg = (exc.message() or str(exc)).lower()
            if "not loaded" in msg or "unknown model" in msg or "no model" in msg:
                return  # already gone: the goal state holds
            raise self._translate(exc, "unload", model, self.timeouts.unload_s) from exc

    async def wait_unavailable(self, model: str, timeout_s: float | None = None) -> float:
        """Poll the index until ``model`` is UNAVAILABLE/absent; return seconds waited."""
        timeout_s = self.timeouts.unload_s if timeout_s is None else timeout_s
        start = time.monotonic()
        # The memory is free when the index says so, and a load waiting for it starts only
        # then: poll every UNLOAD_POLL_MAX_S at most (python backend unloads take >= 1 s; an
        # index RPC costs ~1 ms), so the wait ends ~12 ms after the stub exits, not ~50.
        delay = 0.005
        while True:
            entry = (await self.triton_index()).get(model)
            if entry is None or entry.state in (TritonModelState.UNAVAILABLE, TritonModelState.ABSENT):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise OperationTimeout(
                    f"{model} still {entry.state.value} on {self.grpc_url} after {timeout_s:.0f}s; "
                    "its memory is still counted as used"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, UNLOAD_POLL_MAX_S)

    @traced("triton.statistics")
    async def statistics(self) -> dict[str, dict]:
        """Per-model inference statistics (``last_inference`` in ms since the epoch)."""
        try:
            resp = await self.client.get_inference_statistics(
                as_json=True, client_timeout=self.timeouts.health_s
            )
        except InferenceServerException as exc:
            raise self._unavailable(exc) from exc
        return {s["name"]: s for s in resp.get("model_stats", [])}

    @traced("triton.model_config")
    async def warmup_plan(self, model: str) -> WarmupPlan:
        """How ``model`` is warmed up, from the config Triton loaded (see ``warmup_plan``)."""
        try:
            resp = await self.client.get_model_config(model, client_timeout=self.timeouts.health_s)
        except InferenceServerException as exc:
            raise self._translate(exc, "read the config of", model, self.timeouts.health_s) from exc
        return warmup_plan(resp.config)

    async def warmup(self, model: str, plan: WarmupPlan | None = None) -> float:
        """Run the synthetic warm-up: one inference with ``plan.inputs`` (zeros, b"warmup"
        for BYTES); return its milliseconds.  A refusal says what was sent and how to turn
        the synthetic warm-up off."""
        if plan is None:
            plan = await self.warmup_plan(model)
        return await self.infer_synthetic(model, plan, model)

    @traced("triton.warmup")
    async def infer_synthetic(self, triton_model: str, plan: WarmupPlan, model: str,
                              parameters: dict[str, str] | None = None) -> float:
        """One synthetic inference shaped by ``plan`` on ``triton_model`` (``model``: the name
        errors speak of; ``parameters``: request parameters, e.g. a family's variant)."""
        try:
            inputs = synthetic_inputs(plan)  # a refused datatype is translated below
            start = time.perf_counter()
            await self.client.infer(triton_model, inputs, parameters=parameters,
                                    client_timeout=self.timeouts.infer_s)
        except InferenceServerException as exc:
            status = str(exc.status() or "")
            if "UNAVAILABLE" in status:
                raise self._unavailable(exc) from exc
            sent = ", ".join(i.describe() for i in plan.inputs) or "no inputs"
            advice = (f"it sent {sent}.  Give the model its own model_warmup in config.pbtxt "
                      "(Triton runs it during the load), or turn the synthetic warm-up off "
                      f"with parameters {{ key: \"{WARMUP_PARAMETER}\" value: {{ string_value: "
                      "\"false\" } } in config.pbtxt or with the registry's warm-up setting")
            if "DEADLINE" in status:
                raise OperationTimeout(
                    f"synthetic warm-up inference of {model} did not answer within "
                    f"{self.timeouts.infer_s:.0f}s; {advice}") from exc
            raise ModelLoadFailed(f"synthetic warm-up inference of {model} failed: "
                                  f"{(exc.message() or str(exc)).strip()}; {advice}") from exc
        return (time.perf_counter() - start) * 1000
