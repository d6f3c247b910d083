"""``aligned``: the federated aligned fusion, end to end in-process; what a client sends; bad replies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfuse.fusion.aligned.algorithm import batchnorm, correlations, derive_run_spec
from rayfuse.io import load_params
from rayfuse.method import METHODS
from rayfuse.models import build_model, set_params

INDEPENDENT = {
    "train": {"epochs": 8, "shared_init": False},
    "model": {"name": "mlp", "hidden": [32]},
    "partition": {"method": "iid", "num_clients": 3},
}


def accuracy(coord, label):
    return coord.run_method(label)["metrics"]["accuracy"]


def test_aligned_fusion_of_independently_initialised_models_beats_averaging(coordinator):
    methods = {"average": {}, "act": {"method": "aligned", "alignment": "activation"}, "wm": {"method": "aligned", "alignment": "weight"}}
    coord = coordinator(methods=methods, **INDEPENDENT)
    average, act, wm = (accuracy(coord, label) for label in methods)
    assert act > average + 0.1 and wm > average + 0.05, (average, act, wm)


def test_fusing_copies_of_one_model_returns_the_model(coordinator):
    coord = coordinator(
        methods={
            "act": {"method": "aligned"},
            "wm": {"method": "aligned", "alignment": "weight"},
            "fisher": {"method": "aligned", "merge": "fisher"},
        },
        **INDEPENDENT,
    )
    coord.prepare_local_models()
    params = coord.reference_params()
    for i in range(3):  # the clients own their local models: the same model on every client
        coord.federation.client(i).ctx._local_model = set_params(
            build_model(coord.cfg.model, coord.plan.input_shape, coord.plan.num_classes), params
        )
    for label in ("act", "wm", "fisher"):
        fused = load_params(coord.store.root / coord.run_method(label)["model_file"])
        for key in params:
            np.testing.assert_allclose(fused[key], params[key], rtol=1e-5, atol=1e-6, err_msg=f"{label}: {key}")


def test_a_clients_correlation_reply_holds_per_group_sums_only(coordinator):
    coord = coordinator(methods={"act": {"method": "aligned"}}, **INDEPENDENT)
    model = build_model(coord.cfg.model, coord.plan.input_shape, coord.plan.num_classes, seed=0)
    spec = derive_run_spec(model, tuple(coord.plan.input_shape))
    reference = coord.reference_params()
    gathered = coord.federation.run(correlations, reference, spec, label="act", samples=None, batch_size=64)
    sizes = {g.name: g.size for g in spec.groups}
    n_train = {c: len(coord.plan.client_train[c]) for c in gathered.results}
    for client, reply in gathered.results.items():
        assert set(reply) == {g.name for g in spec.groups if g.probes}
        for name, arrays in reply.items():
            d = sizes[name]
            assert {k: np.shape(v) for k, v in arrays.items()} == {
                "count": (),
                "sum_a": (d,),
                "sum_b": (d,),
                "sumsq_a": (d,),
                "sumsq_b": (d,),
                "cross": (d, d),
            }
            assert float(arrays["count"]) == n_train[client]  # a sum over the client's samples, not the samples


def test_the_batchnorm_reply_is_a_count_a_mean_and_a_variance_per_layer(coordinator):
    coord = coordinator(
        methods={"aligned": {}},
        model={"name": "cnn", "channels": [4, 6]},
        partition={"method": "iid", "num_clients": 2},
        train={"epochs": 1},
    )
    fused = coord.reference_params()
    reply = coord.federation.run(batchnorm, fused, label="aligned", samples=None, batch_size=64).results
    for stats in reply.values():
        for name, s in stats.items():
            assert set(s) == {"count", "mean", "var"} and np.shape(s["count"]) == ()
            assert np.shape(s["mean"]) == np.shape(s["var"]) == np.shape(fused[f"{name}.running_mean"])


def test_a_client_sending_non_finite_statistics_is_rejected_and_recorded(coordinator):
    faults = [{"client": 1, "step": "aligned.correlations", "mode": "nan", "call": 1}]
    coord = coordinator(methods={"act": {"method": "aligned", "sweeps": 2}}, federation={"faults": faults}, **INDEPENDENT)
    summary = coord.run_method("act")
    rejected = [e for e in coord.events.since(0) if e["kind"] == "update_rejected"]
    assert [e["client"] for e in rejected] == [1] and "non-finite" in rejected[0]["message"]
    assert np.isfinite(summary["metrics"]["accuracy"])


def test_an_explicit_spec_that_does_not_fit_the_model_is_refused_before_anything_starts(make_config):
    from rayfuse.errors import InputError
    from rayfuse.runner import prepare_run

    bad = {"groups": [{"name": "h", "size": 99, "axes": [{"key": "layers.0.weight", "dim": 0}]}]}
    with pytest.raises(InputError, match=r"^methods\.aligned\.spec\.h\.layers\.0\.weight: expected 1 x 99 x 1 units"):
        prepare_run(make_config(methods={"aligned": {"spec": bad}}))


class UserNet(torch.nn.Module):
    """A model the registry does not know: conv, BatchNorm, a residual 1x1 branch, flatten, two linears."""

    def __init__(self, input_shape=(1, 8, 8), num_classes=10):
        super().__init__()
        self.conv = torch.nn.Conv2d(input_shape[0], 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.side = torch.nn.Conv2d(6, 6, 1)
        self.fc = torch.nn.Linear(6 * 4 * 4, 24)
        self.out = torch.nn.Linear(24, num_classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        h = torch.nn.functional.max_pool2d(h + self.side(h), 2)
        return self.out(torch.relu(self.fc(torch.flatten(h, 1))))


def test_a_users_model_class_is_aligned_and_fused_through_the_python_api(tmp_path):
    import rayfuse

    config = {
        "data": {"dataset": "digits"},
        "partition": {"method": "iid", "num_clients": 2},
        "train": {"epochs": 3},
        "methods": {"average": {}, "aligned": {"sweeps": 2}},
    }
    result = rayfuse.run(config, model=UserNet, backend="local", run_dir=tmp_path / "run", quiet=True)
    info = result.results["methods"]["aligned"]["info"]
    assert info["groups"] == 2 and info["repaired"] is True  # conv, bn and both sides of the addition (side reads and writes them); fc
    assert result.metrics.loc["aligned", "accuracy"] > 0.5
    assert isinstance(result.model("aligned"), UserNet)


def test_the_nonparametric_merge_grows_the_global_model_and_trains_it_at_its_widths(coordinator):
    methods = {
        "np": {"method": "aligned", "merge": "nonparametric", "new_unit_threshold": 1.0, "max_width": 2.0, "repair": False},
        "np-rounds": {"method": "aligned", "merge": "nonparametric", "rounds": 2, "new_unit_threshold": 1.0, "max_width": 1.5},
    }
    coord = coordinator(methods=methods, **INDEPENDENT)
    one = coord.run_method("np")
    fused = load_params(coord.store.root / one["model_file"])
    assert fused["layers.0.weight"].shape[0] == 64  # every hidden unit new, capped at 2 x 32
    assert one["info"]["widths"] == {"layers.0": 64} and one["info"]["new_units"] == 32
    assert 0.0 <= one["metrics"]["accuracy"] <= 1.0
    rounds = coord.run_method("np-rounds")
    assert load_params(coord.store.root / rounds["model_file"])["layers.0.weight"].shape[0] == 48
    assert rounds["info"]["rounds"] == 2 and np.isfinite(rounds["metrics"]["accuracy"])


def test_a_grown_model_with_batchnorm_is_repaired_by_the_clients_at_its_widths(coordinator):
    coord = coordinator(
        methods={"np": {"method": "aligned", "merge": "nonparametric", "new_unit_threshold": 1.0, "max_width": 1.5}},
        train={"epochs": 1, "shared_init": False},
        model={"name": "rescnn", "channels": [4, 6]},
        partition={"method": "iid", "num_clients": 2},
    )
    result = coord.run_method("np")
    fused = load_params(coord.store.root / result["model_file"])
    widths = result["info"]["widths"]
    assert result["info"]["repaired"] and sorted(widths.values()) == [6, 6, 9, 9]  # every group 1.5 x its 4 or 6 channels
    grown = [k for k, v in fused.items() if k.endswith("running_var") and v.shape[0] in (6, 9)]
    assert grown and np.isfinite(result["metrics"]["accuracy"])


def test_repair_rescales_the_hidden_layers_of_a_model_without_batchnorm_from_per_layer_statistics(coordinator):
    from rayfuse.alignment import repair_units
    from rayfuse.fusion.aligned.algorithm import repair_stats, unit_stats

    coord = coordinator(methods={"act": {"method": "aligned"}, "plain": {"method": "aligned", "repair": False}}, **INDEPENDENT)
    repaired, plain = coord.run_method("act"), coord.run_method("plain")
    assert repaired["info"]["rescaled_layers"] == ["layers.0"] and "rescaled_layers" not in plain["info"]
    a = load_params(coord.store.root / repaired["model_file"])
    b = load_params(coord.store.root / plain["model_file"])
    assert not np.allclose(a["layers.0.bias"], b["layers.0.bias"])  # the rescaling moved the hidden layer
    np.testing.assert_array_equal(a["layers.1.weight"], b["layers.1.weight"])  # and nothing else
    model = build_model(coord.cfg.model, coord.plan.input_shape, coord.plan.num_classes, seed=0)
    spec = derive_run_spec(model, tuple(coord.plan.input_shape))
    units = repair_units(model, spec)
    for step, args in ((unit_stats, (spec, spec.identity(), units)), (repair_stats, (coord.reference_params(), units))):
        gathered = coord.federation.run(step, *args, label="act", samples=None, batch_size=64)
        for client, reply in gathered.results.items():  # a count, a mean and a variance per layer: nothing per sample
            assert {k: {f: np.shape(v) for f, v in r.items()} for k, r in reply.items()} == {
                "layers.0": {"count": (), "mean": (32,), "var": (32,)}
            }
            assert float(reply["layers.0"]["count"]) == len(coord.plan.client_train[client])


def test_every_parameter_of_the_method_and_of_rayfuse_fuse_is_documented():
    from pathlib import Path

    from rayfuse.fusion.aligned.algorithm import AlignedParams
    from rayfuse.merging.fusers import AlignParams

    page = (Path(__file__).resolve().parents[3] / "docs" / "methods" / "aligned.md").read_text(encoding="utf-8")
    table = page[page.index("## Parameters") : page.index("## What leaves a client")]
    missing = [name for cls in (AlignedParams, AlignParams) for name in cls.model_fields if f"`{name}`" not in table]
    assert not missing, missing


def test_aligned_tags_are_its_papers():
    """Rounds of aligning the clients' models; merged by the pipeline's rule (average) or matched into new units
    (nonparametric) it combines weights, weighed by statistics of the clients' data (fisher, regmean) it does not."""
    aligned = METHODS.get("aligned")
    assert aligned.tags.multi_round and aligned.tags.uses_local_models and not aligned.tags.local_model_only
    assert not (aligned.tags.oracle or aligned.tags.heterogeneous_clients)
    assert aligned.tags_for(aligned.Params(merge="regmean")).fuses == "statistics" == aligned.tags_for(aligned.Params(merge="fisher")).fuses
    assert aligned.tags_for(aligned.Params(merge="nonparametric")).fuses == "parameters" == aligned.tags_for(aligned.Params()).fuses
