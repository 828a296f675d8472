"""The models Triton's example clients (triton-inference-server/client, src/python/examples)
call, as python-backend models: ``simple`` (INT32), ``simple_int8``, ``simple_string``
(numbers as BYTES) and ``simple_identity`` (BYTES echoed).  Each takes INPUT0 and INPUT1 of
16 elements in batches of up to 8 and answers OUTPUT0 = sum and OUTPUT1 = difference, as
the examples check; the model code is this suite's own (tests/fixtures/models)."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "models"

ADD_SUB_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 8
input [
  {{ name: "INPUT0" data_type: {dtype} dims: [ 16 ] }},
  {{ name: "INPUT1" data_type: {dtype} dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: {dtype} dims: [ 16 ] }},
  {{ name: "OUTPUT1" data_type: {dtype} dims: [ 16 ] }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

IDENTITY_CONFIG = """name: "simple_identity"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

IDENTITY_MODEL = '''"""OUTPUT0 = INPUT0, whatever its bytes."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                for r in requests]
'''

EXAMPLE_MODELS = ("simple", "simple_int8", "simple_string", "simple_identity")


def write_example_repository(dest: Path) -> Path:
    """The four example models in Triton repository ``dest``; returns ``dest``."""
    for name, dtype, code in (("simple", "TYPE_INT32", FIXTURES / "simple"),
                              ("simple_int8", "TYPE_INT8", FIXTURES / "simple"),
                              ("simple_string", "TYPE_STRING", FIXTURES / "strings")):
        (dest / name / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy(code / "1" / "model.py", dest / name / "1" / "model.py")
        (dest / name / "config.pbtxt").write_text(ADD_SUB_CONFIG.format(name=name, dtype=dtype))
    (dest / "simple_identity" / "1").mkdir(parents=True, exist_ok=True)
    (dest / "simple_identity" / "1" / "model.py").write_text(IDENTITY_MODEL)
    (dest / "simple_identity" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    return dest
