"""tinylm: a byte-level causal LM that serves many LoRA adapters in mixed batches.

Text in (``TEXT``, one prompt per row), greedy continuation out (``GENERATED_TEXT``).
The budget is input ``MAX_NEW_TOKENS`` or request parameter ``max_new_tokens``; the adapter
is request parameter ``adapter`` or input ``ADAPTER`` (none = the base model).  The LoRA
runtime is the ``_lora`` package next to this file (a copy of ``model_runtime/lora`` made by
``control_plane/demo/lora.py``); see README.md for adapters, control and errors.
"""

import os

import numpy as np
import triton_python_backend_utils as pb_utils
from _lora.models import load_tinylm
from _lora.runtime import parse_text_request, tinylm_runner
from _lora.triton_glue import LoraTritonModel, input_array

WEIGHTS_FILE = "weights.safetensors"


class TritonPythonModel(LoraTritonModel):
    def build(self, version_dir):
        self.lm = load_tinylm(os.path.join(version_dir, WEIGHTS_FILE))
        return self.lm, tinylm_runner(self.lm)

    def parse(self, request, parameters):
        payload = parse_text_request(
            self.lm,
            self.settings,
            input_array(request, "TEXT"),
            input_array(request, "MAX_NEW_TOKENS"),
            parameters,
        )
        return payload, len(payload.prompts)

    def outputs(self, texts):
        return [pb_utils.Tensor("GENERATED_TEXT", np.array(texts, dtype=object).reshape(-1, 1))]
