"""Admin HTTP API for the registry and the warm tier (JSON, loopback only).

Routes (added to the admin app by ``add_registry_routes``; errors are mapped to statuses by
the app's error middleware like every other admin route):

    GET  /v1/registry[?model=M]                              versions, stage, size, where
    POST /v1/registry/models/{model}/versions                register (publish if source_dir)
    POST /v1/registry/models/{model}/versions/{version}/stage   promote / retire
    POST /v1/registry/models/{model}/versions/{version}/warmup  synthetic warm-up on/off
    GET  /v1/registry/models/{model}/history[?version=N]     stage changes, who and when
    GET  /v1/warm                                            warm tier: models, downloads
    POST /v1/warm/{name}/stage[?wait=1]                      prefetch into warm (202 or 200)
    POST /v1/warm/{name}/evict                               drop from warm (not if loaded)

Handlers only convert JSON to calls on the Registry / WarmTier and back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from control_plane.admin.api import json_body as _json
from control_plane.registry import DEFAULT_SLA, Registry, parse_metrics, register_version
from domain.errors import ControlPlaneError, InvalidInput
from domain.names import validate_model_name

log = logging.getLogger(__name__)

REGISTRY_KEY = web.AppKey("registry", Registry)
WARM_KEY = web.AppKey("warm_tier", object)
LOCATE_KEY = web.AppKey("locate", object)
STAGING_KEY = web.AppKey("warm_staging", dict)
FAMILIES_KEY = web.AppKey("families", object)


def _who(request: web.Request, body: dict) -> str:
    return str(body.get("who") or request.headers.get("X-MMS-User") or "admin-api")


def _version(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"version ({value!r}) must be a whole number >= 1") from None


def _warm(request: web.Request):
    warm = request.app.get(WARM_KEY)
    if warm is None:
        raise InvalidInput("this control plane runs without a warm tier")
    return warm


async def list_versions(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    locate: Callable[[str], dict] | None = request.app.get(LOCATE_KEY)
    out = []
    for mv in registry.versions(request.query.get("model")):
        row = mv.to_dict()
        row.update(locate(mv.name) if locate is not None else {"tier": None, "server": None})
        out.append(row)
    return web.json_response({"versions": out})


async def add_version(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    model = validate_model_name(request.match_info["model"])
    body = await _json(request)
    metrics = body.get("metrics") or {}
    if isinstance(metrics, dict):
        metrics = [f"{k}={v}" for k, v in metrics.items()]
    if not isinstance(metrics, list):
        raise InvalidInput("metrics must be a list of 'name=value' or an object")
    version = body.get("version")
    text = {key: _text(body, key) for key in ("artifact_uri", "sha256", "source_dir", "sla",
                                              "data_fingerprint", "tenant", "stage", "family",
                                              "weights")}
    previous = registry.production(model)
    mv = await register_version(
        registry, model, _version(version) if version is not None else None,
        who=_who(request, body), artifact_uri=text["artifact_uri"], sha256=text["sha256"],
        source_dir=text["source_dir"], sla=text["sla"] or DEFAULT_SLA,
        metrics=parse_metrics(str(m) for m in metrics),
        data_fingerprint=text["data_fingerprint"], tenant=text["tenant"],
        stage=text["stage"] or None,
        synthetic_warmup=_flag(body.get("synthetic_warmup", True), "synthetic_warmup"),
        family=text["family"] or None, weights=text["weights"] or None,
        families=request.app.get(FAMILIES_KEY))
    out = mv.to_dict()
    out["serves"] = _serves(model, mv, previous, stage_given=bool(body.get("stage")))
    return web.json_response(out, status=201)


def _text(body: dict, key: str) -> str | None:
    """A string field of a request's JSON body, or None when absent or null."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"{key} must be a string, got {type(value).__name__} {str(value)[:40]!r}")
    return value


def _serves(model: str, mv, previous, stage_given: bool) -> str:
    """One line for the person who added a version: what the logical name serves now."""
    if mv.stage == "production":
        why = "" if stage_given else f" (the first version of {model}, so it is production)"
        was = f"; it replaced {previous.name}" if previous is not None else ""
        return (f"{model} serves {mv.name}{why}{was}: clients ask for {model!r}, "
                f"`mmctl load {model}` loads it now")
    current = f"{model} keeps serving {previous.name}" if previous is not None else \
        f"{model} has no production version"
    return (f"{current}; {mv.name} gets its traffic once promoted (mmctl registry promote "
            f"{model} --version {mv.version} --stage production) or a share of it through a "
            f"canary (mmctl canary start {model} --to {mv.name})")


async def promote(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    body = await _json(request)
    if not body.get("stage"):
        raise InvalidInput("say which stage: {\"stage\": \"canary\"}")
    mv = await registry.db.off_loop(
        registry.promote, request.match_info["model"], _version(request.match_info["version"]),
        str(body["stage"]), who=_who(request, body), note=body.get("note"))
    return web.json_response(mv.to_dict())


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"{what} must be true or false, got {value!r}")
    return value


async def set_warmup(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    body = await _json(request)
    if "synthetic_warmup" not in body:
        raise InvalidInput('say whether to send it: {"synthetic_warmup": false}')
    mv = await registry.db.off_loop(registry.set_synthetic_warmup, request.match_info["model"],
                                    _version(request.match_info["version"]),
                                    _flag(body["synthetic_warmup"], "synthetic_warmup"))
    return web.json_response(mv.to_dict())


async def history(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    version = request.query.get("version")
    changes = registry.history(request.match_info["model"],
                               _version(version) if version is not None else None)
    return web.json_response({"history": [c.to_dict() for c in changes]})


async def warm_status(request: web.Request) -> web.Response:
    body = _warm(request).status()
    body["errors"] = dict(request.app[STAGING_KEY].get("errors", {}))
    return web.json_response(body)


async def warm_stage(request: web.Request) -> web.Response:
    warm = _warm(request)
    name = validate_model_name(request.match_info["name"])
    state = request.app[STAGING_KEY]
    errors: dict = state.setdefault("errors", {})
    tasks: set = state.setdefault("tasks", set())
    errors.pop(name, None)
    if request.query.get("wait", "") in ("1", "true", "yes"):
        size = await warm.prefetch(name)
        return web.json_response({"name": name, "size_bytes": size, "tier": "warm"})
    if warm.is_warm(name):
        return web.json_response({"name": name, "tier": "warm"})
    if name not in warm.known():
        raise InvalidInput(f"{name} is not in the registry; register it first (mmctl registry add)")

    async def run():
        try:
            await warm.prefetch(name)
        except ControlPlaneError as exc:
            errors[name] = exc.to_dict()
        except Exception as exc:  # reported to the poller, never lost
            log.exception("staging %s failed", name)
            errors[name] = {"error": "internal", "message": repr(exc)}

    task = asyncio.get_running_loop().create_task(run())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return web.json_response({"name": name, "tier": "staging"}, status=202)


async def warm_evict(request: web.Request) -> web.Response:
    name = validate_model_name(request.match_info["name"])
    evicted = _warm(request).evict(name)
    return web.json_response({"name": name, "evicted": evicted})


def add_registry_routes(app: web.Application, registry: Registry, warm=None,
                        locate: Callable[[str], dict] | None = None, families=None) -> None:
    """Register the routes above.  ``warm`` (a WarmTier) enables /v1/warm; ``locate(name)``
    adds tier/server to ``registry list`` (``warm.locator(manager)`` gives one);
    ``families`` (a FamilyCatalog) lets versions be variants of a model family."""
    app[REGISTRY_KEY] = registry
    if families is not None:
        app[FAMILIES_KEY] = families
    app[STAGING_KEY] = {}
    if warm is not None:
        app[WARM_KEY] = warm
    if locate is not None:
        app[LOCATE_KEY] = locate
    app.add_routes([
        web.get("/v1/registry", list_versions),
        web.post("/v1/registry/models/{model}/versions", add_version),
        web.post("/v1/registry/models/{model}/versions/{version}/stage", promote),
        web.post("/v1/registry/models/{model}/versions/{version}/warmup", set_warmup),
        web.get("/v1/registry/models/{model}/history", history),
        web.get("/v1/warm", warm_status),
        web.post("/v1/warm/{name}/stage", warm_stage),
        web.post("/v1/warm/{name}/evict", warm_evict),
    ])
