"""PEFT adapter files, the manifest and model settings: parsing and refusals (no sockets)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from control_plane.demo.lora import LoraDemoSpec, base_targets, write_demo_adapter, write_lora_model
from model_runtime.lora.errors import AdapterRefused, InvalidAdapterName, InvalidRequest
from model_runtime.lora.manifest import Manifest, ManifestWatcher, read_manifest, write_manifest
from model_runtime.lora.models import TinyLMConfig
from model_runtime.lora.names import validate_adapter_name
from model_runtime.lora.peft import LoraConfig, read_adapter, target_matches, write_adapter
from model_runtime.lora.peft_files import check_adapter
from model_runtime.lora.runtime import LoraSettings, adapter_from

SPEC = LoraDemoSpec(tinylm=TinyLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64))
TINY_TARGETS = base_targets("tinylm", SPEC)
REC_TARGETS = base_targets("recommender_lora", SPEC)


def test_demo_adapter_uses_peft_key_names_and_config(tmp_path):
    path = write_demo_adapter(tmp_path, "tinylm", "acme", rank=4, spec=SPEC)
    keys = set(load_file(str(path / "adapter_model.safetensors")))
    assert "base_model.model.blocks.0.attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.blocks.0.mlp.down_proj.lora_B.weight" in keys
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == "tinylm"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging leftovers


def test_read_adapter_folds_alpha_over_r_into_b(tmp_path):
    path = write_demo_adapter(tmp_path, "tinylm", "acme", rank=4, spec=SPEC)
    raw = load_file(str(path / "adapter_model.safetensors"))
    adapter = read_adapter(path, TINY_TARGETS, max_rank=16)
    a, b_scaled = adapter.weights["blocks.0.attn.v_proj"]
    assert torch.equal(a, raw["base_model.model.blocks.0.attn.v_proj.lora_A.weight"])
    expected = raw["base_model.model.blocks.0.attn.v_proj.lora_B.weight"] * (8 / 4)
    assert torch.allclose(b_scaled, expected, atol=1e-7)
    assert adapter.rank == 4 and "lm_head" not in adapter.weights
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())


def test_peft_variants_adapter_name_in_keys_rank_pattern_and_rslora(tmp_path):
    """Keys that still carry the adapter name, per-module rank/alpha and rsLoRA scaling."""
    out_q, in_q = TINY_TARGETS["blocks.0.attn.q_proj"]
    out_h, in_h = TINY_TARGETS["lm_head"]
    tensors = {
        "base_model.model.blocks.0.attn.q_proj.lora_A.default.weight": torch.randn(4, in_q),
        "base_model.model.blocks.0.attn.q_proj.lora_B.default.weight": torch.randn(out_q, 4),
        "base_model.model.lm_head.lora_A.default.weight": torch.randn(2, in_h),
        "base_model.model.lm_head.lora_B.default.weight": torch.randn(out_h, 2),
    }
    (tmp_path / "v").mkdir()
    save_file(tensors, str(tmp_path / "v" / "adapter_model.safetensors"))
    (tmp_path / "v" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"],
        "rank_pattern": {"lm_head": 2}, "alpha_pattern": {"lm_head": 3}, "use_rslora": True,
    }))
    adapter = read_adapter(tmp_path / "v", TINY_TARGETS)
    _, b_q = adapter.weights["blocks.0.attn.q_proj"]
    _, b_h = adapter.weights["lm_head"]
    q_b = tensors["base_model.model.blocks.0.attn.q_proj.lora_B.default.weight"]
    h_b = tensors["base_model.model.lm_head.lora_B.default.weight"]
    assert torch.allclose(b_q, q_b * (8 / math.sqrt(4)), atol=1e-6)
    assert torch.allclose(b_h, h_b * (3 / math.sqrt(2)), atol=1e-6)


def test_target_module_matching_follows_peft():
    assert target_matches(["q_proj"], "blocks.0.attn.q_proj")
    assert not target_matches(["proj"], "blocks.0.attn.q_proj")  # suffix must be a whole name
    assert target_matches(r"blocks\.\d+\.attn\.(q|v)_proj", "blocks.3.attn.v_proj")
    assert not target_matches(r"attn\.q_proj", "blocks.0.attn.q_proj")  # regex: full match
    assert target_matches("all-linear", "blocks.0.mlp.up_proj", ["lm_head"])
    assert not target_matches("all-linear", "lm_head", ["lm_head"])


def _adapter(tmp_path, name="bad", config=None, tensors=None):
    path = tmp_path / name
    path.mkdir()
    out_q, in_q = TINY_TARGETS["blocks.0.attn.q_proj"]
    if config is None:
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    if tensors is None:
        tensors = {
            "base_model.model.blocks.0.attn.q_proj.lora_A.weight": torch.randn(4, in_q),
            "base_model.model.blocks.0.attn.q_proj.lora_B.weight": torch.randn(out_q, 4),
        }
    if config != "skip":
        (path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors != "skip":
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _cfg(**changes):
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    base.update(changes)
    return base


Q_A = "base_model.model.blocks.0.attn.q_proj.lora_A.weight"
Q_B = "base_model.model.blocks.0.attn.q_proj.lora_B.weight"
OUT, IN = TINY_TARGETS["blocks.0.attn.q_proj"]

REFUSALS = [
    # (case, config, tensors, words the reason must contain)
    ("no config", "skip", None, ["adapter_config.json", "missing"]),
    ("config not json", "{not json", None, ["not valid JSON"]),
    ("config not object", "[1, 2]", None, ["JSON object"]),
    ("r missing", {"peft_type": "LORA", "lora_alpha": 8}, None, ["'r'"]),
    ("r zero", _cfg(r=0), None, ["'r'"]),
    ("other peft type", _cfg(peft_type="IA3"), None, ["IA3"]),
    ("dora", _cfg(use_dora=True), None, ["DoRA"]),
    ("bias", _cfg(bias="all"), None, ["bias"]),
    ("modules_to_save", _cfg(modules_to_save=["lm_head"]), None, ["modules_to_save"]),
    ("no weights", None, "skip", ["adapter_model.safetensors", "missing"]),
    ("unexpected key", None, {"model.q_proj.weight": torch.zeros(2, 2)}, ["unexpected tensor"]),
    ("embedding lora", None, {"base_model.model.embed.lora_embedding_A": torch.zeros(4, 2)}, ["embedding"]),
    ("A without B", None, {Q_A: torch.zeros(4, IN)}, ["no lora_B"]),
    ("rank differs from r", None, {Q_A: torch.zeros(2, IN), Q_B: torch.zeros(OUT, 2)}, ["shape mismatch"]),
    ("wrong in_features", None, {Q_A: torch.zeros(4, IN + 1), Q_B: torch.zeros(OUT, 4)}, ["shape mismatch"]),
    ("nan", None, {Q_A: torch.full((4, IN), float("nan")), Q_B: torch.zeros(OUT, 4)}, ["NaN"]),
    ("integer tensors", None, {Q_A: torch.zeros(4, IN, dtype=torch.int32), Q_B: torch.zeros(OUT, 4, dtype=torch.int32)}, ["floating point"]),
    ("float8 tensors", None, {Q_A: torch.zeros(4, IN).to(torch.float8_e4m3fn),
                              Q_B: torch.zeros(OUT, 4).to(torch.float8_e4m3fn)}, ["floating point"]),
    # Finite weights that overflow once scaled by alpha / r are infinite where they are served.
    ("alpha overflows", _cfg(lora_alpha=1e300), {Q_A: torch.ones(4, IN), Q_B: torch.ones(OUT, 4)},
     ["overflow once scaled"]),
    ("alpha_pattern NaN", ('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": '
                           '["q_proj"], "alpha_pattern": {"q_proj": NaN}}'), None, ["alpha_pattern", "finite"]),
    ("target_modules not a regex", _cfg(target_modules="("), None,
     ["target_modules pattern '('", "not a regular expression"]),
    ("rank_pattern key not a regex", _cfg(rank_pattern={"(": 4}), None, ["rank_pattern pattern"]),
    ("pattern too long", _cfg(target_modules="q" * 300), None, ["at most 256 characters"]),
    ("unknown module", None, {
        "base_model.model.blocks.7.attn.q_proj.lora_A.weight": torch.zeros(4, IN),
        "base_model.model.blocks.7.attn.q_proj.lora_B.weight": torch.zeros(OUT, 4),
    }, ["not a linear layer", "another base"]),
]


# The model's reader (torch) and the control plane's check (numpy): the same refusals.
READERS = pytest.mark.parametrize("reader", [read_adapter, check_adapter], ids=["torch", "numpy"])


@READERS
@pytest.mark.parametrize("case,config,tensors,words", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_malformed_adapters_are_refused_with_the_reason(tmp_path, reader, case, config, tensors, words):
    path = _adapter(tmp_path, config=config, tensors=tensors)
    with pytest.raises(AdapterRefused) as info:
        reader(path, TINY_TARGETS, max_rank=16, base_name="tinylm")
    assert info.value.message.startswith("adapter 'bad' refused: ")
    for word in words:
        assert word in info.value.message, info.value.message


@READERS
def test_corrupt_safetensors_is_refused(tmp_path, reader):
    path = _adapter(tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(AdapterRefused, match="not a readable safetensors file"):
        reader(path, TINY_TARGETS)


@READERS
def test_pickle_only_adapter_is_refused_with_a_hint(tmp_path, reader):
    path = _adapter(tmp_path, tensors="skip")
    (path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterRefused, match="safe_serialization=True"):
        reader(path, TINY_TARGETS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_control_planes_check_finds_what_the_model_loads(tmp_path, dtype):
    """check_adapter reads the factors without torch, bfloat16 included: the same rank and
    served bytes as read_adapter, and a value out of range refused in both."""
    path = write_demo_adapter(tmp_path, "tinylm", "acme", rank=4, spec=SPEC)
    weights = path / "adapter_model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(str(weights)).items()}, str(weights))
    loaded = read_adapter(path, TINY_TARGETS, max_rank=16, all_linear_excluded=("lm_head",))
    checked = check_adapter(path, TINY_TARGETS, max_rank=16, all_linear_excluded=("lm_head",))
    assert (checked.name, checked.config, checked.rank, checked.nbytes) == (
        loaded.name, loaded.config, loaded.rank, loaded.nbytes)
    tensors = load_file(str(weights))
    tensors[Q_B] = torch.full_like(tensors[Q_B], float("inf"))
    save_file(tensors, str(weights))
    for reader in (read_adapter, check_adapter):
        with pytest.raises(AdapterRefused, match="NaN or infinity"):
            reader(path, TINY_TARGETS, max_rank=16)


@pytest.mark.parametrize("kind", ["tinylm", "recommender"])
def test_a_bases_linear_layers_read_from_its_header_are_its_torch_modules(tmp_path, kind):
    """What the control plane checks adapters against (no torch) is what the model's
    nn.Linear layers are, and all-linear leaves out the same head."""
    from model_runtime.lora.base_layers import OUTPUT_LAYERS, linear_layers
    from model_runtime.lora.models import linear_targets, load_recommender, load_tinylm

    repo = tmp_path / "repository"
    model = "tinylm" if kind == "tinylm" else "recommender_lora"
    write_lora_model(repo, model, SPEC)
    weights = next(repo.glob(f"{model}/*/weights.safetensors"))
    module = load_tinylm(weights) if kind == "tinylm" else load_recommender(weights)
    assert linear_layers(weights) == linear_targets(module) and linear_targets(module)
    assert OUTPUT_LAYERS[kind] == tuple(module.output_layers)


def test_adapter_for_the_other_base_is_refused(tmp_path):
    """A recommender adapter offered to tinylm: its modules are not tinylm layers."""
    path = write_demo_adapter(tmp_path, "recommender_lora", "rec", rank=4, spec=SPEC)
    with pytest.raises(AdapterRefused, match="name no linear layer of tinylm"):
        read_adapter(path, TINY_TARGETS, base_name="tinylm")


def test_same_module_names_but_wrong_shapes_are_refused(tmp_path):
    """An adapter for a wider recommender: module names match, shapes do not."""
    wide = LoraDemoSpec(recommender=SPEC.recommender.__class__(hidden_dim=256))
    path = write_demo_adapter(tmp_path, "recommender_lora", "wide", rank=4, spec=wide)
    with pytest.raises(AdapterRefused, match="shape mismatch"):
        read_adapter(path, REC_TARGETS, base_name="recommender_lora")


def test_rank_above_the_model_limit_is_refused(tmp_path):
    path = write_demo_adapter(tmp_path, "tinylm", "big", rank=32, spec=SPEC)
    with pytest.raises(AdapterRefused, match="exceeds this model's max_lora_rank 16"):
        read_adapter(path, TINY_TARGETS, max_rank=16)


@pytest.mark.parametrize("name", ["", "../etc", "a/b", "a b", "x;rm", ".hidden", "a" * 129])
def test_adapter_names_are_validated(name):
    with pytest.raises(InvalidAdapterName):
        validate_adapter_name(name)


def test_adapter_from_parameter_or_input():
    import numpy as np

    assert adapter_from({}, None) is None
    assert adapter_from({"adapter": ""}, None) is None
    assert adapter_from({"adapter": "acme"}, None) == "acme"
    assert adapter_from({}, np.array([[b"acme"], [b"acme"]], dtype=object)) == "acme"
    assert adapter_from({"adapter": "acme"}, np.array([[b"acme"]], dtype=object)) == "acme"
    with pytest.raises(InvalidRequest, match="disagree"):
        adapter_from({"adapter": "acme"}, np.array([[b"globex"]], dtype=object))
    with pytest.raises(InvalidRequest, match="one request per adapter"):
        adapter_from({}, np.array([[b"acme"], [b"globex"]], dtype=object))
    with pytest.raises(InvalidAdapterName):
        adapter_from({"adapter": "../x"}, None)


def test_manifest_round_trip_and_validation(tmp_path):
    assert read_manifest(tmp_path) == Manifest()
    manifest = Manifest(generation=3, pinned=("acme",), preload=("globex",), disabled=("old",))
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest
    for bad, words in [
        ({"pinned": "acme"}, "list"),
        ({"pinned": ["../x"]}, "invalid"),
        ({"pinned": ["a"], "disabled": ["a"]}, "both pinned and disabled"),
        ({"surprise": 1}, "unknown fields"),
        ({"generation": "7"}, "generation"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            Manifest.from_dict(bad)


def test_manifest_watcher_applies_changes_once_and_reports_bad_files(tmp_path):
    applied, errors = [], []
    watcher = ManifestWatcher(tmp_path, applied.append, errors.append, interval_s=0)
    assert watcher.step() is True and applied == [Manifest()]  # no file = empty manifest
    assert watcher.step() is False
    write_manifest(tmp_path, Manifest(generation=1, pinned=("acme",)))
    assert watcher.step() is True and applied[-1].pinned == ("acme",)
    (tmp_path / "manifest.json").write_text("{broken")
    assert watcher.step() is False and "not valid JSON" in errors[-1].message
    assert len(applied) == 2  # the last good state stays applied


def test_settings_parse_and_quote_bad_values(tmp_path):
    settings = LoraSettings.from_parameters({"max_device_adapters": "3", "dtype": "float64"}, tmp_path)
    assert settings.max_device_adapters == 3 and settings.dtype == torch.float64
    assert settings.adapter_dir == tmp_path / "adapters"
    assert LoraSettings.from_parameters({"adapter_dir": "/srv/a"}, tmp_path).adapter_dir.as_posix() == "/srv/a"
    with pytest.raises(InvalidRequest, match=r"max_device_adapters \(0\) must be >= 1"):
        LoraSettings.from_parameters({"max_device_adapters": "0"}, tmp_path)
    with pytest.raises(InvalidRequest, match="'lots' is not an integer"):
        LoraSettings.from_parameters({"max_lora_rank": "lots"}, tmp_path)
    with pytest.raises(InvalidRequest, match="dtype='int8'"):
        LoraSettings.from_parameters({"dtype": "int8"}, tmp_path)


def test_lora_config_defaults_alpha_to_r():
    config = LoraConfig.from_dict({"r": 8, "target_modules": ["q_proj"]})
    assert config.scale_for("blocks.0.attn.q_proj") == 1.0


def test_write_adapter_replaces_atomically(tmp_path):
    a = torch.zeros(2, IN)
    b = torch.zeros(OUT, 2)
    modules = {"blocks.0.attn.q_proj": (a, b)}
    for _ in range(2):
        write_adapter(tmp_path / "x", modules, r=2, lora_alpha=2, target_modules=["q_proj"],
                      base_model_name_or_path="tinylm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]
    assert read_adapter(tmp_path / "x", TINY_TARGETS).rank == 2


def test_weights_beyond_float16s_range_are_refused_for_a_float16_model(tmp_path):
    path = _adapter(tmp_path, tensors={Q_A: torch.ones(4, IN), Q_B: torch.full((OUT, 4), 1e5)})
    read_adapter(path, TINY_TARGETS, max_rank=16, base_name="tinylm")  # float32: served
    with pytest.raises(AdapterRefused, match="overflow once scaled by alpha / r"):
        read_adapter(path, TINY_TARGETS, max_rank=16, base_name="tinylm", dtype=torch.float16)
