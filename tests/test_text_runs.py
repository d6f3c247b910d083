"""Federated text runs (issue 43, item 3): sites holding ``.jsonl`` texts, a tiny BERT ``hf:`` folder (its word
tokenizer built here), the server's public texts a ``.txt`` file without labels. ``local``, ``ensemble``, ``distill``
(transfer: public), ``fedavg``, ``fedlora`` and ``fedmerge`` run in-process; on a local Ray a text run gives the
in-process numbers, and a run cut by a failed client resumes to the same model."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest

import rayfuse
from rayfuse.config import validate_config
from rayfuse.errors import RunFailure
from rayfuse.runner import InProcessBackend, run_experiment
from tests.data.test_text_silos import texts, tiny_text_bert


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three text silos of 30 rows (label-skewed: site 2 mostly 'mood'), the public texts and the model folder."""
    root = tmp_path_factory.mktemp("text_sites")
    bert = tiny_text_bert(root / "bert")
    silos = []
    for i, labels in enumerate((("tech", "mood"), ("tech", "mood", "tech"), ("mood", "mood", "tech"))):
        path = root / f"site{i}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in texts(30, seed=i, labels=labels)), encoding="utf-8")
        silos.append({"dataset": "jsonl", "path": str(path), "text": "q", "label": "cat", "val_size": 0.2})
    (root / "public.txt").write_text("\n".join(r["q"] for r in texts(20, seed=7)) + "\n", encoding="utf-8")
    return {
        "run": {"name": "text", "seed": 0},
        "data": {"silos": silos, "public": {"dataset": "txt", "path": str(root / "public.txt"), "labels": False}, "max_length": 10},
        "model": {"name": f"hf:{bert}"},
        "train": {"epochs": 2, "batch_size": 8, "lr": 0.01, "shared_init": True},
        "federation": {"backend": "local"},
    }


def _job(sites: dict[str, Any], methods: dict[str, Any], **sections: Any) -> dict[str, Any]:
    job = copy.deepcopy(sites)
    job["methods"] = methods
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value}
    return job


METHODS = {
    "local": {},
    "ensemble": {},
    "distill": {"transfer": "public", "init": "average", "epochs": 2, "steps": 40, "batch_size": 16},
    "fedavg": {"rounds": 2, "local_epochs": 1},
    "fedlora": {"rounds": 2, "local_epochs": 1},
    "fedmerge": {},
}


@pytest.mark.parametrize(
    "methods",
    [{k: METHODS[k]} for k in ("local", "ensemble", "distill")] + [{k: METHODS[k]} for k in ("fedavg", "fedlora", "fedmerge")],
    ids=list(METHODS),
)
def test_each_method_runs_on_text_silos_in_process(sites, methods, tmp_path) -> None:
    run = rayfuse.run(_job(sites, methods), run_dir=tmp_path / "r", quiet=True)
    (label,) = methods
    entry = run.results["methods"][label]
    assert run.results["status"] == "succeeded" and 0.0 <= entry["accuracy"] <= 1.0
    assert [row["client"] for row in entry["client_metrics"]] == [0, 1, 2]
    written = (tmp_path / "r" / "config.yaml").read_text()
    assert "tokenizer:" in written and "max_length: 10" in written  # the run records how its texts were tokenised
    manifest = json.loads((tmp_path / "r" / "partition.json").read_text())
    assert manifest["input_shape"] == [10] and "site0" not in json.dumps(manifest)


def test_predictions_only_distill_on_public_texts_sends_the_server_no_parameters(sites, tmp_path, received_replies) -> None:
    """``teachers: clients``: each site scores the server's public texts with its own model; only the predictions come back."""
    method = {"method": "distill", "teachers": "clients", "transfer": "public", "init": "random", "epochs": 2, "steps": 40}
    run = rayfuse.run(_job(sites, {"distill_clients": method}), run_dir=tmp_path / "r", quiet=True)
    entry = run.results["methods"]["distill_clients"]
    assert run.results["status"] == "succeeded" and 0.0 <= entry["accuracy"] <= 1.0
    state = run.models["distill_clients"]
    assert all(np.isfinite(v).all() for v in state.values())
    shapes = {tuple(v.shape) for v in state.values() if np.ndim(v) >= 1 and np.size(v) > 64}
    steps = {step for step, _, _ in received_replies}
    assert any("predict" in step or "logits" in step for step in steps), steps
    for step, client, reply in received_replies:  # no tensor of the model's (a weight matrix, an embedding) comes back
        assert not _arrays(reply) & shapes, (step, client, sorted(_arrays(reply) & shapes))


def _arrays(value: Any) -> set[tuple[int, ...]]:
    """The shapes of every array anywhere in a reply."""
    if isinstance(value, np.ndarray):
        return {tuple(value.shape)}
    if isinstance(value, dict):
        return set().union(*(_arrays(v) for v in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(_arrays(v) for v in value)) if value else set()
    return {tuple(value.shape)} if hasattr(value, "shape") and hasattr(value, "dtype") else set()


def test_distill_on_public_texts_reaches_the_local_models(sites, tmp_path) -> None:
    run = rayfuse.run(_job(sites, {"local": {}, "distill": METHODS["distill"]}, train={"epochs": 4}), run_dir=tmp_path / "r", quiet=True)
    accuracy = {k: v["accuracy"] for k, v in run.results["methods"].items()}
    assert accuracy["distill"] >= accuracy["local"] - 0.2, accuracy


@pytest.mark.ray
def test_a_text_run_on_ray_gives_the_in_process_numbers(sites, tmp_path, ray_session) -> None:
    from actors.backend import RayBackend

    methods = {"fedavg": METHODS["fedavg"], "ensemble": {}}
    local = run_experiment(
        validate_config(_job(sites, methods)), InProcessBackend(), tmp_path / "local", printer=lambda e: None, show_tables=False
    )
    on_ray = run_experiment(
        validate_config(_job(sites, methods, federation={"backend": "ray", "clients_per_actor": 3})),
        RayBackend(),
        tmp_path / "ray",
        printer=lambda e: None,
        show_tables=False,
    )
    for label in methods:
        for key in ("accuracy", "nll", "client_metrics"):
            assert on_ray["methods"][label][key] == local["methods"][label][key], (label, key)


def test_a_text_run_cut_by_a_failed_client_resumes_to_the_same_model(sites, tmp_path) -> None:
    methods = {"fedavg": {"rounds": 3, "local_epochs": 1}}
    whole = rayfuse.run(_job(sites, methods), run_dir=tmp_path / "whole", quiet=True)
    cut = _job(sites, methods, federation={"on_client_failure": "fail", "faults": [{"client": 1, "step": "fedavg.fit", "call": 2}]})
    with pytest.raises(RunFailure):
        rayfuse.run(cut, run_dir=tmp_path / "cut", quiet=True)
    resumed = rayfuse.resume(tmp_path / "cut", overrides=["federation.faults=[]"], quiet=True)
    for key, value in whole.models["fedavg"].items():
        assert np.array_equal(value, resumed.models["fedavg"][key]), key
    assert resumed.results["methods"]["fedavg"]["accuracy"] == whole.results["methods"]["fedavg"]["accuracy"]


def test_the_server_scores_on_its_own_labeled_texts(sites, tmp_path) -> None:
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(row) + "\n" for row in texts(16, seed=11)), encoding="utf-8")
    job = _job(sites, {"fedavg": METHODS["fedavg"]}, data={"test": {"dataset": "jsonl", "path": str(test), "text": "q", "label": "cat"}})
    job["evaluation"] = "central"
    run = rayfuse.run(job, run_dir=tmp_path / "r", quiet=True)
    assert run.results["evaluation"] == "central" and 0.0 <= run.results["methods"]["fedavg"]["accuracy"] <= 1.0
    assert json.loads((tmp_path / "r" / "partition.json").read_text())["roles"]["test"]["size"] == 16
