"""``FamilyAdmin``: a Triton server's model control where a variant's load and unload are
slot operations in its family's model.

The model manager calls ``load``, ``unload``, ``wait_unavailable``, ``index``,
``warmup_plan`` and ``warmup`` for every model; for a variant these become:

* ``load``: the family model is loaded through Triton's load API if this server does not
  have it yet (once; its slot count comes with the load, in the config override), then one
  control request copies the variant's weights from the warm tier into a free slot.
* ``load_replacing``: a miss that evicts variants of the same family is one control request
  (free their slots, then fill), instead of an evict and a fill.
* ``unload``: one control request frees the variant's slot.  The slot's bytes are free at
  once (fixed-size slots: nothing is returned to an allocator), so ``wait_unavailable`` has
  nothing to wait for.
* ``index``: Triton's index with each family model replaced by the variants in its slots,
  so the reconcile adopts and forgets variants as it does models; the family models
  themselves are not models of the manager's catalogue (never listed, loaded or pinned).
* The family model's slots are the manager's to count (``slot_pool``, ``slot_pools``,
  ``loaded_slots``): each variant in a slot takes its slot's bytes and one place of the
  server's budget, as a model does (one cache per server), and a slot's memory is returned
  when its variant is evicted for another entry; once no variant is left the manager
  unloads the family model (``unload_slots``).
* warm-up: the family's config shapes the request, sent with the variant's name.

A family model whose process died (Triton answers "Stub process ... is not healthy" and
does not restart it) is loaded again through Triton's load API, and the variants it held
are copied back into its new slots, so the manager's view stays true.  When the
manager asks for more variants than the family has slots (variants registered after its
load), the family model is loaded again with more slots and its variants refilled.

What this server's control plane knows of each family model (its lock, slots, residents,
process, warm-up) is one ``FamilyInstance`` (instance.py), moved between named states there.
The commands themselves (status, fill, evict) and how they reach the family's process are
``FamilyControl``'s (family_control.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from google.protobuf import json_format

from control_plane.families.family_catalog import Family
from control_plane.families.family_control import FamilyControl, FamilyUnhealthy
from control_plane.families.instance import IN_PROGRESS, FamilyState
from control_plane.triton.admin import (
    IndexEntry,
    SlotPool,
    TritonModelState,
    WarmupPlan,
)
from domain import model_config
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
)
from model_runtime.family.protocol import (
    SLOTS_PARAMETER,
    VARIANT_PARAMETER,
)

log = logging.getLogger(__name__)

# How old the variants' use may be when statistics are read: every load reads them first
# (recency before placement), and a status request waits behind the family's running batch.
USAGE_MAX_AGE_S = 1.0

class FamilyAdmin(FamilyControl):
    """TritonAdmin for one server, with the variants of ``families`` held in slots."""

    # ------------------------------------------------------------------ the family model
    def _family_config(self, family: Family, slots: int) -> str:
        """The load API's override: the family's config (instance kind as placed) with its
        slot count."""
        override = self.load_config(family.name) if self.load_config is not None else None
        if override is not None:
            config = json_format.Parse(override, model_config.ModelConfig())
        else:
            config = model_config.read_config(family.folder / model_config.CONFIG_FILE)
        model_config.set_parameter(config, SLOTS_PARAMETER, str(slots))
        return json_format.MessageToJson(config)

    async def _load_family(self, family: Family, slots: int) -> None:
        if self.guard is not None:
            self.guard()
        # The process Triton replaces may still answer on its socket for a moment: the next
        # command goes through Triton, whose answer names the new process's socket.
        await self.control_sockets.forget(family.name)
        await self.load_with(family.name, await asyncio.to_thread(self._family_config, family, slots))
        self.instance(family.name).loaded(slots)
        log.info("family %s loaded on %s with %d slots of %d bytes", family.name, self.grpc_url,
                 slots, family.slot_bytes)

    async def _ensure_family(self, family: Family, load_absent: bool = True) -> dict:
        """The family model is loaded here and its process alive; returns its status.  A
        family whose process died is loaded again and gets its variants back; one Triton
        does not have is loaded unless ``load_absent`` is False (ModelNotFound then).  Call
        with the family's lock held."""
        try:
            return await self.control(family, {"op": "status"})
        except ModelNotFound:
            if not load_absent:
                raise
            held: set[str] = set()
        except FamilyUnhealthy as exc:
            held = set(self.instance(family.name).resident)
            log.error("family %s on %s: %s; loading it again with %s", family.name,
                      self.grpc_url, exc.message, ", ".join(sorted(held)) or "no variants")
        return await self._reload(family, max(self.slots_for(family), len(held)), held,
                                  FamilyState.LOADING)

    async def _reload(self, family: Family, slots: int, held: set[str],
                      during: FamilyState) -> dict:
        """Load the family with ``slots`` slots (a fresh instance: empty slots) and copy
        ``held`` back into them, ``during`` (LOADING or GROWING) until it answers; a load that
        fails leaves it as it was before (Triton keeps the old instance, dead or alive).  Call
        with the family's lock held."""
        instance = self.instance(family.name)
        before = instance.state
        instance.move(during, f"loading it with {slots} slots")
        try:
            await self._load_family(family, slots)
            for variant in sorted(held):
                try:
                    await self._fill(family, variant)
                except ControlPlaneError as exc:  # the manager sees it gone and loads it again
                    log.warning("%s could not be copied back into family %s: %s", variant,
                                family.name, exc.message)
            status = await self.control(family, {"op": "status"})
            instance.move(FamilyState.SERVING, "loaded")
            return status
        finally:
            if instance.state is during:  # failed before it answered (ABSENT, DEAD: moved)
                instance.move(before, "its load failed")

    async def _grow(self, family: Family, status: dict) -> dict:
        """Load the family again with the slots its server's budget allows now (more
        variants than at its first load) and copy back the variants it holds.  Call with
        the family's lock held (``status`` read under it)."""
        wanted = self.slots_for(family)
        if wanted <= status["slots"]:
            raise CapacityExhausted(
                f"all {status['slots']} slots of family {family.name} on {self.grpc_url} hold "
                f"variants ({', '.join(sorted(status['resident']))}); the server's budget allows "
                "no more: unload one (mmctl unload) or raise --max-loaded / --memory-budget")
        log.info("family %s on %s: growing from %d to %d slots", family.name, self.grpc_url,
                 status["slots"], wanted)
        return await self._reload(family, wanted, set(status["resident"]), FamilyState.GROWING)

    # ------------------------------------------------------------------ the slots' room
    def slot_pool(self, model: str) -> SlotPool | None:
        """The slots ``model`` goes into here (its family's, with the slots a load of the
        family would allocate now), or None for a model of its own."""
        family = self.families.family_of(model)
        if family is None:
            return None
        return SlotPool(family.name, self.slots_for(family), family.slot_bytes)

    def loaded_slots(self, family: str) -> int | None:
        """Slots of ``family``'s model loaded here as last known, or None when it is not."""
        instance = self.instances.get(family)
        if instance is None or instance.state is FamilyState.ABSENT:
            return None
        return instance.slots

    def slot_pools(self) -> dict[str, SlotPool]:
        """The families loaded here (as the last index read found them) with their slots."""
        found = {}
        for name in list(self.instances):
            family = self.families.family(name)
            slots = self.loaded_slots(name)
            if family is not None and slots is not None:
                found[name] = SlotPool(name, slots, family.slot_bytes)
        return found

    async def unload_slots(self, family: str) -> None:
        """Unload ``family``'s model (the manager found no variant left in its slots); its
        memory is back once Triton's index shows it unavailable (``wait_unavailable``)."""
        if self.families.family(family) is None:
            raise ModelNotFound(f"{family} is not a model family")
        instance = self.instance(family)
        async with instance.lock:
            await self.control_sockets.forget(family)  # its process goes with it
            await super().unload(family)
            instance.move(FamilyState.ABSENT, "unloaded: no variant left in its slots")
        log.info("family %s unloaded from %s: no variant was left in its slots", family,
                 self.grpc_url)

    def family_slots(self, family: str) -> dict | None:
        """State, slots and resident variants of ``family`` on this server, as last reported;
        None when it is not loaded here."""
        instance = self.instances.get(family)
        return None if instance is None else instance.view()

    # ------------------------------------------------------------------ TritonAdmin
    def _changing(self, model: str) -> Family | None:
        """The family whose slots a load or unload of ``model`` changes (None: a model of its
        own, Triton's load API), once this control plane may act.  A family model itself is
        never loaded or unloaded as a model."""
        if self.families.family(model) is not None:
            raise ModelNotFound(f"{model} is a model family, served through its variants; "
                                "load, pin or call a variant by its name (mmctl family list)")
        family = self.families.family_of(model)
        if family is not None and self.guard is not None:
            self.guard()
        return family

    async def load(self, model: str) -> None:
        family = self._changing(model)
        if family is None:
            return await super().load(model)
        await self._fill_slot(family, model, [])

    def replaces_in_one(self, model: str, victims: list[str]) -> bool:
        family = self.families.family_of(model)
        return (family is not None and bool(victims)
                and all(self.families.family_of(v) is family for v in victims))

    async def load_replacing(self, model: str, victims: list[str]) -> None:
        """Evict ``victims`` (variants of ``model``'s family) and copy ``model`` into a slot,
        one control request: a miss that replaces a variant waits for one round trip."""
        family = self._changing(model)
        if family is None or not self.replaces_in_one(model, victims):
            raise InvalidInput(f"{model} does not replace {', '.join(victims)} in one family")
        await self._fill_slot(family, model, victims)

    async def _fill_slot(self, family: Family, model: str, evict: list[str]) -> None:
        instance = self.instance(family.name)
        async with instance.lock:
            status = instance.serving_status()
            if status is None:  # not known loaded and alive here: ask, and load it if need be
                instance.resident.difference_update(evict)  # not copied back if it loads again
                status = await self._ensure_family(family)
            leaving = set(evict) & set(status["resident"])
            if not evict and model in status["resident"]:
                return
            if model not in status["resident"] and len(status["resident"]) - len(leaving) >= status["slots"]:
                status = await self._grow(family, status)
            try:
                try:
                    answer = await self._fill(family, model, evict)
                except (ModelNotFound, FamilyUnhealthy):  # unloaded, or its process died
                    instance.resident.difference_update(evict)
                    status = await self._ensure_family(family)
                    if model in status["resident"] and not set(evict) & set(status["resident"]):
                        return
                    answer = await self._fill(family, model, evict)
            except InvalidInput as exc:
                raise ModelLoadFailed(f"{model} cannot go into a slot of family {family.name}: "
                                      f"{exc.message}") from exc
        log.debug("%s: %s slot %s of family %s in %.1f ms (%d bytes copied)%s", model,
                  "read in place by" if answer.get("in_place") else "copied into",
                  answer.get("slot"), family.name, 1000 * answer.get("seconds", 0.0),
                  answer.get("bytes", 0), f", evicting {', '.join(evict)}" if evict else "")

    async def unload(self, model: str) -> None:
        family = self._changing(model)
        if family is None:
            return await super().unload(model)
        instance = self.instance(family.name)
        async with instance.lock:
            try:
                await self.control(family, {"op": "evict", "variant": model})
            except ModelNotFound:
                return  # the family model is not loaded: neither is the variant
            except FamilyUnhealthy:
                instance.resident.discard(model)  # DEAD: not copied back at its next load
                return  # its process died, and its slots with it

    def measured(self, model: str) -> bool:
        return self.families.family_of(model) is None  # a slot's bytes are its size

    async def wait_unavailable(self, model: str, timeout_s: float | None = None) -> float:
        if self.families.family_of(model) is not None:
            return 0.0  # a freed slot is free at once
        return await super().wait_unavailable(model, timeout_s)

    async def index(self, ready_only: bool = False) -> dict[str, IndexEntry]:
        index = await super().index(ready_only)
        for name, instance in self.instances.items():
            entry = index.get(name)
            if ((entry is None or entry.state != TritonModelState.READY)
                    and instance.state is not FamilyState.ABSENT
                    and instance.state not in IN_PROGRESS and not instance.lock.locked()):
                # Triton no longer has it (unloaded, or its Triton restarted): nothing of its
                # slots holds, and their room is free.
                instance.move(FamilyState.ABSENT, "Triton's index does not list it ready")
        for name in list(index):
            family = self.families.family(name)
            if family is None:
                continue
            entry = index.pop(name)
            if entry.state != TritonModelState.READY:
                continue
            try:
                async with self.instance(name).lock:
                    # Unloaded since Triton's index was read (the manager freed its room,
                    # under this lock): a read of the index loads nothing.  A process that
                    # died is loaded again: its room is still counted.
                    status = await self._ensure_family(family, load_absent=False)
            except ModelNotFound:
                continue
            except ControlPlaneError as exc:
                log.warning("family %s on %s did not report its slots: %s", name, self.grpc_url,
                            exc.message)
                continue
            for variant in status["resident"]:
                index[variant] = IndexEntry(variant, TritonModelState.READY)
        return index

    async def statistics(self) -> dict[str, dict]:
        """Triton's statistics with each family model replaced by its variants' use (the
        manager's recency and auto-pinning read these; Triton counts the family as one)."""
        stats = await super().statistics()
        for name in list(stats):
            family = self.families.family(name)
            if family is None:
                continue
            del stats[name]
            instance = self.instance(name)
            usage = instance.usage
            if usage is None or time.monotonic() - instance.usage_read_at > USAGE_MAX_AGE_S:
                try:
                    status = await self.control(family, {"op": "status"})
                except ControlPlaneError:
                    continue
                usage = instance.usage = status.get("usage", {})
                instance.usage_read_at = time.monotonic()
            for variant, (count, last_ms) in usage.items():
                stats[variant] = {"name": variant, "inference_count": count, "last_inference": last_ms}
        return stats

    async def warmup_plan(self, model: str) -> WarmupPlan:
        family = self.families.family_of(model)
        if family is None:
            return await super().warmup_plan(model)
        plan = await self._plan(family)
        if self.instance(family.name).warm:
            return dataclasses.replace(plan, warm_already=(
                f"family {family.name}'s code is warm (warmed up with a variant since it loaded); "
                "a swap changes only the weights in a slot"))
        return plan

    async def warmup(self, model: str, plan: WarmupPlan | None = None) -> float:
        family = self.families.family_of(model)
        if family is None:
            return await super().warmup(model, plan)
        instance = self.instance(family.name)
        serving = instance.instance_id  # a process started during the warm-up is not warm
        ms = await self.infer_synthetic(family.name, plan or await self._plan(family), model,
                                        parameters={VARIANT_PARAMETER: model})
        instance.mark_warmed(serving)
        return ms
