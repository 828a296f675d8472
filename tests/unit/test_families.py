"""Model families without Triton: the layout of a weights file, the slots and their
swap-ins, the catalogue, slot counts, and writing family and variant folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from control_plane.demo.fleet import FleetSpec, customer_weights, generate_family_fleet
from control_plane.families import (
    FamilyCatalog,
    check_variant_weights,
    family_slots,
    write_family,
    write_variant,
)
from control_plane.families.family_catalog import Family
from domain.errors import InvalidInput
from model_runtime.family import Layout, LayoutError, SlotBank, SlotError, read_layout

SCALER = Path(__file__).resolve().parents[1] / "fixtures" / "families" / "scaler"
ROOT = Path(__file__).resolve().parents[2]


def scaler_weights(scale: float, shift: float) -> dict[str, torch.Tensor]:
    return {"scale": torch.full((4,), float(scale)), "shift": torch.full((4,), float(shift))}


def weights_file(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path))
    return path


# --------------------------------------------------------------------------- layout
def test_layout_of_a_safetensors_file_names_every_tensor_and_its_bytes(tmp_path):
    path = weights_file(tmp_path, "a", {"w": torch.zeros(3, 2), "b": torch.zeros(3, dtype=torch.float16)})
    layout, offset = read_layout(path)
    by_name = layout.by_name()
    assert by_name["w"].dtype == "F32" and by_name["w"].shape == (3, 2)
    assert by_name["w"].end - by_name["w"].begin == 24
    assert by_name["b"].dtype == "F16" and by_name["b"].end - by_name["b"].begin == 6
    assert layout.data_bytes == 30
    assert offset + layout.data_bytes == path.stat().st_size
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout


def test_layout_mismatch_says_which_tensor_differs(tmp_path):
    family = read_layout(weights_file(tmp_path, "f", scaler_weights(1, 0)))[0]
    other = read_layout(weights_file(tmp_path, "o", {"scale": torch.zeros(5), "bias": torch.zeros(4)}))[0]
    why = family.mismatch(other)
    assert "missing shift" in why and "unexpected bias" in why and "scale is F32[5]" in why
    wrong_dtype = read_layout(weights_file(tmp_path, "d", {
        "scale": torch.zeros(4, dtype=torch.float64), "shift": torch.zeros(4)}))[0]
    assert "scale is F64[4], the family has F32[4]" in family.mismatch(wrong_dtype)
    assert family.mismatch(read_layout(weights_file(tmp_path, "s", scaler_weights(2, 3)))[0]) is None


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:4], "truncated"),
    (lambda b: b[:-3], "truncated"),
    (lambda b: b[:8] + b"{not json" + b[17:], "not JSON"),
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], "not a safetensors file"),
])
def test_a_damaged_weights_file_is_refused_with_the_reason(tmp_path, damage, message):
    good = weights_file(tmp_path, "g", scaler_weights(1, 0))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(LayoutError, match=message):
        read_layout(bad)


# --------------------------------------------------------------------------- slots
def test_a_swap_in_copies_the_weights_into_a_slot_and_the_slot_module_sees_them(tmp_path):
    layout = read_layout(weights_file(tmp_path, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 2, torch.device("cpu"))
    views = [bank.views(i) for i in range(2)]
    buffers_before = [b.data_ptr() for b in bank.buffers]
    bank.fill("a", weights_file(tmp_path, "a", scaler_weights(2, 1)))
    bank.fill("b", weights_file(tmp_path, "b", scaler_weights(3, 0)))
    x = torch.ones(4)
    assert torch.equal(x * views[bank.slot_of["a"]]["scale"] + views[bank.slot_of["a"]]["shift"], torch.full((4,), 3.0))
    assert torch.equal(views[bank.slot_of["b"]]["scale"], torch.full((4,), 3.0))
    with pytest.raises(SlotError, match="all 2 slots hold variants"):
        bank.fill("c", weights_file(tmp_path, "c", scaler_weights(5, 5)))
    freed = bank.release("a")
    bank.fill("c", tmp_path / "c.safetensors")
    assert bank.slot_of["c"] == freed and "a" not in bank.slot_of
    assert torch.equal(views[freed]["scale"], torch.full((4,), 5.0))  # the same views, new weights
    assert [b.data_ptr() for b in bank.buffers] == buffers_before  # nothing allocated by swaps


def test_weights_of_another_shape_are_refused_and_leave_the_slot_as_it_was(tmp_path):
    layout = read_layout(weights_file(tmp_path, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    bank.fill("a", weights_file(tmp_path, "a", scaler_weights(2, 1)))
    bank.release("a")
    wrong = weights_file(tmp_path, "w", {"scale": torch.zeros(8), "shift": torch.zeros(4)})
    with pytest.raises(SlotError, match="do not fit this family's slots: scale is F32\\[8\\]"):
        bank.fill("w", wrong)
    assert bank.slot_of == {} and torch.equal(bank.views(0)["scale"], torch.full((4,), 2.0))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mapped", [True, False], ids=["kept-mapping", "preadv"])
def test_a_swap_in_read_in_many_parts_has_every_byte_and_a_cut_file_leaves_the_slot_free(
        tmp_path, monkeypatch, threads, mapped):
    from model_runtime.family import slots

    monkeypatch.setattr(slots, "PART_BYTES", 4096)  # 100 KB of weights: 25 parts
    weights = {"scale": torch.arange(25_000, dtype=torch.float32), "shift": torch.ones(4)}
    layout = read_layout(weights_file(tmp_path, "base", weights))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"), read_threads=threads, map_files=mapped)
    bank.fill("a", weights_file(tmp_path, "a", weights))
    assert torch.equal(bank.views(0)["scale"], weights["scale"])
    bank.release("a")
    whole = weights_file(tmp_path, "whole", {k: v + 1 for k, v in weights.items()})
    (tmp_path / "cut.safetensors").write_bytes(whole.read_bytes()[:-50_000])
    # Cut after its header was read (a copy still being written, say): the read finds the end.
    monkeypatch.setattr(slots, "read_layout", lambda _path: read_layout(whole))
    with pytest.raises(SlotError, match="ended at byte"):
        bank.fill("cut", tmp_path / "cut.safetensors")
    assert bank.slot_of == {} and bank.free_slot() == 0


def test_the_demo_mlp_built_over_a_slot_answers_like_its_own_weights(tmp_path):
    spec = FleetSpec(count=2, hidden_dim=16, hidden_layers=2)
    generate_family_fleet(tmp_path, spec)
    family = FamilyCatalog(tmp_path).family("recommender")
    bank = SlotBank(family.layout, 1, torch.device("cpu"))
    bank.fill("cust002", tmp_path / "cust002" / "weights.safetensors")
    slot, own = bank.views(0), customer_weights(spec, "cust002")
    assert set(slot) == set(own)
    for name, tensor in own.items():
        assert torch.equal(slot[name], tensor), name


# --------------------------------------------------------------------------- slot counts
@pytest.mark.parametrize("max_loaded, budget, variants, expected", [
    (4, None, 20, 4),                # --max-loaded 4: four slots
    (None, 1000, 20, 10),            # a byte budget of ten slots
    (8, 300, 20, 3),                 # the smaller limit wins
    (None, None, 20, 30),            # no limit: one slot per variant, and half again
    (100, None, 6, 100),             # as many as the budget: empty slots cost nothing
    (4, 50, 20, 1),                  # a budget smaller than one slot still gets one
])
def test_slots_per_server_follow_its_budget(max_loaded, budget, variants, expected):
    family = Family("f", Layout((), 100), Path("."))
    assert family_slots(family, max_loaded, budget, variants) == expected


# --------------------------------------------------------------------------- folders
def test_a_family_folder_is_a_servable_triton_model_and_variants_find_it(tmp_path):
    base = weights_file(tmp_path, "base", scaler_weights(1, 0))
    repo = tmp_path / "repo"
    repo.mkdir()
    write_family(repo, "scaler", config_text=(SCALER / "config.pbtxt").read_text(),
                 version_files=SCALER / "1", base_weights=base)
    write_variant(repo, "acme", "scaler", scaler_weights(2, 1))
    write_variant(repo, "globex", "scaler", base)
    config = (repo / "scaler" / "config.pbtxt").read_text()
    assert "MMS_FAMILY_STATUS" in config and "count: 1" in config
    assert (repo / "scaler" / "1" / "_mms_family" / "triton_model.py").is_file()
    assert (repo / "scaler" / "1" / "_mms_family" / "mapped_files.py").is_file()
    catalog = FamilyCatalog(repo, lambda: [("cold-only", "scaler")])
    assert set(catalog.families) == {"scaler"}
    assert catalog.carrier_of("acme") == "scaler" and catalog.carrier_of("cold-only") == "scaler"
    assert catalog.carrier_of("scaler") is None and catalog.carrier_of("other") is None
    assert catalog.variants("scaler") == ["acme", "cold-only", "globex"]


def test_variant_weights_that_are_not_the_familys_are_refused_before_anything_is_written(tmp_path):
    family = Family("scaler", read_layout(weights_file(tmp_path, "base", scaler_weights(1, 0)))[0], tmp_path)
    wrong = weights_file(tmp_path, "wrong", {"scale": torch.zeros(4, dtype=torch.float16),
                                             "shift": torch.zeros(4)})
    with pytest.raises(InvalidInput, match="acme's weights .* do not match family scaler: scale is F16"):
        check_variant_weights(family, wrong, "acme")
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(wrong.read_bytes()[:-2])
    with pytest.raises(InvalidInput, match="truncated"):
        check_variant_weights(family, truncated, "acme")


def test_a_family_written_by_an_earlier_version_gets_this_versions_runtime(tmp_path):
    from control_plane.families import refresh_family_runtime

    base = weights_file(tmp_path, "base", scaler_weights(1, 0))
    repo = tmp_path / "repo"
    repo.mkdir()
    family = write_family(repo, "scaler", config_text=(SCALER / "config.pbtxt").read_text(),
                          version_files=SCALER / "1", base_weights=base)
    runtime = repo / "scaler" / "1" / "_mms_family"
    assert not refresh_family_runtime(family)  # this version's already: nothing to do
    # An earlier version's copy: a module that differs, one this version lacks.
    (runtime / "slots.py").write_text("# an earlier version's fills\n")
    (runtime / "mapped_files.py").unlink()
    assert refresh_family_runtime(family)
    assert (runtime / "slots.py").read_bytes() == (ROOT / "model_runtime/family/slots.py").read_bytes()
    assert (runtime / "mapped_files.py").is_file() and (runtime / "control_socket.py").is_file()
    assert sorted(p.name for p in (repo / "scaler" / "1").iterdir()) == ["_mms_family", "model.py"]
    # A family whose version folder has its own code and no copy of the runtime: left alone.
    import shutil
    shutil.rmtree(runtime)
    assert not refresh_family_runtime(family) and not runtime.exists()
