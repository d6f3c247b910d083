"""The refusals' wording comes from the methods' tags, not from hand-kept lists: ``train.dp`` names every
``local_model_only`` method, a ``dp`` refusal lists every method whose ``dp`` applies (central DP-FedAvg and the
clients' upload DP), and clients of different models are refused in the words of what the method fuses."""

from __future__ import annotations

from typing import Any

import pytest

from rayfuse.config import ModelConfig
from rayfuse.errors import InputError
from rayfuse.method import METHODS, MethodSpec, RunSetup, dp_options, dp_refusal, resolve_methods
from rayfuse.prestart import check_tags
from rayfuse.updates.pipeline import check_update_pipeline
from tests.test_method_tags import setup_for

DP = {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.5}


def refusal(specs: Any, setup: RunSetup, cfg: Any) -> InputError:
    with pytest.raises(InputError) as raised:
        check_tags(specs, setup, cfg)
    assert "\n" not in str(raised.value)
    return raised.value


def test_dp_options_are_read_from_the_params_and_tags():
    options = dp_options()
    assert sorted(options) == ["central DP-FedAvg", "upload DP (each client clips and noises its upload)"]
    central, upload = options["central DP-FedAvg"], options["upload DP (each client clips and noises its upload)"]
    assert {"fedadagrad", "fedadam", "fedavg", "fedlora", "fedprox", "fedyogi"} <= set(central) and "fedref" not in central  # its no_dp
    assert {"aligned", "average"} <= set(upload) and central == sorted(central) and upload == sorted(upload)


def test_the_train_dp_refusal_lists_every_local_model_only_method_and_lets_oracles_pass(make_config):
    cfg = make_config(train={"dp": {"noise_multiplier": 1.0, "delta": 1e-5}})
    err = refusal(resolve_methods({"fedavg": {}}), setup_for(cfg), cfg)
    released = [name for name, cls in METHODS.items() if cls.tags.local_model_only]
    assert {"local", "average", "ensemble", "distill"} <= set(released)
    assert str(err).startswith(
        f"train.dp: expected methods whose clients release only their DP-trained local models "
        f"({', '.join(released)}; oracles pass as non-private references), not method 'fedavg'"
    )
    upload = dp_options()["upload DP (each client clips and noises its upload)"]
    assert f"upload DP (each client clips and noises its upload) on {', '.join(upload)}" in str(err) and "aligned" in upload
    check_tags(resolve_methods({"distill": {}, "global": {}}), setup_for(cfg), cfg)  # what the line says passes, passes


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("local", "it has no differential-privacy option"),
        ("gems", "it fuses statistics; dp acts on parameter updates"),
        ("kl", "it fuses posteriors; dp acts on parameter updates"),
    ],
)
def test_a_dp_entry_on_a_method_without_one_names_every_method_whose_dp_applies(name, why):
    with pytest.raises(InputError) as raised:
        resolve_methods({name: {"dp": DP}})
    assert str(raised.value) == (
        f"methods.{name}.dp: expected no dp for method {name!r} ({why}), got {DP!r}; methods.<label>.dp is "
        "central DP-FedAvg on fedadagrad, fedadam, fedavg, fedlora, fedprox, fedyogi; upload DP (each client clips "
        "and noises its upload) on aligned, average"
    )


def test_dp_refusal_reads_what_the_params_fuse():
    aligned = METHODS.get("aligned")
    err = dp_refusal(aligned, "aligned", "methods.a.dp", params=aligned.Params(merge="fisher", alignment="weight"))
    assert "(it fuses statistics; dp acts on parameter updates)" in str(err)
    assert "(it has no differential-privacy option)" in str(dp_refusal(aligned, "aligned", "methods.a.dp"))


def test_the_pipeline_dp_refusal_ends_with_the_methods_whose_dp_applies(make_config):
    cfg = make_config()
    aligned = METHODS.get("aligned")
    params = aligned.Params.model_validate({"merge": "fisher", "alignment": "weight", "dp": {"clip_norm": 1.0, "noise_multiplier": 1.0}})
    with pytest.raises(InputError) as raised:
        check_update_pipeline([MethodSpec("a", "aligned", aligned, params)], setup_for(cfg), [])
    assert str(raised.value).startswith(
        "methods.a.dp: expected no dp for method 'aligned' (it fuses statistics; dp acts on parameter "
        "updates), got 'a dp section'; methods.<label>.dp is central DP-FedAvg on "
    )


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("fedavg", "combines the clients' weights, in one layout"),
        ("aligned", "combines the clients' weights, in one layout"),
        ("kl", "fuses posteriors over the clients' weights, in one layout"),
        ("spahm", "fuses posteriors over the clients' weights, in one layout"),
        ("dp_cluster", "fuses posteriors over the clients' weights, in one layout"),
        ("epgan", "fuses posteriors over the clients' weights, in one layout"),
        ("fedsa", "fuses statistics of the clients' models, in one layout"),
        ("gems", "fuses statistics of the clients' models, in one layout"),
        ("scratch", "builds every model it trains or scores in the run's one architecture"),
    ],
)
def test_clients_of_different_models_are_refused_in_the_words_of_what_the_method_fuses(make_config, name, words):
    cfg = make_config()
    assert not METHODS.get(name).tags.heterogeneous_clients
    other = ModelConfig(name="mlp", hidden=[8])
    err = refusal(resolve_methods({name: {}}), setup_for(cfg, client_models=(cfg.model, other, cfg.model)), cfg)
    assert str(err).startswith(
        f"federation.client_overrides: expected clients of one architecture for method {name!r} "
        f"(methods.{name} {words}), got client 1 with models other than client 0's"
    )
    err = refusal(resolve_methods({name: {}}), setup_for(cfg, client_models=(other,) * 3), cfg)
    assert str(err).startswith(
        f"federation.client_overrides: expected clients of the run's architecture (model: {cfg.model.name}) "
        f"for method {name!r} (methods.{name} {words} and scores in the server's model)"
    )


def test_a_params_dependent_fuse_words_the_client_models_refusal(make_config):
    cfg = make_config()
    other = ModelConfig(name="mlp", hidden=[8])
    specs = resolve_methods({"a": {"method": "aligned", "merge": "regmean", "alignment": "weight"}})
    err = refusal(specs, setup_for(cfg, client_models=(cfg.model, other, cfg.model)), cfg)
    assert "(methods.a fuses statistics of the clients' models, in one layout)" in str(err)


def test_a_long_path_keeps_its_file_name_in_the_one_line_and_other_long_values_are_cut_at_the_end():
    deep = "/tmp/" + "/".join(["a-long-temporary-folder"] * 6) + "/nope.npz"  # 150 characters: whole
    assert repr(deep) in str(InputError("data.path", "an existing .npz file", deep))
    deeper = "/tmp/" + "/".join(["a-long-temporary-folder"] * 12) + "/nope.npz"  # 300: cut in the middle
    line = str(InputError("data.path", "an existing .npz file", deeper))
    assert "\n" not in line and line.endswith("/nope.npz'") and "..." in line and len(line) < 300
    many = str(InputError("x.y", "a short list", list(range(100))))
    assert many.endswith("...") and len(many) < 120
