"""A family model's states on one server (``FamilyInstance``), each change reached through
``FamilyAdmin`` the way the model manager drives it, against a fake Triton whose family
process can be loaded, killed, unloaded or refuse a load."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tritonclient.utils import InferenceServerException

from control_plane.families import FamilyCatalog, write_family, write_variant
from control_plane.families.instance import (
    FAMILY_TRANSITIONS,
    FamilyInstance,
    FamilyState,
)
from control_plane.families.slot_control import FamilyAdmin
from control_plane.manager.records import STRICT_ENV, IllegalTransition
from domain import model_config
from domain.errors import CapacityExhausted, ModelLoadFailed, ModelNotFound
from model_runtime.family.protocol import CONTROL_PARAMETER, SLOTS_PARAMETER
from tests.conftest import run

SCALER = Path(__file__).resolve().parents[1] / "fixtures" / "families" / "scaler"
FAMILY = "scaler"
URL = "fake:8001"
UNKNOWN = "Request for unknown model: 'scaler' is not found"
DEAD_STUB = ("Failed to process the request(s) for model 'scaler_0_0', message: Stub process "
             "'scaler_0_0' is not healthy.")


class FakeTriton:
    """Triton with one family model, as the admin sees it through tritonclient: its load
    API starts a process with empty slots; control requests fill, free and report them."""

    def __init__(self, config: model_config.ModelConfig):
        self.config = config
        self.loaded = False
        self.dead = False
        self.slots = 0
        self.resident: dict[str, int] = {}
        self.instance = ""
        self.loads = 0
        self.refuse_load: str | None = None  # the load API's refusal
        self.after_load = None  # called after a load API call succeeds (the process dies...)

    def start(self, slots: int, resident=()) -> None:
        """A process with ``slots`` slots holding ``resident`` (another control plane's)."""
        self.loaded, self.dead, self.slots = True, False, slots
        self.loads += 1
        self.instance = f"process{self.loads}"
        self.resident = {v: i for i, v in enumerate(resident)}

    async def load_model(self, model, headers=None, config=None, client_timeout=None):
        if self.refuse_load is not None:
            raise InferenceServerException(self.refuse_load, status="StatusCode.INTERNAL")
        parameters = json.loads(config)["parameters"]
        self.start(int(parameters[SLOTS_PARAMETER]["stringValue"]))
        if self.after_load is not None:
            self.after_load()

    async def get_model_config(self, model, client_timeout=None):
        if not self.loaded:
            raise InferenceServerException(UNKNOWN, status="StatusCode.NOT_FOUND")
        return SimpleNamespace(config=self.config)

    async def infer(self, model, inputs, outputs=None, parameters=None, client_timeout=None,
                    **_):
        if not self.loaded:
            raise InferenceServerException(UNKNOWN, status="StatusCode.NOT_FOUND")
        if self.dead:
            raise InferenceServerException(DEAD_STUB, status="StatusCode.INTERNAL")
        command = json.loads((parameters or {}).get(CONTROL_PARAMETER, "null"))
        if command is None:  # a warm-up with a variant
            return SimpleNamespace(as_numpy=lambda _name: np.zeros((1, 4), np.float32))
        variant = command.get("variant")
        if command["op"] == "load" and variant not in self.resident:
            free = sorted(set(range(self.slots)) - set(self.resident.values()))
            if not free:
                raise InferenceServerException(f"all {self.slots} slots hold variants",
                                               status="StatusCode.UNAVAILABLE")
            self.resident[variant] = free[0]
        elif command["op"] == "evict":
            self.resident.pop(variant, None)
        body = json.dumps({"instance": self.instance, "slots": self.slots,
                           "resident": dict(self.resident),
                           "usage": {v: [1, 1000] for v in self.resident}})
        return SimpleNamespace(as_numpy=lambda _name: np.array([[body.encode()]], np.object_))

    async def get_inference_statistics(self, as_json=True, client_timeout=None):
        return {"model_stats": [{"name": FAMILY}] if self.loaded else []}

    async def RepositoryIndex(self, request, metadata=None, timeout=None):
        state = "READY" if self.loaded else "UNAVAILABLE"
        return SimpleNamespace(models=[SimpleNamespace(name=FAMILY, state=state, reason="")])

    async def close(self):
        pass


@pytest.fixture
def catalog(tmp_path) -> FamilyCatalog:
    repo = tmp_path / "repo"
    repo.mkdir()
    base = tmp_path / "base.safetensors"
    save_file({"scale": torch.ones(4), "shift": torch.zeros(4)}, str(base))
    write_family(repo, FAMILY, config_text=(SCALER / "config.pbtxt").read_text(),
                 version_files=SCALER / "1", base_weights=base)
    for name in ("acme", "globex", "initech"):
        write_variant(repo, name, FAMILY, {"scale": torch.full((4,), 2.0), "shift": torch.ones(4)})
    return FamilyCatalog(repo)


@pytest.fixture
def triton(catalog) -> FakeTriton:
    return FakeTriton(model_config.read_config(catalog.repository / FAMILY / "config.pbtxt"))


class Admin:
    """A FamilyAdmin on the fake Triton, and every change of the family's state it made."""

    def __init__(self, catalog: FamilyCatalog, triton: FakeTriton, slots: int = 2):
        self.slots = slots  # what the server's budget allows the family now
        self.admin = FamilyAdmin(URL, catalog, lambda _family: self.slots)
        self.admin._client = triton
        self.admin._stub = triton
        self.changes: list[tuple[str, str]] = []
        self.instance = self.admin.instance(FAMILY)
        move = self.instance.move

        def recorded(to: FamilyState, why: str = "") -> None:
            if to is not self.instance.state:
                self.changes.append((self.instance.state.value, to.value))
            move(to, why)

        self.instance.move = recorded  # type: ignore[method-assign]

    def taken(self) -> list[tuple[str, str]]:
        """The changes since the last call."""
        taken, self.changes[:] = list(self.changes), []
        return taken

    @property
    def slots_view(self) -> dict | None:
        return self.admin.family_slots(FAMILY)


def serving(admin: Admin, *variants: str) -> Admin:
    """The family loaded through the admin with ``variants`` in its slots."""
    async def scenario():
        for variant in variants:
            await admin.admin.load(variant)

    run(scenario())
    admin.taken()
    assert admin.instance.state is FamilyState.SERVING
    return admin


# ---------------------------------------------------------------------- reached by behaviour
def test_a_first_load_moves_absent_to_loading_to_serving_and_the_next_fill_moves_nothing(
        catalog, triton):
    admin = Admin(catalog, triton)
    assert admin.slots_view is None
    seen_while_loading = []
    triton.after_load = lambda: seen_while_loading.append(admin.instance.state)
    run(admin.admin.load("acme"))
    assert seen_while_loading == [FamilyState.LOADING]
    assert admin.taken() == [("absent", "loading"), ("loading", "serving")]
    run(admin.admin.load("globex"))
    assert admin.taken() == []
    assert triton.loads == 1
    assert admin.slots_view == {"state": "serving", "slots": 2, "resident": ["acme", "globex"]}


def test_a_family_loaded_before_this_control_plane_is_adopted_from_absent_to_serving(
        catalog, triton):
    triton.start(2, ["globex"])
    admin = Admin(catalog, triton)
    index = run(admin.admin.index())
    assert admin.taken() == [("absent", "serving")]
    assert set(index) == {"globex"} and triton.loads == 1  # nothing loaded again
    assert admin.slots_view == {"state": "serving", "slots": 2, "resident": ["globex"]}


def test_more_variants_than_slots_grow_it_from_serving_and_back(catalog, triton):
    admin = serving(Admin(catalog, triton, slots=1), "acme")
    with pytest.raises(CapacityExhausted, match="budget allows no more"):
        run(admin.admin.load("globex"))  # the budget allows no second slot: nothing moves
    assert admin.taken() == []
    admin.slots = 2
    run(admin.admin.load("globex"))
    assert admin.taken() == [("serving", "growing"), ("growing", "serving")]
    assert triton.slots == 2 and set(triton.resident) == {"acme", "globex"}
    assert admin.slots_view == {"state": "serving", "slots": 2, "resident": ["acme", "globex"]}


def test_a_grow_that_triton_refuses_keeps_the_old_instance_serving(catalog, triton):
    admin = serving(Admin(catalog, triton, slots=1), "acme")
    admin.slots, triton.refuse_load = 2, "out of memory"
    with pytest.raises(ModelLoadFailed, match="out of memory"):
        run(admin.admin.load("globex"))
    assert admin.taken() == [("serving", "growing"), ("growing", "serving")]
    assert admin.slots_view == {"state": "serving", "slots": 1, "resident": ["acme"]}


def test_a_first_load_that_triton_refuses_leaves_it_absent(catalog, triton):
    admin = Admin(catalog, triton)
    triton.refuse_load = "out of memory"
    with pytest.raises(ModelLoadFailed, match="out of memory"):
        run(admin.admin.load("acme"))
    assert admin.taken() == [("absent", "loading"), ("loading", "absent")]
    assert admin.slots_view is None


@pytest.mark.parametrize("during, start", [("loading", ()), ("growing", ("acme",))])
@pytest.mark.parametrize("fate, to, error", [("dies", "dead", ModelLoadFailed),
                                             ("vanishes", "absent", ModelNotFound)])
def test_a_process_that_dies_or_vanishes_right_after_its_load_is_dead_or_absent(
        catalog, triton, during, start, fate, to, error):
    admin = serving(Admin(catalog, triton, slots=1), *start) if start else Admin(catalog, triton)
    admin.slots = 2

    def after_load():
        if fate == "dies":
            triton.dead = True
        else:
            triton.loaded = False

    triton.after_load = after_load
    with pytest.raises(error):
        run(admin.admin.load("globex"))
    assert admin.taken() == [("serving" if start else "absent", during), (during, to)]


def test_a_dead_process_is_loaded_again_by_the_next_command_with_what_it_held(catalog, triton):
    admin = serving(Admin(catalog, triton, slots=3), "acme", "globex")
    triton.dead = True
    with pytest.raises(ModelLoadFailed, match="is not healthy"):
        run(admin.admin.control(catalog.family(FAMILY), {"op": "status"}))
    assert admin.taken() == [("serving", "dead")]
    assert admin.slots_view == {"state": "dead", "slots": 3, "resident": ["acme", "globex"]}
    run(admin.admin.load("initech"))
    assert admin.taken() == [("dead", "loading"), ("loading", "serving")]
    assert triton.loads == 2 and set(triton.resident) == {"acme", "globex", "initech"}


def test_a_variant_unloaded_while_its_process_is_dead_is_not_copied_back(catalog, triton):
    admin = serving(Admin(catalog, triton), "acme", "globex")
    triton.dead = True
    run(admin.admin.unload("globex"))
    assert admin.taken() == [("serving", "dead")]
    assert admin.slots_view == {"state": "dead", "slots": 2, "resident": ["acme"]}
    index = run(admin.admin.index())  # the reconcile's pass loads it again
    assert admin.taken() == [("dead", "loading"), ("loading", "serving")]
    assert set(index) == {"acme"} and set(triton.resident) == {"acme"}


def test_a_reload_of_a_dead_process_that_triton_refuses_leaves_it_dead(catalog, triton):
    admin = serving(Admin(catalog, triton), "acme")
    triton.dead, triton.refuse_load = True, "out of memory"
    with pytest.raises(ModelLoadFailed, match="out of memory"):
        run(admin.admin.load("globex"))
    assert admin.taken() == [("serving", "dead"), ("dead", "loading"), ("loading", "dead")]
    assert admin.slots_view == {"state": "dead", "slots": 2, "resident": ["acme"]}
    triton.refuse_load = None
    run(admin.admin.load("globex"))
    assert admin.taken() == [("dead", "loading"), ("loading", "serving")]
    assert set(triton.resident) == {"acme", "globex"}


def test_a_process_found_dead_is_loaded_again_with_nothing_to_copy_back(catalog, triton):
    triton.start(2, ["acme"])
    triton.dead = True
    admin = Admin(catalog, triton)
    assert run(admin.admin.index()) == {}
    assert admin.taken() == [("absent", "dead"), ("dead", "loading"), ("loading", "serving")]
    assert triton.loads == 2 and triton.resident == {}


def test_a_dead_process_loaded_again_elsewhere_is_serving_at_its_first_answer(catalog, triton):
    admin = serving(Admin(catalog, triton), "acme", "globex")
    triton.dead = True
    run(admin.admin.unload("globex"))
    assert admin.taken() == [("serving", "dead")]
    triton.start(2, ["acme"])  # another control plane loaded it again
    stats = run(admin.admin.statistics())
    assert admin.taken() == [("dead", "serving")]
    assert set(stats) == {"acme"}


@pytest.mark.parametrize("start", ["serving", "dead"])
def test_a_family_triton_no_longer_has_is_absent_and_nothing_of_it_is_kept(catalog, triton,
                                                                          start):
    admin = serving(Admin(catalog, triton), "acme")
    if start == "dead":
        triton.dead = True
        run(admin.admin.unload("acme"))
        admin.taken()
    triton.loaded = False  # unloaded behind this control plane's back, or Triton restarted
    run(admin.admin.unload("acme"))
    assert admin.taken() == [(start, "absent")]
    assert admin.slots_view is None and admin.instance.plan is None
    run(admin.admin.load("acme"))
    assert admin.taken() == [("absent", "loading"), ("loading", "serving")]


def test_a_family_unloaded_while_the_index_is_read_is_not_loaded_again_by_the_read(
        catalog, triton):
    """Triton's index lists the family ready; before the read takes the family's lock the
    manager unloads it (its room given to another model).  The read once loaded it again,
    all its slots, outside any room the manager reserved."""
    admin = serving(Admin(catalog, triton), "acme")
    listed = triton.RepositoryIndex

    async def index_then_unloaded(request, metadata=None, timeout=None):
        answer = await listed(request, metadata, timeout)  # READY
        triton.loaded = False
        triton.resident.clear()
        return answer

    triton.RepositoryIndex = index_then_unloaded
    index = run(admin.admin.index())
    assert triton.loads == 1, "a read of the index loaded the family again"
    assert "acme" not in index and FAMILY not in index
    triton.RepositoryIndex = listed
    run(admin.admin.index())
    assert admin.instance.state is FamilyState.ABSENT and triton.loads == 1


def test_a_warm_up_warms_the_process_that_served_it_and_no_later_one(catalog, triton):
    admin = serving(Admin(catalog, triton), "acme")
    assert run(admin.admin.warmup_plan("acme")).warm_already is None
    run(admin.admin.warmup("acme"))
    assert run(admin.admin.warmup_plan("globex")).warm_already
    triton.dead = True
    run(admin.admin.load("globex"))  # a fill in a dead process: loaded again
    assert run(admin.admin.warmup_plan("globex")).warm_already is None


# ---------------------------------------------------------------------- the table itself
def test_every_state_lists_where_it_may_go_and_every_state_is_reachable():
    assert set(FAMILY_TRANSITIONS) == set(FamilyState)
    reachable = set().union(*FAMILY_TRANSITIONS.values())
    assert reachable == set(FamilyState)


def test_an_illegal_change_fails_loudly_under_the_test_suite(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    instance = FamilyInstance(FAMILY, URL)
    with pytest.raises(IllegalTransition,
                       match="family scaler on fake:8001: illegal state change absent -> growing"):
        instance.move(FamilyState.GROWING)
    assert instance.state is FamilyState.ABSENT


def test_an_illegal_change_is_logged_and_made_in_production(monkeypatch, caplog):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    instance = FamilyInstance(FAMILY, URL, state=FamilyState.SERVING)
    with caplog.at_level(logging.ERROR, logger="control_plane.families.instance"):
        instance.move(FamilyState.LOADING)
    assert instance.state is FamilyState.LOADING
    assert "illegal state change serving -> loading" in caplog.text
