"""Metadata and configuration of a model that is not loaded, from its config.pbtxt.

Answering these calls must not load the model (a public call would otherwise load models
and evict others), so the router reads the model's folder in Triton's repository and
answers in the shapes Triton uses for a loaded model: the metadata Triton derives from the
configuration, and the configuration itself.  Triton fills in defaults when it loads a
model (instance group names, optimization settings); a configuration read from the file
has only what the file says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor, text_format
from tritonclient.grpc import model_config_pb2, service_pb2

CONFIG_FILE = "config.pbtxt"


@dataclass(frozen=True)
class FolderConfig:
    config: model_config_pb2.ModelConfig
    versions: tuple[str, ...]  # numbered version folders, ascending


def read_folder(folder: Path) -> FolderConfig | None:
    """The parsed config.pbtxt and version folders of one model, or None when the folder has
    no configuration Triton could load (missing, unreadable or not a ModelConfig).
    Blocking: call it in a thread."""
    try:
        text = (folder / CONFIG_FILE).read_text()
        versions = sorted((p.name for p in folder.iterdir() if p.name.isdigit() and p.is_dir()), key=int)
    except (OSError, UnicodeDecodeError):
        return None
    config = model_config_pb2.ModelConfig()
    try:
        # Fields newer than this client's schema are skipped, as in registry.check_model_config.
        text_format.Parse(text, config, allow_unknown_field=True)
    except text_format.ParseError:
        return None
    return FolderConfig(config, tuple(versions))


def _datatype(data_type: int) -> str:
    """``TYPE_FP32`` -> ``FP32``; Triton's metadata calls TYPE_STRING ``BYTES``."""
    name = model_config_pb2.DataType.Name(data_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def metadata_from_config(config: model_config_pb2.ModelConfig, name: str,
                         versions: list[str]) -> service_pb2.ModelMetadataResponse:
    """The metadata Triton reports for ``config`` once loaded: a batching model's tensors get a
    leading -1 (batch) dimension, the platform is the backend when none is named."""
    batch = [-1] if config.max_batch_size > 0 else []
    response = service_pb2.ModelMetadataResponse(name=name, versions=versions,
                                                 platform=config.platform or config.backend)
    for tensors, out in ((config.input, response.inputs), (config.output, response.outputs)):
        for tensor in tensors:
            out.add(name=tensor.name, datatype=_datatype(tensor.data_type),
                    shape=[*batch, *tensor.dims])
    return response


def triton_json(message) -> dict:
    """A protobuf message as Triton's HTTP API writes it: every scalar and list (defaults
    included), numbers as JSON numbers (protobuf's JSON mapping writes 64-bit integers as
    strings), enums by name, message fields only when set."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _json_value(value_field, v) for k, v in value.items()}
        elif field.label == descriptor.FieldDescriptor.LABEL_REPEATED:
            out[field.name] = [_json_value(field, v) for v in value]
        elif field.message_type is not None or field.containing_oneof is not None:
            if message.HasField(field.name):
                out[field.name] = _json_value(field, value)
        else:
            out[field.name] = _json_value(field, value)
    return out


def _json_value(field, value):
    if field.message_type is not None:
        return triton_json(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    return value
