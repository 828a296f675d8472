"""Headroom and leaving residents in the planner (pure policy code, no manager)."""

from __future__ import annotations

import pytest

from control_plane.eviction import (
    STAGE_PRIORITY,
    CachePlanner,
    Capacity,
    Headroom,
    HeadroomSpec,
    Resident,
    make_policy,
)
from domain.errors import CapacityExhausted

MB = 1_000_000


def planner(slots=None, max_bytes=None, headroom=None, priority_of=None) -> CachePlanner:
    return CachePlanner(make_policy("lru"), Capacity(max_bytes, slots), priority_of=priority_of,
                        headroom=headroom)


def fill(p: CachePlanner, names, size=0, now=0.0, **fields):
    for i, n in enumerate(names):
        p.admit(Resident(n, size, **fields), now + i)


HEADROOM_SLOT_CASES = {  # name: (slots, spec, expected headroom slots)
    "default, 15 slots": (15, HeadroomSpec(), 1),
    "default, 8 slots: the smallest server that gets one": (8, HeadroomSpec(), 1),
    "default, 7 slots: none": (7, HeadroomSpec(), 0),
    "explicit 2 of 15": (15, HeadroomSpec(models=2), 2),
    "explicit 3 of 4: capped at half": (4, HeadroomSpec(models=3), 2),
    "off": (15, HeadroomSpec(models=0), 0),
}


@pytest.mark.parametrize("case", HEADROOM_SLOT_CASES)
def test_headroom_target_in_slots(case):
    slots, spec, expected = HEADROOM_SLOT_CASES[case]
    assert planner(slots=slots, headroom=spec).headroom_target() == Headroom(expected, 0)


def test_headroom_in_bytes_is_models_times_the_median_size():
    p = planner(max_bytes=1000 * MB, headroom=HeadroomSpec())
    fill(p, ["a", "b", "c"], size=0)
    for name, size in (("a", 40 * MB), ("b", 50 * MB), ("c", 900 * MB)):
        p.update(name, size_bytes=size)
    # 1000 MB / 50 MB median = 20 models fit: the default headroom is one median model.
    assert p.headroom_target() == Headroom(0, 50 * MB)
    p.headroom = HeadroomSpec(bytes=123 * MB)
    assert p.headroom_target() == Headroom(0, 123 * MB)
    p.headroom = HeadroomSpec(bytes=900 * MB)  # never more than half the budget
    assert p.headroom_target() == Headroom(0, 500 * MB)


def test_headroom_victims_follow_the_policy_and_skip_pinned_and_busy():
    p = planner(slots=8, headroom=HeadroomSpec())
    fill(p, ["pinned"], pinned=True)
    fill(p, ["busy"], now=1, evictable=False)  # loading, or a request holds it
    fill(p, ["old", "mid", "new"], now=2)
    assert p.headroom_victims() == []  # 5 of 8: room to spare
    fill(p, ["x", "y", "z"], now=10)  # 8 of 8
    assert p.headroom_victims() == ["old"]
    p.touch("old", 20)
    assert p.headroom_victims() == ["mid"]


def test_headroom_counts_leaving_residents_as_gone():
    p = planner(slots=8, headroom=HeadroomSpec())
    fill(p, [f"m{i}" for i in range(8)])
    assert p.headroom_victims() == ["m0"]
    p.update("m0", evictable=False)
    p.update("m0", leaving=True)  # its unload is under way
    assert p.used_slots == 8 and p.committed_slots == 7
    assert p.headroom_victims() == []  # no second model for the same headroom


def test_headroom_never_takes_the_last_evictable_model():
    p = planner(slots=8, headroom=HeadroomSpec())
    fill(p, [f"pin{i}" for i in range(7)], pinned=True)
    fill(p, ["just-loaded"], now=10)
    assert p.headroom_victims() == []


def test_plan_counts_leaving_room_as_free_so_two_misses_evict_one_model_each():
    p = planner(slots=3)
    fill(p, ["a", "b", "c"])
    first = p.plan("d", 0).victims
    assert first == ["a"]
    p.update("a", evictable=False)
    p.update("a", leaving=True)
    p.admit(Resident("d", 0, evictable=False), 10)  # d reserved; a still counted until gone
    assert p.used_slots == 4
    assert p.plan("e", 0).victims == ["b"]  # not b and c


def test_a_failed_unload_holds_its_room_again():
    p = planner(slots=2)
    fill(p, ["a", "b"])
    p.update("a", evictable=False)
    p.update("a", leaving=True)
    assert p.plan("c", 0).victims == []
    p.update("a", leaving=False)  # its unload failed: Triton may still hold it
    assert p.plan("c", 0).victims == ["b"]


def test_a_shadow_leaves_the_headroom_alone():
    stages = {"shadow1": "shadow", "shadow2": "shadow"}
    p = planner(slots=8, headroom=HeadroomSpec(),
                priority_of=lambda n: STAGE_PRIORITY[stages.get(n, "production")])
    fill(p, [f"prod{i}" for i in range(7)], priority=STAGE_PRIORITY["production"])
    with pytest.raises(CapacityExhausted, match="shadow"):
        p.plan("shadow1", 0)  # the free slot is the headroom: not for a shadow
    assert p.plan("prod-next", 0).victims == []  # a serving model may use it
    p.remove("prod6")
    p.admit(Resident("shadow2", 0, priority=STAGE_PRIORITY["shadow"]), 20)
    # 6 serving + 1 shadow of 8: the shadow takes the other shadow's room, not the headroom.
    assert p.plan("shadow1", 0).victims == ["shadow2"]


def test_headroom_spec_refuses_negative_values():
    with pytest.raises(ValueError, match="headroom models"):
        HeadroomSpec(models=-1)
    with pytest.raises(ValueError, match="headroom bytes"):
        HeadroomSpec(bytes=-5)
