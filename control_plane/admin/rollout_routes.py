"""Admin API routes (loopback, on the control plane's admin port) for routing changes:
aliases, A/B experiments, canaries, shadows and rate limits.

They act on the control plane's rollouts (``control_plane.rollouts.owner.Rollouts``: the
route table, the statistics, the canaries) and read what only the serving side knows, the
shadow comparisons and reports not yet gathered, through ``ServedReports``: the data-plane
hub when router workers serve, or the in-process router that mmctl assembles."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Protocol

from aiohttp import web

from control_plane.admin.api import json_body as _json
from control_plane.rollouts.canary import abort
from domain import errors as cp
from domain.names import validate_model_name
from domain.router_errors import InvalidRequest, ModelNotFound, RouterError
from domain.routes import split_adapter, validate_logical_name


class ShadowFigures(Protocol):
    """Shadow comparisons by route (``router.rollouts.shadow.ShadowMirror`` in process, or
    the workers' summed, ``control_plane.dataplane.reports.ShadowReports``)."""

    @property
    def reports(self) -> dict: ...

    def report(self, route: str) -> dict: ...


class ServedReports(Protocol):
    """What the serving side reports: the shadows, and every outcome counted on demand."""

    @property
    def shadow(self) -> ShadowFigures: ...

    async def gather_reports(self) -> bool: ...


@dataclass
class RolloutAdmin:
    """What the routes act on: the rollouts, the manager (is a model known?), the reports."""

    rollouts: object  # control_plane.rollouts.owner.Rollouts
    manager: object  # control_plane.manager.model_manager.ModelManager
    served: ServedReports

    @property
    def table(self):
        return self.rollouts.table

    @property
    def stats(self):
        return self.rollouts.stats

    @property
    def canaries(self):
        return self.rollouts.canaries

    @property
    def shadow(self) -> ShadowFigures:
        return self.served.shadow

    async def gather_reports(self) -> bool:
        return await self.served.gather_reports()


ROUTER_ADMIN_KEY = web.AppKey("router_admin", RolloutAdmin)


@web.middleware
async def router_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RouterError as exc:
        code = {404: "model_not_found", 400: "invalid_input"}.get(exc.http_status, "internal")
        return web.json_response({"error": code, "message": exc.message}, status=exc.http_status)


def _r(request) -> RolloutAdmin:
    return request.app[ROUTER_ADMIN_KEY]


def _num(body: dict, key: str, default=None, cast=float):
    value = body.get(key, default)
    if value is None:
        return None
    try:
        return cast(value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{key} must be a number, got {value!r}") from None


async def require_model(router: RolloutAdmin, model: str) -> None:
    """ModelNotFound (404, mmctl exit 4) unless ``model`` is a concrete model of a repository
    or tier: an alias or a split pointing at nothing would fail every request later."""
    try:
        await router.manager.known(model)
    except cp.ModelNotFound:
        serves = router.table.target_of(model)
        if serves != model:  # a logical name: its route or production version is the model
            raise ModelNotFound(f"{model!r} is a logical name, not a model: point at the model "
                                f"it serves ({serves}) or another version "
                                f"(`mmctl registry list {model}`)") from None
        raise ModelNotFound(f"unknown model {model!r}: it is in no model repository or tier; "
                            "`mmctl status --all` lists the known models") from None


async def require_servable(router: RolloutAdmin, name: str) -> None:
    """ModelNotFound unless ``name`` (or the base of ``base:adapter``) is something clients
    can ask for: a route, or a name whose target is a known model."""
    validate_logical_name(name)
    base, _adapter = split_adapter(name)
    if base in router.table.routes:
        return
    try:
        await router.manager.known(router.table.target_of(base))
    except cp.ModelNotFound:
        raise ModelNotFound(f"unknown model {base!r}: no route and no model of that name; "
                            "`mmctl status --all` lists the known models") from None


async def routes_list(request):
    return web.json_response(_r(request).table.to_dict())


async def alias_set(request):
    body = await _json(request)
    if not body.get("target"):
        raise InvalidRequest("give the concrete model as 'target'")
    for name in (request.match_info["name"], body["target"]):
        validate_model_name(name)  # a bad name is bad input (400), before "unknown" (404)
    await require_model(_r(request), body["target"])
    route = _r(request).table.set_alias(request.match_info["name"], body["target"])
    return web.json_response(asdict(route))


async def experiment_create(request):
    body = await _json(request)
    for key in ("id", "control", "treatment"):
        if not body.get(key):
            raise InvalidRequest(f"'{key}' is required")
    exp = _r(request).table.create_experiment(
        body["id"], body["control"], body["treatment"], _num(body, "treatment_percent", 50.0),
        bool(body.get("sticky", True)), body.get("route"))
    return web.json_response(asdict(exp))


async def experiment_list(request):
    table = _r(request).table
    return web.json_response([dict(asdict(r.experiment), route=r.name)
                              for r in table.routes.values() if r.experiment])


async def experiment_stats(request):
    router = _r(request)
    route, exp = router.table.experiment_for(request.match_info["id"])
    await router.gather_reports()
    return web.json_response({"experiment": asdict(exp), "route": route.name,
                              "variants": router.stats.scope(f"exp:{exp.id}")})


async def experiment_enable(request):
    enabled = request.match_info["action"] == "enable"
    exp = _r(request).table.set_experiment_enabled(request.match_info["id"], enabled)
    return web.json_response(asdict(exp))


async def experiment_delete(request):
    router = _r(request)
    router.table.delete_experiment(request.match_info["id"])
    router.stats.reset(f"exp:{request.match_info['id']}")
    return web.json_response({"deleted": request.match_info["id"]})


async def canary_start(request):
    body = await _json(request)
    if not body.get("to"):
        raise InvalidRequest("give the candidate model as 'to'")
    options = {}
    for key in ("stage_s", "check_interval_s", "max_error_rate", "max_p99_ms", "max_error_rate_ratio",
                "max_p99_ratio"):
        if body.get(key) is not None:
            options[key] = _num(body, key)
    for key in ("min_requests", "max_failed_checks"):
        if body.get(key) is not None:
            options[key] = _num(body, key, cast=int)
    if body.get("stages") is not None:
        options["stages"] = body["stages"]
    if "stage_s" not in options:
        raise InvalidRequest("stage_s (seconds per stage) is required")
    router = _r(request)
    name = request.match_info["name"]
    canary = router.table.start_canary(name, body["to"], **options)
    # Once started (no await between): a start refused (a canary already running, a bad
    # gate) keeps the running one's observations.
    router.stats.reset(f"canary:{name}")
    return web.json_response(asdict(canary))


async def canary_status(request):
    router = _r(request)
    name = request.match_info["name"]
    canary = router.table.canary(name)
    await router.gather_reports()
    body = asdict(canary)
    body["percent"] = canary.percent
    body["route"] = name
    body["serving"] = router.table.target_of(name)
    body["variants"] = router.stats.scope(f"canary:{name}")
    return web.json_response(body)


async def canary_action(request):
    router = _r(request)
    name = request.match_info["name"]
    canary = router.table.canary(name)
    if canary.status != "running":
        raise InvalidRequest(f"the canary of {name} is {canary.status}, not running")
    route = router.table.routes[name]
    if request.match_info["action"] == "abort":
        abort(router.table, route, time.time())
    else:
        router.canaries.promote_by_hand(route, time.time())
    return web.json_response(asdict(route.canary))


async def shadow_start(request):
    body = await _json(request)
    if not body.get("model"):
        raise InvalidRequest("give the shadow model as 'model'")
    router, model = _r(request), body["model"]
    for name in (request.match_info["name"], model):
        validate_model_name(name)  # a bad name is bad input (400), before "unknown" (404)
    # A shadow that could never answer is refused, not mirrored to and failed forever.
    await require_model(router, model)
    route = router.table.set_shadow(request.match_info["name"], model, _num(body, "percent", 100.0))
    return web.json_response(asdict(route))


async def shadow_stop(request):
    route = _r(request).table.set_shadow(request.match_info["name"], None)
    return web.json_response(asdict(route))


async def shadow_report(request):
    router = _r(request)
    name = request.match_info["name"]
    route = router.table.routes.get(name)
    if route is None or (route.shadow is None and name not in router.shadow.reports):
        raise ModelNotFound(f"{name} has no shadow; start one with mmctl shadow start")
    await router.gather_reports()
    body = router.shadow.report(name)
    body["route"] = name
    body["shadow"] = asdict(route.shadow) if route.shadow else None
    return web.json_response(body)


async def limit_set(request):
    body = await _json(request)
    await require_servable(_r(request), request.match_info["name"])
    _r(request).table.set_limit(request.match_info["name"], _num(body, "qps"), _num(body, "burst"))
    return web.json_response({"name": request.match_info["name"],
                              "limit": _r(request).table.limits.get(request.match_info["name"])})


async def limit_clear(request):
    _r(request).table.set_limit(request.match_info["name"], None)
    return web.json_response({"name": request.match_info["name"], "limit": None})


async def limit_list(request):
    return web.json_response(_r(request).table.limits)


def _share_listing(router: RolloutAdmin) -> dict:
    body = router.rollouts.shares.listing()
    body["servers"] = {name: server.spec.concurrency
                       for name, server in router.manager.servers.items()}
    return body


async def share_set(request):
    router, kind, name = _r(request), request.match_info["kind"], request.match_info["name"]
    body = await _json(request)
    if body.get("weight") is None:
        raise InvalidRequest("give the weight as 'weight': a number > 0 (unset, a model's "
                             "weight is 1)")
    shares = router.rollouts.shares
    if kind == "models":
        validate_model_name(name)
        if name not in router.rollouts.names.models:  # a registry model: all its versions
            await require_model(router, name)
        shares.set_model(name, body["weight"])
    else:
        shares.set_tenant(name, body["weight"])
    return web.json_response(_share_listing(router))


async def share_clear(request):
    router, kind, name = _r(request), request.match_info["kind"], request.match_info["name"]
    shares = router.rollouts.shares
    if name not in (shares.models if kind == "models" else shares.tenants):
        raise ModelNotFound(f"{kind[:-1]} {name!r} has no weight of its own; `mmctl share list` "
                            "lists the weights set")
    (shares.set_model if kind == "models" else shares.set_tenant)(name, None)
    return web.json_response(_share_listing(router))


async def share_list(request):
    return web.json_response(_share_listing(_r(request)))


def add_rollout_routes(app: web.Application, admin: RolloutAdmin) -> None:
    app[ROUTER_ADMIN_KEY] = admin
    app.middlewares.append(router_errors)
    app.add_routes([
        web.get("/v1/routes", routes_list),
        web.put("/v1/routes/{name}", alias_set),
        web.post("/v1/experiments", experiment_create),
        web.get("/v1/experiments", experiment_list),
        web.get("/v1/experiments/{id}", experiment_stats),
        web.post("/v1/experiments/{id}/{action:enable|disable}", experiment_enable),
        web.delete("/v1/experiments/{id}", experiment_delete),
        web.post("/v1/canaries/{name}", canary_start),
        web.get("/v1/canaries/{name}", canary_status),
        web.post("/v1/canaries/{name}/{action:abort|promote}", canary_action),
        web.post("/v1/shadows/{name}", shadow_start),
        web.delete("/v1/shadows/{name}", shadow_stop),
        web.get("/v1/shadows/{name}", shadow_report),
        web.put("/v1/limits/{name}", limit_set),
        web.delete("/v1/limits/{name}", limit_clear),
        web.get("/v1/limits", limit_list),
        web.put("/v1/shares/{kind:models|tenants}/{name}", share_set),
        web.delete("/v1/shares/{kind:models|tenants}/{name}", share_clear),
        web.get("/v1/shares", share_list),
    ])
