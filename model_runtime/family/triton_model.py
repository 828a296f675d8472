"""``FamilyModel``: the Triton python model of a model family, one instance holding up to K
weight slots that the family's variants take turns in (a slot holds memory only while a
variant fills it: slots.py).

A family's ``model.py`` subclasses it and writes three methods (the contract; nothing in
it is specific to one architecture):

* ``build(weights)`` -> a callable (usually a ``torch.nn.Module``) whose parameters *are*
  the given tensors (views of one slot: use ``load_state_dict(..., assign=True)`` on a
  module made on the meta device; never copy them, never write them).  Called when a
  variant first fills a slot (its memory is new), and on CPU again by each fill that reads
  a variant's file in host RAM in place (slots.py): keep it as cheap as that.
* ``parse(request)`` -> the request's input rows as one tensor; raise ``FamilyInputError``
  for bad input (that request alone gets the error).
* ``outputs(rows)`` -> the ``pb_utils.Tensor`` list of one request's response, from its rows
  of the batch's result.

Optionally ``forward(module, batch)`` (default: ``module(batch)`` in inference mode).

Requests name their variant in the request parameter ``mms_variant`` (the router sets it;
clients name the variant as a model).  A batch is grouped by variant and each group runs
on its slot.  The control plane sends control requests (parameter ``mms_family_control``,
JSON) to fill or free slots and to read what is resident; the answer is the output
``MMS_FAMILY_STATUS``; a fill may name the variants to evict first (one request for a
miss that replaces a variant).

The same commands also come over the family's control socket (``control_socket`` in its
status: an abstract Unix socket of this process, open to processes of its own user that hold
the key), served by a thread of its own: a fill then runs beside the batch Triton is
executing instead of queueing behind it, and behind no request queued before it.  A batch
never sees a slot mid-write: a batch counts as a reader of the slots it uses, a fill writes
only into a slot that holds no variant and that no batch reads (an evicted variant's slot is
written once the batch reading it is done), and the variant is visible to batches only once
its bytes are whole.

On CPU a fill out of a file in host RAM reads it in place (slots.py), and a slot that goes
on serving is copied into its own memory afterwards, where a forward pass is faster: once
batches have read it in place ``SETTLE_AFTER_BATCHES`` times, by a thread of low priority
(``settle``), which gives up as soon as a fill wants the slot; batches switch to the copy
once it is whole.  A variant evicted before then is never copied.

A variant that is not in a slot is answered NOT_FOUND "Request for unknown model", as
Triton answers for a model it has unloaded: the router has the control plane load it and
sends the request again.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import defaultdict

import numpy as np
import torch

from .layout import Layout, LayoutError
from .protocol import (
    CONTROL_PARAMETER,
    LAYOUT_FILE,
    SLOTS_PARAMETER,
    STATUS_OUTPUT,
    UNKNOWN_MODEL_PREFIX,
    VARIANT_PARAMETER,
)
from .responses import ControlRefused, FamilyInputError, _describe, _error, _parameter, _pb
from .slots import SlotBank, SlotError

try:  # the copy in a model folder carries the control socket beside this package's modules
    from .control_socket import MAX_COMMAND_BYTES, ControlSocketServer, read_control_key
except ImportError:  # the source tree
    from ..control_socket import MAX_COMMAND_BYTES, ControlSocketServer, read_control_key

log = logging.getLogger(__name__)

# A batch out of a mapping in place costs about 7% more than out of the slot's own memory;
# the copy that ends it costs about one pass over the weights, so about 14 such batches.  As
# in renting against buying, the slot is copied once its batches have cost about that much
# (never more than twice the best choice made knowing the future).
SETTLE_AFTER_BATCHES = 16

__all__ = ["MAX_COMMAND_BYTES", "FamilyInputError", "FamilyModel"]


class FamilyModel:
    # ------------------------------------------------------------------ the contract
    def build(self, weights: dict[str, torch.Tensor]):
        raise NotImplementedError("a family's model.py defines build(weights)")

    def parse(self, request) -> torch.Tensor:
        raise NotImplementedError("a family's model.py defines parse(request)")

    def outputs(self, rows: torch.Tensor) -> list:
        raise NotImplementedError("a family's model.py defines outputs(rows)")

    def forward(self, module, batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return module(batch)

    # ------------------------------------------------------------------ Triton
    def initialize(self, args: dict) -> None:
        self.model_config = json.loads(args["model_config"])
        self.family = self.model_config.get("name", "family")
        groups = self.model_config.get("instance_group") or [{}]
        if sum(int(g.get("count", 1)) for g in groups) > 1:
            # Each instance is its own process with its own slots; the control plane fills
            # the slots of one, so a second would answer from empty slots.
            raise SlotError(f"family {self.family} must run one instance (instance_group count 1)")
        if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
            self.device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
        else:
            self.device = torch.device("cpu")
        model_dir = args["model_repository"]  # the model's folder, where family.json is
        try:
            with open(os.path.join(model_dir, LAYOUT_FILE)) as f:
                layout = Layout.from_json(json.load(f))
        except (OSError, json.JSONDecodeError, LayoutError) as exc:
            raise SlotError(f"family {self.family}: cannot read {LAYOUT_FILE}: {exc}") from None
        slots = int(_parameter(self.model_config, SLOTS_PARAMETER, "1"))
        # Benchmarks and tests: device time simulated on a machine without one, slept once
        # per batch that ran (the recommender's parameter of the same name).
        self.execute_delay_s = float(_parameter(self.model_config, "execute_delay_s", "0"))
        self.bank = SlotBank(layout, slots, self.device)
        # A slot's module is built when a variant first fills it (its buffer is allocated
        # then: elastic slots), and again whenever the slot's views move.
        self.modules: list = [None] * slots
        self.instance = uuid.uuid4().hex[:12]  # a restarted family has empty slots
        self.swaps = 0
        # Only the control plane may change the slots: control commands carry the key it
        # wrote beside the families in Triton's repository (clients that reach Triton's
        # inference port cannot read it).
        self.control_key = read_control_key(os.path.dirname(os.path.abspath(model_dir)))
        # variant -> [inferences, last inference in ms since the epoch], for the control
        # plane's recency and auto-pinning (Triton counts the family model as one).
        self.usage: dict[str, list[int]] = {}
        # What the slots hold, the batches reading each slot and the slots being written
        # change under this condition; control commands run one at a time.
        self.guard = threading.Condition()
        self.readers = [0] * slots
        self.filling: set[int] = set()
        self.commands = threading.Lock()
        # CPU: which slots' modules read a file's mapping in place, and the slots being
        # copied into their own memory meanwhile (slot -> its give-up flag).
        self.over_mapping = [False] * slots
        self.batches_in_place = [0] * slots
        self.settling: dict[int, threading.Event] = {}
        self._to_settle: queue.SimpleQueue = queue.SimpleQueue()
        if self.bank.in_place:
            threading.Thread(target=self._settle_slots, name="slot-settle", daemon=True).start()
        self._control_server = ControlSocketServer(f"mms-family-{self.family}-{self.instance}",
                                                   self._socket_command, what=f"family {self.family}")
        self.control_socket = self._control_server.name

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        params = [self._parameters(r) for r in requests]
        # Control first, then the slots the requests use: a batch may carry a swap of the
        # very slot another of its requests names, and that request must then meet its
        # variant gone (retried by the router), never the new variant's weights.
        for i, p in enumerate(params):
            if CONTROL_PARAMETER in p:
                responses[i] = self._control(p[CONTROL_PARAMETER])
        groups: dict[int, list[int]] = defaultdict(list)
        with self.guard:  # the slots this batch reads are not written until it is done
            for i, p in enumerate(params):
                if responses[i] is not None:
                    continue
                variant = p.get(VARIANT_PARAMETER)
                if not variant:
                    responses[i] = _error(f"{self.family} serves its variants only; ask for a "
                                          "variant by its model name", "INVALID_ARG")
                    continue
                slot = self.bank.slot_of.get(variant)
                if slot is None:
                    responses[i] = _error(f"{UNKNOWN_MODEL_PREFIX}: '{variant}' is not loaded "
                                          "(its weights left their slot)", "NOT_FOUND")
                    continue
                groups[slot].append(i)
            holders = {slot: self.bank.holder[slot] for slot in groups}
            # Taken with the readers: an evict that returns the slot's memory meanwhile
            # leaves this batch its module (and the buffer it reads) until it ends.
            modules = {slot: self.modules[slot] for slot in groups}
            for slot in groups:
                self.readers[slot] += 1
        try:
            for slot, members in groups.items():
                try:
                    self._run(modules[slot], holders[slot], members, requests, responses)
                except Exception as exc:  # noqa: BLE001  (one group's failure is its requests' only)
                    for i in members:
                        if responses[i] is None:
                            responses[i] = _error(f"{holders[slot]} failed: {exc}", "INTERNAL")
            if groups and self.execute_delay_s > 0:
                time.sleep(self.execute_delay_s)
        finally:
            with self.guard:
                for slot in groups:
                    self.readers[slot] -= 1
                    if self.over_mapping[slot]:
                        self.batches_in_place[slot] += 1
                        if self.batches_in_place[slot] == SETTLE_AFTER_BATCHES:
                            self._to_settle.put((slot, holders[slot]))
                self.guard.notify_all()
        return responses

    @staticmethod
    def _parameters(request) -> dict:
        try:
            params = json.loads(request.parameters() or "{}")
        except json.JSONDecodeError:
            return {}
        return params if isinstance(params, dict) else {}

    def _run(self, module, variant: str, members: list[int], requests: list, responses: list) -> None:
        rows, ok = [], []
        for i in members:
            try:
                rows.append(self.parse(requests[i]))
                ok.append(i)
            except FamilyInputError as exc:
                responses[i] = _error(str(exc), "INVALID_ARG")
        if not ok:
            return
        batch = torch.cat(rows).to(self.device) if len(rows) > 1 else rows[0].to(self.device)
        result = self.forward(module, batch).cpu()
        offset = 0
        pb_utils = _pb()
        for i, part in zip(ok, rows):
            n = part.shape[0]
            responses[i] = pb_utils.InferenceResponse(output_tensors=self.outputs(result[offset:offset + n]))
            offset += n
        with self.guard:
            usage = self.usage.setdefault(variant, [0, 0])
            usage[0] += offset
            usage[1] = int(time.time() * 1000)

    # ------------------------------------------------------------------ control
    def status(self) -> dict:
        with self.guard:
            return {"family": self.family, "instance": self.instance, "slots": self.bank.count,
                    "allocated": self.bank.allocated,
                    "slot_bytes": self.bank.layout.data_bytes, "device": str(self.device),
                    "resident": dict(self.bank.slot_of), "swaps": self.swaps,
                    "usage": {v: list(u) for v, u in self.usage.items() if v in self.bank.slot_of},
                    "control_socket": self.control_socket}

    def _control(self, raw: str):
        """A control command that came as a request: its answer as Triton's response."""
        try:
            body = json.dumps(self.command(raw))
        except ControlRefused as exc:
            return _error(str(exc), exc.code)
        pb_utils = _pb()
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(STATUS_OUTPUT, np.array([[body.encode()]], dtype=np.object_))])

    def command(self, raw: str) -> dict:
        """Run one control command (JSON, with the key): its answer, the status with what the
        command did.  Raises ControlRefused.  Commands run one at a time, from requests and
        from the control socket alike."""
        command: dict = {}
        try:
            command = json.loads(raw)
            if not isinstance(command, dict):
                raise TypeError("a control command is a JSON object")
            if self.control_key is None or not hmac.compare_digest(
                    str(command.get("key", "")), self.control_key):
                raise ControlRefused("family control refused: wrong or missing key", "INVALID_ARG")
            op = command.get("op")
            answer: dict = {}
            with self.commands:
                if self.bank is None:
                    raise ControlRefused(f"{UNKNOWN_MODEL_PREFIX}: family {self.family} was "
                                         "unloaded", "NOT_FOUND")
                if op == "load":
                    # "evict": variants whose slots are freed first, in the same command: a
                    # miss that replaces a variant is one control request, and the evicted
                    # variant's next request meets it gone.
                    evict = command.get("evict", [])
                    if not isinstance(evict, list):
                        raise TypeError("'evict' is a list of variants")
                    answer.update(self._fill(str(command["variant"]), command["path"],
                                             [str(v) for v in evict]))
                elif op == "evict":
                    # The control plane gave the slot's room to something else: its memory
                    # goes back now (elastic slots).
                    with self.guard:
                        answer = {"slot": self._release(str(command["variant"]), keep_memory=False)}
                elif op != "status":
                    raise ControlRefused(f"unknown family control op {op!r}", "INVALID_ARG")
        except ControlRefused:
            raise
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
            raise ControlRefused(f"malformed family control command: {exc}", "INVALID_ARG") from None
        except SlotError as exc:
            raise ControlRefused(str(exc), "UNAVAILABLE" if "slots hold" in str(exc)
                                 else "INVALID_ARG") from None
        except (OSError, ValueError, RuntimeError) as exc:  # a copy that failed: the slot is free
            raise ControlRefused(f"family control {_describe(command)} failed: {exc}",
                                 "INTERNAL") from None
        return {**self.status(), **answer, "at": time.time()}

    def _fill(self, variant: str, path: str, evict: list[str]) -> dict:
        """Free the slots of ``evict``, then copy ``variant`` into a slot that holds nothing
        and that no batch reads, waiting for the batch reading an evicted slot when no other
        is free.  Batches on the other slots run meanwhile."""
        with self.guard:
            freed = [slot for slot in map(self._release, evict) if slot is not None]
            if variant in self.bank.slot_of:
                return {"evicted": freed, "slot": self.bank.slot_of[variant], "bytes": 0, "seconds": 0.0}
        offset = self.bank.check(variant, path)  # the file's header, before a slot is taken
        with self.guard:
            free = [i for i, holder in enumerate(self.bank.holder)
                    if holder is None and i not in self.filling]
            if not free:
                raise SlotError(f"all {self.bank.count} slots hold variants "
                                f"({', '.join(self.bank.slot_of)}); evict one first")
            # No batch reading it first, then one that has its memory (an evicted variant's,
            # reused: no allocation, no new module).
            slot = min(free, key=lambda i: (self.readers[i] > 0 or i in self.settling,
                                            not self.bank.has_memory(i), i))
            fresh = not self.bank.has_memory(slot) or self.modules[slot] is None
            self.filling.add(slot)
            # The other slots this command freed hold no variant now: their memory goes back.
            for other in freed:
                if (other != slot and self.bank.holder[other] is None
                        and other not in self.filling and other not in self.settling):
                    self.bank.drop_memory(other)
                    self.modules[other] = None
            # A batch still reads an evicted variant's weights, or its copy is settling.
            while self.readers[slot] or slot in self.settling:
                self.guard.wait()
        try:
            seconds = self.bank.write(slot, path, offset)
            in_place = self.bank.reads_in_place(slot)
            if in_place or self.over_mapping[slot] or fresh:  # the slot's views moved: rebuild
                self.modules[slot] = self._build(variant, slot)
                self.over_mapping[slot] = in_place
                self.batches_in_place[slot] = 0
        finally:
            with self.guard:
                self.filling.discard(slot)
        with self.guard:
            self.bank.assign(slot, variant)
            self.swaps += 1
        return {"evicted": freed, "slot": slot, "in_place": in_place,
                "bytes": 0 if in_place else self.bank.layout.data_bytes, "seconds": seconds}

    def _release(self, variant: str, keep_memory: bool = True) -> int | None:
        """Free ``variant``'s slot (under ``guard``), giving up the copy settling it;
        ``keep_memory=False`` returns its memory (its module goes: batches running keep
        theirs)."""
        if not keep_memory:
            slot = self.bank.slot_of.get(variant)
            if slot is not None and slot in self.settling:
                # The settling copy writes into the buffer: the memory goes once it gave up.
                keep_memory = True
        slot = self.bank.release(variant, keep_memory=keep_memory)
        if slot is not None and not keep_memory:
            self.modules[slot] = None
            self.over_mapping[slot] = False
        if slot in self.settling:
            self.settling[slot].set()
        return slot

    def _settle_slots(self) -> None:
        """Copy each slot filled in place into its own memory, one at a time, and switch its
        batches to the copy once it is whole (slots.py: ``settle``).  At low priority: on a
        busy host the requests' threads go first."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while (item := self._to_settle.get()) is not None:
            slot, variant = item
            with self.guard:
                if (self.bank is None or self.bank.holder[slot] != variant
                        or slot in self.filling or not self.bank.reads_in_place(slot)):
                    continue
                give_up = self.settling[slot] = threading.Event()
            module = None
            try:
                if self.bank.settle(slot, give_up.is_set):
                    module = self._build(variant, slot)
            except Exception as exc:  # noqa: BLE001  (the slot keeps reading the mapping)
                log.warning("family %s: copying %s into its slot failed; it goes on reading "
                            "its file in place: %s", self.family, variant, exc)
            finally:
                with self.guard:
                    if module is not None and not give_up.is_set():
                        self.modules[slot] = module  # batches running keep the one they took
                        self.over_mapping[slot] = False
                    del self.settling[slot]
                    self.guard.notify_all()

    def _build(self, variant: str, slot: int):
        """The module of ``slot`` over its views; a build that fails fails the fill alone
        (the slot stays free)."""
        try:
            return self.build(self.bank.views(slot))
        except Exception as exc:  # noqa: BLE001  (the family's own code)
            raise RuntimeError(f"building {self.family}'s module over {variant}'s weights "
                               f"failed: {type(exc).__name__}: {exc}") from None

    # ------------------------------------------------------------------ the control socket
    def _socket_command(self, line: str) -> dict:
        """A command from the control socket (model_runtime.control_socket): its answer."""
        try:
            return self.command(line)
        except ControlRefused as exc:
            return {"error": str(exc), "code": exc.code}

    def finalize(self) -> None:
        server = getattr(self, "_control_server", None)
        if server is not None:
            server.close()
        settling = getattr(self, "settling", None)
        if settling is not None:
            self._to_settle.put(None)
        with self.commands:  # a command running now ends before the slots go
            if settling is not None:
                with self.guard:  # and a slot being settled gives up first
                    for give_up in settling.values():
                        give_up.set()
                    while settling:
                        self.guard.wait()
            self.modules = []
            if self.bank is not None:
                self.bank.close()
            self.bank = None
