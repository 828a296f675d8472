"""Which model names clients may ask for, and how a served model is named back to them.

Clients name *logical* models (``simple``, ``cust017``) and, optionally, a registry version
of one (``simple`` version 2).  The concrete Triton models behind them (``simple.v2``,
``cust017-faulty``) are internal: a request for one is answered exactly like a request for
a model that does not exist, so it cannot skip the A/B split, canary or rate limits set on
the logical name.  ``mmctl up --expose-versions`` makes concrete names callable as they are
(Triton's own names and versions, no renaming).

Built from the registry and rebuilt on every registry change (rare); the request path only
reads the dictionaries, never SQLite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from domain.router_errors import UnknownModel


class _Version(Protocol):
    model: str
    version: int
    stage: str

    @property
    def name(self) -> str: ...


class PublicNames:
    """The registry's models and versions as clients see them.

    ``versions()`` lists the registry's versions (``Registry.versions``).  Retired versions
    are not served: asking for one is asking for an unknown version.
    """

    def __init__(self, versions: Callable[[], Iterable[_Version]], expose_concrete: bool = False):
        self._versions = versions
        self.expose_concrete = expose_concrete
        # Mutated in place on refresh: RouteTable holds ``production.get``.
        self.production: dict[str, str] = {}  # model -> concrete name of its production version
        self.by_version: dict[tuple[str, str], str] = {}  # (model, "N") -> concrete name
        self.public: dict[str, tuple[str, str]] = {}  # concrete name -> (model, "N")
        self.models: set[str] = set()
        self.generation = 0  # bumped on every refresh (lets callers cache derived values)
        self.refresh()

    def refresh(self, *_args) -> None:
        """Re-read the registry (its change listener calls this with (name, stage))."""
        production, by_version, public, models = {}, {}, {}, set()
        for v in self._versions():
            models.add(v.model)
            if v.stage == "retired":
                continue
            number = str(v.version)
            by_version[(v.model, number)] = v.name
            public[v.name] = (v.model, number)
            if v.stage == "production":
                production[v.model] = v.name
        self.production.clear()
        self.production.update(production)
        self.by_version, self.public, self.models = by_version, public, models
        self.generation += 1

    def unrouted(self, name: str) -> str:
        """The concrete model a name serves when it has no route and no production version.

        A registry model without a production version serves nothing (Triton: "has no
        available versions"); any other name is a concrete name, served as it is only when
        concrete names are exposed."""
        if name in self.models:
            raise UnknownModel(name, no_versions=True)
        if self.expose_concrete:
            return name
        raise UnknownModel(name)
