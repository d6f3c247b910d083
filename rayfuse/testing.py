"""The checks every method passes, public so that a method outside the repository (a ``rayfuse.methods`` entry-point
plug-in, a class in a notebook) runs the same checks in its own tests, the way scikit-learn's ``check_estimator``
runs every estimator through the same checks::

    from rayfuse.testing import check_method

    def test_my_method_passes_the_contract(tmp_path):
        check_method(MyMethod, tmp_path=tmp_path)

Each check runs the method in-process on a tiny config (:data:`BASE` with the sections and parameters of the
method's :class:`~rayfuse.method.MethodCase`, its class's ``test_case``) and raises ``AssertionError`` naming what
failed:

1. :func:`check_runs`: it runs; its metrics are finite, its fused model (where it has one) is finite and loads into
   its model, and it does what its tags declare (every client trains a local model exactly when it
   ``uses_local_models``; only an oracle that ``needs_dataset`` reads the clients' data pooled);
2. :func:`check_resumes`: a run stopped in the middle of the method (a fault injected into the method's own client
   step with ``on_client_failure: fail``, after at least one round checkpoint for a ``multi_round`` method; a method
   without a client step of its own is interrupted on the server, as SIGTERM does) and resumed as
   ``rayfuse run --resume`` does ends with the uninterrupted run's numbers and fused model, bit for bit;
3. :func:`check_refusals`: it is refused before anything starts (one line naming the key, nothing written) exactly
   where its tags say (:data:`RULES`: clients of other models, ``train.dp``, ``evaluation: federated``,
   ``data.silos``, an unlabelled public sample, a ``dp`` or ``aggregator`` key, attacks), and runs everywhere else.

:func:`check_method` runs all three. A test suite checking many methods shares each method's uninterrupted run
between the first two checks through one :class:`Runs` (a module-scoped fixture). A class not in the registry is
passed as an object (``rayfuse.run(..., methods={label: cls})``), so nothing is registered.

This module is core: it imports no Ray; the engine (``rayfuse.runner``) is imported when a check runs.
"""

from __future__ import annotations

import copy
import json
import math
import random
import tempfile
import typing
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from rayfuse.config import parse_overrides, validate_config
from rayfuse.errors import InputError, RunFailure
from rayfuse.method import Method, MethodCase, MethodTags, method_name, step_name

__all__ = [
    "BASE",
    "CHECKS",
    "RULES",
    "MethodCase",
    "Rule",
    "Runs",
    "Straight",
    "case_of",
    "check_method",
    "check_refusal",
    "check_refusals",
    "check_resumes",
    "check_runs",
    "is_refused",
    "merge",
    "refusal_rules",
    "scramble_global_rngs",
]

#: the tiny run every check starts from (a case's ``sections`` merge over it): 4 clients of the bundled digits, a
#: small MLP, 2 local epochs, in-process
BASE: dict[str, Any] = {
    "run": {"name": "t", "seed": 0},
    "data": {"dataset": "digits"},
    "partition": {"method": "dirichlet", "num_clients": 4, "alpha": 0.5},
    "model": {"name": "mlp", "hidden": [16]},
    "train": {"epochs": 2, "shared_init": True},
    "federation": {"backend": "local", "ray_init": {"num_cpus": 2, "include_dashboard": False}},
}
#: the checks :func:`check_method` runs, by name
CHECKS: tuple[str, ...] = ("runs", "resumes", "refusals")
#: what ``rayfuse run --resume`` is given after the interruption: the fault removed, failures retried
RESUME_SETS = ("federation.faults=[]", "federation.on_client_failure=retry")
#: bookkeeping in a method's result entry, not a number it computed
NOT_METRICS = frozenset({"method", "oracle", "note", "model_file", "evaluation", "info", "client_metrics"})


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep merge; a key whose value is a dict merges, anything else replaces (``methods`` replaces)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "methods":
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def scramble_global_rngs(seed: int = 987654) -> None:
    """Put Python's, numpy's and torch's global random generators in a state no run would leave them in: a resumed run
    checked after this cannot lean on the interrupted run's process-wide random state (a real resume is a new
    process)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# A method's case and its tiny run


def case_of(method_cls: type[Method[Any, Any]]) -> MethodCase:
    """The method's :class:`MethodCase` (its class's ``test_case``); an ``AssertionError`` naming the attribute to add
    when it has none."""
    case = getattr(method_cls, "test_case", None)
    assert isinstance(case, MethodCase), (
        f"method {method_name(method_cls)!r} ({method_cls.__module__}.{method_cls.__qualname__}) declares no test case: set "
        "test_case = MethodCase(...) on its class (rayfuse.method.MethodCase: its tiny parameters, the config sections "
        f"it needs, the client step to interrupt), got {case!r}"
    )
    return case


def _tags(method_cls: type[Method[Any, Any]], params: dict[str, Any]) -> MethodTags:
    """The tags of an entry with ``params`` (:meth:`Method.tags_for`)."""
    return method_cls.tags_for(method_cls.Params.model_validate(params))


def _job(
    method_cls: type[Method[Any, Any]],
    case: MethodCase,
    storage: Path,
    *,
    params: dict[str, Any] | None = None,
    cache: Path | None = None,
    **sections: Any,
) -> dict[str, Any]:
    data = merge(merge(BASE, case.sections), sections)
    data["methods"] = {method_name(method_cls): dict(case.params if params is None else params)}
    data["run"]["storage"] = str(storage)
    if case.client_state and cache is not None:
        data["run"]["model_cache"] = str(cache)
    return data


def _prepare(method_cls: type[Method[Any, Any]], cfg: Any) -> Any:
    """Every pre-start check of ``cfg``, the method given as an object (no registry)."""
    from rayfuse.runner import prepare_run

    return prepare_run(cfg, methods={method_name(method_cls): method_cls})


def _run(method_cls: type[Method[Any, Any]], data: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    prepared = _prepare(method_cls, validate_config(data))
    return run_experiment(prepared, InProcessBackend(), run_dir, printer=Printer(enabled=False), show_tables=False)


def _scrubbed(value: Any) -> Any:
    """A result without its wall-clock timings (``seconds``, ``fuse_seconds``...), the one thing a resumed run may
    differ in."""
    if isinstance(value, dict):
        return {k: _scrubbed(v) for k, v in value.items() if "seconds" not in str(k)}
    if isinstance(value, list):
        return [_scrubbed(v) for v in value]
    return value


def _numbers(value: Any) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def _difference(a: Any, b: Any, path: str = "") -> str:
    """Where two results first differ, in words."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}{key}: only in the {'uninterrupted' if key in a else 'resumed'} run"
            if a[key] != b[key]:
                return _difference(a[key], b[key], f"{path}{key}.")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _difference(x, y, f"{path}{i}.")
    return f"{path.rstrip('.') or 'the result'}: {a!r} uninterrupted, {b!r} resumed"


@dataclass
class Straight:
    """An uninterrupted run: its results and folder, each client's calls of each step, and how often the method asked
    the server for the clients' data pooled."""

    results: dict[str, Any]
    run_dir: Path
    calls: Counter[tuple[int, str]]
    pooled: int


class Runs:
    """Each method's uninterrupted run, made once under ``root`` and shared read-only by :func:`check_runs` and
    :func:`check_resumes` (a test suite holds one per module)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._done: dict[tuple[type[Any], str], Straight] = {}

    def folder(self, method_cls: type[Method[Any, Any]]) -> Path:
        """The storage of the method's runs (its uninterrupted run's folder is ``straight`` in it)."""
        return self.root / method_name(method_cls)

    def straight(self, method_cls: type[Method[Any, Any]], case: MethodCase | None = None) -> Straight:
        case = case or case_of(method_cls)
        key = (method_cls, json.dumps(asdict(case), sort_keys=True, default=str))
        if key not in self._done:
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

            folder = self.folder(method_cls)
            run_dir = folder / "straight"
            with mock.patch.object(client_module.Client, "run", counted), mock.patch.object(ServerData, "pooled_train", pooled_train):
                results = _run(method_cls, _job(method_cls, case, folder, cache=folder / "straight-cache"), run_dir)
            self._done[key] = Straight(results, run_dir, calls, len(pooled))
        return self._done[key]


def _scratch(tmp_path: Path | str | None, stack: ExitStack) -> Path:
    """``tmp_path``, or a temporary folder removed when ``stack`` closes."""
    if tmp_path is not None:
        return Path(tmp_path)
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rayfuse-check-")))


# ---------------------------------------------------------------------------------------------------------------
# 1. Runs on a tiny config


def check_runs(
    method_cls: type[Method[Any, Any]], *, case: MethodCase | None = None, runs: Runs | None = None, tmp_path: Path | str | None = None
) -> None:
    """The method runs on its tiny config with finite metrics, a finite fused model that loads into its model, and
    does what its tags declare. ``runs``: the uninterrupted runs to share (default: one under ``tmp_path``, or a
    temporary folder)."""
    case = case or case_of(method_cls)
    with ExitStack() as stack:
        runs = runs or Runs(_scratch(tmp_path, stack) / "straight")
        _check_runs(method_cls, case, runs)


def _check_runs(method_cls: type[Method[Any, Any]], case: MethodCase, runs: Runs) -> None:
    name = method_name(method_cls)
    straight = runs.straight(method_cls, case)
    results = straight.results
    assert results["status"] == "succeeded", f"{name}: the run did not succeed: {results.get('error')}"
    entry = results["methods"][name]
    tags = _tags(method_cls, case.params)
    assert entry["method"] == name and entry["oracle"] is tags.oracle, f"{name}: the result entry says {entry}, its tags {tags}"
    # what it declares is what it does: every client trains a local model exactly for a method that uses them; a
    # method that pools the clients' data is an oracle that needs the whole dataset (refused on silo data)
    trained = sorted(client for (client, step) in straight.calls if step == "train_local")
    clients = validate_config(_job(method_cls, case, runs.folder(method_cls))).partition.num_clients
    expected = list(range(clients)) if tags.uses_local_models else []
    assert trained == expected, (
        f"{name}: clients {trained} trained a local model, expected {expected} (tags: uses_local_models={tags.uses_local_models})"
    )
    assert not straight.pooled or (tags.oracle and tags.needs_dataset), (
        f"{name}: read the clients' data pooled {straight.pooled} time(s) without tags oracle=True and needs_dataset=True"
    )
    metrics = {k: v for k, v in entry.items() if k not in NOT_METRICS and not k.endswith("seconds")}
    assert metrics and all(isinstance(v, (int, float)) for v in metrics.values()), f"{name}: no numeric metrics in {entry}"
    assert all(math.isfinite(v) for v in _numbers(_scrubbed(entry))), f"{name}: a metric is not finite: {entry}"
    if tags.federated_evaluation:  # scored through the server's evaluate: a classifier's metrics
        assert "accuracy" in entry and "nll" in entry and "ece" in entry, (
            f"{name}: tagged federated_evaluation=True but its metrics are not server.scoring.evaluate's (accuracy, nll, ece): {entry}"
        )
        assert 0.0 <= entry["accuracy"] <= 1.0 and entry["nll"] >= 0.0 and 0.0 <= entry["ece"] <= 1.0, f"{name}: {entry}"
    if case.fused is not None:
        assert entry.get("model_file") == f"models/{name}.safetensors", f"{name}: no fused model file (test_case fused={case.fused!r})"
    if not entry.get("model_file"):
        return
    from rayfuse.io import load_params
    from rayfuse.models import params_equal

    file = straight.run_dir / entry["model_file"]
    params = load_params(file)
    assert params and all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for v in params.values()), (
        f"{name}: the fused model {file} is empty or not finite"
    )
    if case.fused is None:  # not a classifier of the run's kind (EP-GAN's generators): its tensors are checked finite above
        return
    from rayfuse.api import load_fused
    from rayfuse.config import ModelConfig
    from rayfuse.data.roles import load_dataset_from_config
    from rayfuse.models import build_model, get_params

    cfg = validate_config(_job(method_cls, case, runs.folder(method_cls)))
    model_cfg = cfg.model if case.fused == "model" else ModelConfig.model_validate(case.params[case.fused])
    dataset = load_dataset_from_config(cfg.data)
    model = load_fused(build_model(model_cfg, tuple(dataset.input_shape), int(dataset.num_classes), seed=1), file)
    assert params_equal(get_params(model), params), f"{name}: the fused model does not load into its model ({case.fused})"


# ---------------------------------------------------------------------------------------------------------------
# 2. Resumes bit-exact after an interruption


def _interrupt(method_cls: type[Method[Any, Any]], case: MethodCase, straight: Straight, storage: Path, folder: Path) -> None:
    """Run the method into ``folder`` and stop it in the middle of the method."""
    name = method_name(method_cls)
    cache = folder.with_name(folder.name + "-cache")
    if case.step is not None:
        counts = {client: n for (client, step), n in straight.calls.items() if step == case.step}
        assert counts, f"{name}: the uninterrupted run never called its test_case's step {case.step!r}: {dict(straight.calls)}"
        most = max(counts.values())
        client = max(c for c, n in counts.items() if n == most)
        call = case.call or (most if _tags(method_cls, case.params).multi_round else most // 2 + 1)
        fault = {"client": client, "step": case.step, "call": call, "mode": "raise"}
        said = f"injected fault: client {client}, step {case.step}, call {call}"
        try:
            _run(
                method_cls,
                _job(method_cls, case, storage, cache=cache, federation={"on_client_failure": "fail", "faults": [fault]}),
                folder,
            )
        except RunFailure as exc:
            assert said in str(exc), f"{name}: the interrupted run failed otherwise than by the injected fault: {exc}"
            return
        raise AssertionError(f"{name}: a fault injected into step {case.step!r} (call {call} on client {client}) did not stop the run")
    from rayfuse.coordinator import MethodServer
    from rayfuse.interrupts import Interrupted

    original = getattr(MethodServer, case.server_hook)
    seen: list[int] = []

    def stop(server: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        if len(seen) == (case.call or 1):
            raise Interrupted()  # what SIGTERM raises in a run (rayfuse.interrupts)
        return original(server, *args, **kwargs)

    try:
        with mock.patch.object(MethodServer, case.server_hook, stop):
            _run(method_cls, _job(method_cls, case, storage, cache=cache), folder)
    except KeyboardInterrupt:
        return
    raise AssertionError(f"{name}: the run never called server.{case.server_hook} {case.call or 1} time(s): nothing interrupted it")


def check_resumes(
    method_cls: type[Method[Any, Any]], *, case: MethodCase | None = None, runs: Runs | None = None, tmp_path: Path | str | None = None
) -> None:
    """A run interrupted in the middle of the method and resumed ends with the uninterrupted run's numbers, events and
    fused model, bit for bit (the interrupted run goes under ``tmp_path``; ``runs`` as for :func:`check_runs`)."""
    case = case or case_of(method_cls)
    with ExitStack() as stack:
        scratch = _scratch(tmp_path, stack)
        runs = runs or Runs(scratch / "straight")
        _check_resumes(method_cls, case, runs, scratch / "resumed" / method_name(method_cls))


def _check_resumes(method_cls: type[Method[Any, Any]], case: MethodCase, runs: Runs, storage: Path) -> None:
    from rayfuse.io import load_params
    from rayfuse.models import params_equal
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, load_run_config, run_experiment

    name = method_name(method_cls)
    straight = runs.straight(method_cls, case)
    folder = storage / "run"
    _interrupt(method_cls, case, straight, storage, folder)
    assert not (folder / "state" / f"{name}.json").exists(), f"{name}: the interruption came after the method finished"
    latest = folder / "checkpoints" / name / "latest.json"
    checkpointed = json.loads(latest.read_text())["round"] if latest.is_file() else 0
    checkpoints = _tags(method_cls, case.params).multi_round if case.checkpoints is None else case.checkpoints
    if checkpoints:  # stopped after a checkpoint of the method
        assert checkpointed >= 1, f"{name}: interrupted before its first round checkpoint (test_case step={case.step!r}, call={case.call})"
    scramble_global_rngs()  # a real resume is a new process
    prepared = _prepare(method_cls, load_run_config(folder, parse_overrides(RESUME_SETS)))
    resumed = run_experiment(prepared, InProcessBackend(), folder, resume=True, printer=Printer(enabled=False), show_tables=False)
    assert resumed["status"] == "succeeded", f"{name}: the resumed run did not succeed: {resumed.get('error')}"
    said = [e["message"] for e in resumed["events"] if e["kind"] == "warning"]
    before = [e["message"] for e in straight.results["events"] if e["kind"] == "warning"]
    assert said == before, f"{name}: the resumed run warned {said}, the uninterrupted one {before} (a fallback or a restart)"
    if checkpointed:  # continued after its last checkpointed round, not from the start
        rounds = [e["round"] for e in resumed["events"] if e["kind"] == "resumed" and e.get("method", name) == name]
        assert rounds == [checkpointed], f"{name}: resumed at rounds {rounds}, expected after its checkpoint of round {checkpointed}"
    a, b = _scrubbed(straight.results["methods"][name]), _scrubbed(resumed["methods"][name])
    assert a == b, f"{name}: the resumed run's result differs from the uninterrupted run's, {_difference(a, b)}"
    file = straight.results["methods"][name].get("model_file")
    if file:
        assert params_equal(load_params(folder / file), load_params(straight.run_dir / file)), (
            f"{name}: the resumed run's fused model {file} differs from the uninterrupted run's"
        )


# ---------------------------------------------------------------------------------------------------------------
# 3. Refused where its tags say so, and only there

OTHER_MODEL = {"name": "mlp", "hidden": [32]}
LOCAL_DP = {"noise_multiplier": 0.5, "max_grad_norm": 1.0, "delta": 1e-5}
CENTRAL_DP = {"noise_multiplier": 0.5, "clip_norm": 1.0, "sample_rate": 1.0, "delta": 0.01}
UPLOAD_DP = {"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 0.01}


def _central_dp(method_cls: type[Method[Any, Any]]) -> bool:
    """Whether the method's ``dp`` key is central DP-FedAvg (else a DP upload, or none)."""
    from rayfuse.updates.central_dp import CentralDPSettings

    field = method_cls.Params.model_fields.get("dp")
    return field is not None and CentralDPSettings in (typing.get_args(field.annotation) or (field.annotation,))


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    X = rng.normal(size=(n, 4)) * 0.5 + 3.0 * np.eye(3, 4)[y]
    return X.astype(np.float32), y.astype(np.int64)


def _silo_job(
    method_cls: type[Method[Any, Any]], params: dict[str, Any], storage: Path, scratch: Path, *, labelled: bool = True
) -> dict[str, Any]:
    """Three silos of a 3-class task (npz files written under ``scratch``), the server's test and public sets."""
    scratch.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {}
    for key, n, seed in (("site0", 45, 0), ("site1", 45, 1), ("site2", 45, 2), ("test", 30, 7), ("public", 30, 8)):
        X, y = _blobs(n, seed=seed)
        np.savez(scratch / f"{key}.npz", X=X, y=y)
        files[key] = {"dataset": "npz", "path": str(scratch / f"{key}.npz")}
    return {
        "run": {"name": "contract", "seed": 0, "storage": str(storage)},
        "data": {
            "silos": [files[f"site{i}"] for i in range(3)],
            "test": files["test"],
            "public": files["public"] if labelled else {**files["public"], "labels": False},
        },
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"epochs": 1, "batch_size": 16, "shared_init": True},
        "federation": {"backend": "local"},
        "evaluation": "central",
        "methods": {method_name(method_cls): dict(params)},
    }


@dataclass(frozen=True)
class Rule:
    """One refusal the tags decide: the run that asks for it (``build(method_cls, params, storage, scratch)``, the
    method's entry ``params`` being its case's ``variants[variant]``, else its ``params``; ``variant`` defaults to the
    rule's name), whether the entry's tags refuse it (``refused(method_cls, tags)``), the key named and what the line
    says (naming the method: the refusal is the method's, not the config's), and whether the rule applies to the method
    at all."""

    build: Callable[[type[Method[Any, Any]], dict[str, Any], Path, Path], dict[str, Any]]
    refused: Callable[[type[Method[Any, Any]], MethodTags], bool]
    key: Callable[[str], str]
    says: Callable[[str, type[Method[Any, Any]], MethodTags], str]
    applies: Callable[[MethodTags], bool] = lambda tags: True
    variant: str | None = None


def _simulation(**sections: Any) -> Callable[[type[Method[Any, Any]], dict[str, Any], Path, Path], dict[str, Any]]:
    """A rule's run: the method's tiny config with ``sections`` on top."""

    def build(method_cls: type[Method[Any, Any]], params: dict[str, Any], storage: Path, scratch: Path) -> dict[str, Any]:
        return _job(method_cls, case_of(method_cls), storage, params=params, **sections)

    return build


def _with_key(
    key: str, value: Callable[[type[Method[Any, Any]]], Any]
) -> Callable[[type[Method[Any, Any]], dict[str, Any], Path, Path], dict[str, Any]]:
    """A rule's run: the method's entry with ``key`` set."""

    def build(method_cls: type[Method[Any, Any]], params: dict[str, Any], storage: Path, scratch: Path) -> dict[str, Any]:
        return _job(method_cls, case_of(method_cls), storage, params={**params, key: value(method_cls)})

    return build


def _dp_refused(method_cls: type[Method[Any, Any]], tags: MethodTags) -> bool:
    # the pipeline's DP acts on parameter updates: only a method fusing parameters whose tags take a dp key (and give no
    # no_dp reason) takes it, central DP-FedAvg only where its rounds train the round loop's cohort
    return tags.fuses != "parameters" or "dp" not in tags.updates or bool(tags.no_dp) or (_central_dp(method_cls) and not tags.cohort)


def _dp_says(name: str, method_cls: type[Method[Any, Any]], tags: MethodTags) -> str:
    if tags.fuses not in ("parameters", "nothing") and not tags.no_dp:
        return f"no dp for method {name!r} (it fuses {tags.fuses}; dp acts on parameter updates)"
    if tags.fuses == "parameters" and "dp" in tags.updates and not tags.no_dp:
        return f"no central dp for method {name!r}"
    return f"no dp for method {name!r}"


def _aggregator_says(name: str, method_cls: type[Method[Any, Any]], tags: MethodTags) -> str:
    if "aggregator" not in tags.updates:
        return "expected a known key"
    return f"the default mean for method {name!r} (it fuses {tags.fuses}; a robust rule and clip_norm act on parameter updates)"


#: every refusal the tags decide, by name (a case's ``variants`` key for the entry it runs with)
RULES: dict[str, Rule] = {
    # clients whose model is not the run's: only methods that need each client's predictions, not weights in one layout
    "client-models": Rule(
        _simulation(federation={"client_overrides": {1: {"model": OTHER_MODEL}}}),
        lambda cls, tags: not tags.heterogeneous_clients,
        lambda n: "federation.client_overrides",
        lambda n, cls, tags: f"for method {n!r}",
    ),
    # local DP-SGD covers what a method releases only when it reads the clients' data through their local models
    "local-dp": Rule(
        _simulation(train={"dp": LOCAL_DP}),
        lambda cls, tags: not (tags.local_model_only or tags.oracle),
        lambda n: "train.dp",
        lambda n, cls, tags: f"not method {n!r}",
    ),
    # federated evaluation: only methods that score through the server's evaluate
    "federated-evaluation": Rule(
        _simulation(evaluation="federated", data={"val_size": 0.2}),
        lambda cls, tags: not tags.federated_evaluation,
        lambda n: "evaluation",
        lambda n, cls, tags: f"for method {n!r}",
    ),
    # silo data: no process holds the whole dataset
    "silos": Rule(
        lambda cls, params, storage, scratch: _silo_job(cls, params, storage, scratch),
        lambda cls, tags: tags.needs_dataset,
        lambda n: f"methods.{n}",
        lambda n, cls, tags: f"with data.silos (no process reads every silo), got {n!r}",
        variant="silos",
    ),
    # a public sample without labels (silo data): refused for a method that reads them (a method that needs the whole
    # dataset is refused on silo data before its labels matter: the rule above)
    "unlabelled-public": Rule(
        lambda cls, params, storage, scratch: _silo_job(cls, params, storage, scratch, labelled=False),
        lambda cls, tags: tags.public_labels,
        lambda n: "data.public.labels",
        lambda n, cls, tags: f"for method {n!r}",
        applies=lambda tags: not tags.needs_dataset,
        variant="silos",
    ),
    # a dp key on the method (central DP-FedAvg, a DP upload), of the kind its parameters declare
    "method-dp": Rule(
        _with_key("dp", lambda cls: UPLOAD_DP if "dp" in cls.Params.model_fields and not _central_dp(cls) else CENTRAL_DP),
        _dp_refused,
        lambda n: f"methods.{n}.dp",
        _dp_says,
    ),
    # a robust rule (coordinate-wise median): only where the pipeline combines parameter updates and the method's tags
    # take an aggregator key (else the key is unknown to its parameters)
    "robust-aggregator": Rule(
        _with_key("aggregator", lambda cls: {"name": "median"}),
        lambda cls, tags: tags.fuses != "parameters" or "aggregator" not in tags.updates,
        lambda n: f"methods.{n}.aggregator",
        _aggregator_says,
    ),
    # simulated attacks: refused for a method fusing anything but parameters (posteriors, statistics, predictions: the
    # pipeline's attacks act on parameter updates); methods combining no client upload ("nothing": local, oracles) run
    # beside them
    "attacks": Rule(
        _simulation(federation={"attacks": [{"client": 1, "kind": "sign_flip"}]}),
        lambda cls, tags: tags.fuses not in ("parameters", "nothing"),
        lambda n: "federation.attacks",
        lambda n, cls, tags: f"no attacks with method {n!r} (methods.{n} fuses {tags.fuses}; attacks act on parameter updates)",
    ),
}


def _entry(rule: str, case: MethodCase) -> dict[str, Any]:
    """The method's entry in the run of ``rule``."""
    return case.variants.get(RULES[rule].variant or rule, case.params)


def _rule_tags(method_cls: type[Method[Any, Any]], rule: str, case: MethodCase) -> MethodTags:
    return _tags(method_cls, _entry(rule, case))


def refusal_rules(method_cls: type[Method[Any, Any]], case: MethodCase | None = None) -> list[str]:
    """The names of the :data:`RULES` that apply to the method (each one a :func:`check_refusal`)."""
    case = case or case_of(method_cls)
    return [rule for rule in sorted(RULES) if RULES[rule].applies(_rule_tags(method_cls, rule, case))]


def is_refused(method_cls: type[Method[Any, Any]], rule: str, case: MethodCase | None = None) -> bool:
    """Whether the method's tags refuse the run of ``rule``."""
    case = case or case_of(method_cls)
    return RULES[rule].refused(method_cls, _rule_tags(method_cls, rule, case))


def check_refusal(
    method_cls: type[Method[Any, Any]], rule: str, *, case: MethodCase | None = None, tmp_path: Path | str | None = None
) -> None:
    """The run of :data:`RULES` ``[rule]`` is refused before anything starts (one line naming the key and the method,
    nothing written) where the method's tags say so, and passes every pre-start check where they allow it."""
    case = case or case_of(method_cls)
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {', '.join(sorted(RULES))}, got {rule!r}")
    name, spec = method_name(method_cls), RULES[rule]
    tags = _rule_tags(method_cls, rule, case)
    with ExitStack() as stack:
        scratch = _scratch(tmp_path, stack) / "refusals" / name / rule
        storage = scratch / "runs"
        data = spec.build(method_cls, _entry(rule, case), storage, scratch / "files")
        try:
            _prepare(method_cls, validate_config(data))
            refusal = None
        except InputError as exc:
            refusal = str(exc)
        assert not storage.exists(), f"{name}, {rule}: the pre-start checks wrote {storage}"
        if not spec.refused(method_cls, tags):
            assert refusal is None, f"{name}, {rule}: refused although its tags allow it: {refusal}"
            return
        assert refusal is not None, f"{name}, {rule}: not refused before start although its tags say so ({tags})"
        key = spec.key(name)
        assert refusal.startswith(f"{key}: ") and "\n" not in refusal, f"{name}, {rule}: expected one line at {key}, got {refusal!r}"
        says = spec.says(name, method_cls, tags)
        assert says in refusal, f"{name}, {rule}: expected the refusal to say {says!r}, got {refusal!r}"


def check_refusals(method_cls: type[Method[Any, Any]], *, case: MethodCase | None = None, tmp_path: Path | str | None = None) -> None:
    """:func:`check_refusal` for every rule that applies to the method."""
    case = case or case_of(method_cls)
    with ExitStack() as stack:
        scratch = _scratch(tmp_path, stack)
        for rule in refusal_rules(method_cls, case):
            check_refusal(method_cls, rule, case=case, tmp_path=scratch)


# ---------------------------------------------------------------------------------------------------------------
# All of them


def check_method(
    method_cls: type[Method[Any, Any]],
    *,
    case: MethodCase | None = None,
    tmp_path: Path | str | None = None,
    checks: Sequence[str] = CHECKS,
) -> None:
    """Run ``checks`` (of :data:`CHECKS`: ``runs``, ``resumes``, ``refusals``) on ``method_cls``, registered or not,
    in-process on its tiny config (``case``, default: its class's ``test_case``); the runs go under ``tmp_path``
    (default: a temporary folder, removed after). Raises ``AssertionError`` naming the first check that fails."""
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"checks: expected names among {', '.join(CHECKS)}, got {', '.join(map(repr, unknown))}")
    case = case or case_of(method_cls)
    with ExitStack() as stack:
        scratch = _scratch(tmp_path, stack)
        runs = Runs(scratch / "straight")
        if "runs" in checks:
            _check_runs(method_cls, case, runs)
        if "resumes" in checks:
            _check_resumes(method_cls, case, runs, scratch / "resumed" / method_name(method_cls))
        if "refusals" in checks:
            check_refusals(method_cls, case=case, tmp_path=scratch)
