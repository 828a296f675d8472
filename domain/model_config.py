"""Triton's config.pbtxt as a message: read, check, edit and write it with protobuf.

A model's configuration is the ``inference.ModelConfig`` message in protobuf text format.
Reading it with ``google.protobuf.text_format`` into tritonclient's ``ModelConfig`` sees
what Triton sees ('#' comments, single or double quotes, ``input [ {...} ]`` or repeated
``input {...}`` blocks, fields in any order), where a pattern over the text sees one
layout.  Edits change the message and write it out again in text format: the result is
the configuration Triton loads, without the file's comments and layout.

Fields this tritonclient's schema does not know are an error by default, as they are for
Triton itself.  A caller that only reads a few fields of a configuration written for a
newer Triton may pass ``allow_unknown_fields=True``; a caller that writes the configuration
back must not, because the unknown fields would be dropped from the copy.

Pure: no network; the functions that take a path read or write that one file.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelInstanceGroup

from domain.errors import InvalidInput

CONFIG_FILE = "config.pbtxt"

__all__ = [
    "CONFIG_FILE",
    "ModelConfig",
    "ModelInstanceGroup",
    "config_name",
    "input_names",
    "parse_config",
    "read_config",
    "render_config",
    "set_input_dims",
    "set_instance_kind",
    "set_name",
    "set_name_in_file",
    "set_parameter",
    "string_parameters",
]


def _schema_hint(error: str) -> str:
    """Advice for a field the schema lacks: the schema is tritonclient's, so say which."""
    if "has no field named" not in error:
        return ""
    try:
        version = metadata.version("tritonclient")
    except metadata.PackageNotFoundError:  # a source checkout without package metadata
        version = "installed"
    return (f" (the model configuration schema of tritonclient {version} has no such field: "
            "remove it, or upgrade tritonclient when a newer Triton added it)")


def parse_config(text: str, where: str = CONFIG_FILE, *,
                 allow_unknown_fields: bool = False) -> ModelConfig:
    """``text`` as a ModelConfig; InvalidInput naming ``where`` (the file or URI) and the
    line:column of the first error when Triton would not parse it either."""
    config = ModelConfig()
    try:
        text_format.Parse(text, config, allow_unknown_field=allow_unknown_fields)
    except text_format.ParseError as exc:
        raise InvalidInput(f"{where} is not a valid Triton model configuration: {exc}"
                           f"{_schema_hint(str(exc))}") from None
    return config


def read_config(path: Path, *, allow_unknown_fields: bool = False) -> ModelConfig:
    """The ModelConfig in the file ``path``.  FileNotFoundError passes through (what a missing
    file means is the caller's to say); an unreadable or invalid file is InvalidInput."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from None
    return parse_config(text, str(path), allow_unknown_fields=allow_unknown_fields)


def render_config(config: ModelConfig) -> str:
    """The text-format file Triton reads (fields in schema order, map keys sorted, so the
    same message always gives the same bytes)."""
    return text_format.MessageToString(config)


def config_name(config: ModelConfig) -> str | None:
    """The ``name`` the configuration gives, or None when it leaves it out (Triton then uses
    the model folder's name)."""
    return config.name or None


def set_name(config: ModelConfig, name: str) -> None:
    config.name = name


def set_parameter(config: ModelConfig, key: str, value: str) -> None:
    """``parameters { key: KEY value: { string_value: VALUE } }``, replacing one of that key."""
    config.parameters[key].string_value = value


def string_parameters(config: ModelConfig) -> dict[str, str]:
    """The ``parameters`` map as plain strings."""
    return {key: param.string_value for key, param in config.parameters.items()}


def input_names(config: ModelConfig) -> set[str]:
    return {tensor.name for tensor in config.input}


def set_input_dims(config: ModelConfig, input_name: str, dims: Iterable[int]) -> None:
    """Replace the dims of the input ``input_name``; InvalidInput when there is none."""
    for tensor in config.input:
        if tensor.name == input_name:
            tensor.dims[:] = list(dims)
            return
    raise InvalidInput(f"the model configuration {config.name or '(unnamed)'} has no input "
                       f"{input_name!r}; its inputs are {sorted(input_names(config))}")


def set_instance_kind(config: ModelConfig, from_kind: str, to_kind: str) -> None:
    """Every instance group of kind ``from_kind`` (e.g. ``KIND_CPU``) becomes ``to_kind``."""
    source = ModelInstanceGroup.Kind.Value(from_kind)
    target = ModelInstanceGroup.Kind.Value(to_kind)
    for group in config.instance_group:
        if group.kind == source:
            group.kind = target


def set_name_in_file(path: Path, name: str) -> bool:
    """Write ``name`` into the configuration file ``path``; True when the file changed.

    Triton serves a model only under the name its configuration gives (or, with none, its
    folder's), so a copy staged under another folder name carries that name.  The file is
    parsed strictly: unknown fields would be lost when it is written back."""
    path = Path(path)
    config = read_config(path)
    if config.name == name:
        return False
    set_name(config, name)
    path.write_text(render_config(config))
    return True
