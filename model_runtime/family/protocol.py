"""The names a family model, the control plane and the router agree on.  Plain constants:
the router imports them without importing torch."""

__all__ = ["CONTROL_KEY_FILE", "CONTROL_PARAMETER", "LAYOUT_FILE", "SLOTS_PARAMETER",
           "STATUS_OUTPUT", "UNKNOWN_MODEL_PREFIX", "VARIANT_PARAMETER"]

CONTROL_PARAMETER = "mms_family_control"  # request parameter: a JSON control command
VARIANT_PARAMETER = "mms_variant"  # request parameter: the variant a request is for
STATUS_OUTPUT = "MMS_FAMILY_STATUS"  # output: the JSON answer to a control command
SLOTS_PARAMETER = "mms_family_slots"  # config parameter: slots, sent with each load
LAYOUT_FILE = "family.json"  # in the family's model folder: the slot layout
try:  # the key every control command carries (the copy in a model folder carries this file)
    from .control_socket import CONTROL_KEY_FILE
except ImportError:  # the source tree
    from ..control_socket import CONTROL_KEY_FILE
# Triton's own words for a model it does not hold; the router recognizes them.
UNKNOWN_MODEL_PREFIX = "Request for unknown model"
