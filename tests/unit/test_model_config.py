"""config.pbtxt through protobuf: parse errors name the file, edits survive Triton's syntax
(comments, either quote, either list form), and the generators write configs that parse."""

from __future__ import annotations

import pytest

from control_plane.adapters import describe_base
from control_plane.demo.fleet import FleetSpec
from control_plane.demo.fleet import render_config as render_fleet_config
from control_plane.demo.lora import RECOMMENDER, TINYLM, LoraDemoSpec
from control_plane.demo.lora import render_config as render_lora_config
from control_plane.registry import check_model_config
from domain import model_config
from domain.errors import InvalidInput

# What Triton accepts and a line pattern does not expect: a comment before the name, the
# name indented and single-quoted, repeated ``input {}`` blocks instead of ``input [ ]``,
# a comment that looks like a field, a parameter written over several lines.
AWKWARD = """# serves the ranking model
   name: 'ranker'  # the logical name
backend: "python"
max_batch_size: 0
input { name: "FEATURES" data_type: TYPE_FP32 dims: [ 8 ] }
# input { name: "NOT_AN_INPUT" }
input {
  name: "ADAPTER_CONTROL"
  data_type: TYPE_STRING
  dims: [ 1 ]
  optional: true
}
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 1 ] } ]
parameters {
  key: "max_lora_rank"
  value: { string_value: "4" }
}
"""


def test_parse_reads_what_triton_reads():
    config = model_config.parse_config(AWKWARD)
    assert model_config.config_name(config) == "ranker"
    assert model_config.input_names(config) == {"FEATURES", "ADAPTER_CONTROL"}
    assert model_config.string_parameters(config) == {"max_lora_rank": "4"}
    assert model_config.config_name(model_config.parse_config('backend: "python"')) is None


@pytest.mark.parametrize("text, words", [
    ('name: "m"\nmax_batch_size: "eight"\n', "2:"),
    ('name: "m"\ninput [ { name: "X" }\n', "m/config.pbtxt is not a valid Triton model configuration"),
    ('name: "m"\nname: "n"\n', 'multiple "name" fields'),
])
def test_parse_errors_name_the_file_and_the_place(text, words):
    with pytest.raises(InvalidInput, match="m/config.pbtxt is not a valid Triton model configuration") as err:
        model_config.parse_config(text, "m/config.pbtxt")
    assert words in err.value.message


def test_unknown_fields_are_refused_unless_the_caller_only_reads():
    text = 'name: "m"\nbackend: "python"\nfuture_option: 3\n'
    with pytest.raises(InvalidInput, match="no field named \"future_option\".*tritonclient"):
        model_config.parse_config(text, "m/config.pbtxt")
    assert model_config.parse_config(text, allow_unknown_fields=True).backend == "python"


def test_read_config_says_what_is_wrong_with_the_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        model_config.read_config(tmp_path / "config.pbtxt")
    (tmp_path / "config.pbtxt").write_bytes(b'name: "\xff"\n')
    with pytest.raises(InvalidInput, match="cannot read .*config.pbtxt"):
        model_config.read_config(tmp_path / "config.pbtxt")


def test_edits_round_trip_through_the_text_format():
    config = model_config.parse_config(AWKWARD)
    model_config.set_name(config, "ranker.v2")
    model_config.set_parameter(config, "max_lora_rank", "8")
    model_config.set_parameter(config, "note", 'say "hi" \\ bye')
    model_config.set_input_dims(config, "FEATURES", [16])
    model_config.set_instance_kind(config, "KIND_CPU", "KIND_GPU")  # no groups: nothing to do
    again = model_config.parse_config(model_config.render_config(config))
    assert again == config
    assert again.name == "ranker.v2" and list(again.input[0].dims) == [16]
    assert model_config.string_parameters(again) == {"max_lora_rank": "8", "note": 'say "hi" \\ bye'}
    with pytest.raises(InvalidInput, match="no input 'TEXT'"):
        model_config.set_input_dims(config, "TEXT", [1])


def test_set_name_in_file_renames_any_layout_and_keeps_a_matching_file(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(AWKWARD)
    assert model_config.set_name_in_file(path, "ranker.v1")
    text = path.read_text()
    assert text.startswith('name: "ranker.v1"\n') and "'ranker'" not in text
    assert model_config.parse_config(text).input[1].name == "ADAPTER_CONTROL"
    assert not model_config.set_name_in_file(path, "ranker.v1") and path.read_text() == text


def test_set_name_in_file_refuses_to_drop_unknown_fields(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "m"\nfuture_option: 3\n')
    with pytest.raises(InvalidInput, match="future_option"):
        model_config.set_name_in_file(path, "m.v1")
    assert path.read_text() == 'name: "m"\nfuture_option: 3\n'  # left as it was


def test_check_model_config_accepts_any_layout_of_the_right_name():
    # The staged copy is written from the parsed message, so the name may sit anywhere.
    check_model_config(AWKWARD, "ranker/config.pbtxt", ("ranker",))
    with pytest.raises(InvalidInput, match="says name: \"ranker\" but the model is added as 'other'"):
        check_model_config(AWKWARD, "ranker/config.pbtxt", ("other",))
    with pytest.raises(InvalidInput, match="no field named \"future_option\""):
        check_model_config('name: "ranker"\nfuture_option: 1\n', "ranker/config.pbtxt", ("ranker",))


def test_describe_base_reads_repeated_input_blocks_and_comments(tmp_path):
    folder = tmp_path / "ranker"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(AWKWARD)
    base = describe_base(tmp_path, "ranker")
    assert (base.kind, base.max_rank) == ("recommender", 4)
    (folder / "config.pbtxt").write_text('name: "ranker"\ninput [ { name: "ADAPTER_CONTROL" }\n')
    with pytest.raises(InvalidInput, match="ranker/config.pbtxt is not a valid Triton model configuration"):
        describe_base(tmp_path, "ranker")


def test_fleet_configs_carry_the_spec():
    spec = FleetSpec(feature_dim=12, max_batch_size=5, instance_kind="KIND_GPU",
                     extra_parameters=(("fail_fraction", "0.5"), ("note", 'a "quoted" value')))
    config = model_config.parse_config(render_fleet_config(spec, "cust009"))
    assert config.name == "cust009" and config.max_batch_size == 5
    assert [list(t.dims) for t in config.input] == [[12]]
    assert [g.kind for g in config.instance_group] == [model_config.ModelInstanceGroup.KIND_GPU]
    assert model_config.string_parameters(config) == {"fail_fraction": "0.5", "note": 'a "quoted" value'}
    assert render_fleet_config(spec, "cust009") == render_fleet_config(spec, "cust009")  # same bytes


def test_lora_configs_replace_template_parameters_and_add_new_ones():
    spec = LoraDemoSpec(instance_kind="KIND_GPU", parameters={"max_lora_rank": "4"},
                        recommender=FleetSpec(feature_dim=24))
    tiny = model_config.parse_config(render_lora_config(TINYLM, "tiny2", spec, {"path": 'C:\\a "b"'}))
    params = model_config.string_parameters(tiny)
    assert tiny.name == "tiny2" and params["max_lora_rank"] == "4" and params["path"] == 'C:\\a "b"'
    assert params["adapter_dir"] == "adapters"  # template parameters stay
    assert {g.kind for g in tiny.instance_group} == {model_config.ModelInstanceGroup.KIND_GPU}
    rec = model_config.parse_config(render_lora_config(RECOMMENDER, "rec", spec, {}))
    assert {t.name: list(t.dims) for t in rec.input}["FEATURES"] == [24]
