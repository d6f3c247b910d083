"""Method tags: every registered method declares one frozen ``MethodTags``; ``check_tags`` refuses, before anything
starts and in one line, every run a method's tags rule out; a method of one's own with odd tags is refused the same
way. Also: ``Method`` is generic in its parameters, so no method re-declares ``params``."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
import yaml

import rayfuse
from rayfuse.cli import main
from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.method import (
    METHODS,
    Method,
    MethodParams,
    MethodResult,
    MethodTags,
    RunSetup,
    ServerContext,
    resolve_methods,
)
from rayfuse.prestart import check_tags

FUSES = set(typing.get_args(typing.get_type_hints(MethodTags)["fuses"]))
OLD_FLAGS = (
    "uses_local_models",
    "oracle",
    "multi_round",
    "federated_evaluation",
    "local_model_only",
    "needs_dataset",
    "heterogeneous_clients",
    "public_labels",
    "no_dp",
)


def setup_for(cfg: Any, **changes: Any) -> RunSetup:
    """A cheap run description of ``cfg`` with 3 clients, each holding train and held-out data (``changes`` on top)."""
    base = RunSetup(
        model=cfg.model,
        train=cfg.train,
        data=cfg.data,
        num_clients=3,
        input_shape=(64,),
        num_classes=10,
        train_sizes=(40, 40, 40),
        val_sizes=(5, 5, 5),
        public_size=20,
        test_size=20,
        evaluation=str(cfg.evaluation),
    )
    return dataclasses.replace(base, **changes)


def refusal(specs: Any, setup: RunSetup, cfg: Any) -> InputError:
    with pytest.raises(InputError) as raised:
        check_tags(specs, setup, cfg)
    assert "\n" not in str(raised.value)  # one line
    return raised.value


# ---------------------------------------------------------------------------------------------------------------
# Every registered method has tags (and no capability flag of its own besides them)


def test_every_registered_method_has_frozen_tags_and_no_loose_flags():
    names = METHODS.names()
    assert len(names) >= 20
    for name in names:
        cls = METHODS.get(name)
        tags = cls.tags
        assert isinstance(tags, MethodTags), name
        assert tags.fuses in FUSES, name
        with pytest.raises(dataclasses.FrozenInstanceError):
            tags.oracle = not tags.oracle  # type: ignore[misc]
        for flag in OLD_FLAGS:
            assert not any(flag in vars(k) for k in cls.__mro__), f"{name} still sets {flag} outside its tags"


def test_the_tags_of_every_registered_method_hang_together():
    """Derived from the registry and the tags, not from a list of names (each method's own tags are checked against its
    paper in its tests under tests/fusion/): a method reading the whole dataset is an oracle (no federation holds
    one); one whose rounds train the round loop's cohort has rounds."""
    for name, cls in METHODS.items():
        tags = cls.tags
        assert not tags.needs_dataset or tags.oracle, name
        assert not tags.cohort or tags.multi_round, name


def test_no_registered_method_re_declares_its_params():
    for name in METHODS.names():
        cls = METHODS.get(name)
        for klass in cls.__mro__:
            if klass.__module__.startswith("rayfuse.fusion"):
                assert "params" not in vars(klass).get("__annotations__", {}), f"{klass.__name__} re-declares params"


def _generic_params(cls: type) -> Any:
    """The parameters argument ``P`` that ``cls`` passes up its chain of generic bases to ``Method[P, RS]``."""
    env: dict[Any, Any] = {}
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin, args = typing.get_origin(base), typing.get_args(base)
            if origin is None:
                continue
            params = getattr(origin, "__parameters__", ())
            resolved = [env.get(a, a) for a in args]
            if origin is Method:
                return resolved[0]
            env.update(zip(params, resolved))
    return None


def test_every_registered_methods_generic_parameters_are_its_params_class():
    for name in METHODS.names():
        cls = METHODS.get(name)
        if name == "fedavg":  # the generic base of its family: its own P is unbound, Params is the default
            assert cls.Params.__name__ == "FedAvgParams"
            continue
        assert _generic_params(cls) is cls.Params, name


# ---------------------------------------------------------------------------------------------------------------
# Each refusal the tags imply: one line, at its key, before start


def test_methods_that_need_the_whole_dataset_are_refused_with_silos(make_config, tmp_path):
    cfg = make_config()
    needing = [n for n in METHODS.names() if METHODS.get(n).tags.needs_dataset]
    silos = cfg.data.model_copy(update={"silos": [{"dataset": "npz", "path": str(tmp_path / "a.npz")}]})
    siloed = cfg.model_copy(update={"data": silos})
    for name in needing:
        specs = resolve_methods({name: {}})
        check_tags(specs, setup_for(cfg), cfg)  # a simulation: accepted
        err = refusal(specs, setup_for(siloed), siloed)
        assert err.path == f"methods.{name}" and "without a dataset of their own with data.silos" in str(err)


def test_methods_scoring_in_their_own_way_are_refused_with_federated_evaluation(make_config):
    for evaluation in ("federated", "both"):
        cfg = make_config(evaluation=evaluation)
        for name in METHODS.names():
            specs = resolve_methods({name: {}})
            if METHODS.get(name).tags.federated_evaluation:
                check_tags(specs, setup_for(cfg), cfg)
                continue
            err = refusal(specs, setup_for(cfg), cfg)
            assert err.path == "evaluation" and f"central for method {name!r}" in str(err)


def test_methods_combining_weights_are_refused_when_the_clients_models_differ(make_config):
    cfg = make_config()
    other = ModelConfig(name="mlp", hidden=[8])
    setup = setup_for(cfg, client_models=(cfg.model, other, cfg.model))
    for name in METHODS.names():
        specs = resolve_methods({name: {}})
        if METHODS.get(name).tags.heterogeneous_clients:
            check_tags(specs, setup, cfg)
            continue
        err = refusal(specs, setup, cfg)
        assert err.path == "federation.client_overrides"
        assert str(err).startswith(f"federation.client_overrides: expected clients of one architecture for method {name!r}")
        assert "client 1 with models other than client 0's" in str(err)


def test_methods_reading_the_public_labels_are_refused_without_them(make_config):
    cfg = make_config()
    setup = setup_for(cfg, public_labeled=False)
    for name in METHODS.names():
        specs = resolve_methods({name: {}})
        if not METHODS.get(name).tags.public_labels:
            check_tags(specs, setup, cfg)
            continue
        err = refusal(specs, setup, cfg)
        assert str(err).startswith(f"data.public.labels: expected true (a labelled public sample) for method {name!r}")


def test_local_dp_sgd_is_refused_for_methods_that_release_more_than_their_local_models(make_config):
    cfg = make_config(train={"dp": {"noise_multiplier": 1.0, "delta": 1e-5}})
    for name in METHODS.names():
        tags = METHODS.get(name).tags
        specs = resolve_methods({name: {}})
        if tags.local_model_only or tags.oracle:
            check_tags(specs, setup_for(cfg), cfg)
            continue
        err = refusal(specs, setup_for(cfg), cfg)
        assert err.path == "train.dp" and f"not method {name!r}" in str(err)


def test_dp_is_refused_where_the_tags_say_it_does_not_apply(make_config):
    cfg = make_config()
    dp = {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.5}
    err = refusal(resolve_methods({"ref": {"method": "fedref", "dp": dp}}), setup_for(cfg), cfg)
    assert err.path == "methods.ref.dp" and str(err).startswith(
        "methods.ref.dp: expected no dp for method 'fedref' (its server step reads each client's training loss"
    )
    check_tags(resolve_methods({"avg": {"method": "fedavg", "dp": dp}}), setup_for(cfg), cfg)  # central DP applies to FedAvg
    with pytest.raises(InputError) as raised:  # a method with no dp option at all: refused as its entry is read
        resolve_methods({"gems": {"dp": dp}})
    assert raised.value.path == "methods.gems.dp" and "no dp for method 'gems' (it fuses statistics; dp acts on parameter updates" in str(
        raised.value
    )


def test_a_tag_refusal_on_the_command_line_is_one_line_and_starts_nothing(tmp_path, capsys):
    job = {
        "run": {"name": "tags", "seed": 0, "storage": str(tmp_path / "runs")},
        "data": {"dataset": "digits"},
        "partition": {"num_clients": 3},
        "model": {"name": "mlp", "hidden": [8]},
        "evaluation": "federated",
        "methods": {"average": {}, "kl": {"application": "bnn"}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["run", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfuse: error: evaluation: expected central for method 'kl'") and "\n" not in err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------------------
# A method of one's own with odd tags


class OddParams(MethodParams):
    k: int = 1


class Odd(Method[OddParams, None]):
    """A method that says it reads the whole dataset, the public labels and scores in its own way."""

    Params = OddParams
    tags = MethodTags(fuses="statistics", needs_dataset=True, federated_evaluation=False, public_labels=True)

    def run(self, server: ServerContext) -> MethodResult:
        raise AssertionError("a refused method never runs")


def test_a_method_of_ones_own_with_odd_tags_is_refused_before_start(make_config, tmp_path):
    cfg = make_config(evaluation="federated")  # the config's own methods score federatedly; Odd joins them as an object
    with pytest.raises(InputError) as raised:
        rayfuse.run(cfg, methods={"odd": Odd}, run_dir=tmp_path / "run", quiet=True)
    assert str(raised.value).startswith("evaluation: expected central for method 'Odd' (methods.odd:") and "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()
    specs = resolve_methods({"odd": {"k": 2}}, {"odd": Odd})
    assert specs[0].params.k == 2
    check_tags(specs, setup_for(make_config()), make_config())  # central evaluation, labelled public sample: accepted
    err = refusal(specs, setup_for(make_config(), public_labeled=False), make_config())
    assert err.path == "data.public.labels" and "for method 'Odd'" in str(err)


class OldStyle(Method[OddParams, None]):
    """A method written before the tags: its loose flag would be silently ignored."""

    Params = OddParams
    uses_local_models = True

    def run(self, server: ServerContext) -> MethodResult:
        raise AssertionError("a refused method never runs")


def test_a_method_setting_a_loose_capability_flag_is_refused_with_one_line():
    with pytest.raises(InputError) as raised:
        resolve_methods({"old": {}}, {"old": OldStyle})
    assert str(raised.value).startswith(
        "methods.old: expected capability flags in the method's tags (tags = "
        "MethodTags(uses_local_models=...)), not as class attributes of OldStyle"
    )
    with pytest.raises(InputError):
        resolve_methods({}, {"old": OldStyle()})
