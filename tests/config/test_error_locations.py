"""Cross-field config errors carry their key path as data (rayfuse.errors.key_error: a pydantic custom error whose
context holds ``loc``), not as a marker inside the message text parsed back by a regular expression."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from rayfuse.config import ExperimentConfig, PartitionConfig, pydantic_input_error, validate_config
from rayfuse.errors import KEYED_ERROR, InputError, key_error
from rayfuse.method import resolve_methods

ROOT = Path(__file__).resolve().parents[2]
# what the old protocol wrote at the head of a ValueError's text: "@partition.num_clients@ ..."
MARKER = re.compile(r"@[A-Za-z0-9_.{}]+@")


def _pydantic_error(model: type, data: dict) -> dict:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return info.value.errors(include_url=False)[0]


def test_a_cross_field_error_holds_its_key_path_in_its_context() -> None:
    error = _pydantic_error(PartitionConfig, {"method": "labels", "num_clients": 2, "groups": [[0], []]})
    assert error["type"] == KEYED_ERROR
    assert error["loc"] == ()  # the model validator's own location: the whole section
    assert error["ctx"]["loc"] == ("groups", "1")  # the key it names, as data
    assert "@" not in error["msg"]
    assert error["msg"] == "at least one label for client 1, got []"


def test_the_key_path_comes_from_loc_relative_to_the_raising_section() -> None:
    # raised by data.silos.0's own validator: pydantic's location (data, silos, 0) + the error's (val_size)
    data = {"data": {"silos": [{"dataset": "npz", "path": "a.npz", "val_size": 0.2, "test_path": "b.npz"}]}}
    with pytest.raises(ValidationError) as info:
        ExperimentConfig.model_validate(data)
    error = info.value.errors(include_url=False)[0]
    assert error["loc"] == ("data", "silos", 0)
    assert error["ctx"]["loc"] == ("val_size",)
    line = str(pydantic_input_error(info.value))
    assert line == "data.silos.0.val_size: expected val_size or test_path, not both (test_path is 'b.npz'), got 0.2"


@pytest.mark.parametrize(
    "data, path, rest",
    [
        # from the top-level config's validators: the path is absolute
        ({"federation": {"min_clients": 6}}, "federation.min_clients", "expected at most partition.num_clients (5), got 6"),
        (
            {"federation": {"attacks": [{"client": 9, "kind": "sign_flip"}]}},
            "federation.attacks.0.client",
            "expected a client id in 0..4, got 9",
        ),
        ({"methods": {}}, "methods", "expected at least one method, got none"),
        # from a section's validator: the section's path, then the key
        ({"partition": {"num_clients": 3, "corrupt": {7: "noise"}}}, "partition.corrupt.7", "expected a client id in 0..2, got 7"),
        (
            {"train": {"dp": {"noise_multiplier": 1.0, "target_epsilon": 2.0}}},
            "train.dp.noise_multiplier",
            "expected exactly one of noise_multiplier and target_epsilon, got both",
        ),
        ({"model": {"name": "mlp", "factory": "x.y"}}, "model.factory", "expected no factory for model 'mlp'"),
    ],
)
def test_the_one_line_names_the_key_from_loc(data: dict, path: str, rest: str) -> None:
    with pytest.raises(InputError) as info:
        validate_config(data)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: {rest}")
    assert not MARKER.search(str(info.value))


def test_a_method_parameters_error_is_under_the_method_label() -> None:
    cfg = validate_config({"methods": {"ada": {"method": "fedadagrad", "bias_correction": True}}})
    with pytest.raises(InputError) as info:
        resolve_methods(cfg.methods)
    assert info.value.path == "methods.ada.bias_correction"
    assert "@" not in str(info.value)


def test_a_message_with_at_signs_is_kept_as_text() -> None:
    # the message is data too: an '@' in it is never read as a key path
    error = key_error(("federation", "min_clients"), "@run.name@ is not a key here")
    assert error.context == {"loc": ("federation", "min_clients"), "expected": "@run.name@ is not a key here"}


def test_no_key_marker_remains_in_the_package() -> None:
    found = []
    for file in sorted((ROOT / "rayfuse").rglob("*.py")):
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"""["']@[A-Za-z0-9_.{}]+@""", line) or "@([A-Za-z0-9_.]+)@" in line:
                found.append(f"{file.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
