"""Adapter names and LoRA bases: what an adapter may be called and which models take adapters.

Pure apart from ``describe_base``, which reads a base's config.pbtxt and lists its version
folders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from domain import model_config
from domain.errors import InvalidInput, ModelNotFound
from domain.names import validate_model_name
from model_runtime.lora.peft_files import CONFIG_FILE, WEIGHTS_FILE

PEFT_FILES = (CONFIG_FILE, WEIGHTS_FILE)
CONTROL_INPUT = "ADAPTER_CONTROL"
DEFAULT_ADAPTER_DIR = "adapters"
DEFAULT_MAX_RANK = 16
LABEL_SEPARATOR = "/"


def adapter_name(name: object) -> str:
    """``name`` if it is a valid adapter name (the model-name alphabet), else InvalidInput."""
    try:
        return validate_model_name(name)
    except InvalidInput as exc:
        raise InvalidInput(exc.message.replace("model name", "adapter name")) from None


def parse_adapter_ref(ref: object) -> tuple[str, str | None]:
    """``"acme"`` -> ``("acme", None)``; ``"support-bot/acme"`` -> ``("acme", "support-bot/acme")``.

    An adapter is served, pinned and selected (``adapter=acme``, ``tinylm:acme``) by a plain
    name, because the name becomes a directory and a request parameter.  A reference with
    ``/`` is a display label whose last segment is that name; every segment must be valid."""
    if not isinstance(ref, str) or not ref:
        raise InvalidInput("adapter name must be a non-empty string")
    if LABEL_SEPARATOR not in ref:
        return adapter_name(ref), None
    segments = ref.split(LABEL_SEPARATOR)
    for segment in segments:
        if not segment:
            raise InvalidInput(f"adapter label {ref!r} has an empty segment; write owner/name, e.g. "
                               "support-bot/acme")
        try:
            adapter_name(segment)
        except InvalidInput:
            raise InvalidInput(
                f"adapter label {ref!r} is invalid: each '/'-separated part must use letters, digits, "
                "'_', '-' and '.'; the last part is the adapter's name (support-bot/acme is served "
                "as acme)") from None
    return segments[-1], ref


def parse_model_config(text: str, where: str = model_config.CONFIG_FILE) -> tuple[set[str], dict[str, str]]:
    """Input names and string parameters of a config.pbtxt (the subset this module needs);
    InvalidInput naming ``where`` when Triton could not parse it either.

    Only read, never written back: fields a newer Triton added may stay unknown here."""
    config = model_config.parse_config(text, where, allow_unknown_fields=True)
    return model_config.input_names(config), model_config.string_parameters(config)


@dataclass(frozen=True)
class LoraBase:
    """A LoRA base model folder in Triton's repository."""

    name: str
    folder: Path
    kind: str  # "tinylm" | "recommender"
    adapter_dir: Path
    max_rank: int
    weights: Path


def describe_base(repository: Path, name: str) -> LoraBase:
    """Raise ModelNotFound for a missing folder, InvalidInput for a model that is not a
    LoRA base (no ADAPTER_CONTROL input), with what to do instead."""
    validate_model_name(name)
    folder = repository / name
    config = folder / "config.pbtxt"
    try:
        text = config.read_text()
    except FileNotFoundError:
        raise ModelNotFound(f"unknown base model {name!r}: no {config}; `mmctl status --all` "
                            "lists the models") from None
    inputs, params = parse_model_config(text, str(config))
    if CONTROL_INPUT not in inputs:
        raise InvalidInput(f"{name} is not a LoRA base model (its config has no {CONTROL_INPUT} "
                           "input); adapters go to a LoRA base such as tinylm or recommender_lora")
    kind = "tinylm" if "TEXT" in inputs else "recommender" if "FEATURES" in inputs else None
    if kind is None:
        raise InvalidInput(f"{name} has an {CONTROL_INPUT} input but neither TEXT nor FEATURES: "
                           "this control plane does not know its layers")
    adapter_dir = Path(params.get("adapter_dir") or DEFAULT_ADAPTER_DIR)
    if not adapter_dir.is_absolute():
        adapter_dir = folder / adapter_dir
    try:
        max_rank = int(params.get("max_lora_rank") or DEFAULT_MAX_RANK)
    except ValueError:
        raise InvalidInput(f"{config}: max_lora_rank={params['max_lora_rank']!r} is not an integer") from None
    versions = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()),
                      key=lambda p: int(p.name))
    if not versions:
        raise InvalidInput(f"{name} has no version folder (e.g. {folder / '1'})")
    return LoraBase(name, folder, kind, adapter_dir, max_rank, versions[-1] / "weights.safetensors")
