"""Pre-start rules added in hardening round 4, one table row each: settings no method of the run can use, the
coordinator's memory for a method that gathers every client's model (each client's own model counted), distill's
nested ``aligned:`` block checked as the ``aligned`` entry it runs as (over the student's architecture and the clients
that have it), and ``rayfuse fuse`` distill's activation alignment without data. Exit 2, one line naming the key,
nothing written."""

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
# clients 0 and 1 train a model of about 150 KB of their own; the other three the run's of about 36 KB
WIDE = {"model": {"name": "mlp", "hidden": [512]}}
WIDE_CLIENTS = {"client_overrides": {0: WIDE, 1: WIDE}}
# within (5 + 2) x the run's model, below what the clients' own models take
COORDINATOR_400K = {"coordinator": {"memory": 400_000}, **WIDE_CLIENTS}

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
    (
        "per-actor-with-another-multi-round-method",  # fedlora's rounds are its own, not summed by the pipeline
        lambda t: _job(t, federation=PER_ACTOR, methods={"fedlora": {}}),
        "federation.aggregation",
        "not with fedlora",
    ),
    (
        "per-node-on-ray-without-rounds",
        lambda t: _job(t, federation={"backend": "ray", "aggregation": "per_node"}, methods={"local": {}, "aligned": {}}),
        "federation.aggregation",
        "(per_node serves fedadagrad, fedadam, fedavg",
    ),
    (
        "per-actor-with-a-robust-rule-only",  # the FedAvg family, but every round would gather
        lambda t: _job(t, federation=PER_ACTOR, methods={"tm": {"method": "fedavg", "aggregator": {"name": "trimmed_mean", "beta": 0.2}}}),
        "federation.aggregation",
        "flat or unset with methods.tm.aggregator 'trimmed_mean'",
    ),
    (
        "per-actor-with-a-robust-rule-beside-the-mean",
        lambda t: _job(t, federation=PER_ACTOR, methods={"fedavg": {}, "med": {"method": "fedprox", "aggregator": {"name": "median"}}}),
        "federation.aggregation",
        "methods.med.aggregator 'median' (per_actor partial sums need a rule that is a sum",
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
    (
        "distill-teachers-of-their-own-size",  # each client's own model counted, held twice (uploads and teachers)
        lambda t: _job(t, federation=COORDINATOR_400K, methods={"distill": {"init": "random"}}),
        "methods.distill.teachers",
        "held twice: the uploads and the teachers built from them), got '880.5 KiB (gathered: 5 local models, 405.2 KiB)'",
    ),
    (
        "ensemble-members-of-their-own-size",
        lambda t: _job(t, federation=COORDINATOR_400K, methods={"ensemble": {}}),
        "methods.ensemble",
        "(federation.coordinator.memory: 390.6 KiB), got '475.3 KiB (gathered: 5 local models, 405.2 KiB)'",
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
    (
        "nested-aligned-krum-over-the-clients-of-the-students-architecture",  # 3 of the 5 clients have it
        lambda t: _job(t, federation=WIDE_CLIENTS, methods={"distill": {"aligned": {"aggregator": {"name": "krum", "f": 1}}}}),
        "methods.distill.aligned.aggregator.f",
        "with n = 3 clients, got 1; lower f or use more clients; the aligned start merges the 3 clients of the student's "
        "architecture, [2, 3, 4]",
    ),
    (
        "nested-aligned-krum-for-a-student-of-two-clients",
        lambda t: _job(
            t, federation=WIDE_CLIENTS, methods={"distill": {"student": WIDE["model"], "aligned": {"aggregator": {"name": "krum", "f": 0}}}}
        ),
        "methods.distill.aligned.aggregator.f",
        "the aligned start merges the 2 clients of the student's architecture, [0, 1]",
    ),
]


@pytest.mark.parametrize(("make", "key", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_setting_the_run_cannot_use_is_one_line_before_start(tmp_path, capsys, make, key, words):
    refused_before_start(tmp_path, capsys, make(tmp_path), key, words)


ACCEPTED = [
    (
        "distill-with-teachers-on-their-clients-gathers-no-model",
        {**TINY_COORDINATOR},
        {"distill": {"teachers": "clients", "init": "random"}},
    ),
    (
        "per-actor-with-central-dp",
        PER_ACTOR,
        {"dp": {"method": "fedavg", "dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.5}}},
    ),
    ("per-actor-with-the-mean-and-clip-norm", PER_ACTOR, {"c": {"method": "fedavg", "aggregator": {"clip_norm": 1.0}}}),
    (  # no client has the student's architecture: the student starts at random and the aligned block is unused
        "nested-aligned-block-of-a-student-no-client-has",
        {},
        {"distill": {"student": WIDE["model"], "aligned": {"aggregator": {"name": "krum", "f": 5}}}},
    ),
]


@pytest.mark.parametrize(("federation", "methods"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_what_the_run_can_use_passes_validate(tmp_path, capsys, federation, methods):
    from rayfuse.cli import main

    assert main(_job(tmp_path, federation=federation, methods=methods)) == 0, capsys.readouterr().err


def test_a_silo_runs_gathered_models_are_held_to_the_coordinators_memory_after_its_survey(tmp_path):
    # the models' sizes are known once the silos reported their shape: refused then, before any client trains
    from rayfuse.errors import InputError
    from tests.test_silo_runs import _job as silo_job
    from tests.test_silo_runs import _run

    job = silo_job(tmp_path, {"ensemble": {}})
    job["federation"] = {**job["federation"], "coordinator": {"memory": 1000}}
    with pytest.raises(InputError) as info:
        _run(tmp_path, job)
    assert info.value.path == "methods.ensemble" and "gathered: 3 local models" in str(info.value)
    assert not (tmp_path / "runs" / "r" / "results.json").exists()


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
