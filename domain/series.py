"""Prometheus series that stay bounded with thousands of models.

A label that names a model (or a route, which clients name) would give every model its own
series: ten thousand models, ten thousand series per metric, in every scrape.  The first
``MODEL_SERIES_CAP`` values seen keep series of their own; the others share one series
labelled ``OTHER_LABEL``, so a sum over the label is still the exact total.
"""

from __future__ import annotations

MODEL_SERIES_CAP = 250
OTHER_LABEL = "_other"


class BoundedLabel:
    """The label value to record for a model: its name, or ``OTHER_LABEL`` once ``cap``
    other names have series of their own.  O(1) per call."""

    def __init__(self, cap: int = MODEL_SERIES_CAP):
        self.cap = cap
        self._own: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._own:
            return value
        if len(self._own) < self.cap:
            self._own.add(value)
            return value
        return OTHER_LABEL
