"""A family's fills copy out of the variants' files kept mapped: the same file is mapped
once, a file replaced by a rename is read anew, a removed one is unmapped by the sweep, and
the bytes kept mapped stay within their bound."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from model_runtime.family import SlotBank, read_layout
from model_runtime.family.mapped_files import MappedFiles


def write(path, data: bytes):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.rename(tmp, path)  # as the warm tier and the control plane replace files
    return path


@pytest.fixture
def files():
    mapped = MappedFiles(max_bytes=3000, sweep_s=None)
    yield mapped
    mapped.close()


def test_a_file_is_mapped_once_and_read_anew_once_replaced(tmp_path, files):
    path = write(tmp_path / "a", b"a" * 1000)
    first = files.view(path)
    assert bytes(first) == b"a" * 1000 and files.view(path) is first  # kept
    with pytest.raises(ValueError):
        first[0] = 1  # read-only: a fill cannot write the warm tier
    write(path, b"b" * 1000)
    assert bytes(files.view(path)) == b"b" * 1000
    assert bytes(first) == b"a" * 1000  # a copy still reading the old one reads it whole
    assert len(files) == 1 and files.mapped_bytes == 1000


def test_the_least_recently_used_go_beyond_the_bound(tmp_path, files):
    paths = [write(tmp_path / name, name.encode() * 1000) for name in "abcd"]
    for path in paths[:3]:
        files.view(path)
    files.view(paths[0])  # a is used again: b is the oldest
    files.view(paths[3])
    assert files.mapped_bytes == 3000 and len(files) == 3
    again = files.view(paths[1])  # mapped anew, the oldest (c) goes
    assert bytes(again) == b"b" * 1000 and files.mapped_bytes == 3000


def test_the_sweep_unmaps_files_gone_or_replaced(tmp_path, files):
    gone = write(tmp_path / "gone", b"g" * 100)
    replaced = write(tmp_path / "replaced", b"r" * 100)
    kept = write(tmp_path / "kept", b"k" * 100)
    for path in (gone, replaced, kept):
        files.view(path)
    gone.unlink()
    write(replaced, b"R" * 200)
    assert files.sweep() == 2
    assert len(files) == 1 and files.mapped_bytes == 100


def test_a_slot_filled_again_after_its_file_was_replaced_holds_the_new_weights(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "v.safetensors"
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(tmp_path / "first"))
    os.rename(tmp_path / "first", path)
    layout = read_layout(path)[0]
    bank = SlotBank(layout, 1, torch.device("cpu"))
    try:
        bank.fill("v", path)
        assert torch.equal(bank.views(0)["w"], torch.arange(1000, dtype=torch.float32))
        save_file({"w": -torch.arange(1000, dtype=torch.float32)}, str(tmp_path / "second"))
        os.rename(tmp_path / "second", path)
        bank.release("v")
        bank.fill("v", path)
        assert torch.equal(bank.views(0)["w"], -torch.arange(1000, dtype=torch.float32))
        assert len(bank.files) == 1  # the first file's mapping was let go
    finally:
        bank.close()


def test_an_empty_or_missing_file_is_an_error_not_a_mapping(tmp_path, files):
    with pytest.raises(ValueError):
        files.view(write(tmp_path / "empty", b""))
    with pytest.raises(FileNotFoundError):
        files.view(tmp_path / "missing")
    assert len(files) == 0 and np.asarray(files.mapped_bytes) == 0
