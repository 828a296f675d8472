"""What a router worker serves from: its copy of the control plane's published state
(``control_plane.dataplane.publisher``), section by section, and the names, route table,
placement and addresses read from it.  ``router.serving.state_client.RemoteState`` keeps it
current from the control plane (its long-poll, and the changes an ensure's answer carries).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from domain.public_names import PublicNames
from domain.routes import Route, RouteTable
from router.serving.serving_state import ServerAddress

# The sections of the control plane's published state (control_plane.dataplane.publisher) and
# what a worker builds from each when it changes.
NAME_SECTIONS = frozenset({"production", "versions", "public", "models", "meta"})
TABLE_SECTIONS = frozenset({"routes", "limits"}) | NAME_SECTIONS


def names_from_sections(sections: dict) -> PublicNames:
    names = PublicNames(lambda: (), expose_concrete=bool(sections["meta"].get("expose_concrete")))
    names.production.update(sections["production"])
    names.by_version = {(m, n): c for m, numbers in sections["versions"].items()
                        for n, c in numbers.items()}
    names.public = {c: tuple(v) for c, v in sections["public"].items()}
    names.models = set(sections["models"])
    return names


def table_from_sections(sections: dict, names: PublicNames, version: int) -> RouteTable:
    table = RouteTable(default_target=names.production.get, unrouted=names.unrouted)
    for d in sections["routes"].values():
        route = Route.from_dict(d)
        table.routes[route.name] = route
    table.limits = dict(sections["limits"])
    table.version = version
    return table



class PublishedView:
    """The published sections as one worker has applied them, up to ``version`` of
    ``epoch``; the reads of ``router.serving.serving_state.ServingState`` that need no call."""

    def __init__(self, on_snapshot: Callable[[], None] = lambda: None):
        self.version = -1
        self.epoch = ""
        # Kept current key by key; placement and carriers are read from them as they are.
        self.sections: dict[str, dict] = {}
        self.names = PublicNames(lambda: ())
        self.table = RouteTable(default_target=self.names.production.get, unrouted=self.names.unrouted)
        self.repository: Path | None = None
        self.placement: dict[str, str] = {}
        self.carriers: dict[str, str] = {}  # family variant -> the Triton model serving it
        self.addresses: dict[str, ServerAddress] = {}
        self.workers = 1
        self.on_snapshot = on_snapshot  # called after each new snapshot is applied

    def apply(self, published: dict) -> None:
        """Apply the control plane's answer: the whole state, or the changes since ours.
        Only what a change touches is rebuilt: a placement change is one dictionary write;
        the names and the route table are rebuilt when one of their sections changed.
        A version of this epoch no newer than ours is passed over: an ensure's answer and the
        long-poll both bring changes, in either order."""
        if published["epoch"] == self.epoch and published["version"] <= self.version:
            return
        if "sections" in published:
            self.sections = {section: dict(keys) for section, keys in published["sections"].items()}
            touched = set(self.sections)
        else:
            touched = set()
            for section, key, value in published["changes"]:
                keys = self.sections.setdefault(section, {})
                if value is None:
                    keys.pop(key, None)
                else:
                    keys[key] = value
                touched.add(section)
        for section in ("placement", "carriers", "routes", "limits", "production", "versions",
                        "public", "models", "servers", "meta", "miss_ms", "copies", "concurrency",
                        "shares"):
            self.sections.setdefault(section, {})
        version = published["version"]
        if touched & NAME_SECTIONS:
            self.names = names_from_sections(self.sections)
            self.names.generation = version  # the router's cached public names are stale
        if touched & TABLE_SECTIONS:
            self.table = table_from_sections(self.sections, self.names, version)
        if "servers" in touched:
            self.addresses = {name: ServerAddress(name, grpc, http, up)
                              for name, (grpc, http, up) in self.sections["servers"].items()}
        self.placement = self.sections["placement"]
        self.carriers = self.sections["carriers"]
        if "meta" in touched:
            meta = self.sections["meta"]
            self.repository = Path(meta["repository"]) if meta.get("repository") else None
            self.workers = max(1, int(meta.get("workers") or 1))
        self.version, self.epoch = version, published["epoch"]
        self.on_snapshot()

    def ready_server(self, model: str) -> ServerAddress | None:
        name = self.placement.get(model)
        return None if name is None else self.addresses.get(name)

    def copy_servers(self, model: str) -> list[ServerAddress]:
        found = [self.addresses.get(name) for name in self.sections["copies"].get(model, ())]
        return [a for a in found if a is not None]

    def concurrency(self, server: str) -> int | None:
        total = self.sections["concurrency"].get(server)
        return None if total is None else max(1, int(total) // self.workers)

    def share_weight(self, model: str) -> float:
        return float(self.sections["shares"].get(model, 1.0))

    def carrier_of(self, model: str) -> str | None:
        return self.carriers.get(model)

    def expected_miss_s(self, model: str) -> float | None:
        ms = self.sections.get("miss_ms", {}).get(model)
        return None if ms is None else ms / 1000.0

    def servers(self) -> list[ServerAddress]:
        return list(self.addresses.values())
