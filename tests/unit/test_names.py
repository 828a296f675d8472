import pytest

from domain.errors import InvalidModelName
from domain.names import validate_model_name


@pytest.mark.parametrize("name", ["cust001", "cust017.v3", "rec-ab_2", "A1", "x" * 128])
def test_valid_names_pass(name):
    assert validate_model_name(name) == name


@pytest.mark.parametrize(
    "name, why",
    [
        ("", "non-empty"),
        ("..", "'..'"),
        ("a..b", "'..'"),
        ("../etc/passwd", "'..'"),
        ("a/b", "invalid"),
        ("a b", "invalid"),
        ("a\tb", "invalid"),
        ("cust001\n", "invalid"),
        ("x;rm -rf /", "invalid"),
        ("$(id)", "invalid"),
        ("`id`", "invalid"),
        ("a|b", "invalid"),
        ("-rf", "invalid"),
        (".hidden", "invalid"),
        ("x" * 129, "limit"),
        (None, "non-empty"),
        (7, "non-empty"),
    ],
)
def test_bad_names_are_refused_with_a_reason(name, why):
    with pytest.raises(InvalidModelName, match=why.replace("(", r"\(")):
        validate_model_name(name)
