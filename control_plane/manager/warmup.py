"""Warm-up after a load, as the model says (what ``health`` shows)."""

from __future__ import annotations

from collections.abc import Callable

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.records import TritonServer
from domain.errors import ModelLoadFailed, OperationTimeout


async def warm_up(server: TritonServer, name: str, config: ManagerConfig,
                  warmup_enabled: Callable[[str], bool], clock: Callable[[], float]) -> dict:
    """Warm ``name`` up as the model says; the result is what ``health`` shows.

    ``model``: its config has ``model_warmup``, which Triton ran during the load;
    ``off``: the config's ``mms_warmup`` parameter, the registry or the control plane's
    configuration turned the synthetic warm-up off; ``synthetic``: one inference with
    zeros shaped from the config.

    A synthetic warm-up that the model refuses does not refuse the model: Triton loaded it,
    and the request was the product's invention (Triton's own ``simple_string`` example
    reads numbers from its strings).  The result says ``ok: False`` with what was sent and
    how to turn it off (``mmctl health``, ``mms_warmup_failures_total``); the model is
    served.  A model's own ``model_warmup`` failing fails Triton's load, as anywhere."""
    result = {"ok": True, "latency_ms": None, "checked_at": clock(), "error": None}
    if not config.warmup:
        return {**result, "mode": "off", "note": "warm-up is off in the control plane's configuration"}
    plan = await server.admin.warmup_plan(name)
    if plan.warm_already:
        return {**result, "mode": "family", "note": plan.warm_already}
    if plan.model_samples:
        return {**result, "mode": "model",
                "note": f"Triton ran the model's own model_warmup ({plan.model_samples} "
                        "samples) during the load"}
    if not plan.synthetic_enabled:
        return {**result, "mode": "off",
                "note": "config.pbtxt parameter mms_warmup is false: no synthetic warm-up"}
    if not warmup_enabled(name):
        return {**result, "mode": "off",
                "note": "the registry turned the synthetic warm-up off for this model"}
    try:
        ms = await server.admin.warmup(name, plan)
    except (ModelLoadFailed, OperationTimeout) as exc:
        return {**result, "ok": False, "mode": "synthetic", "error": exc.message,
                "note": "served anyway: Triton loaded it; only the control plane's own check failed"}
    return {**result, "latency_ms": ms, "mode": "synthetic"}

