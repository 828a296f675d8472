"""Weights of models and tenants in a saturated server's fair share (``mmctl share``).

A weight is set on a model (a Triton model, a family's variant, or a registry model: then all
its versions) or on a tenant (every registered version of that tenant); a model's own weight
beats its tenant's; unset is 1.  The router's fair-share gate
(``router.serving.fair_shares``) reads the weights of concrete names, resolved here and
published to the router workers (section ``shares``).  Saved in the state store's key-value
table (SQLite and PostgreSQL alike, no migration).
"""

from __future__ import annotations

import json
import math

from domain.errors import InvalidInput
from domain.names import validate_model_name

SHARES_KEY = "shares"
MAX_WEIGHT = 1000.0  # a weight is a ratio to the others; past this it says nothing more


def check_weight(weight) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise InvalidInput(f"a weight is a number > 0 and <= {MAX_WEIGHT:g}, not {weight!r}")
    if not 0 < weight <= MAX_WEIGHT:
        raise InvalidInput(f"weight {weight:g} must be > 0 and <= {MAX_WEIGHT:g} (1 is every "
                           "model's weight when unset)")
    return float(weight)


class ShareWeights:
    """``store``: a key-value store (get/put); ``versions()``: the registry's versions (for
    tenants and registry models); ``names``: the registry's public names (their
    ``generation`` says when to resolve again)."""

    def __init__(self, store, versions, names):
        self.store = store
        self.versions = versions
        self.names = names
        saved = json.loads(store.get(SHARES_KEY, "{}") or "{}")
        self.models: dict[str, float] = dict(saved.get("models", {}))
        self.tenants: dict[str, float] = dict(saved.get("tenants", {}))
        self.generation = 0  # bumped on every change
        self._resolved: dict[str, float] = {}
        self._resolved_for = (-1, -1)  # (generation, names.generation)

    def set_model(self, name: str, weight: float | None) -> None:
        validate_model_name(name)
        self._set(self.models, name, weight)

    def set_tenant(self, tenant: str, weight: float | None) -> None:
        if not tenant or len(tenant) > 128 or not tenant.isprintable():
            raise InvalidInput("a tenant is a printable name of at most 128 characters")
        self._set(self.tenants, tenant, weight)

    def _set(self, table: dict[str, float], key: str, weight: float | None) -> None:
        if weight is None:
            table.pop(key, None)
        else:
            table[key] = check_weight(weight)
        self.store.put(SHARES_KEY, json.dumps({"models": self.models, "tenants": self.tenants}))
        self.generation += 1

    def listing(self) -> dict:
        return {"models": dict(self.models), "tenants": dict(self.tenants)}

    def resolved(self) -> dict[str, float]:
        """Concrete model -> weight, for every model whose weight is not 1 by default."""
        key = (self.generation, self.names.generation)
        if key == self._resolved_for:
            return self._resolved
        found: dict[str, float] = {}
        if self.tenants or self.models:
            for v in self.versions():
                if v.tenant in self.tenants:
                    found[v.name] = self.tenants[v.tenant]
            for name, weight in self.models.items():
                found[name] = weight
                for (model, _number), concrete in self.names.by_version.items():
                    if model == name and concrete not in self.models:
                        found[concrete] = weight
        self._resolved, self._resolved_for = found, key
        return found
