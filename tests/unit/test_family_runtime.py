"""The family runtime's execute() without Triton: a stand-in for triton_python_backend_utils,
a user-style family over real slots.  Control commands in a batch, their key, and one
group's failure."""

from __future__ import annotations

import json
import os
import socket
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from control_plane.families import FamilyCatalog, write_family, write_variant

SCALER = Path(__file__).resolve().parents[1] / "fixtures" / "families" / "scaler"


class TritonError:
    INVALID_ARG, NOT_FOUND, UNAVAILABLE, INTERNAL = "INVALID_ARG", "NOT_FOUND", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, np.asarray(array)

    def as_numpy(self):
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs, self.error = {t.name: t.array for t in output_tensors}, error


class Request:
    def __init__(self, params: dict, x: np.ndarray | None = None):
        self.params, self.x = params, x

    def parameters(self):
        return json.dumps(self.params)


@pytest.fixture
def pb_utils(monkeypatch):
    module = types.ModuleType("triton_python_backend_utils")
    module.TritonError, module.Tensor, module.InferenceResponse = TritonError, Tensor, InferenceResponse
    module.get_input_tensor_by_name = lambda request, name: Tensor(name, request.x)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


@pytest.fixture
def family(tmp_path, pb_utils, monkeypatch):
    model, repo, catalog_key = scaler_family(tmp_path, monkeypatch)
    yield model, repo, catalog_key
    model.finalize()


def scaler_family(tmp_path: Path, monkeypatch, slots: int = 1):
    """The scaler family's own model.py, initialized as Triton would, with ``slots``, its
    repository in ``tmp_path`` (needs ``pb_utils``); the caller finalizes it."""
    base = tmp_path / "base.safetensors"
    save_file({"scale": torch.ones(4), "shift": torch.zeros(4)}, str(base))
    repo = tmp_path / "repo"
    catalog_key = FamilyCatalog(repo).control_key  # writes the key beside the families
    write_family(repo, "scaler", config_text=(SCALER / "config.pbtxt").read_text(),
                 version_files=SCALER / "1", base_weights=base)
    for name, scale in (("acme", 2.0), ("globex", 100.0)):
        write_variant(repo, name, "scaler", {"scale": torch.full((4,), scale), "shift": torch.zeros(4)})
    monkeypatch.syspath_prepend(str(repo / "scaler" / "1"))
    for mod in [m for m in sys.modules if m == "_mms_family" or m.startswith("_mms_family.")]:
        monkeypatch.delitem(sys.modules, mod)
    source = (repo / "scaler" / "1" / "model.py").read_text()
    namespace: dict = {}
    exec(compile(source, "model.py", "exec"), namespace)  # noqa: S102  (the family's own file)
    model = namespace["TritonPythonModel"]()
    config = {"name": "scaler", "instance_group": [{"count": 1}],
              "parameters": {"forward_delay_s": {"string_value": "0"},
                             "mms_family_slots": {"string_value": str(slots)}}}
    model.initialize({"model_config": json.dumps(config), "model_repository": str(repo / "scaler"),
                      "model_version": "1", "model_instance_kind": "CPU"})
    return model, repo, catalog_key


def control(key, op, **fields):
    return Request({"mms_family_control": json.dumps({"op": op, "key": key, **fields})},
                   np.zeros((1, 4), np.float32))


def infer(variant):
    return Request({"mms_variant": variant}, np.ones((1, 4), np.float32))


def test_a_swap_in_the_same_batch_never_answers_a_request_with_the_new_weights(family):
    model, repo, key = family
    model.execute([control(key, "load", variant="acme", path=str(repo / "acme" / "weights.safetensors"))])
    assert model.execute([infer("acme")])[0].outputs["OUTPUT0"].tolist() == [[2.0] * 4]
    # One dynamic batch: a request for acme, then acme's slot given to globex.
    out = model.execute([infer("acme"), control(key, "evict", variant="acme"),
                         control(key, "load", variant="globex",
                                 path=str(repo / "globex" / "weights.safetensors"))])
    assert out[0].error is not None and out[0].error.code == "NOT_FOUND"
    assert out[0].error.message.startswith("Request for unknown model: 'acme'")
    assert model.execute([infer("globex")])[0].outputs["OUTPUT0"].tolist() == [[100.0] * 4]


def test_elastic_slots_hold_memory_only_while_a_variant_fills_them(tmp_path, pb_utils, monkeypatch):
    """A slot's memory is allocated by its first fill and returned by an evict (the control
    plane gave its room to something else); a swap (evict and fill in one command) reuses
    the evicted slot's memory; a batch reading a slot when its memory is returned answers
    from the weights it started with."""
    model, repo, key = scaler_family(tmp_path, monkeypatch, slots=2)

    def fill(variant, evict=()):
        answer = model.command(json.dumps({"op": "load", "key": key, "variant": variant,
                                           "path": str(repo / variant / "weights.safetensors"),
                                           "evict": list(evict)}))
        return answer["slot"]

    def out(variant):
        (response,) = model.execute([infer(variant)])
        return response.error.code if response.error is not None else response.outputs["OUTPUT0"].tolist()

    try:
        assert model.bank.allocated == 0 and model.bank.nbytes == 0, "no memory before a variant"
        fill("acme")
        assert model.bank.allocated == 1 and out("acme") == [[2.0] * 4]
        globex_slot = fill("globex")
        assert model.bank.allocated == 2 and out("globex") == [[100.0] * 4]
        model.command(json.dumps({"op": "evict", "key": key, "variant": "acme"}))
        assert model.bank.allocated == 1 and out("acme") == "NOT_FOUND"
        assert out("globex") == [[100.0] * 4]
        buffer = model.bank.buffers[globex_slot].data_ptr()
        assert fill("acme", evict=["globex"]) == globex_slot, "the swap takes the evicted slot"
        assert model.bank.allocated == 1 and model.bank.buffers[globex_slot].data_ptr() == buffer
        assert out("acme") == [[2.0] * 4] and out("globex") == "NOT_FOUND"
        assert json.loads(model.execute([control(key, "status")])[0]
                          .outputs["MMS_FAMILY_STATUS"][0][0])["allocated"] == 1
        # An evict (from the control socket) while a batch reads the slot: the batch keeps
        # its module and the memory under it until it ends.
        forward = model.forward

        def evicted_meanwhile(module, batch):
            model.command(json.dumps({"op": "evict", "key": key, "variant": "acme"}))
            return forward(module, batch)

        model.forward = evicted_meanwhile
        assert out("acme") == [[2.0] * 4]
        model.forward = forward
        assert model.bank.allocated == 0 and out("acme") == "NOT_FOUND"
    finally:
        model.finalize()


def test_control_without_the_key_is_refused_and_changes_nothing(family):
    model, repo, _key = family
    out = model.execute([control("guess", "load", variant="acme",
                                 path=str(repo / "acme" / "weights.safetensors"))])
    assert out[0].error.code == "INVALID_ARG" and "key" in out[0].error.message
    assert model.bank.slot_of == {}


def test_a_failing_forward_fails_its_own_requests_only(family):
    model, repo, key = family
    model.execute([control(key, "load", variant="acme", path=str(repo / "acme" / "weights.safetensors"))])
    model.forward = lambda module, batch: (_ for _ in ()).throw(RuntimeError("kernel fault"))
    out = model.execute([infer("acme"), control(key, "status"), infer("nobody")])
    assert out[0].error.code == "INTERNAL" and "kernel fault" in out[0].error.message
    assert json.loads(out[1].outputs["MMS_FAMILY_STATUS"][0][0])["resident"] == {"acme": 0}
    assert out[2].error.code == "NOT_FOUND"


def test_a_failed_fill_names_the_command_but_never_its_key(family):
    """An I/O error in the middle of a fill answers with the operation and the variant: the
    error becomes the model's failure text, which clients and health checks see."""
    model, repo, key = family

    def failing_read(*args, **kwargs):
        raise OSError(5, "Input/output error")

    model.bank._read_into = failing_read
    out = model.execute([control(key, "load", variant="acme",
                                 path=str(repo / "acme" / "weights.safetensors"))])
    assert out[0].error is not None and out[0].error.code == "INTERNAL"
    assert "'load' of 'acme'" in out[0].error.message and "Input/output error" in out[0].error.message
    assert key not in out[0].error.message
    assert model.bank.slot_of == {}


def test_a_key_file_other_users_can_read_opens_no_slot(family):
    model, repo, key = family
    (repo / ".mms-family-key").chmod(0o644)
    model.initialize({"model_config": json.dumps({"name": "scaler", "instance_group": [{"count": 1}],
                                                  "parameters": {"forward_delay_s": {"string_value": "0"},
                                                                 "mms_family_slots": {"string_value": "1"}}}),
                      "model_repository": str(repo / "scaler"), "model_version": "1",
                      "model_instance_kind": "CPU"})
    out = model.execute([control(key, "load", variant="acme", path=str(repo / "acme" / "weights.safetensors"))])
    assert out[0].error.code == "INVALID_ARG" and "key" in out[0].error.message
    assert model.bank.slot_of == {}
    # The control plane does not trust it either: it writes a new, owner-only key.
    fresh = FamilyCatalog(repo).control_key
    assert fresh != key and (repo / ".mms-family-key").stat().st_mode & 0o077 == 0


# --------------------------------------------------------------------------- the control socket
def connect(model) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect("\0" + model.control_socket)
    return conn


def ask(conn: socket.socket, command: dict | bytes) -> dict | None:
    """One command and its answer; None when the family closed the connection.  A broken
    pipe or a reset is raised, never taken for an answer: a test that expects one says so."""
    conn.sendall(command if isinstance(command, bytes) else json.dumps(command).encode() + b"\n")
    line = conn.makefile("rb").readline()
    return json.loads(line) if line else None


def test_the_control_socket_fills_with_the_key_and_refuses_without_it(family):
    model, repo, key = family
    assert model.status()["control_socket"] == model.control_socket
    with connect(model) as conn:
        refused = ask(conn, {"op": "load", "key": "guess", "variant": "acme",
                             "path": str(repo / "acme" / "weights.safetensors")})
        assert refused["code"] == "INVALID_ARG" and "key" in refused["error"]
        assert model.bank.slot_of == {}
        answer = ask(conn, {"op": "load", "key": key, "variant": "acme",
                            "path": str(repo / "acme" / "weights.safetensors")})
        assert answer["resident"] == {"acme": 0} and key not in json.dumps(answer)
    assert model.execute([infer("acme")])[0].outputs["OUTPUT0"].tolist() == [[2.0] * 4]


def test_an_oversize_control_command_is_refused_before_it_is_read_whole(family):
    from model_runtime.family.triton_model import MAX_COMMAND_BYTES

    model, _repo, key = family
    with connect(model) as conn:
        # The first MAX_COMMAND_BYTES + 1 bytes of a longer command, and no more: the family
        # must refuse it from those (it cannot read the rest, which never comes), and since
        # it is left nothing unread, it closes without a reset.  A broken pipe or a reset
        # fails the test: only the family's own answer passes it.
        huge = json.dumps({"op": "status", "key": key, "pad": "x" * MAX_COMMAND_BYTES}).encode()
        answer = ask(conn, huge[:MAX_COMMAND_BYTES + 1])
        assert answer == {"error": "control command too long", "code": "INVALID_ARG"}
        assert conn.recv(1) == b""  # and the connection is closed


def test_after_finalize_the_control_socket_is_gone(family):
    model, _repo, key = family
    with connect(model) as conn:
        assert "resident" in ask(conn, {"op": "status", "key": key})  # open and served
        model.finalize()
        # The open connection is shut both ways: the end of it to read, a broken pipe to
        # write (the refusal itself, asserted: not taken for an answer, nor ignored).
        assert conn.recv(1) == b""
        with pytest.raises(BrokenPipeError):
            ask(conn, {"op": "status", "key": key})
    with pytest.raises(ConnectionRefusedError):
        connect(model)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_a_process_of_another_user_cannot_use_the_control_socket(family):
    model, _repo, key = family
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # another user, with the key in hand: still refused
        outcome = b"no outcome"
        try:
            os.setuid(65534)
            conn = connect(model)
            # Refused: closed as soon as the family sees who connected, before a command is
            # read (nothing left unread: an end of file, not a reset).  Served, it would wait
            # for a command: a timeout here.  Any other error (no socket at all) is its own
            # outcome, never taken for the refusal.
            outcome = b"closed" if conn.recv(1) == b"" else b"sent something"
            if outcome == b"closed":
                try:
                    if ask(conn, {"op": "status", "key": key}) is not None:
                        outcome = b"answered"
                except BrokenPipeError:
                    pass  # the refusal: a command cannot even be sent
        except BaseException as exc:  # noqa: BLE001  told to the parent, whatever it is
            outcome = type(exc).__name__.encode()
        finally:
            os.write(write, outcome)
            os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 100) == b"closed"
