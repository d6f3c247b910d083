"""Pre-start rules added in hardening round 4, one table row each: settings no method of the run can use, the
coordinator's memory for a method that gathers every client's model, distill's nested ``aligned:`` block checked as
an ``aligned`` entry, and ``rayfuse fuse`` distill's activation alignment without data. Exit 2, one line naming the
key, nothing written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.nn as nn

from tests.config.test_bad_inputs import Files, refused_line
from tests.test_bounds import job, refused_before_start


def _job(tmp_path: Path, **sections: Any) -> list[str]:
    return ["validate", job(tmp_path, **sections)]


PER_ACTOR = {"aggregation": "per_actor", "clients_per_actor": 2, "streaming": True}
TINY_COORDINATOR = {"coordinator": {"memory": 100_000}}

CASES = [
    # 7. an aggregation mode no round can use
    (
        "per-actor-without-rounds",
        lambda t: _job(t, federation=PER_ACTOR, methods={"average": {}, "ensemble": {}}),
        "federation.aggregation",
        "no configured method folds rounds of updates into sums (per_actor serves fedadagrad, fedadam, fedavg",
    ),
    (
        "per-actor-with-distill-only",
        lambda t: _job(t, federation=PER_ACTOR, methods={"distill": {}}),
        "federation.aggregation",
        "not with distill",
    ),
    # 8. the coordinator's memory holds distill's teachers
    (
        "distill-gathers-beyond-coordinator-memory",
        lambda t: _job(t, federation=TINY_COORDINATOR, methods={"distill": {}}),
        "methods.distill.teachers",
        "gathered: 5 local models",
    ),
    (
        "distill-free-gathers-beyond-coordinator-memory",
        lambda t: _job(t, federation=TINY_COORDINATOR, methods={"free": {"method": "distill", "transfer": "synthetic"}}),
        "methods.free.teachers",
        "teachers: clients keeps each local model on its client",
    ),
    # 9. distill's nested aligned: the aligned method's own checks and the pipeline's
    (
        "nested-aligned-krum-precondition",
        lambda t: _job(
            t, partition={"num_clients": 3}, methods={"distill": {"aligned": {"aggregator": {"name": "krum", "f": 5}, "merge": "average"}}}
        ),
        "methods.distill.aligned.aggregator.f",
        "krum",
    ),
    (
        "nested-aligned-bad-spec",
        lambda t: _job(t, methods={"distill": {"aligned": {"spec": {"nope": 1}}}}),
        "methods.distill.aligned.spec",
        "",
    ),
    (
        "nested-aligned-robust-rule-with-a-merge",
        lambda t: _job(t, methods={"distill": {"aligned": {"aggregator": {"name": "median"}, "merge": "nonparametric"}}}),
        "methods.distill.aligned.aggregator",
        "the default mean with merge 'nonparametric'",
    ),
]


@pytest.mark.parametrize(("make", "key", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_setting_the_run_cannot_use_is_one_line_before_start(tmp_path, capsys, make, key, words):
    refused_before_start(tmp_path, capsys, make(tmp_path), key, words)


def test_distill_with_teachers_on_their_clients_gathers_no_model(tmp_path, capsys):
    from rayfuse.cli import main

    argv = _job(tmp_path, federation=TINY_COORDINATOR, methods={"distill": {"teachers": "clients", "init": "random"}})
    assert main(argv) == 0, capsys.readouterr().err


FUSE_DISTILL_WITHOUT_DATA = [
    ("activation-synthetic", {"input_shape": [3]}, {"transfer": "synthetic", "alignment": "activation"}, "alignment: activation"),
    ("activation-no-input-shape", {}, {"alignment": "activation"}, "alignment: activation"),
    ("activation-nonparametric", {}, {"alignment": "activation", "merge": "nonparametric"}, "alignment: activation"),
    ("public-no-input-shape", {}, {"transfer": "public"}, "transfer: public"),
]


@pytest.mark.parametrize(
    ("shape", "parameters", "why"), [c[1:] for c in FUSE_DISTILL_WITHOUT_DATA], ids=[c[0] for c in FUSE_DISTILL_WITHOUT_DATA]
)
def test_fuse_distill_that_reads_data_without_it_names_the_data_key(tmp_path, capsys, monkeypatch, shape, parameters, why):
    # 10. refused from the fuse file alone, before a model is read: no torch warning, the data key named (not
    # input_shape, which the data would give)
    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    fuse = f.fuse(
        merge_method="distill",
        architecture="torch.nn:Linear",
        architecture_args={"in_features": 3, "out_features": 4},
        parameters=parameters,
        **shape,
    )
    line = refused_line(["fuse", fuse], capsys)
    assert line.startswith("rayfuse: error: fuse.yaml: data: expected a sample") and why in line, line
    assert not (tmp_path / "fused.safetensors").exists()


class ThreeClasses(nn.Sequential):
    """A 4 -> 8 -> 3 MLP for the fuse file below (module:Class)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("merge", ["fisher", "average"])
def test_fuse_refuses_labels_beyond_the_models_outputs_before_any_merge(tmp_path, capsys, monkeypatch, merge):
    # labels 0..9 for a 3-output model: a Fisher's log-likelihood would index past the logits (a RuntimeError before)
    import numpy as np
    import torch

    monkeypatch.chdir(tmp_path)
    f = Files(tmp_path)
    torch.manual_seed(0)
    models = [f.params(f"s{i}.safetensors", dict(ThreeClasses().state_dict())) for i in range(2)]
    data = f.npz("ten.npz", y=np.arange(60) % 10)
    fuse = f.fuse(
        models=models,
        merge_method="weight_matching",
        architecture=f"{__name__}:ThreeClasses",
        data={"path": data},
        parameters={"merge": merge},
    )
    line = refused_line(["fuse", fuse], capsys)
    assert line == "rayfuse: error: fuse.yaml: data.path: expected class labels in [0, 3) (the model's 3 outputs), got 'labels 0..9'", line
    assert not (tmp_path / "fused.safetensors").exists()
