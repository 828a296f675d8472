"""On a GPU, a family's kept mappings of the warm tier are registered with CUDA so a fill is
one device copy out of them: each mapping registered once (read-only) when kept, unregistered
only between fills once forgotten and before its memory can be unmapped, and a registration
that fails turns it off (the staging path) with the failing call made on a thread of its own.

The CUDA runtime is a recording fake here (these machines have no GPU); the last test runs
the real device copy where a GPU is present."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest
import torch

from model_runtime.family import SlotBank, read_layout
from model_runtime.family.mapped_files import MappedFiles
from model_runtime.family.pinned_mappings import PinnedMappings

CUDA_HOST_REGISTER_READ_ONLY = 0x08  # the mappings are PROT_READ: registered read-only or not at all


class FakeCudart:
    """The two calls PinnedMappings makes, recorded with the thread that made them."""

    class cudaError:
        success = 0

    def __init__(self, fail_register: int | None = None):
        self.fail_register = fail_register  # an error code for every registration
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes, flags, threading.current_thread().name))
        if self.fail_register is not None:
            return self.fail_register
        self.registered[address] = nbytes
        return self.cudaError.success

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address, threading.current_thread().name))
        return self.cudaError.success if self.registered.pop(address, None) else 712

    def cudaGetErrorString(self, error):
        return {801: "operation not supported"}.get(error, "unknown error")


def write(path, data: bytes):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.rename(tmp, path)
    return path


@pytest.fixture
def pinned_files():
    cudart = FakeCudart()
    pinned = PinnedMappings(lambda: cudart)
    files = MappedFiles(max_bytes=3000, sweep_s=None, on_keep=pinned.keep, on_forget=pinned.forget)
    yield cudart, pinned, files
    files.close()
    pinned.close()


def address(array) -> int:
    return array.__array_interface__["data"][0]


def test_a_kept_mapping_is_registered_once_read_only(tmp_path, pinned_files):
    cudart, pinned, files = pinned_files
    path = write(tmp_path / "a", b"a" * 1000)
    mapping = files.view(path)
    assert files.view(path) is mapping and pinned.holds(mapping)
    (op, where, nbytes, flags, thread), = cudart.calls
    assert (op, where, nbytes) == ("register", address(mapping), 1000)
    assert flags & CUDA_HOST_REGISTER_READ_ONLY
    assert thread.startswith("slot-pin")  # not the caller's thread


def test_a_forgotten_mapping_stays_registered_and_mapped_until_released(tmp_path, pinned_files):
    cudart, pinned, files = pinned_files
    path = write(tmp_path / "a", b"a" * 1000)
    old = files.view(path)
    old_address, gone = address(old), weakref.ref(old)
    write(path, b"b" * 1000)  # replaced: the next view maps the new file
    new = files.view(path)
    del old
    gc.collect()
    # A copy may still read the old mapping: registered and alive until the next fill.
    assert gone() is not None and cudart.registered.keys() == {old_address, address(new)}
    assert pinned.release_forgotten() == 1
    assert ("unregister", old_address, cudart.calls[-1][2]) == cudart.calls[-1]
    gc.collect()
    assert gone() is None  # nothing holds it any more: unmapped after it was unregistered
    assert cudart.registered.keys() == {address(new)} and pinned.holds(new)


def test_mappings_beyond_the_bound_and_at_close_are_unregistered(tmp_path, pinned_files):
    cudart, pinned, files = pinned_files
    paths = [write(tmp_path / n, n.encode() * 1000) for n in "abcd"]
    for path in paths:
        files.view(path)  # the fourth pushes the first out (3000 bytes kept at most)
    assert len(cudart.registered) == 4 and pinned.release_forgotten() == 1
    assert len(cudart.registered) == 3 and len(pinned) == 3
    files.close()
    pinned.close()
    assert cudart.registered == {} and len(pinned) == 0


def test_a_registration_that_fails_turns_registration_off_and_says_why(tmp_path, caplog):
    cudart = FakeCudart(fail_register=801)
    pinned = PinnedMappings(lambda: cudart)
    files = MappedFiles(sweep_s=None, on_keep=pinned.keep, on_forget=pinned.forget)
    try:
        first = files.view(write(tmp_path / "a", b"a" * 100))
        files.view(write(tmp_path / "b", b"b" * 100))
        assert not pinned.holds(first)
        assert pinned.disabled == "operation not supported (cudaError 801)"
        assert [c[0] for c in cudart.calls] == ["register"]  # not tried again
        assert cudart.calls[0][4].startswith("slot-pin")
        assert "staging buffer" in caplog.text and "operation not supported" in caplog.text
    finally:
        files.close()
        pinned.close()


def test_without_a_cuda_runtime_registration_is_off(tmp_path):
    def no_runtime():
        raise RuntimeError("Torch not compiled with CUDA enabled")

    pinned = PinnedMappings(no_runtime)
    files = MappedFiles(sweep_s=None, on_keep=pinned.keep, on_forget=pinned.forget)
    try:
        assert not pinned.holds(files.view(write(tmp_path / "a", b"a" * 100)))
        assert "not compiled with CUDA" in pinned.disabled
    finally:
        files.close()
        pinned.close()


def test_a_cpu_bank_registers_nothing(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "v.safetensors"
    save_file({"w": torch.arange(100, dtype=torch.float32)}, str(path))
    bank = SlotBank(read_layout(path)[0], 1, torch.device("cpu"))
    try:
        bank.fill("v", path)
        assert bank.pinned is None and torch.equal(bank.views(0)["w"], torch.arange(100.0))
    finally:
        bank.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run by bench/device_run.sh)")
def test_a_gpu_fill_copies_straight_out_of_the_registered_mapping(tmp_path):
    from safetensors.torch import save_file

    paths = []
    for i in range(3):
        paths.append(tmp_path / f"v{i}.safetensors")
        save_file({"w": torch.full((1 << 20,), float(i + 1))}, str(paths[-1]))
    layout = read_layout(paths[0])[0]
    bank = SlotBank(layout, 2, torch.device("cuda"))
    try:
        for round_ in range(2):
            for i, path in enumerate(paths):
                bank.release(f"v{(i - 2) % 3}")
                bank.fill(f"v{i}", path)
                assert torch.equal(bank.views(bank.slot_of[f"v{i}"])["w"].cpu(),
                                   torch.full((1 << 20,), float(i + 1)))
        assert bank.pinned.disabled is None, bank.pinned.disabled
        assert len(bank.pinned) == 3 and bank._staging is None  # no staging buffer was needed
    finally:
        bank.close()
    assert len(bank.pinned) == 0
