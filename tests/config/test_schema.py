"""The experiment config (rayfuse.config): one table of bad configs, each rejected with a one-line InputError naming
the key path; the defaults are the quickstart job; --set overrides; loading files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rayfuse.config import (
    DEFAULT_METHODS,
    ExperimentConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_overrides,
    validate_config,
)
from rayfuse.errors import InputError
from rayfuse.method import resolve_methods, resolved_config

QUICKSTART = Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"

# ---------------------------------------------------------------------------------------------------------------
# Bad configs, one table: (config data or --set overrides, key path the message starts with, another pattern the
# message must contain)

LABELS_2 = {"method": "labels", "num_clients": 2}


class Set(tuple):
    """A row given as ``--set`` overrides on the default config (``load_config(overrides=...)``)."""

    def __new__(cls, *overrides: str) -> Set:
        return super().__new__(cls, overrides)


BAD_CONFIGS = [
    pytest.param(
        {"bogus": 1},
        "bogus",
        r"one of the keys \{data, evaluation, federation, methods, model, partition, run, tracking, train\}",
        id="unknown-top-level-key",
    ),
    pytest.param({"partition": {"alpah": 1}}, "partition.alpah", r"did you mean 'alpha'", id="unknown-nested-key-suggests"),
    pytest.param(
        {"federation": {"clients": {"num_gpuz": 1}}},
        "federation.clients.num_gpuz",
        r"did you mean 'num_gpus'",
        id="unknown-deep-key-suggests",
    ),
    pytest.param({"train": 5}, "train", r"got 5", id="section-not-a-mapping"),
    pytest.param({"train": {"epochs": "many"}}, "train.epochs", r"integer.*got 'many'", id="epochs-wrong-type"),
    pytest.param({"train": {"epochs": 1.5}}, "train.epochs", r"fractional", id="epochs-fractional"),
    pytest.param({"train": {"epochs": -1}}, "train.epochs", r"greater than or equal to 0, got -1", id="epochs-negative"),
    pytest.param({"train": {"batch_size": 0}}, "train.batch_size", r"greater than or equal to 1, got 0", id="batch-size-zero"),
    pytest.param({"train": {"lr": 0}}, "train.lr", r"greater than 0", id="lr-zero"),
    pytest.param({"train": {"optimizer": "adamw"}}, "train.optimizer", r"'adam' or 'sgd', got 'adamw'", id="optimizer-unknown"),
    pytest.param({"partition": {"alpha": 0}}, "partition.alpha", r"greater than 0, got 0", id="alpha-zero"),
    pytest.param({"partition": {"alpha": -1.0}}, "partition.alpha", r"greater than 0, got -1\.0", id="alpha-negative"),
    pytest.param({"partition": {"num_clients": 0}}, "partition.num_clients", r"got 0", id="no-clients"),
    pytest.param({"partition": {"shard_size": 0}}, "partition.shard_size", r"got 0", id="shard-size-zero"),
    pytest.param(
        {"partition": {"method": "dirichlett"}}, "partition.method", r"did you mean 'dirichlet'", id="unknown-partitioner-suggests"
    ),
    pytest.param({"partition": {"method": "labels"}}, "partition.groups", r"method is 'labels'", id="labels-without-groups"),
    pytest.param(
        {"partition": {**LABELS_2, "groups": [[0]]}},
        "partition.groups",
        r"one label list per client \(2\), got 1 lists",
        id="labels-wrong-group-count",
    ),
    pytest.param(
        {"partition": {**LABELS_2, "groups": [[0], []]}},
        "partition.groups.1",
        r"at least one label for client 1, got \[\]",
        id="labels-empty-group",
    ),
    pytest.param(
        {"partition": {**LABELS_2, "groups": [[0], [-1]]}}, "partition.groups.1", r"labels >= 0, got \[-1\]", id="labels-negative-label"
    ),
    pytest.param({"partition": {**LABELS_2, "groups": [[0], ["one"]]}}, "partition.groups.1.0", r"integer", id="labels-group-not-int"),
    pytest.param({"data": {"dataset": "digit"}}, "data.dataset", r"got 'digit'; did you mean 'digits'\?$", id="unknown-dataset-suggests"),
    pytest.param({"data": {"dataset": "npz"}}, "data.path", r"npz", id="npz-without-path"),
    pytest.param({"data": {"dataset": "parquet"}}, "data.path", r"parquet", id="parquet-without-path"),
    pytest.param({"data": {"test_size": 1.0}}, "data.test_size", r"less than 1", id="test-size-one"),
    pytest.param({"data": {"test_size": 0}}, "data.test_size", r"greater than 0", id="test-size-zero"),
    pytest.param({"data": {"val_size": -0.1}}, "data.val_size", r"got -0\.1", id="val-size-negative"),
    pytest.param(
        {"data": {"public_size": 2.5}}, "data.public_size", r"a fraction below 1 or a whole count", id="public-size-fractional-count"
    ),
    pytest.param({"data": {"public_size": -1}}, "data.public_size", r"greater than or equal to 0", id="public-size-negative"),
    pytest.param({"data": {"options": 3}}, "data.options", r"dictionary", id="options-not-a-mapping"),
    pytest.param({"model": {"name": "mpl"}}, "model.name", r"did you mean 'mlp'", id="unknown-model-suggests"),
    pytest.param(
        {"model": {"name": "torchvision:resnet81"}}, "model.name", r"did you mean 'resnet18'", id="unknown-torchvision-model-suggests"
    ),
    pytest.param({"model": {"hidden": [64, 0]}}, "model.hidden", r"positive widths", id="hidden-zero-width"),
    pytest.param({"model": {"hidden": 64}}, "model.hidden", r"list", id="hidden-not-a-list"),
    pytest.param({"model": {"dropout": 1.0}}, "model.dropout", r"less than 1", id="dropout-one"),
    pytest.param({"model": {"activation": "sigmoid"}}, "model.activation", r"'relu', 'tanh' or 'gelu'", id="activation-unknown"),
    pytest.param({"run": {"seed": -1}}, "run.seed", r"got -1", id="seed-negative"),
    pytest.param({"run": {"seed": 2**32}}, "run.seed", r"less than or equal to 4294967295", id="seed-too-large"),
    pytest.param({"run": {"name": "bad name!"}}, "run.name", r"pattern", id="run-name-with-space"),
    pytest.param(
        {"federation": {"min_clients": 6}},
        "federation.min_clients",
        r"at most partition\.num_clients \(5\), got 6",
        id="min-clients-above-num-clients",
    ),
    pytest.param(
        {"federation": {"faults": [{"client": 7, "step": "train_local"}]}},
        "federation.faults.0.client",
        r"a client id in 0\.\.4, got 7",
        id="fault-for-missing-client",
    ),
    pytest.param({"federation": {"faults": [{"client": 0}]}}, "federation.faults.0.step", r"required", id="fault-without-step"),
    pytest.param(
        {"federation": {"faults": [{"client": 0, "step": "x", "mode": "explode"}]}},
        "federation.faults.0.mode",
        r"'raise', 'exit', 'nan', 'nan_metrics' or 'hang'",
        id="fault-mode-unknown",
    ),
    pytest.param(
        {"federation": {"client_overrides": {9: {"num_gpus": 0.5}}}},
        "federation.client_overrides.9",
        r"a client id in 0\.\.4, got 9",
        id="override-for-missing-client",
    ),
    pytest.param(
        {"federation": {"clients_per_actor": 2, "client_overrides": {1: {"num_gpus": 0.5}}}},
        "federation.clients_per_actor",
        r"1 when federation.client_overrides gives clients their own resources, got 2",
        id="packed-clients-with-overrides",
    ),
    pytest.param(
        {"federation": {"client_overrides": {1: {"model": {"name": "cnnn"}}}}},
        "federation.client_overrides.1.model.name",
        r"a model in \{.*\}, got 'cnnn'; did you mean 'cnn'\?$",
        id="override-unknown-model",
    ),
    pytest.param(
        {"federation": {"client_overrides": {1: {"model": {"name": "cnn", "chanels": [8]}}}}},
        "federation.client_overrides.1.model.chanels",
        r"did you mean 'channels'",
        id="override-model-unknown-key",
    ),
    pytest.param(
        {"federation": {"client_overrides": {1: {"modle": {"name": "cnn"}}}}},
        "federation.client_overrides.1.modle",
        r"did you mean 'model'",
        id="override-unknown-key",
    ),
    pytest.param(
        {"federation": {"client_overrides": {5: {"model": {"name": "cnn"}}}}},
        "federation.client_overrides.5",
        r"a client id in 0\.\.4, got 5",
        id="model-override-for-missing-client",
    ),
    pytest.param(
        {"federation": {"clients_per_actor": 2, "client_overrides": {1: {"num_gpus": 0.5, "model": {"name": "cnn"}}}}},
        "federation.clients_per_actor",
        r"own resources, got 2",
        id="packed-clients-with-resources-and-model",
    ),
    pytest.param(
        Set("federation.client_overrides.1.model.name=cnnn"),
        "federation.client_overrides.1.model.name",
        r"did you mean 'cnn'",
        id="set-override-unknown-model",
    ),
    pytest.param(
        {"federation": {"clients_per_actor": 0}}, "federation.clients_per_actor", r"greater than or equal to 1", id="zero-clients-per-actor"
    ),
    pytest.param({"federation": {"clients": {"num_cpus": -1}}}, "federation.clients.num_cpus", r">= 0 or 'auto'", id="num-cpus-negative"),
    pytest.param(
        {"federation": {"on_client_failure": "ignore"}},
        "federation.on_client_failure",
        r"'retry', 'drop' or 'fail'",
        id="failure-policy-unknown",
    ),
    pytest.param({"federation": {"timeout_s": 0}}, "federation.timeout_s", r"greater than 0", id="timeout-zero"),
    pytest.param({"methods": {}}, "methods", r"at least one method", id="no-methods"),
    pytest.param({"methods": []}, "methods", r"at least one method", id="empty-methods-list"),
    pytest.param({"methods": [1, 2]}, "methods", r"list of method names", id="methods-list-of-numbers"),
    pytest.param({"methods": {"fedavgg": {}}}, "methods.fedavgg", r"did you mean 'fedavg'", id="unknown-method-suggests"),
    pytest.param({"methods": {"fedavg": {"roundz": 3}}}, "methods.fedavg.roundz", r"known key", id="unknown-method-parameter"),
    pytest.param({"methods": {"fedavg": {"rounds": 0}}}, "methods.fedavg.rounds", r"greater than or equal to 1, got 0", id="rounds-zero"),
    pytest.param({"methods": {"fedavg": {"rounds": "x"}}}, "methods.fedavg.rounds", r"integer", id="rounds-wrong-type"),
    pytest.param({"methods": {"fedavg": 3}}, "methods.fedavg", r"dictionary", id="method-entry-not-a-mapping"),
    pytest.param(
        {"methods": {"strong": {"method": "fedprx"}}},
        "methods.strong.method",
        r"did you mean 'fedprox'",
        id="labelled-entry-unknown-method",
    ),
    pytest.param(
        {"methods": {"prox": {"method": "fedprox", "mu": -1}}},
        "methods.prox.mu",
        r"greater than or equal to 0",
        id="labelled-entry-bad-parameter",
    ),
    pytest.param({"methods": {"avg": {"method": "fedavg", "mu": 0.1}}}, "methods.avg.mu", r"known key", id="parameter-of-another-method"),
    pytest.param({"methods": {"bad label!": {}}}, "methods.bad label!", r"a label of letters, digits", id="method-label-with-space"),
    pytest.param(Set("partition.num_clients"), "--set", r"KEY=VALUE", id="set-without-equals-sign"),
    pytest.param(Set("partition..alpha=1"), "--set", r"dotted key path", id="set-empty-key-part"),
    pytest.param(Set("=3"), "--set", r"dotted key path", id="set-empty-key"),
    pytest.param(Set("run name=x"), "--set", r"dotted key path", id="set-space-in-key"),
    pytest.param(Set("partition.alpha=-1"), "partition.alpha", r"greater than 0", id="set-bad-value"),
    pytest.param(Set("partition.alpah=1"), "partition.alpah", r"did you mean 'alpha'", id="set-unknown-key"),
    pytest.param(Set("methods.fedavg.roundz=3"), "methods.fedavg.roundz", r"known key", id="set-unknown-method-parameter"),
    pytest.param(Set("methods.fedavg.rounds=0"), "methods.fedavg.rounds", r"got 0", id="set-rounds-zero"),
    pytest.param(Set("train.epochs.x=1"), "train.epochs", r"integer", id="set-key-inside-a-number"),
    pytest.param(Set("train=fast"), "train", r"got 'fast'", id="set-section-to-a-string"),
    pytest.param(
        Set("partition.num_clients=2", "federation.min_clients=3"),
        "federation.min_clients",
        r"at most partition\.num_clients \(2\)",
        id="set-cross-check-after-overrides",
    ),
]


@pytest.mark.parametrize(("config", "path", "also"), BAD_CONFIGS)
def test_bad_config_is_rejected_with_one_line_naming_the_key_path(config, path, also):
    with pytest.raises(InputError, match=rf"^{re.escape(path)}: expected ") as info:
        cfg = load_config(overrides=list(config)) if isinstance(config, Set) else validate_config(config)
        resolve_methods(cfg.methods)  # the schema, then the methods' entries against the registry
    message = str(info.value)
    assert "\n" not in message
    assert info.value.path == path
    assert re.search(also, message), message


def test_setting_a_key_inside_a_scalar_of_a_file_names_the_scalar(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 3\n")
    with pytest.raises(InputError, match=r"^train\.epochs: expected a mapping to set a key inside, got 3$"):
        load_config(path, overrides=["train.epochs.x=1"])


def test_config_that_is_not_a_mapping():
    with pytest.raises(InputError, match=r"^config: expected a mapping of sections"):
        validate_config([1, 2])


# ---------------------------------------------------------------------------------------------------------------
# Message quality and value coercion details.


@pytest.mark.parametrize(("section", "key"), [("train", "epochs"), ("partition", "num_clients"), ("run", "seed")])
def test_boolean_for_an_integer_key_is_rejected(section, key):
    with pytest.raises(InputError, match=rf"^{section}\.{key}: "):
        validate_config({section: {key: True}})


@pytest.mark.parametrize(
    ("override", "section", "key", "value"), [("run.name=2024", "run", "name", "2024"), ("data.label=1", "data", "label", "1")]
)
def test_numeric_looking_value_for_a_string_key_is_kept_as_text(override, section, key, value):
    config = load_config(overrides=[override])
    assert getattr(getattr(config, section), key) == value


def test_unknown_method_parameter_suggests_the_close_one():
    with pytest.raises(InputError, match=r"^methods\.fedavg\.roundz: .*did you mean 'rounds'"):
        resolve_methods(validate_config({"methods": {"fedavg": {"roundz": 3}}}).methods)


def test_hidden_width_message_says_got_once():
    with pytest.raises(InputError) as info:
        validate_config({"model": {"hidden": [0]}})
    assert str(info.value).count("got") == 1


@pytest.mark.parametrize(
    "data",
    [
        {"partition": {"method": "labels"}},
        {"data": {"dataset": "npz"}},
        {"federation": {"min_clients": 6}},
        {"methods": {}},
    ],
)
def test_cross_check_messages_read_expected_value_not_a_sentence(data):
    with pytest.raises(InputError) as info:
        validate_config(data)
    assert " must " not in str(info.value) and " names client " not in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# The defaults are the quickstart job


def test_empty_config_is_the_defaults():
    assert resolved_config(validate_config({})) == resolved_config(ExperimentConfig())
    assert resolved_config(validate_config(None)) == resolved_config(ExperimentConfig())
    assert resolved_config(load_config()) == resolved_config(ExperimentConfig())


def test_quickstart_job_is_exactly_the_schema_defaults():
    config = load_config(QUICKSTART)
    assert resolved_config(config) == resolved_config(ExperimentConfig())


def test_quickstart_methods_are_the_default_methods():
    raw = yaml.safe_load(QUICKSTART.read_text())
    assert list(raw["methods"]) == list(DEFAULT_METHODS)
    assert resolved_config(load_config(QUICKSTART))["methods"] == resolved_config(validate_config({"methods": DEFAULT_METHODS}))["methods"]


def test_defaults_by_hand():
    resolved = resolved_config(ExperimentConfig())
    assert resolved["data"]["dataset"] == "digits" and resolved["partition"]["method"] == "dirichlet"
    assert resolved["partition"]["num_clients"] == 5 and resolved["model"]["hidden"] == [64, 64]
    assert resolved["train"]["shared_init"] is False
    assert list(resolved["methods"]) == [
        "local",
        "average",
        "ensemble",
        "aligned",
        "aligned-wide",
        "distill",
        "distill-free",
        "distill-rounds",
        "fedavg",
        "global",
    ]
    assert resolved["data"]["public_size"] == 300  # the quickstart's public sample, for distill
    assert resolved["methods"]["fedavg"]["rounds"] == 20 and resolved["methods"]["fedavg"]["local_epochs"] == 2


def test_resolved_fills_method_defaults():
    methods = resolved_config(validate_config({"methods": {"fedavg": {}, "fedprox": {"rounds": 3}}}))["methods"]
    assert methods["fedavg"] == {
        "method": "fedavg",
        "rounds": 20,
        "local_epochs": 2,
        "lr": None,
        "batch_size": None,
        "optimizer": None,
        "fraction": 1.0,
        "weighted": True,
        "evaluate_every": 1,
        "aggregator": {"name": "mean", "clip_norm": None},
    }
    assert methods["fedprox"]["rounds"] == 3 and methods["fedprox"]["mu"] == 0.01


def test_dump_config_round_trips(tmp_path):
    config = validate_config(
        {
            "partition": {"method": "shards", "num_clients": 3},
            "federation": {"client_overrides": {1: {"num_gpus": 0.5}}},
            "methods": {"p": {"method": "fedprox", "mu": 0.5}},
        }
    )
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(resolved_config(config)))
    assert resolved_config(load_config(path)) == resolved_config(config)


def test_config_is_frozen():
    config = ExperimentConfig()
    with pytest.raises(ValidationError, match="frozen"):
        config.train.epochs = 3  # type: ignore[misc]
    assert config.train.epochs == 20


# ---------------------------------------------------------------------------------------------------------------
# Aliases, partition parameters and methods


def test_aliases_resolve():
    config = validate_config({"data": {"dataset": "FashionMNIST"}, "partition": {"method": "hetero-dir"}, "methods": {"naive-average": {}}})
    assert config.data.dataset == "fashion_mnist"
    assert config.partition.canonical_method == "dirichlet"
    assert resolved_config(config)["methods"]["naive-average"]["method"] == "average"


@pytest.mark.parametrize(
    ("partition", "params"),
    [
        ({"method": "iid", "alpha": 0.1}, {}),  # another partitioner's parameter is ignored, not an error
        ({"method": "homo"}, {}),
        ({"method": "dirichlet", "alpha": 0.1}, {"alpha": 0.1, "balance": True, "min_size": 10}),
        ({"method": "labels", "num_clients": 2, "groups": [[0, 1], [2]]}, {"groups": [[0, 1], [2]]}),
        ({"method": "pathological", "classes_per_client": 3}, {"classes_per_client": 3}),
        ({"method": "shards"}, {"shards_per_client": 2, "shard_size": None}),
    ],
)
def test_partition_params_are_the_chosen_partitioners_only(partition, params):
    assert validate_config({"partition": partition}).partition.params() == params


def test_methods_list_shorthand():
    config = validate_config({"methods": ["local", "fedavg"]})
    assert config.methods == {"local": {}, "fedavg": {}}
    assert [spec.label for spec in resolve_methods(config.methods)] == ["local", "fedavg"]


def test_methods_list_shorthand_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("methods: [local, fedavg]\n")
    assert list(load_config(path).methods) == ["local", "fedavg"]


def test_labelled_method_entries_run_one_method_twice():
    config = validate_config(
        {"methods": {"fedprox-weak": {"method": "fedprox", "mu": 0.01}, "fedprox-strong": {"method": "fedprox", "mu": 0.5}}}
    )
    specs = {spec.label: spec for spec in resolve_methods(config.methods)}
    assert specs["fedprox-strong"].method == "fedprox" and specs["fedprox-strong"].params.mu == 0.5
    assert specs["fedprox-weak"].params.mu == 0.01
    assert resolved_config(config)["methods"]["fedprox-strong"]["method"] == "fedprox"


def test_null_method_entry_means_defaults():
    assert validate_config({"methods": {"local": None}}).methods == {"local": {}}


# ---------------------------------------------------------------------------------------------------------------
# --set overrides


def test_parse_overrides_reads_values_as_yaml():
    parsed = parse_overrides(
        ["methods.fedavg.rounds=20", "model.hidden=[128,64]", "run.name=exp", "data.root=", "run.name=a=b", "x=[unclosed"]
    )
    assert parsed == [
        (["methods", "fedavg", "rounds"], 20),
        (["model", "hidden"], [128, 64]),
        (["run", "name"], "exp"),
        (["data", "root"], None),
        (["run", "name"], "a=b"),  # split at the first '='
        (["x"], "[unclosed"),  # not YAML: kept as text
    ]


def test_apply_overrides_sets_nested_keys_without_touching_the_input():
    data = {"train": {"epochs": 3}, "methods": ["local", "fedavg"]}
    out = apply_overrides(data, parse_overrides(["train.lr=0.1", "methods.fedavg.rounds=4", "partition.num_clients=8"]))
    assert out == {"train": {"epochs": 3, "lr": 0.1}, "methods": {"local": {}, "fedavg": {"rounds": 4}}, "partition": {"num_clients": 8}}
    assert data == {"train": {"epochs": 3}, "methods": ["local", "fedavg"]}


def test_load_config_applies_overrides_on_top_of_the_file():
    config = load_config(
        QUICKSTART,
        overrides=[
            "partition.num_clients=8",
            "model.hidden=[128,64]",
            "methods.fedavg.rounds=3",
            "data.options={n_samples: 100}",
            "data.dataset=synthetic",
        ],
    )
    assert config.partition.num_clients == 8
    assert config.model.hidden == [128, 64]
    assert config.methods["fedavg"] == {"rounds": 3, "local_epochs": 2}  # the file's other fedavg keys stay
    assert config.data.dataset == "synthetic" and config.data.options == {"n_samples": 100}


def test_override_replaces_the_methods_with_a_list():
    assert list(load_config(overrides=["methods=[local, fedavg]"]).methods) == ["local", "fedavg"]
    assert list(load_config(QUICKSTART, overrides=["methods=[ensemble]"]).methods) == ["ensemble"]


def test_override_adds_a_labelled_entry_to_the_files_methods():
    config = load_config(QUICKSTART, overrides=["methods.strong.method=fedprox", "methods.strong.mu=0.5"])
    assert resolved_config(config)["methods"]["strong"]["mu"] == 0.5
    assert list(config.methods) == [*DEFAULT_METHODS, "strong"]


@pytest.mark.parametrize("overrides", [["methods.fedavg.rounds=3"], ["methods.strong.method=fedprox"]])
def test_method_override_without_a_file_edits_the_default_methods(overrides):
    # The empty config is the quickstart, so the same override on either must give the same job.
    assert resolved_config(load_config(overrides=overrides)) == resolved_config(load_config(QUICKSTART, overrides=overrides))


def test_override_can_switch_partitioner_on_a_config_that_sets_another_ones_parameters():
    config = load_config(QUICKSTART, overrides=["partition.method=iid"])  # the file sets alpha
    assert config.partition.params() == {}


# ---------------------------------------------------------------------------------------------------------------
# Loading files


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(InputError, match=r"nope\.yaml: expected an existing YAML config file, got 'no such file'"):
        load_config(missing)


def test_invalid_yaml_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  name: x\npartition:\n  alpha: [0.5\n  num_clients: 4\n")
    with pytest.raises(InputError, match=r"broken\.yaml: expected valid YAML, got 'a syntax error at line \d+, column \d+'") as info:
        load_config(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_yaml_error_reports_the_offending_line(tmp_path):
    path = tmp_path / "colon.yaml"
    path.write_text("run:\n  name: x\n  seed: a: b\n")  # line 3: a mapping value where none is allowed
    with pytest.raises(InputError, match=r"at line 3, column"):
        load_config(path)


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- run\n- data\n")
    with pytest.raises(InputError, match=r"list\.yaml: expected a YAML mapping of sections, got 'list'"):
        load_config(path)


def test_empty_yaml_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert resolved_config(load_config(path)) == resolved_config(ExperimentConfig())


def test_error_in_a_file_names_the_key_not_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("partition:\n  alpha: -2\n")
    with pytest.raises(InputError, match=r"^partition\.alpha: expected greater than 0, got -2$"):
        load_config(path)


@pytest.mark.parametrize(
    "error",
    [
        InputError("partition.alpha", "a number > 0", -1.0, "e.g. 0.5"),
        InputError("data.public_size", "a fraction in (0, 1)"),
        InputError("federation", "a trial that fits", [{"CPU": 1.0}]),
    ],
)
def test_an_input_error_survives_pickling_and_copying(error):
    """Ray pickles an error raised in an actor, a task or a Tune trial, and Tune copies it (copy.copy) to shorten its
    traceback: both must give back the same one-line message and fields, not a TypeError from __init__."""
    import copy
    import pickle

    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(again) is InputError and str(again) == str(error)
        assert (again.path, again.expected, again.hint) == (error.path, error.expected, error.hint)
        assert (again.got is InputError._MISSING) == (error.got is InputError._MISSING)
