"""Every method's ``check``: a method-versus-config mismatch is refused by ``rayfuse validate`` / ``rayfuse run`` /
``rayfuse tune --check`` with exit code 2 and one line naming the key, before any actor starts or any client trains."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayfuse.cli import main
from rayfuse.config import validate_config
from rayfuse.errors import InputError
from rayfuse.runner import Backend, prepare_run, run_experiment

BASE: dict[str, Any] = {
    "run": {"name": "checks", "seed": 0},
    "data": {"dataset": "digits", "public_size": 0.1},
    "partition": {"method": "iid", "num_clients": 2},
    "model": {"name": "mlp", "hidden": [8]},
    "train": {"epochs": 1},
    "federation": {"backend": "local"},
    "methods": {"local": {}},
}
CNN = {"name": "cnn", "channels": [4]}
GMM = {
    "data": {"dataset": "kl_gmm", "options": {"num_groups": 2, "points": 20}, "val_size": 0, "public_size": 0},
    "partition": {"method": "labels", "num_clients": 2, "groups": [[0], [1]]},
}
LDA = {
    "data": {
        "dataset": "kl_lda",
        "options": {"num_topics": 4, "vocabulary": 30, "num_groups": 2, "docs": 20, "test_docs": 10, "min_topics": 2, "max_topics": 2},
        "public_size": 0,
    },
    "partition": {"method": "labels", "num_clients": 2, "groups": [[0], [1]]},
}
FEDSA = {"method": "fedsa", "k": 2, "student": CNN}


def job(methods: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """``BASE`` with ``methods`` and each given section merged over its own (one level deep)."""
    data = copy.deepcopy(BASE)
    for key, value in sections.items():
        data[key] = {**data[key], **value}
    data["methods"] = methods
    return data


# (id, job, the key path the error names, a fragment of its message)
CASES = [
    # GEMS
    ("gems-cnn", job({"gems": {}}, model=CNN), "model.name", "logreg or mlp for method gems"),
    (
        "gems-lbfgs-logreg",
        job({"gems": {"tune_solver": "lbfgs"}}, model={"name": "logreg"}),
        "methods.gems.tune_solver",
        "model without hidden layers",
    ),
    (
        "gems-lbfgs-every-layer",
        job({"gems": {"tune_solver": "lbfgs", "last_layer_only": False}}),
        "methods.gems.tune_solver",
        "last_layer_only",
    ),
    (
        "gems-hidden-epsilon-per-layer",
        job({"gems": {"hidden_epsilon": [1.0, 2.0]}}),
        "methods.gems.hidden_epsilon",
        "one value per hidden layer (1)",
    ),
    (
        "gems-m-epsilon-per-layer",
        job({"gems": {"m_epsilon": [4, 4]}}, model={"hidden": [8]}),
        "methods.gems.m_epsilon",
        "one value per hidden layer (1)",
    ),
    ("gems-m-epsilon-neurons", job({"gems": {"m_epsilon": 9}}, model={"hidden": [4]}), "methods.gems.m_epsilon", "(2 x 4 = 8), got 9"),
    (
        "gems-public-samples",
        job({"gems": {"public_samples": [10, 5000]}}),
        "methods.gems.public_samples",
        "at most the public sample's size",
    ),
    # finetune
    (
        "finetune-no-public-sample",
        job({"tuned": {"method": "finetune"}}, data={"public_size": 0}),
        "data.public_size",
        "a public sample (> 0) for fine-tuning",
    ),
    (
        "finetune-public-samples",
        job({"tuned": {"method": "finetune", "public_samples": 5000}}),
        "methods.tuned.public_samples",
        "at most the public sample's size",
    ),
    (
        "finetune-raw-epochs",
        job({"tuned": {"method": "finetune", "base": "average", "raw_epochs": 3}}),
        "methods.tuned.raw_epochs",
        "only with base: raw",
    ),
    (
        "finetune-raw-dropout-logreg",
        job({"tuned": {"method": "finetune", "base": "raw", "raw_dropout": 0.5}}, model={"name": "logreg"}),
        "methods.tuned.raw_dropout",
        "an mlp model",
    ),
    (
        "finetune-lbfgs-raw",
        job({"tuned": {"method": "finetune", "base": "raw", "tune_solver": "lbfgs"}}),
        "methods.tuned.tune_solver",
        "base: raw",
    ),
    # FedSA and its baselines
    ("fedsa-no-target-set", job({"fedsa": FEDSA}, model=CNN, data={"public_size": 0}), "data.public_size", "a labelled target set"),
    ("fedsa-k-teachers", job({"fedsa": {**FEDSA, "k": 3}}, model=CNN), "methods.fedsa.k", "at most the number of teachers (2"),
    (
        "fedsa-student-logreg",
        job({"fedsa": {**FEDSA, "student": {"name": "logreg"}}}, model=CNN),
        "methods.fedsa.student",
        "a model with a hidden representation",
    ),
    (
        "fedsa-teacher-logreg",
        job({"fedsa": {**FEDSA, "student": None}}, model={"name": "logreg"}),
        "model.name",
        "a model with a hidden representation",
    ),
    (
        "fedsa-vector-student-map-teacher",
        job({"fedsa": {**FEDSA, "student": {"name": "mlp", "hidden": [8]}}}, model=CNN),
        "methods.fedsa.student",
        "a student representation a translator can map",
    ),
    (
        "fedsa-gradcam-mlp",
        job({"fedsa": {**FEDSA, "student": None, "saliency": "gradcam"}}),
        "methods.fedsa.saliency",
        "grad for models without a convolutional feature map",
    ),
    ("fedsa-student-does-not-fit", job({"fedsa": FEDSA}, data={"dataset": "iris"}), "methods.fedsa.student.name", "an image dataset"),
    ("scratch-no-target-set", job({"scratch": {}}, data={"public_size": 0}), "data.public_size", "a labelled target set"),
    ("transfer-no-target-set", job({"transfer": {}}, data={"public_size": 0}), "data.public_size", "a labelled target set"),
    # KL-fusion and the GMM baselines
    ("kl-gmm-dataset", job({"kl": {}}), "data.dataset", "kl_gmm (method kl needs"),
    ("kl-topics-dataset", job({"kl": {"application": "topics"}}), "data.dataset", "kl_lda (application topics"),
    (
        "kl-homogeneous-true",
        job({"kl": {"application": "topics", "homogeneous": True}}, **LDA),
        "methods.kl.n_components",
        "a number of topics every client fits",
    ),
    (
        "kl-components-points",
        job({"kl": {"n_components": 50}}, **GMM),
        "methods.kl.n_components",
        "at most the smallest client's number of training points",
    ),
    (
        "kl-init-components",
        job({"kl": {"n_components": 3, "n_init_components": 2}}, **GMM),
        "methods.kl.n_init_components",
        "at least the largest local count (3)",
    ),
    (
        "kl-bnn-init-components",
        job({"kl": {"application": "bnn", "hidden": 10, "n_init_components": 4}}),
        "methods.kl.n_init_components",
        "at least the largest local count (10)",
    ),
    ("spahm-dataset", job({"spahm": {}}), "data.dataset", "kl_gmm (method spahm needs"),
    ("spahm-components-points", job({"spahm": {"n_components": 50}}, **GMM), "methods.spahm.n_components", "training points"),
    ("dp-cluster-dataset", job({"dp_cluster": {}}), "data.dataset", "kl_gmm (method dp_cluster needs"),
    ("gmm-oracle-dataset", job({"gmm_oracle": {}}), "data.dataset", "kl_gmm (method gmm_oracle needs"),
]
RUN_CASES = ["gems-cnn", "finetune-raw-epochs", "fedsa-k-teachers", "kl-gmm-dataset"]
BY_ID = {case[0]: case[1:] for case in CASES}


def write_job(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("rayfuse: error: ") and "Traceback" not in err
    return lines[0][len("rayfuse: error: ") :]


@pytest.mark.parametrize(("data", "path", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validate_refuses_a_method_the_run_cannot_do(tmp_path, capsys, data, path, fragment):
    assert main(["validate", str(write_job(tmp_path, data))]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"{path}: expected "), line
    assert fragment in line


@pytest.mark.parametrize("case", sorted({c[1]["data"]["dataset"] for c in CASES}))
def test_the_base_jobs_themselves_validate(tmp_path, capsys, case):
    """The refusals above come from the method entries: each dataset's job with a method that fits it validates."""
    data = {
        "kl_gmm": job({"kl": {}}, **GMM),
        "kl_lda": job({"kl": {"application": "topics"}}, **LDA),
        "iris": job({"gems": {}}, data={"dataset": "iris"}),
    }.get(case, job({"fedsa": FEDSA, "scratch": {}, "transfer": {}}, model=CNN))
    assert main(["validate", str(write_job(tmp_path, data))]) == 0, capsys.readouterr().err


class SpyBackend(Backend):
    """Records every call; a refused run must make none."""

    name = "spy"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("start")

    def survey_silos(self) -> Any:
        self.calls.append("survey_silos")

    def prepare_local_models(self, resume: bool = False) -> Any:
        self.calls.append("prepare_local_models")

    def run_method(self, label: str, resume: bool = False) -> Any:
        self.calls.append("run_method")

    def stop(self) -> None:
        self.calls.append("stop")


@pytest.mark.parametrize("case", RUN_CASES)
def test_a_refused_run_starts_no_backend_and_writes_no_run_folder(tmp_path, case):
    data, path, _ = BY_ID[case]
    backend, run_dir = SpyBackend(), tmp_path / "run"
    with pytest.raises(InputError) as err:
        run_experiment(validate_config(data), backend, run_dir)
    assert err.value.path == path
    assert backend.calls == [] and not run_dir.exists()


@pytest.mark.parametrize("case", RUN_CASES)
def test_rayfuse_run_local_exits_2_before_any_client_trains(tmp_path, capsys, monkeypatch, case):
    from rayfuse.runner import InProcessBackend

    data, path, _ = BY_ID[case]
    started: list[str] = []
    monkeypatch.setattr(InProcessBackend, "start", lambda self, *a, **k: started.append("start"))
    out = tmp_path / "run"
    assert main(["run", str(write_job(tmp_path, data)), "--local", "--out", str(out), "--quiet"]) == 2
    assert one_error_line(capsys).startswith(f"{path}: ")
    assert started == [] and not out.exists()


def test_a_coordinator_prepared_as_a_run_refuses_the_method_before_any_client_works(tmp_path):
    """A test's coordinator goes through the run's own preparation (tests/helpers.py): the method is refused there, once,
    before any client exists (the coordinator does not check again when it runs a method)."""
    from rayfuse.federation import EventLog
    from tests.helpers import prepared_coordinator

    cfg = validate_config(job({"gems": {}}, model=CNN))
    events = EventLog()
    with pytest.raises(InputError, match=r"^model\.name: expected logreg or mlp for method gems"):
        prepared_coordinator(cfg, tmp_path / "run", events=events)
    assert [e for e in events.since(0) if e["kind"] in ("client_trained", "method_start")] == []
    assert not (tmp_path / "run").exists()


def test_prepare_run_names_the_label_of_the_refused_entry():
    data = job({"fine": {"method": "gems"}, "coarse": {"method": "gems", "m_epsilon": 9}}, model={"hidden": [4]})
    with pytest.raises(InputError) as err:
        prepare_run(validate_config(data))
    assert err.value.path == "methods.coarse.m_epsilon"


def test_tune_check_refuses_a_trial_value_a_method_check_rejects(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job({"gems": {}}, model={"hidden": [4]})), encoding="utf-8")
    space = {"base": "job.yaml", "space": {"methods.gems.m_epsilon": {"grid": [2, 8, 9]}}, "metric": "fused/gems/accuracy"}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space), encoding="utf-8")
    assert main(["tune", str(path), "--check"]) == 2
    line = one_error_line(capsys)
    assert "space.methods.gems.m_epsilon: expected values the config accepts (methods.gems.m_epsilon: at most the number of neurons" in line
    assert "got 9" in line
