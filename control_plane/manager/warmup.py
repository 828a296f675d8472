"""Warm-up after a load, as the model says (what ``health`` shows)."""

from __future__ import annotations

from collections.abc import Callable

from control_plane.manager.records import ManagerConfig, TritonServer


async def warm_up(server: TritonServer, name: str, config: ManagerConfig,
                  warmup_enabled: Callable[[str], bool], clock: Callable[[], float]) -> dict:
    """Warm ``name`` up as the model says; the result is what ``health`` shows.

    ``model``: its config has ``model_warmup``, which Triton ran during the load;
    ``off``: the config's ``mms_warmup`` parameter, the registry or the control plane's
    configuration turned the synthetic warm-up off; ``synthetic``: one inference with
    zeros shaped from the config (raises ModelLoadFailed saying what it sent)."""
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
    ms = await server.admin.warmup(name, plan)
    return {**result, "latency_ms": ms, "mode": "synthetic"}

