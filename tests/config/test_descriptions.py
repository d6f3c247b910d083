"""Every config key and every shipped method's parameter has a description, so the generated configuration
reference (``python -m rayfuse.docs_gen``) shows no ``-`` in its description column."""

from __future__ import annotations

from rayfuse.config import ExperimentConfig
from rayfuse.docs_gen import config_rows, method_rows, missing_descriptions, shipped_methods


def test_no_config_key_or_method_parameter_lacks_a_description():
    assert missing_descriptions() == []


def test_every_section_and_the_keys_named_in_the_polish_list_have_one():
    rows = {row.path: row.description for section in config_rows().values() for row in section}
    for section in ExperimentConfig.model_fields:
        assert rows[section], section
    for path in (
        "partition.num_clients",
        "model.dropout",
        "model.activation",
        "train.epochs",
        "train.batch_size",
        "train.optimizer",
        "train.lr",
        "train.weight_decay",
        "federation.on_client_failure",
        "federation.clients",
        "federation.coordinator",
        "federation.faults",
        "federation.faults.<i>.client",
        "federation.attacks.<i>.client",
        "federation.client_overrides.<i>.model.dropout",
        "federation.client_overrides.<i>.model.activation",
    ):
        assert rows[path], path


def test_every_shipped_method_parameter_has_a_description():
    names = shipped_methods()
    assert {"fedavg", "fedref", "aligned", "average", "ensemble", "epgan", "fedsa", "finetune", "gems", "distill"} <= set(names)
    for name in names:
        for row in method_rows(name):
            assert row.description, f"{name}: {row.path}"


def test_the_attacks_description_names_where_the_pipeline_applies_them_and_what_is_refused():
    description = ExperimentConfig.model_fields["federation"].annotation.model_fields["attacks"].description
    for word in ("FedAvg family", "average", "aligned", "finetune", "posteriors", "statistics", "predictions"):
        assert word in description, word
