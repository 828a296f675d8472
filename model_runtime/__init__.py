"""Code that runs inside Triton's python-backend stubs, not in the control plane.

``model_runtime.family``: the model-family runtime (fixed-size weight slots shared by the
fine-tuned variants of one architecture).  ``model_runtime.lora``: the LoRA runtime (many
adapters on one base model), copied into each LoRA base model as ``<version>/_lora``
(``control_plane.demo.lora`` writes it).  A family's model folder gets a copy of that
package as ``<version>/_mms_family`` (``control_plane.families.folders`` writes it), so a
Triton model folder stays self-contained; this package therefore imports nothing from the
control plane or the router.
"""
