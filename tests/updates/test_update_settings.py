"""The update layer's settings (``aggregator``, ``dp``, ``fraction``, ``weighted``) are declared once, in
``rayfuse.updates.settings``, and taken by every registered method whose tags name them; an entry gives them at its
top level (the older spelling) or grouped under ``updates:``, read the same way; what cannot be read is one line."""

from __future__ import annotations

import pytest

import rayfuse
from rayfuse.errors import InputError
from rayfuse.method import METHODS, resolve_methods
from rayfuse.runner import prepare_run
from rayfuse.updates.settings import AggregatorUpdates, CentralDPUpdates, CohortUpdates, UploadDPUpdates, WeightedUpdates
from tests.conftest import TINY, merge

#: the framework's class declaring each setting (dp: by the method's kind of round)
DECLARED = {"aggregator": AggregatorUpdates, "weighted": WeightedUpdates, "fraction": CohortUpdates}


@pytest.mark.parametrize("name", [n for n in METHODS.names() if METHODS.get(n).tags.updates])
def test_each_method_takes_the_settings_its_tags_name_from_the_framework(name):
    cls = METHODS.get(name)
    for key in cls.tags.updates:
        owner = DECLARED.get(key) or (CentralDPUpdates if cls.tags.cohort else UploadDPUpdates)
        assert issubclass(cls.Params, owner), f"{name}: {key} is not the framework's ({owner.__name__})"


def test_the_aggregator_is_offered_to_exactly_the_methods_that_fuse_parameters():
    # every method whose (default) entry fuses parameters combines them through the pipeline, with its rule
    for name in METHODS.names():
        tags = METHODS.get(name).tags
        assert ("aggregator" in tags.updates) == (tags.fuses == "parameters"), name


def test_finetune_on_the_average_takes_a_robust_rule_and_only_there(make_config):
    (spec,) = resolve_methods({"finetune": {"updates": {"aggregator": {"name": "median"}}}})
    assert spec.params.aggregator.name == "median"
    cfg = make_config(data={"public_size": 0.1}, methods={"finetune": {"base": "local", "updates": {"aggregator": {"name": "median"}}}})
    with pytest.raises(InputError) as raised:
        prepare_run(cfg)
    assert str(raised.value).startswith(
        "methods.finetune.updates.aggregator: expected the default mean for method 'finetune' (it fuses nothing"
    )


GROUPED = [
    ("fedavg", {"aggregator": {"name": "median"}, "fraction": 0.5, "weighted": False}),
    ("fedprox", {"dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.5}}),
    ("average", {"aggregator": {"name": "trimmed_mean", "beta": 0.25}, "dp": {"clip_norm": 1.0, "noise_multiplier": 0.5}}),
    ("aligned", {"weighted": False}),
    ("fedlora", {"aggregator": {"clip_norm": 1.0}}),
]


@pytest.mark.parametrize(("name", "settings"), GROUPED, ids=[g[0] for g in GROUPED])
def test_the_updates_block_reads_as_the_top_level_keys(name, settings):
    (grouped,) = resolve_methods({name: {"updates": settings}})
    (flat,) = resolve_methods({name: dict(settings)})
    assert grouped.params == flat.params and grouped.grouped == set(settings) and not flat.grouped


def test_a_run_with_the_block_gives_the_top_level_runs_numbers(tmp_path):
    def run(entry, where):
        cfg = merge(TINY, {"run": {"storage": str(tmp_path / where)}, "partition": {"method": "iid", "num_clients": 4}})
        cfg["methods"] = {"fedavg": {"rounds": 2, "local_epochs": 1, **entry}}
        return rayfuse.run(cfg, backend="local", quiet=True).results["methods"]["fedavg"]

    settings = {"aggregator": {"name": "median"}, "fraction": 0.5}
    grouped, flat = run({"updates": settings}, "grouped"), run(settings, "flat")
    assert grouped["accuracy"] == flat["accuracy"] and grouped["nll"] == flat["nll"]


REFUSED = [
    ("not-a-mapping", {"fedavg": {"updates": 3}}, "methods.fedavg.updates: expected a mapping of the update layer's settings"),
    (
        "not-an-update-key",
        {"fedavg": {"updates": {"mu": 1}}},
        "methods.fedavg.updates.mu: expected one of aggregator, dp, fraction, weighted",
    ),
    (
        "a-key-the-method-lacks",
        {"average": {"updates": {"fraction": 0.5}}},
        "methods.average.updates.fraction: expected one of aggregator, dp, weighted",
    ),
    ("no-update-settings", {"kl": {"updates": {"dp": {}}}}, "methods.kl.updates: expected no updates block for method 'kl'"),
    (
        "given-twice",
        {"fedavg": {"updates": {"fraction": 0.5}, "fraction": 0.5}},
        "methods.fedavg.updates.fraction: expected fraction given once",
    ),
    ("bad-value", {"fedavg": {"updates": {"fraction": 2}}}, "methods.fedavg.updates.fraction: expected less than or equal to 1, got 2"),
    ("bad-nested", {"fedavg": {"updates": {"aggregator": {"name": "nope"}}}}, "methods.fedavg.updates.aggregator.name: expected 'mean'"),
]


@pytest.mark.parametrize(("methods", "line"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_the_block_cannot_say_is_one_line(methods, line):
    with pytest.raises(InputError) as raised:
        resolve_methods(methods)
    assert str(raised.value).startswith(line) and "\n" not in str(raised.value)


def test_a_pre_start_refusal_names_the_key_where_the_entry_gave_it(make_config):
    # Krum's precondition on 4 clients (n > 2f + 2): refused by the update pipeline's rule, at the block's key
    cfg = make_config(methods={"krum": {"method": "fedavg", "rounds": 1, "updates": {"aggregator": {"name": "krum", "f": 2}}}})
    with pytest.raises(InputError) as raised:
        prepare_run(cfg)
    assert raised.value.path.startswith("methods.krum.updates.aggregator"), str(raised.value)
