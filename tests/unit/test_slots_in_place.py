"""On CPU a slot reads a variant's file in host RAM (tmpfs: the default warm tier) in place,
through its kept mapping, instead of copying it; a file on a disk is copied.  The family
model builds the slot's module again over the moved views, so every answer is the variant's
own weights' answer, whichever way its slot was filled before."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model_runtime.family import SlotBank, SlotError, read_layout
from tests.unit.test_families import scaler_weights, weights_file
from tests.unit.test_family_runtime import control, infer, pb_utils, scaler_family  # noqa: F401

SHM = Path("/dev/shm")


@pytest.fixture(autouse=True)
def small_files_in_place(monkeypatch):
    """The tests' files are bytes, not megabytes: read them in place all the same."""
    from model_runtime.family import slots

    monkeypatch.setattr(slots, "IN_PLACE_MIN_BYTES", 0)


@pytest.fixture
def ram_dir():
    """A folder in tmpfs (host RAM), as the default warm tier is."""
    if not os.access(SHM, os.W_OK):
        pytest.fail("these tests need a writable tmpfs at /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="mms-in-place-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir(tmp_path):
    from model_runtime.family.mapped_files import RAM_FILE_SYSTEMS, file_system_of

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        if file_system_of(fd) in RAM_FILE_SYSTEMS:
            pytest.fail(f"{tmp_path} is in RAM here: give pytest a --basetemp on a disk")
    finally:
        os.close(fd)
    return tmp_path


def values(bank: SlotBank, slot: int) -> dict[str, list[float]]:
    return {name: tensor.tolist() for name, tensor in bank.views(slot).items()}


def test_a_file_in_ram_is_read_in_place_and_its_slot_buffer_never_written(ram_dir):
    layout = read_layout(weights_file(ram_dir, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 2, torch.device("cpu"))
    bank.fill("a", weights_file(ram_dir, "a", scaler_weights(2, 1)))
    bank.fill("b", weights_file(ram_dir, "b", scaler_weights(3, 0)))
    assert bank.reads_in_place(bank.slot_of["a"]) and bank.reads_in_place(bank.slot_of["b"])
    assert values(bank, bank.slot_of["a"]) == {"scale": [2.0] * 4, "shift": [1.0] * 4}
    assert values(bank, bank.slot_of["b"]) == {"scale": [3.0] * 4, "shift": [0.0] * 4}
    # No byte copied: the slots were not even given memory of their own.
    assert bank.buffers == [None, None] and bank.nbytes == 0
    # The views are the kept mapping's memory: the same bytes the file holds.
    mapping = bank.files.view(ram_dir / "a.safetensors")
    address = mapping.__array_interface__["data"][0]
    assert address <= bank.views(bank.slot_of["a"])["scale"].data_ptr() < address + len(mapping)
    bank.close()


def test_a_file_on_a_disk_and_a_bank_told_not_to_are_copied(ram_dir, disk_dir):
    layout = read_layout(weights_file(disk_dir, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    bank.fill("disk", weights_file(disk_dir, "disk", scaler_weights(4, 4)))
    assert not bank.reads_in_place(0)
    assert values(bank, 0) == {"scale": [4.0] * 4, "shift": [4.0] * 4}
    bank.close()
    copying = SlotBank(layout, 1, torch.device("cpu"), in_place=False)
    copying.fill("ram", weights_file(ram_dir, "ram", scaler_weights(5, 5)))
    assert not copying.reads_in_place(0) and values(copying, 0)["scale"] == [5.0] * 4
    copying.close()


def unaligned_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A valid safetensors file whose data section starts 4 bytes past a multiple of 8 (a
    writer that does not pad its header, as save_file does)."""
    header, data, at = {}, b"", 0
    for name, tensor in tensors.items():
        raw = tensor.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [at, at + len(raw)]}
        data, at = data + raw, at + len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((4 - (8 + len(text))) % 8)
    assert (8 + len(text)) % 8 == 4
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def small_file(folder: Path, monkeypatch) -> Path:
    from model_runtime.family import slots

    monkeypatch.setattr(slots, "IN_PLACE_MIN_BYTES", 33)  # the scaler's data: 32 bytes
    return weights_file(folder, "small", scaler_weights(3, 4))


def odd_file(folder: Path, _monkeypatch) -> Path:
    unaligned_file(folder / "odd.safetensors", scaler_weights(3, 4))
    return folder / "odd.safetensors"


@pytest.mark.parametrize("make", [small_file, odd_file],
                         ids=["below the size worth reading in place", "data not aligned"])
def test_such_a_file_in_ram_is_copied(ram_dir, monkeypatch, make):
    layout = read_layout(weights_file(ram_dir, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    bank.fill("v", make(ram_dir, monkeypatch))
    assert not bank.reads_in_place(0)
    assert values(bank, 0) == {"scale": [3.0] * 4, "shift": [4.0] * 4}
    bank.close()


def test_a_file_replaced_after_its_fill_is_read_as_it_was_until_the_next_fill(ram_dir):
    layout = read_layout(weights_file(ram_dir, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    path = weights_file(ram_dir, "a", scaler_weights(2, 2))
    bank.fill("a", path)
    # Replaced as the warm tier replaces a file: a complete file renamed over it.
    os.replace(weights_file(ram_dir, "a-new", scaler_weights(9, 9)), path)
    assert values(bank, 0) == {"scale": [2.0] * 4, "shift": [2.0] * 4}
    assert bank.files.sweep() == 1  # the old mapping is forgotten, the slot still holds it
    assert values(bank, 0)["scale"] == [2.0] * 4
    bank.release("a")
    bank.fill("a", path)
    assert values(bank, 0) == {"scale": [9.0] * 4, "shift": [9.0] * 4}
    bank.close()


def test_a_file_in_ram_shorter_than_its_header_says_leaves_the_slot_free(ram_dir, monkeypatch):
    from model_runtime.family import slots

    layout = read_layout(weights_file(ram_dir, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    whole = weights_file(ram_dir, "whole", scaler_weights(1, 1))
    (ram_dir / "cut.safetensors").write_bytes(whole.read_bytes()[:-8])
    monkeypatch.setattr(slots, "read_layout", lambda _path: read_layout(whole))
    with pytest.raises(SlotError, match="ended at byte"):
        bank.fill("cut", ram_dir / "cut.safetensors")
    assert bank.slot_of == {} and bank.free_slot() == 0 and not bank.reads_in_place(0)
    bank.close()


# ----------------------------------------------------------------- through the family model
@pytest.fixture
def ram_family(ram_dir, monkeypatch, request):
    """The scaler family of test_family_runtime, its repository in host RAM."""
    request.getfixturevalue("pb_utils")
    model, repo, key = scaler_family(ram_dir, monkeypatch)
    # The family's own copy of the runtime (its _mms_family package): small files in place.
    monkeypatch.setattr(sys.modules[type(model.bank).__module__], "IN_PLACE_MIN_BYTES", 0)
    yield model, repo, key
    model.finalize()


def output(model, variant) -> list[list[float]]:
    response = model.execute([infer(variant)])[0]
    assert response.error is None, response.error.message
    return response.outputs["OUTPUT0"].tolist()


def load(model, key, variant, path, evict=()):
    [answer] = model.execute([control(key, "load", variant=variant, path=str(path), evict=list(evict))])
    assert answer.error is None, answer.error.message
    return json.loads(answer.outputs["MMS_FAMILY_STATUS"][0][0])


def test_the_family_answers_from_a_slot_read_in_place_and_from_a_copy_after_it(ram_family, disk_dir):
    model, repo, key = ram_family
    first = load(model, key, "acme", repo / "acme" / "weights.safetensors")
    assert first["in_place"] and first["bytes"] == 0
    assert output(model, "acme") == [[2.0] * 4]
    # The same slot, in place again (another mapping): the module follows it.
    again = load(model, key, "globex", repo / "globex" / "weights.safetensors", evict=["acme"])
    assert again["in_place"] and again["slot"] == first["slot"]
    assert output(model, "globex") == [[100.0] * 4]
    # The same slot filled by a copy (a file on a disk): the module reads the slot's buffer.
    disk = weights_file(disk_dir, "initech", {"scale": torch.full((4,), 7.0), "shift": torch.ones(4)})
    copied = load(model, key, "initech", disk, evict=["globex"])
    assert not copied["in_place"] and copied["bytes"] == model.bank.layout.data_bytes
    assert output(model, "initech") == [[8.0] * 4]
    back = load(model, key, "acme", repo / "acme" / "weights.safetensors", evict=["initech"])
    assert back["in_place"] and output(model, "acme") == [[2.0] * 4]


def test_a_build_that_fails_fails_its_fill_alone_and_the_slot_stays_free(ram_family):
    model, repo, key = ram_family
    build = model.build
    model.build = lambda weights: (_ for _ in ()).throw(KeyError("layers.0.weight"))
    [answer] = model.execute([control(key, "load", variant="acme",
                                      path=str(repo / "acme" / "weights.safetensors"))])
    assert answer.error.code == "INTERNAL"
    assert "building scaler's module over acme's weights failed: KeyError" in answer.error.message
    assert model.bank.slot_of == {} and model.bank.free_slot() == 0
    model.build = build
    load(model, key, "acme", repo / "acme" / "weights.safetensors")
    assert output(model, "acme") == [[2.0] * 4]


def test_the_views_of_a_slot_read_in_place_are_read_only_memory(ram_dir):
    """A model that writes its weights faults its own process (PROT_READ), never the warm
    tier's file: the mapping is not writable."""
    layout = read_layout(weights_file(ram_dir, "base", scaler_weights(0, 0)))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    bank.fill("a", weights_file(ram_dir, "a", scaler_weights(2, 1)))
    mapping = bank.files.view(ram_dir / "a.safetensors")
    assert not mapping.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        np.copyto(mapping[:4], np.zeros(4, np.uint8))
    bank.close()


# ----------------------------------------------------------------- settling into the slot
def test_settle_copies_the_mapping_into_the_slot_and_gives_up_when_asked(ram_dir, monkeypatch):
    from model_runtime.family import slots

    monkeypatch.setattr(slots, "PART_BYTES", 4096)
    weights = {"scale": torch.arange(25_000, dtype=torch.float32), "shift": torch.ones(4)}
    layout = read_layout(weights_file(ram_dir, "base", weights))[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    bank.fill("a", weights_file(ram_dir, "a", weights))
    asked = iter([False, False, True])
    assert not bank.settle(0, lambda: next(asked))  # given up after two of 25 parts
    assert bank.reads_in_place(0)
    assert bank.settle(0)
    assert not bank.reads_in_place(0) and not bank.settle(0)
    assert torch.equal(bank.views(0)["scale"], weights["scale"])
    buffer = bank.buffers[0]
    assert buffer.data_ptr() <= bank.views(0)["scale"].data_ptr() < buffer.data_ptr() + buffer.numel()
    bank.close()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def serve(model, variant: str, batches: int, expected: list[list[float]]) -> None:
    for _ in range(batches):
        assert output(model, variant) == expected


def settle_after_batches(model) -> int:
    return sys.modules[type(model).__mro__[1].__module__].SETTLE_AFTER_BATCHES


def test_a_slot_that_goes_on_serving_is_settled_into_its_own_memory_and_batches_follow(ram_family):
    model, repo, key = ram_family
    filled = load(model, key, "acme", repo / "acme" / "weights.safetensors")
    slot = filled["slot"]
    assert filled["in_place"]
    serve(model, "acme", settle_after_batches(model) - 1, [[2.0] * 4])
    time.sleep(0.2)
    assert model.over_mapping[slot] and not model.settling  # not yet: it may be evicted soon
    assert not model.bank.has_memory(slot), "no memory of its own until it is settled"
    serve(model, "acme", 1, [[2.0] * 4])
    wait_for(lambda: not model.settling and not model.over_mapping[slot])
    assert not model.bank.reads_in_place(slot)
    buffer = model.bank.buffers[slot]
    assert buffer.data_ptr() <= model.modules[slot].scale.data_ptr() < buffer.data_ptr() + buffer.numel()
    assert output(model, "acme") == [[2.0] * 4]
    # The next fill of that slot reads in place again, and is settled again.
    again = load(model, key, "globex", repo / "globex" / "weights.safetensors", evict=["acme"])
    assert again["in_place"] and output(model, "globex") == [[100.0] * 4]
    serve(model, "globex", settle_after_batches(model), [[100.0] * 4])
    wait_for(lambda: not model.settling and not model.over_mapping[slot])
    assert output(model, "globex") == [[100.0] * 4]


def test_a_fill_of_a_slot_being_settled_makes_it_give_up_and_answers_right(ram_family):
    import threading

    model, repo, key = ram_family
    bank, settle = model.bank, model.bank.settle
    started, release = threading.Event(), threading.Event()

    def slow_settle(slot, given_up):
        started.set()
        release.wait(10)
        return settle(slot, given_up)

    bank.settle = slow_settle
    load(model, key, "acme", repo / "acme" / "weights.safetensors")
    serve(model, "acme", settle_after_batches(model), [[2.0] * 4])
    assert started.wait(10)
    done = {}
    fill = threading.Thread(target=lambda: done.update(
        load(model, key, "globex", repo / "globex" / "weights.safetensors", evict=["acme"])))
    fill.start()
    # The eviction asked the settling copy to give up; the fill waits for it to stop.
    wait_for(lambda: all(flag.is_set() for flag in model.settling.values()))
    assert fill.is_alive()
    release.set()
    fill.join(10)
    assert done["in_place"] and output(model, "globex") == [[100.0] * 4]
    bank.settle = settle
    serve(model, "globex", settle_after_batches(model), [[100.0] * 4])
    wait_for(lambda: not model.settling and not model.over_mapping[done["slot"]])
    assert output(model, "globex") == [[100.0] * 4]
