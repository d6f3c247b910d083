"""The common contract every registered method passes, the way scikit-learn's ``check_estimator`` runs every estimator
through the same checks.

``CONTRACT`` holds one entry per registered method (``rayfuse.method.METHODS``): its tiny parameters and the sections
its data or model needs. A method registered without an entry fails :func:`test_every_registered_method_has_a_contract_entry`
(and every check parametrised over it). Each method, in-process:

1. runs on a tiny config: its metrics are finite, and its fused model (where it has one) is finite and loads into
   its model;
2. resumes bit-exact after an interruption: a run stopped in the middle of the method (a fault injected into the
   method's own client step with ``on_client_failure: fail``, after at least one round checkpoint for a multi-round
   method; a method without a client step of its own is interrupted on the server, as SIGTERM does) and resumed as
   ``rayfuse run --resume`` does ends with the uninterrupted run's numbers and fused model, bit for bit;
3. is refused where its capabilities say so, before anything starts (``rayfuse validate``: exit 2, one line naming
   the key), and is not refused where they allow it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from rayfuse.config import parse_overrides, validate_config
from rayfuse.errors import RunFailure
from rayfuse.interrupts import Interrupted
from rayfuse.io import load_params
from rayfuse.method import METHODS, Method, step_name
from rayfuse.models import params_equal
from rayfuse.report import Printer
from rayfuse.runner import InProcessBackend, load_run_config, run_experiment
from tests.conftest import TINY, merge, scramble_global_rngs


def caps(cls: type[Method]) -> dict[str, Any]:
    """A method's declared capabilities, read in this one place (the contract checks below derive every refusal from
    these)."""
    return {
        # what the update pipeline would combine: its attacks, robust rules and DP act on "parameters" only (the cases
        # run each method's default merge / base, where its Params' fuses is its tags': a test below checks it)
        "fuses": cls.tags.fuses,
        "uses_local_models": bool(cls.tags.uses_local_models),
        "heterogeneous_clients": bool(cls.tags.heterogeneous_clients),
        "local_model_only": bool(cls.tags.local_model_only),
        "oracle": bool(cls.tags.oracle),
        "federated_evaluation": bool(cls.tags.federated_evaluation),
        "needs_dataset": bool(cls.tags.needs_dataset),
        "public_labels": bool(cls.tags.public_labels),
        "multi_round": bool(cls.tags.multi_round),
        # central DP of the FedAvg family or a DP upload (aligned, average): a ``dp`` key in the method's parameters
        # that the method does not refuse (FedRef's ``no_dp``)
        "dp": "dp" in cls.Params.model_fields and not cls.tags.no_dp,
        # a robust aggregation rule: the method averages parameter updates (an ``aggregator`` key in its parameters)
        "aggregator": "aggregator" in cls.Params.model_fields,
    }


# ---------------------------------------------------------------------------------------------------------------
# The table: one entry per registered method


@dataclass(frozen=True)
class Case:
    """How to run one method tiny.

    ``params``: the method's entry; ``sections``: config sections merged over ``BASE`` (its own data or model);
    ``step``: the method's own client step (``@client_step``) the interruption is injected into, at ``call`` (default:
    the last call of that step on a client for a multi-round method, so at least one round is checkpointed, else the
    middle one); a method without a client step of its own is interrupted on the server instead: ``Interrupted`` (what
    SIGTERM raises) at the ``call``-th call of ``server_hook`` (default: the server logging the method's metrics).
    ``fused``: the model its fused file loads into (``"model"``: the run's, ``"student"``: ``params["student"]``;
    ``None``: a file of other parameters, checked finite only). ``variants``: the method's entry for one refusal
    check (a run of another shape: ``silos``). ``client_state``: its clients keep state across rounds (EP-GAN's
    GANs, FedSA's translators), which outlives their process only under ``run.model_cache``: each run gets a cache of
    its own, so that a resume continues mid-method instead of restarting the method.
    """

    params: dict[str, Any]
    sections: dict[str, Any] = field(default_factory=dict)
    step: str | None = None
    call: int | None = None
    server_hook: str = "log"
    fused: str | None = "model"
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    client_state: bool = False
    checkpoints: bool | None = None  # checkpoints mid-method (default: the method is multi-round)


GMM = {
    "data": {"dataset": "kl_gmm", "options": {"separation": 30.0, "local_sd": 0.1, "points": 60, "num_groups": 4}, "val_size": 0},
    "partition": {"method": "labels", "num_clients": 4, "groups": [[0], [1], [2], [3]]},
}
TOY = {
    "data": {"dataset": "gaussians4", "options": {"n_per_mode": 60}, "val_size": 0.0},
    "partition": {"method": "labels", "num_clients": 4, "groups": [[0], [1], [2], [3]]},
}
SMALL_CNN = {"name": "cnn", "channels": [4, 8]}
TEACHERS = {"data": {"dataset": "digits", "public_size": 0.1, "val_size": 0.0}, "model": SMALL_CNN}
PUBLIC = {"data": {"public_size": 0.1}}
ROUNDS = {"rounds": 3, "local_epochs": 1}
EPGAN = {"warmup_epochs": 1, "rounds": 2, "local_epochs": 1, "batch_size": 32, "grid": 20, "eval_samples": 200}
TARGET = {"target_epochs": 1, "adapt_epochs": 1}
GMM_FIT = {"n_components": 4, "n_init": 1, "vi_max_iter": 20}
SILO_GMM = {"n_components": 3, "n_init": 1, "vi_max_iter": 20}
#: on silo data (4 features): a vector student for FedSA (no images, so no convolutional student)
SILO_STUDENT = {"name": "mlp", "hidden": [8]}

CONTRACT: dict[str, Case] = {
    # a DP upload covers the clients' weights only: aligned with dp is one round aligned by weights, without repair
    "aligned": Case({"rounds": 2, "samples": 256}, step="aligned.fit", variants={"method-dp": {"alignment": "weight", "repair": False}}),
    "average": Case({}),
    "distill": Case({"steps": 20, "epochs": 1}, PUBLIC, step="aligned.correlations"),
    "dp_cluster": Case(GMM_FIT, GMM, step="kl.gmm_posterior", fused=None, variants={"silos": SILO_GMM}),
    "ensemble": Case({}, fused=None),
    "epgan": Case(EPGAN, TOY, step="epgan.train", fused=None, client_state=True),
    # the oracle trains on the pooled data on the server, a checkpoint per block of local_epochs epochs: interrupted
    # at its second block's log, after block 1's checkpoint
    "epgan-oracle": Case({**EPGAN, "epochs": 3}, TOY, call=2, fused=None, checkpoints=True),
    "fedadagrad": Case(ROUNDS, step="fedavg.fit"),
    "fedadam": Case(ROUNDS, step="fedavg.fit"),
    "fedavg": Case(ROUNDS, step="fedavg.fit"),
    "fedlora": Case({"rounds": 2, "local_epochs": 1, "r": 2}, step="fedlora.fit"),
    "fedmerge": Case({"local_epochs": 1}, step="fedmerge.fit"),
    "fedprox": Case({**ROUNDS, "mu": 0.1}, step="fedavg.fit"),
    "fedref": Case({**ROUNDS, "p": 1}, step="fedavg.fit"),
    "fedyogi": Case(ROUNDS, step="fedavg.fit"),
    "fedsa": Case(
        {
            **TARGET,
            "student": SMALL_CNN,
            "rounds": 3,
            "select_every": 1,
            "k": 2,
            "selection": "all",
            "local_epochs": 1,
            "evaluate_every": 1,
        },
        TEACHERS,
        step="fedsa.distill",
        fused="student",
        client_state=True,
        variants={"silos": {**TARGET, "student": SILO_STUDENT, "rounds": 1, "k": 2, "local_epochs": 1}},
    ),
    "finetune": Case({"tune_epochs": 1}, PUBLIC),
    "gems": Case({"tune_epochs": 1, "retrain_epochs": 1, "num_samples": 50}, PUBLIC, step="gems.model_ball"),
    "global": Case({"epochs": 2}),
    "gmm_oracle": Case(GMM_FIT, GMM, fused=None),
    "kl": Case({"n_init": 1, "vi_max_iter": 20}, GMM, step="kl.gmm_posterior", fused=None, variants={"silos": SILO_GMM}),
    "local": Case({}, fused=None),
    "scratch": Case({**TARGET, "student": SMALL_CNN}, TEACHERS, fused="student", variants={"silos": {**TARGET, "student": SILO_STUDENT}}),
    "spahm": Case(GMM_FIT, GMM, step="kl.gmm_posterior", fused=None, variants={"silos": SILO_GMM}),
    "transfer": Case(TARGET, TEACHERS, fused=None),
}

BASE = merge(TINY, {"train": {"epochs": 2}})
QUIET = Printer(enabled=False)
#: what ``rayfuse run --resume`` is given after the interruption: the fault removed, failures retried
RESUME_SETS = ["federation.faults=[]", "federation.on_client_failure=retry"]
#: bookkeeping in a method's result entry, not a number it computed
NOT_METRICS = {"method", "oracle", "note", "model_file", "evaluation", "info", "client_metrics"}

NAMES = sorted(METHODS.names())


def case_of(name: str) -> Case:
    assert name in CONTRACT, f"method {name!r} is registered without an entry in tests/test_method_contract.py's CONTRACT"
    return CONTRACT[name]


def job(name: str, storage: Path, *, params: dict[str, Any] | None = None, cache: Path | None = None, **sections: Any) -> dict[str, Any]:
    case = case_of(name)
    data = merge(merge(BASE, case.sections), sections)
    data["methods"] = {name: case.params if params is None else params}
    data["run"]["storage"] = str(storage)
    if case.client_state and cache is not None:
        data["run"]["model_cache"] = str(cache)
    return data


def run(data: dict[str, Any], run_dir: Path, **kwargs: Any) -> dict[str, Any]:
    return run_experiment(validate_config(data), InProcessBackend(), run_dir, printer=QUIET, show_tables=False, **kwargs)


def scrubbed(value: Any) -> Any:
    """A result without its wall-clock timings (``seconds``, ``fuse_seconds``...), the one thing a resumed run may
    differ in."""
    if isinstance(value, dict):
        return {k: scrubbed(v) for k, v in value.items() if "seconds" not in str(k)}
    if isinstance(value, list):
        return [scrubbed(v) for v in value]
    return value


def numbers(value: Any) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)


@dataclass
class Straight:
    """An uninterrupted run: its results and folder, each client's calls of each step, and how often the method asked
    the server for the clients' data pooled."""

    results: dict[str, Any]
    run_dir: Path
    calls: Counter[tuple[int, str]]
    pooled: int


class Runs:
    """The uninterrupted run of each method, made once per module and shared read-only by the checks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Straight] = {}

    def straight(self, name: str) -> Straight:
        if name not in self._done:
            import rayfuse.client as client_module
            from rayfuse.coordinator import ServerData

            calls: Counter[tuple[int, str]] = Counter()
            pooled: list[int] = []
            original, pool = client_module.Client.run, ServerData.pooled_train

            def counted(client: Any, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                calls[(client.client_id, step_name(step))] += 1
                return original(client, step, *args, **kwargs)

            def pooled_train(server: Any) -> Any:
                pooled.append(1)
                return pool(server)

            run_dir = self.root / name / "straight"
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(client_module.Client, "run", counted)
                patch.setattr(ServerData, "pooled_train", pooled_train)
                results = run(job(name, self.root / name, cache=run_dir.with_name("straight-cache")), run_dir)
            self._done[name] = Straight(results, run_dir, calls, len(pooled))
        return self._done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("contract"))


def test_every_registered_method_has_a_contract_entry():
    assert NAMES, "no method registered"
    assert sorted(CONTRACT) == NAMES, "CONTRACT must have exactly one entry per registered method"


# ---------------------------------------------------------------------------------------------------------------
# 1. Runs on a tiny config


@pytest.mark.parametrize("name", NAMES)
def test_runs_on_a_tiny_config(runs, name):
    case = case_of(name)
    straight = runs.straight(name)
    results = straight.results
    assert results["status"] == "succeeded"
    entry = results["methods"][name]
    declared = caps(METHODS.get(name))
    assert entry["method"] == name and entry["oracle"] is declared["oracle"]
    # what it declares is what it does: every client trains a local model exactly for a method that uses them; a
    # method that pools the clients' data is an oracle that needs the whole dataset (refused on silo data)
    trained = sorted(client for (client, step) in straight.calls if step == "train_local")
    clients = validate_config(job(name, runs.root / name)).partition.num_clients
    assert trained == (list(range(clients)) if declared["uses_local_models"] else []), trained
    assert not straight.pooled or (declared["oracle"] and declared["needs_dataset"]), straight.pooled
    metrics = {k: v for k, v in entry.items() if k not in NOT_METRICS and not k.endswith("seconds")}
    assert metrics and all(isinstance(v, (int, float)) for v in metrics.values()), entry
    assert all(math.isfinite(v) for v in numbers(scrubbed(entry))), entry
    if declared["federated_evaluation"]:  # scored through the server's evaluate: a classifier's metrics
        assert 0.0 <= entry["accuracy"] <= 1.0 and entry["nll"] >= 0.0 and 0.0 <= entry["ece"] <= 1.0, entry
    if case.fused is not None:
        assert entry["model_file"] == f"models/{name}.safetensors"
    if not entry.get("model_file"):
        return
    file = straight.run_dir / entry["model_file"]
    params = load_params(file)
    assert params and all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for v in params.values())
    if case.fused is None:  # not a classifier of the run's kind (EP-GAN's generators): its tensors are checked finite above
        return
    from rayfuse.api import load_fused
    from rayfuse.config import ModelConfig
    from rayfuse.models import build_model, get_params

    cfg = validate_config(job(name, runs.root / name))
    model_cfg = cfg.model if case.fused == "model" else ModelConfig.model_validate(case.params[case.fused])
    plan_shape, num_classes = _data_shape(cfg)
    model = load_fused(build_model(model_cfg, plan_shape, num_classes, seed=1), file)
    assert params_equal(get_params(model), params)


def _data_shape(cfg: Any) -> tuple[tuple[int, ...], int]:
    from rayfuse.data.roles import load_dataset_from_config

    dataset = load_dataset_from_config(cfg.data)
    return tuple(dataset.input_shape), int(dataset.num_classes)


# ---------------------------------------------------------------------------------------------------------------
# 2. Resumes bit-exact after an interruption


def _interrupt(runs: Runs, name: str, folder: Path) -> None:
    """Run ``name`` into ``folder`` and stop it in the middle of the method."""
    case = case_of(name)
    straight = runs.straight(name)
    if case.step is not None:
        counts = {client: n for (client, step), n in straight.calls.items() if step == case.step}
        assert counts, f"{name}: the uninterrupted run never called {case.step!r}: {dict(straight.calls)}"
        most = max(counts.values())
        client = max(c for c, n in counts.items() if n == most)
        call = case.call or (most if caps(METHODS.get(name))["multi_round"] else most // 2 + 1)
        fault = {"client": client, "step": case.step, "call": call, "mode": "raise"}
        with pytest.raises(RunFailure, match=f"injected fault: client {client}, step {case.step}, call {call}"):
            run(
                job(name, runs.root / name, cache=folder.with_name("cache"), federation={"on_client_failure": "fail", "faults": [fault]}),
                folder,
            )
        return
    from rayfuse.coordinator import MethodServer

    original = getattr(MethodServer, case.server_hook)
    seen: list[int] = []

    def stop(server: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        if len(seen) == (case.call or 1):
            raise Interrupted()  # what SIGTERM raises in a run (rayfuse.interrupts)
        return original(server, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(MethodServer, case.server_hook, stop)
        run(job(name, runs.root / name, cache=folder.with_name("cache")), folder)


@pytest.mark.parametrize("name", NAMES)
def test_resumes_bit_exact_after_an_interruption(runs, tmp_path, name):
    straight = runs.straight(name)
    folder = tmp_path / "run"
    _interrupt(runs, name, folder)
    assert not (folder / "state" / f"{name}.json").exists(), "the interruption came after the method finished"
    latest = folder / "checkpoints" / name / "latest.json"
    checkpointed = json.loads(latest.read_text())["round"] if latest.is_file() else 0
    checkpoints = case_of(name).checkpoints
    if caps(METHODS.get(name))["multi_round"] if checkpoints is None else checkpoints:  # stopped after a checkpoint of the method
        assert checkpointed >= 1
    scramble_global_rngs()  # a real resume is a new process
    resumed = run_experiment(
        load_run_config(folder, parse_overrides(RESUME_SETS)), InProcessBackend(), folder, resume=True, printer=QUIET, show_tables=False
    )
    assert resumed["status"] == "succeeded"
    said = [e["message"] for e in resumed["events"] if e["kind"] == "warning"]
    assert said == [e["message"] for e in straight.results["events"] if e["kind"] == "warning"], said  # no fallback, no restart
    if checkpointed:  # continued after its last checkpointed round, not from the start
        assert [e["round"] for e in resumed["events"] if e["kind"] == "resumed" and e.get("method", name) == name] == [checkpointed]
    assert scrubbed(resumed["methods"][name]) == scrubbed(straight.results["methods"][name])
    file = straight.results["methods"][name].get("model_file")
    if file:
        assert params_equal(load_params(folder / file), load_params(straight.run_dir / file))


# ---------------------------------------------------------------------------------------------------------------
# 3. Refused where its capabilities say so, and only there

OTHER_MODEL = {"name": "mlp", "hidden": [32]}
LOCAL_DP = {"noise_multiplier": 0.5, "max_grad_norm": 1.0, "delta": 1e-5}
CENTRAL_DP = {"noise_multiplier": 0.5, "clip_norm": 1.0, "sample_rate": 1.0, "delta": 0.01}
UPLOAD_DP = {"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 0.01}


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = rng.normal(size=(n, 4)) * 0.5 + 3.0 * np.eye(3, 4)[y]
    return X.astype(np.float32), y.astype(np.int64)


@pytest.fixture(scope="module")
def silo_files(tmp_path_factory) -> dict[str, Any]:
    """Three silos of a 3-class task, and the server's test and public sets (npz)."""
    root = tmp_path_factory.mktemp("contract-silos")
    files: dict[str, Any] = {"silos": []}
    for i in range(3):
        X, y = _blobs(45, seed=i)
        np.savez(root / f"site{i}.npz", X=X, y=y)
        files["silos"].append({"dataset": "npz", "path": str(root / f"site{i}.npz")})
    for key, seed in (("test", 7), ("public", 8)):
        X, y = _blobs(30, seed=seed)
        np.savez(root / f"{key}.npz", X=X, y=y)
        files[key] = {"dataset": "npz", "path": str(root / f"{key}.npz")}
    return files


def _silo_job(name: str, storage: Path, silo_files: dict[str, Any], *, labelled: bool = True) -> dict[str, Any]:
    case = case_of(name)
    public = dict(silo_files["public"]) if labelled else {**silo_files["public"], "labels": False}
    return {
        "run": {"name": "contract", "seed": 0, "storage": str(storage)},
        "data": {"silos": silo_files["silos"], "test": silo_files["test"], "public": public},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 1, "batch_size": 16, "shared_init": True},
        "federation": {"backend": "local"},
        "evaluation": "central",
        "methods": {name: case.variants.get("silos", case.params)},
    }


def _dp_entry(name: str) -> dict[str, Any]:
    """A valid ``dp`` section of the kind the method's parameters declare (central DP-FedAvg or a DP upload)."""
    from rayfuse.updates.privacy import UploadDP

    annotation = str(METHODS.get(name).Params.model_fields["dp"].annotation)
    return UPLOAD_DP if UploadDP.__name__ in annotation else CENTRAL_DP


def _with_dp(name: str, storage: Path, silo_files: dict[str, Any]) -> dict[str, Any]:
    data = job(name, storage, params=case_of(name).variants.get("method-dp"))
    data["methods"][name] = {
        **data["methods"][name],
        "dp": _dp_entry(name) if "dp" in METHODS.get(name).Params.model_fields else CENTRAL_DP,
    }
    return data


def _with_median(name: str, storage: Path, silo_files: dict[str, Any]) -> dict[str, Any]:
    data = job(name, storage)
    data["methods"][name] = {**data["methods"][name], "aggregator": {"name": "median"}}
    return data


def _needs_val(name: str, storage: Path) -> dict[str, Any]:
    return job(name, storage, evaluation="federated", data={"val_size": 0.2})


def _dp_says(name: str) -> str:
    fused = caps(METHODS.get(name))["fuses"]
    if fused in ("posteriors", "statistics", "predictions"):
        return f"no dp for method {name!r} (it fuses {fused}; dp acts on parameter updates)"
    return f"no dp for method {name!r}"


def _aggregator_says(name: str) -> str:
    declared = caps(METHODS.get(name))
    if not declared["aggregator"]:
        return "expected a known key"
    return f"the default mean for method {name!r} (it fuses {declared['fuses']}; a robust rule and clip_norm act on parameter updates)"


@dataclass(frozen=True)
class Rule:
    """One refusal the capabilities decide: the run that asks for it, whether ``caps`` refuses it, the key named and
    what the line says (naming the method: the refusal is the method's, not the config's)."""

    build: Callable[[str, Path, dict[str, Any]], dict[str, Any]]
    refused: Callable[[dict[str, bool]], bool]
    key: Callable[[str], str]
    says: Callable[[str], str]
    applies: Callable[[dict[str, bool]], bool] = lambda c: True


RULES: dict[str, Rule] = {
    # clients whose model is not the run's: only methods that need each client's predictions, not weights in one layout
    "client-models": Rule(
        lambda n, s, f: job(n, s, federation={"client_overrides": {1: {"model": OTHER_MODEL}}}),
        lambda c: not c["heterogeneous_clients"],
        lambda n: "federation.client_overrides",
        lambda n: f"for method {n!r}",
    ),
    # local DP-SGD covers what a method releases only when it reads the clients' data through their local models
    "local-dp": Rule(
        lambda n, s, f: job(n, s, train={"dp": LOCAL_DP}),
        lambda c: not (c["local_model_only"] or c["oracle"]),
        lambda n: "train.dp",
        lambda n: f"not method {n!r}",
    ),
    # federated evaluation: only methods that score through the server's evaluate
    "federated-evaluation": Rule(
        lambda n, s, f: _needs_val(n, s), lambda c: not c["federated_evaluation"], lambda n: "evaluation", lambda n: f"for method {n!r}"
    ),
    # silo data: no process holds the whole dataset
    "silos": Rule(
        lambda n, s, f: _silo_job(n, s, f),
        lambda c: c["needs_dataset"],
        lambda n: f"methods.{n}",
        lambda n: f"with data.silos (no process reads every silo), got {n!r}",
    ),
    # a public sample without labels (silo data): refused for a method that reads them (a method that needs the whole
    # dataset is refused on silo data before its labels matter: the rule above)
    "unlabelled-public": Rule(
        lambda n, s, f: _silo_job(n, s, f, labelled=False),
        lambda c: c["public_labels"],
        lambda n: "data.public.labels",
        lambda n: f"for method {n!r}",
        applies=lambda c: not c["needs_dataset"],
    ),
    # a dp key on the method (central DP-FedAvg, a DP upload): the pipeline's DP acts on parameter updates, so only a
    # method fusing parameters with a dp key of its own (and no no_dp) takes it
    "method-dp": Rule(_with_dp, lambda c: c["fuses"] != "parameters" or not c["dp"], lambda n: f"methods.{n}.dp", _dp_says),
    # a robust rule (coordinate-wise median): only where the pipeline combines parameter updates and the method has an
    # aggregator key (else the key is unknown to its parameters)
    "robust-aggregator": Rule(
        _with_median, lambda c: c["fuses"] != "parameters" or not c["aggregator"], lambda n: f"methods.{n}.aggregator", _aggregator_says
    ),
    # simulated attacks: refused for a method fusing posteriors, statistics or predictions (the pipeline's attacks act
    # on parameter updates); methods combining no client upload ("nothing": local, oracles) run beside them
    "attacks": Rule(
        lambda n, s, f: job(n, s, federation={"attacks": [{"client": 1, "kind": "sign_flip"}]}),
        lambda c: c["fuses"] in ("posteriors", "statistics", "predictions"),
        lambda n: "federation.attacks",
        lambda n: f"no attacks with method {n!r} (methods.{n} fuses {caps(METHODS.get(n))['fuses']}; attacks act on parameter updates)",
    ),
}


def _validate(tmp_path: Path, data: dict[str, Any], capsys) -> tuple[int, str]:
    from rayfuse.cli import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    code = main(["validate", str(path)])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(("name", "rule"), [(n, r) for n in NAMES for r in sorted(RULES) if RULES[r].applies(caps(METHODS.get(n)))])
def test_refused_where_its_capabilities_say_so(tmp_path, capsys, silo_files, name, rule):
    spec, declared = RULES[rule], caps(METHODS.get(name))
    code, err = _validate(tmp_path, spec.build(name, tmp_path / "runs", silo_files), capsys)
    if spec.refused(declared):
        assert code == 2, err
        assert err.startswith(f"rayfuse: error: {spec.key(name)}: ") and "\n" not in err, err
        assert spec.says(name) in err, err
    else:
        assert code == 0, err
    assert not (tmp_path / "runs").exists()  # nothing written either way


def test_the_cases_fuse_what_the_tags_say():
    """``caps`` reads ``tags.fuses``; a method whose parameters decide what it fuses (aligned's merge, finetune's base)
    runs here with parameters under which the two agree."""
    for name in NAMES:
        cls = METHODS.get(name)
        assert cls.tags_for(cls.Params.model_validate(case_of(name).params)).fuses == cls.tags.fuses, name


def test_the_contract_covers_both_sides_of_every_refusal():
    """Each refusal rule meets at least one method it refuses and one it lets through (else the check proves nothing)."""
    for rule, spec in RULES.items():
        outcomes = {spec.refused(caps(METHODS.get(n))) for n in NAMES if spec.applies(caps(METHODS.get(n)))}
        assert outcomes == {True, False}, rule


def test_an_unlisted_method_fails_the_contract():
    assert "no-such-method" not in CONTRACT
    with pytest.raises(AssertionError, match="registered without an entry"):
        case_of("no-such-method")
