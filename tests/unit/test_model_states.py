"""One state machine per model: ``ModelRecord.move`` is the only writer of a model's state,
and a change that ``TRANSITIONS`` does not list fails loudly under test and is logged and
counted in production."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from control_plane.manager.records import (
    STRICT_ENV,
    TRANSITIONS,
    IllegalTransition,
    ModelRecord,
    ModelState,
)

ROOT = Path(__file__).resolve().parents[2]


def test_every_state_has_its_transitions_listed():
    assert set(TRANSITIONS) == set(ModelState)
    assert all(to in ModelState and to != state for state, tos in TRANSITIONS.items() for to in tos)


def test_an_illegal_change_fails_under_test():
    rec = ModelRecord("m")
    rec.move(ModelState.LOADING, server="s0")
    rec.move(ModelState.READY)
    with pytest.raises(IllegalTransition, match="m: illegal state change ready -> loading"):
        rec.move(ModelState.LOADING)
    assert rec.state == ModelState.READY


def test_in_production_an_illegal_change_is_counted_logged_and_made(monkeypatch, caplog):
    monkeypatch.delenv(STRICT_ENV)
    seen = []
    rec = ModelRecord("m", on_illegal=lambda was, to: seen.append((was, to)))
    rec.move(ModelState.READY, server="s0")  # from warm: adopted
    rec.move(ModelState.LOADING)
    assert seen == [(ModelState.READY, ModelState.LOADING)]
    assert rec.state == ModelState.LOADING
    assert "illegal state change ready -> loading" in caplog.text


def test_staying_in_a_state_is_allowed():
    rec = ModelRecord("m")
    rec.move(ModelState.WARM)
    assert rec.state == ModelState.WARM


def test_nothing_but_the_record_writes_a_models_state():
    """Every change goes through ``move`` (so through the table): no assignment elsewhere."""
    writes = []
    for path in (ROOT / "control_plane").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b\w+\.state\s*(,[^=]*)?=[^=].*ModelState\.", line) or \
                    re.search(r"\.state\s*=\s*ModelState\.", line):
                writes.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert writes == []


def test_the_manager_counts_illegal_changes(monkeypatch, tmp_path):
    from control_plane.manager.model_manager import ModelManager
    from control_plane.manager.records import ServerSpec
    from control_plane.state.state_store import StateStore

    monkeypatch.delenv(STRICT_ENV)
    server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2"), "lru")
    mgr = ModelManager([server], StateStore(tmp_path / "s.db"))
    rec = mgr.state.book.record("m")
    rec.move(ModelState.READY, server="s0")
    rec.move(ModelState.LOADING)
    assert mgr.metrics.illegal_transitions.labels("ready", "loading")._value.get() == 1


def test_a_copy_is_on_a_server_and_a_model_without_one_is_on_none():
    rec = ModelRecord("m")
    with pytest.raises(ValueError, match="on a server"):
        rec.move(ModelState.LOADING)
    rec.move(ModelState.LOADING, server="s0", memory_bytes=5)
    assert (rec.state, rec.server, list(rec.copies)) == (ModelState.LOADING, "s0", ["s0"])
    rec.move(ModelState.READY)
    rec.move(ModelState.UNLOADING)
    assert rec.room_promised  # an unload in progress promises its room to the next load
    rec.move(ModelState.UNLOAD_FAILED)
    assert rec.server == "s0" and not rec.room_promised  # it still holds its room
    rec.move(ModelState.UNLOADING)
    assert not rec.room_promised  # a retried failed unload promises nothing
    rec.move(ModelState.WARM, server=None)
    assert (rec.state, rec.server, rec.copies) == (ModelState.WARM, None, {})
    with pytest.raises(ValueError, match="no copy"):
        rec.move(ModelState.FAILED, server="s0")
