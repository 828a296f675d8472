"""Prometheus series stay bounded with thousands of models: past MODEL_SERIES_CAP names, the
others share one "_other" series, and the sums stay exact."""

from __future__ import annotations

from domain.routes import Decision
from domain.series import OTHER_LABEL, BoundedLabel
from router.serving.metrics import Recording, RouterMetrics
from tests.conftest import run
from tests.unit.test_manager_unit import make


def samples(registry, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for m in registry.collect() for s in m.samples
            if s.name == name}


def test_a_bounded_label_keeps_its_first_names_and_folds_the_rest():
    label = BoundedLabel(cap=2)
    assert [label(n) for n in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER_LABEL, "a",
                                                                  OTHER_LABEL, "b"]


def test_the_routers_request_series_are_bounded_and_their_sum_exact():
    metrics = RouterMetrics()
    metrics.model_label, metrics.route_label = BoundedLabel(cap=3), BoundedLabel(cap=3)
    recording = Recording(metrics)
    for i in range(50):
        recording.record(Decision(logical=f"m{i}", model=f"m{i}", variant="default"), 0.001, "OK")
    counts = samples(metrics.registry, "mmr_requests_total")
    assert len(counts) == 4  # three names of their own, and "_other"
    assert sum(counts.values()) == 50
    assert counts[(("code", "OK"), ("model", OTHER_LABEL), ("route", OTHER_LABEL),
                   ("variant", "default"))] == 47


def test_the_control_planes_hit_and_miss_series_are_bounded(tmp_path):
    async def go():
        mgr, _admin = make(tmp_path, max_loaded=6)
        mgr.metrics.model_label = BoundedLabel(cap=2)
        await mgr.start()
        for name in ("m1", "m2", "m3", "m4", "m1", "m4"):
            await mgr.ensure(name)
        misses = samples(mgr.metrics.registry, "mms_cache_misses_total")
        hits = samples(mgr.metrics.registry, "mms_cache_hits_total")
        assert misses == {(("model", "m1"),): 1, (("model", "m2"),): 1,
                          (("model", OTHER_LABEL),): 2}
        assert hits == {(("model", "m1"),): 1, (("model", OTHER_LABEL),): 1}

    run(go())


def test_the_cap_is_documented_where_operators_read_about_metrics():
    from pathlib import Path

    from domain.series import MODEL_SERIES_CAP

    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    assert f"{MODEL_SERIES_CAP:,}" in text and OTHER_LABEL in text
