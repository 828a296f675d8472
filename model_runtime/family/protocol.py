"""The names a family model, the control plane and the router agree on.  Plain constants:
the router imports them without importing torch."""

CONTROL_PARAMETER = "mms_family_control"  # request parameter: a JSON control command
VARIANT_PARAMETER = "mms_variant"  # request parameter: the variant a request is for
STATUS_OUTPUT = "MMS_FAMILY_STATUS"  # output: the JSON answer to a control command
SLOTS_PARAMETER = "mms_family_slots"  # config parameter: slots, sent with each load
LAYOUT_FILE = "family.json"  # in the family's model folder: the slot layout
# In Triton's repository (beside the family folders), readable by its owner only: the key
# every control command carries.  A dot file: Triton never lists it as a model.
CONTROL_KEY_FILE = ".mms-family-key"
# Triton's own words for a model it does not hold; the router recognizes them.
UNKNOWN_MODEL_PREFIX = "Request for unknown model"
