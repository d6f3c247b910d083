"""Accuracy of one-shot fusion of K independently trained clients: the grid driver of the aligned-fusion benchmark.

Grid: K in {2, 3, 5} x partition {iid, dirichlet0.5, label-disjoint} x init {shared, independent} x architectures
{mlp, cnn, rescnn, transformer} x datasets {digits, mnist5k} x seeds {0, 1, 2} (``resnet18`` on request:
``--archs resnet18``). ``--quick``: K=3, rescnn, dirichlet0.5, independent init, digits, seed 0, 5 local epochs, the
clients trained afresh into ``--out`` (default: a new temporary folder), never over the committed tables or the cache.

Each cell's clients are trained once (``train.py``, cached); then every method in :data:`METHODS` fuses them and the
fused model is scored on the cell's test set. A method is a callable ``(TrainedCell) -> {label: {"accuracy": ...,
"seconds": ..., ...}}`` (one method may report several labels, e.g. with and without BatchNorm re-estimation):

* ``best_local``, ``ensemble`` (mean of softmax), ``naive_average`` (sample-weighted) and ``naive_average+bn`` (its
  BatchNorm statistics re-estimated on the server's public slice of 100 samples);
* ``rebasin_mergemany`` / ``rebasin_mergemany+bn``: rebasin's MergeMany on the cell's checkpoints, run by
  ``rebasin_runner.py`` in a subprocess with the rebasin virtualenv's Python (``seconds`` is rebasin's own wall
  time, as the runner measures it); its merged model's BatchNorm statistics are one client's, so ``+bn`` re-estimates
  them the same way as ``naive_average+bn``;
* ``rayfuse_wm`` / ``rayfuse_wm+bn``: rayfuse's weight matching (``rayfuse.alignment.weight_matching``, MergeMany)
  with the spec ``rayfuse.symmetry.derive_spec`` derives from the cell's model, on the same checkpoints rebasin gets,
  then ``merge_average``; ``+bn`` as above (the apples-to-apples comparison with rebasin); ``+clients_bn``: the
  BatchNorm statistics re-estimated the way ``rayfuse_am`` re-estimates them (each client's data, pooled by count);
* ``rayfuse_am``, ``rayfuse_am_norepair``, ``rayfuse_am_fisher``: rayfuse's activation matching as the federated
  protocol plays it: each client's correlation statistics on its own training split, the sample-weighted average,
  the BatchNorm statistics computed by each client on its own data and pooled by count (``_norepair``: without that
  repair; ``_fisher``: the Fisher-weighted merge, each client's diagonal Fisher on its own data, then the repair);
* ``rayfuse_np`` (the nonparametric merge) and ``rayfuse_am+rescale``: see :func:`rayfuse_np`;
* ``rayfuse_am+round``, ``rayfuse_np+round``: the one-shot merge, then one more round (E/5 local epochs from it on
  every client, averaged): see :func:`rayfuse_rounds`;
* ``fedavg_1`` and ``fedavg_5``: rayfuse's FedAvg (``rayfuse.run(config, backend="local")``) on the same split and
  seed, 1 round of E local epochs and 5 rounds of E/5 (the same local compute as the one-shot methods). FedAvg
  starts every client from its server's one initialisation, whatever the cell's ``init``.

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/aligned/accuracy.py --quick
    PYTHONPATH=$PWD .venv/bin/python benchmarks/aligned/accuracy.py [--archs ...] [--datasets ...] [--clients ...] \
        [--partitions ...] [--inits ...] [--seeds ...] [--methods ...] [--out docs/results/aligned] [--threads 1]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/aligned/accuracy.py --render RAW.json [RAW2.json ...]   # outputs only

Writes ``<out>/accuracy.csv`` (one row per cell, seed and method label), ``<out>/accuracy.md`` (mean and standard
deviation over seeds) and ``<out>/accuracy_<dataset>_<arch>.png``, and the raw rows to
``benchmarks/results/aligned_accuracy.json`` (``--quick``: ``<out>/aligned_accuracy_quick.json``). Without the rebasin
environment its methods are left out, with a printed line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _common import machine_info, out_dir, write_results  # noqa: E402
from arch import build_arch  # noqa: E402
from train import (  # noqa: E402
    CACHE_DIR,
    INITS,
    PARTITIONS,
    Cell,
    TrainedCell,
    accuracy_of,
    average_params,
    build_model,
    ensemble_accuracy,
    reestimate_batchnorm,
    train_cell,
)

from rayfuse.io import load_params  # noqa: E402

REPO = HERE.parents[1]
REBASIN_PYTHON = HERE.parent / ".venv-rebasin" / "bin" / "python"
OUT_DIR = REPO / "docs" / "results" / "aligned"
ARCHS = ("mlp", "cnn", "rescnn", "transformer")
DATASETS = ("digits", "mnist5k")
CLIENTS = (2, 3, 5)
SEEDS = (0, 1, 2)
QUICK = {
    "archs": ["rescnn"],
    "datasets": ["digits"],
    "clients": [3],
    "partitions": ["dirichlet0.5"],
    "inits": ["independent"],
    "seeds": [0],
}

MethodFn = Callable[[TrainedCell], dict[str, dict[str, Any]]]


def score(
    trained: TrainedCell, params: Mapping[str, Any], seconds: float, label: str, *, with_bn: bool = True, **extra: Any
) -> dict[str, dict[str, Any]]:
    """``{label: ...}`` and, when the model has BatchNorm and ``with_bn``, ``{label+bn: ...}`` (statistics re-estimated
    on the public slice)."""
    out = {label: {"accuracy": accuracy_of(trained.spec, params, trained.test), "seconds": seconds, **extra}}
    if with_bn and any(k.endswith("running_mean") for k in params):
        started = time.perf_counter()
        repaired = reestimate_batchnorm(trained.spec, params, trained.public.X)
        out[label + "+bn"] = {
            "accuracy": accuracy_of(trained.spec, repaired, trained.test),
            "seconds": seconds + time.perf_counter() - started,
            **extra,
        }
    return out


def best_local(trained: TrainedCell) -> dict[str, dict[str, Any]]:
    """The best client model on the test set (an oracle choice: it looks at test accuracy)."""
    scores = [accuracy_of(trained.spec, p, trained.test) for p in trained.clients]
    return {"best_local": {"accuracy": max(scores), "seconds": 0.0, "locals": scores}}


def ensemble(trained: TrainedCell) -> dict[str, dict[str, Any]]:
    """The mean of the clients' softmax outputs (K models at inference)."""
    return {"ensemble": {"accuracy": ensemble_accuracy(trained.spec, trained.clients, trained.test), "seconds": 0.0}}


def naive_average(trained: TrainedCell) -> dict[str, dict[str, Any]]:
    """The sample-weighted average of the clients' parameters, without alignment."""
    started = time.perf_counter()
    average = average_params(trained.clients, trained.num_examples)
    return score(trained, average, time.perf_counter() - started, "naive_average")


def run_rebasin(
    folder: Path,
    arch_file: Path,
    out: Path,
    *,
    modes: Sequence[str] = ("mergemany",),
    threads: int = 1,
    python: Path = REBASIN_PYTHON,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Run ``rebasin_runner.py`` on a checkpoint folder with the rebasin virtualenv's Python; return its result dict.

    Raises ``RuntimeError`` (with the runner's last lines) when the environment is missing or the runner fails.
    """
    if not python.exists():
        raise RuntimeError(f"no rebasin environment at {python} (see benchmarks/README.md, 'Aligned fusion')")
    cmd = [
        str(python),
        str(HERE / "rebasin_runner.py"),
        str(folder),
        str(arch_file),
        str(out),
        "--modes",
        *modes,
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
        raise RuntimeError(f"rebasin_runner.py exited with {proc.returncode}:\n{tail}")
    return dict(json.loads(lines[-1]))


def rebasin_mergemany(trained: TrainedCell) -> dict[str, dict[str, Any]]:
    """rebasin's MergeMany (git re-basin's N-way weight matching) in its own virtualenv."""
    with tempfile.TemporaryDirectory(prefix="rebasin-") as tmp:
        result = run_rebasin(trained.folder, trained.folder / "arch.json", Path(tmp))
        run = result["mergemany"]
        if not run.get("ok"):
            return {"rebasin_mergemany": {"accuracy": float("nan"), "seconds": float("nan"), "error": run.get("error", "")}}
        merged = load_params(Path(tmp) / run["file"])
    return score(trained, merged, float(run["seconds"]), "rebasin_mergemany", max_output_change=run.get("max_output_change"))


def fedavg(trained: TrainedCell, rounds: Sequence[int] = (1, 5)) -> dict[str, dict[str, Any]]:
    """rayfuse's FedAvg on the cell's split and seed: R rounds of E/R local epochs for each R in ``rounds``."""
    import rayfuse

    epochs = trained.cell.epochs
    config = dict(trained.config)
    config["methods"] = {f"fedavg_{r}": {"method": "fedavg", "rounds": r, "local_epochs": max(1, epochs // r)} for r in rounds}
    config["federation"] = {"backend": "local"}
    spec = trained.spec

    def factory(input_shape: tuple[int, ...], num_classes: int) -> Any:
        return build_arch({**spec, "input_shape": list(input_shape), "num_classes": num_classes})

    with tempfile.TemporaryDirectory(prefix="fedavg-") as tmp, contextlib.redirect_stdout(io.StringIO()):
        result = rayfuse.run(config, model=factory, backend="local", run_dir=Path(tmp) / "run", quiet=True)
    methods = result.results["methods"]
    return {
        label: {"accuracy": float(result.metrics.loc[label, "accuracy"]), "seconds": float(methods[label]["seconds"])}
        for label in config["methods"]
    }


def derive_cell_spec(trained: TrainedCell) -> Any:
    """rayfuse's permutation spec of the cell's model, derived from its graph (``rayfuse.symmetry.derive_spec``)."""
    import torch

    from rayfuse.symmetry import derive_spec

    return derive_spec(build_arch(trained.spec), torch.zeros((2, *trained.spec["input_shape"])))


def rayfuse_wm(trained: TrainedCell) -> dict[str, dict[str, Any]]:
    """rayfuse's weight matching (MergeMany, ``rayfuse.alignment.weight_matching``) on the cell's checkpoints with the
    derived spec, then the sample-weighted average (``merge_average``); ``+bn`` as for the other methods (the public
    slice). Data-free: the same inputs rebasin gets. ``seconds``: spec derivation, matching and merge."""
    from rayfuse.alignment import apply_alignment, merge_average, weight_matching
    from rayfuse.matching import serial_map

    started = time.perf_counter()
    pspec = derive_cell_spec(trained)
    alignment = weight_matching(trained.clients, pspec, weights=trained.num_examples, executor=serial_map)
    merged = merge_average(apply_alignment(trained.clients, pspec, alignment), trained.num_examples)
    seconds = time.perf_counter() - started
    out = score(trained, merged, seconds, "rayfuse_wm", sweeps=alignment.sweeps)
    if "rayfuse_wm+bn" in out:  # the federated repair, as rayfuse_am gets it: each client's BatchNorm statistics, pooled
        started = time.perf_counter()
        repaired = repair_with_clients(trained, merged, [split.X[:2048] for split in trained.train_sets])
        out["rayfuse_wm+clients_bn"] = {
            "accuracy": accuracy_of(trained.spec, repaired, trained.test),
            "seconds": seconds + time.perf_counter() - started,
            "sweeps": alignment.sweeps,
        }
    return out


@dataclass
class ActivationAlignment:
    """One cell's activation matching (:func:`align_by_activations`): the spec, the result, the aligned client models
    and the seconds it took (spec derivation, the clients' statistics and the solves)."""

    key: str
    spec: Any
    alignment: Any
    aligned: list[dict[str, Any]]
    seconds: float


_LAST_ALIGNMENT: list[ActivationAlignment] = []


def align_by_activations(trained: TrainedCell, *, samples: int = 2048, sweeps: int = 3) -> ActivationAlignment:
    """rayfuse's activation matching, the federated protocol played in-process: each sweep every client computes the
    per-group correlation statistics of the reference against its own model on its own training split (at most
    ``samples``), the server solves the assignments and the reference becomes the weighted average of the aligned
    models. The methods that start from it (``rayfuse_am``, ``rayfuse_np``, ``rayfuse_rounds``) share the last cell's
    result (it is deterministic), so it runs once per cell."""
    from rayfuse.alignment import activation_matching, apply_alignment, collect_correlations
    from rayfuse.matching import serial_map
    from rayfuse.symmetry import trace_model

    key = f"{trained.cell.key()}|{samples}|{sweeps}"
    if _LAST_ALIGNMENT and _LAST_ALIGNMENT[0].key == key:
        return _LAST_ALIGNMENT[0]
    started = time.perf_counter()
    pspec = derive_cell_spec(trained)
    graph = trace_model(build_arch(trained.spec))
    data = [split.X[:samples] for split in trained.train_sets]
    owns = [build_model(trained.spec, p) for p in trained.clients]

    def collect(reference: Mapping[str, Any]) -> list[dict[str, Any]]:
        ref = build_model(trained.spec, reference)
        return [collect_correlations(ref, own, pspec, graph, graph, X) for own, X in zip(owns, data)]

    alignment = activation_matching(trained.clients, pspec, collect, weights=trained.num_examples, sweeps=sweeps, executor=serial_map)
    found = ActivationAlignment(key, pspec, alignment, apply_alignment(trained.clients, pspec, alignment), time.perf_counter() - started)
    _LAST_ALIGNMENT[:] = [found]
    return found


def rayfuse_am(trained: TrainedCell, *, samples: int = 2048, sweeps: int = 3) -> dict[str, dict[str, Any]]:
    """rayfuse's activation matching (:func:`align_by_activations`), then the merge and the BatchNorm repair: the merged
    model's BatchNorm statistics computed by each client on its own data and pooled by count (``batchnorm_statistics``
    + ``combine_batchnorm``).

    Labels: ``rayfuse_am`` (sample-weighted average, repaired), ``rayfuse_am_norepair`` (the same average with its
    averaged running statistics) and ``rayfuse_am_fisher`` (the same alignment, Fisher-weighted merge with each
    client's diagonal Fisher of its aligned model on its own data, repaired). ``seconds``: everything but scoring."""
    from rayfuse.alignment import diagonal_fisher, merge_average, merge_fisher

    found = align_by_activations(trained, samples=samples, sweeps=sweeps)
    alignment, aligned, align_s = found.alignment, found.aligned, found.seconds
    data = [(split.X[:samples], split.y[:samples]) for split in trained.train_sets]
    started = time.perf_counter()
    merged = merge_average(aligned, trained.num_examples)
    average_s = align_s + time.perf_counter() - started
    started = time.perf_counter()
    repaired = repair_with_clients(trained, merged, [X for X, _ in data])
    repaired_s = average_s + time.perf_counter() - started
    extra = {"sweeps": alignment.sweeps}
    out = {
        "rayfuse_am_norepair": {"accuracy": accuracy_of(trained.spec, merged, trained.test), "seconds": average_s, **extra},
        "rayfuse_am": {"accuracy": accuracy_of(trained.spec, repaired, trained.test), "seconds": repaired_s, **extra},
    }
    started = time.perf_counter()
    fishers = [diagonal_fisher(build_model(trained.spec, a), X, y) for a, (X, y) in zip(aligned, data)]
    fused = repair_with_clients(trained, merge_fisher(aligned, fishers, trained.num_examples), [X for X, _ in data])
    fisher_s = align_s + time.perf_counter() - started
    out["rayfuse_am_fisher"] = {"accuracy": accuracy_of(trained.spec, fused, trained.test), "seconds": fisher_s, **extra}
    return out


NP_DEFAULTS = (0.5, 2.0)  # the nonparametric merge's threshold and width cap: the method's defaults


def fuse_wide(
    trained: TrainedCell, found: ActivationAlignment, data: Sequence[Any], roles: Any, threshold: float, max_width: float
) -> tuple[dict[str, Any], Any]:
    """The nonparametric merge of the aligned clients (``rayfuse.alignment.fuse_nonparametric``), then the clients'
    BatchNorm repair and REPAIR's rescaling: the fused parameters and the merge's plan."""
    from rayfuse.alignment import fuse_nonparametric

    merged, plan = fuse_nonparametric(
        found.aligned,
        found.spec,
        roles,
        quality=found.alignment.quality,
        weights=trained.num_examples,
        threshold=threshold,
        max_width=max_width,
    )
    return rescale_with_clients(trained, found.spec, found.aligned, repair_with_clients(trained, merged, data), data, plan), plan


def rayfuse_np(
    trained: TrainedCell, *, samples: int = 2048, sweeps: int = 3, variants: Sequence[tuple[float, float]] = (NP_DEFAULTS, (0.5, 1.5))
) -> dict[str, dict[str, Any]]:
    """rayfuse's activation matching (as ``rayfuse_am`` plays it), then what the merge and the repair add:

    * ``rayfuse_np`` (threshold 0.5, width at most 2x: the method's defaults) and ``rayfuse_np_w1.5`` (at most 1.5x):
      the nonparametric merge (``rayfuse.alignment.fuse_nonparametric``): a unit whose activation correlation with the
      reference's unit is below the threshold becomes a new global unit; then the clients' BatchNorm repair and REPAIR's
      rescaling of the layers no BatchNorm follows (``width``: the global model's units over the clients');
    * ``rayfuse_am+rescale`` (models with layers no BatchNorm follows): ``rayfuse_am``'s merge and BatchNorm repair,
      then REPAIR's rescaling.

    ``seconds``: alignment, merge and repair."""
    from rayfuse.alignment import merge_average, width_roles

    found = align_by_activations(trained, samples=samples, sweeps=sweeps)
    pspec, aligned, align_s = found.spec, found.aligned, found.seconds
    data = [split.X[:samples] for split in trained.train_sets]
    started = time.perf_counter()
    roles = width_roles(build_arch(trained.spec), pspec)
    align_s += time.perf_counter() - started
    out = {}
    for threshold, max_width in variants:
        started = time.perf_counter()
        repaired, plan = fuse_wide(trained, found, data, roles, threshold, max_width)
        growth = sum(plan.widths.values()) / sum(g.size for g in pspec.groups)
        label = "rayfuse_np" if (threshold, max_width) == variants[0] else f"rayfuse_np_w{max_width:g}"
        out[label] = {
            "accuracy": accuracy_of(trained.spec, repaired, trained.test),
            "seconds": align_s + time.perf_counter() - started,
            "width": round(growth, 3),
        }
    started = time.perf_counter()
    average = repair_with_clients(trained, merge_average(aligned, trained.num_examples), data)
    rescaled = rescale_with_clients(trained, pspec, aligned, average, data, None)
    if rescaled is not average:
        out["rayfuse_am+rescale"] = {
            "accuracy": accuracy_of(trained.spec, rescaled, trained.test),
            "seconds": align_s + time.perf_counter() - started,
        }
    return out


def rayfuse_rounds(trained: TrainedCell, *, samples: int = 2048, sweeps: int = 3) -> dict[str, dict[str, Any]]:
    """Aligned fusion with a second round: the one-shot merge (``rayfuse_am``'s average or ``rayfuse_np``'s
    nonparametric merge, each with its repair) goes back to the clients, each trains it for E/5 local epochs on its
    own split (``fedavg_5``'s epochs per round; the nonparametric merge's wider model at its widths), and the server
    averages the updates by sample count and pools the clients' BatchNorm statistics. Two uploads per client, against
    one for the one-shot methods and five for ``fedavg_5``. Close to the federated method with ``rounds: 2``, which
    also weight-matches each second-round update onto the global model before merging; here the updates, all trained
    from one model, are averaged as they are.

    Labels: ``rayfuse_am+round``, ``rayfuse_np+round``. ``seconds``: alignment, merges, the round's training and
    the repairs."""
    from rayfuse.alignment import merge_average, width_roles
    from rayfuse.models import get_params, train_model
    from rayfuse.seeding import derive_seed

    found = align_by_activations(trained, samples=samples, sweeps=sweeps)
    data = [split.X[:samples] for split in trained.train_sets]
    train = trained.config["train"]
    epochs = max(1, trained.cell.epochs // 5)

    def second_round(start: Mapping[str, Any]) -> dict[str, Any]:
        updates = []
        for i, split in enumerate(trained.train_sets):
            model = build_model(trained.spec, start)
            train_model(
                model,
                split.X,
                split.y,
                epochs=epochs,
                batch_size=int(train["batch_size"]),
                lr=float(train["lr"]),
                optimizer=train["optimizer"],
                seed=derive_seed(trained.cell.seed, "aligned-round", i),
            )
            updates.append(get_params(model))
        return repair_with_clients(trained, merge_average(updates, trained.num_examples), data)

    out = {}
    started = time.perf_counter()
    average = repair_with_clients(trained, merge_average(found.aligned, trained.num_examples), data)
    out["rayfuse_am+round"] = second_round(average), time.perf_counter() - started
    started = time.perf_counter()
    wide, _ = fuse_wide(trained, found, data, width_roles(build_arch(trained.spec), found.spec), *NP_DEFAULTS)
    out["rayfuse_np+round"] = second_round(wide), time.perf_counter() - started
    return {
        label: {"accuracy": accuracy_of(trained.spec, params, trained.test), "seconds": found.seconds + seconds}
        for label, (params, seconds) in out.items()
    }


def rescale_with_clients(
    trained: TrainedCell, pspec: Any, aligned: Sequence[dict[str, Any]], params: dict[str, Any], data: Sequence[Any], plan: Any
) -> dict[str, Any]:
    """``params`` after REPAIR's rescaling as the federated protocol plays it (``rayfuse.alignment.repair_units``,
    ``unit_statistics`` of each client's aligned model and of the merged model on each client's data, ``repair_targets``,
    ``apply_repair``, one pass per layer, at most 3); ``params`` itself when every hidden layer feeds a BatchNorm."""
    from rayfuse.alignment import apply_repair, repair_targets, repair_units, unit_statistics

    units = repair_units(build_arch(trained.spec), pspec)
    if not units:
        return params
    own = [unit_statistics(build_model(trained.spec, a), X, units) for a, X in zip(aligned, data)]
    targets = repair_targets(
        own, units, trained.num_examples, index=plan.index if plan is not None else None, widths=plan.widths if plan is not None else None
    )
    for _ in range(min(len(units), 3)):
        model = build_model(trained.spec, params)
        params = apply_repair(
            params, units, repair_targets([unit_statistics(model, X, units) for X in data], units, trained.num_examples), targets
        )
    return params


def repair_with_clients(trained: TrainedCell, params: dict[str, Any], data: Sequence[Any]) -> dict[str, Any]:
    """``params`` with its BatchNorm running statistics replaced by the pooled statistics each client computes on its own
    data (``batchnorm_statistics`` per client, ``combine_batchnorm``, ``apply_batchnorm``); unchanged without
    BatchNorm."""
    from rayfuse.alignment import apply_batchnorm, batchnorm_statistics, combine_batchnorm

    if not any(k.endswith("running_mean") for k in params):
        return params
    model = build_model(trained.spec, params)
    return apply_batchnorm(params, combine_batchnorm([batchnorm_statistics(model, X) for X in data]))


# The methods of the grid, by name.
METHODS: dict[str, MethodFn] = {
    "best_local": best_local,
    "ensemble": ensemble,
    "naive_average": naive_average,
    "rebasin_mergemany": rebasin_mergemany,
    "rayfuse_wm": rayfuse_wm,
    "rayfuse_am": rayfuse_am,
    "rayfuse_np": rayfuse_np,
    "rayfuse_rounds": rayfuse_rounds,
    "fedavg": fedavg,
}


def iterate_cells(
    archs: Sequence[str],
    datasets: Sequence[str],
    clients: Sequence[int],
    partitions: Sequence[str],
    inits: Sequence[str],
    seeds: Sequence[int],
    epochs: int,
) -> list[Cell]:
    """Every cell of the grid, seeds innermost."""
    return [Cell(a, d, p, k, i, s, epochs) for d, a, p, k, i, s in itertools.product(datasets, archs, partitions, clients, inits, seeds)]


def run_grid(cells: Sequence[Cell], methods: Mapping[str, MethodFn], cache_dir: Path = CACHE_DIR) -> list[dict[str, Any]]:
    """Train (or read back from ``cache_dir``) each cell's clients, run every method; one row per cell and method label."""
    rows = []
    for cell in cells:
        trained = train_cell(cell, cache_dir)
        print(f"{cell.key()} (clients trained in {trained.train_seconds:.1f} s)", flush=True)
        for name, method in methods.items():
            try:
                results = method(trained)
            except Exception as exc:  # one failing method must not stop the grid: recorded in its row
                results = {name: {"accuracy": float("nan"), "seconds": float("nan"), "error": f"{type(exc).__name__}: {exc}"[:300]}}
            for label, result in results.items():
                row = {**cell.fields(), "method": label, **result}
                rows.append(row)
                note = f"  ({result['error']})" if result.get("error") else ""
                print(f"  {label:24s} {result['accuracy']:.4f}  {result['seconds']:.2f} s{note}", flush=True)
    return rows


KEYS = ("dataset", "arch", "partition", "num_clients", "init")
# The tables' column order: references, data-free merges, merges with the clients' statistics, then the methods that
# take more than one round (labels not listed follow, each base label before its variants).
LABEL_ORDER = (
    "best_local",
    "ensemble",
    "naive_average",
    "naive_average+bn",
    "rebasin_mergemany",
    "rebasin_mergemany+bn",
    "rayfuse_wm",
    "rayfuse_wm+bn",
    "rayfuse_wm+clients_bn",
    "rayfuse_am_norepair",
    "rayfuse_am",
    "rayfuse_am+rescale",
    "rayfuse_am_fisher",
    "rayfuse_np",
    "rayfuse_np_w1.5",
    "rayfuse_am+round",
    "rayfuse_np+round",
    "fedavg_1",
    "fedavg_5",
)


def read_raw(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of raw result files (``aligned_accuracy.json``, ``aligned_width.json``) in the tables' order, a later
    file's row replacing an earlier one of the same cell and method label, and the first file's machine info."""
    payloads = [json.loads(Path(path).read_text(encoding="utf-8")) for path in paths]
    fields = (*asdict(Cell("", "", "", 0, "", 0)), "method")  # model_width and public_size: None when a row has none
    keyed = {tuple(row.get(k) for k in fields): row for payload in payloads for row in payload["rows"]}
    archs = ("mlp", "cnn", "rescnn", "vgg", "transformer", "resnet18")
    rows = sorted(
        keyed.values(),
        key=lambda r: (
            r["dataset"],
            archs.index(r["arch"]) if r["arch"] in archs else len(archs),
            r["arch"],
            PARTITIONS.index(r["partition"]),
            r["num_clients"],
            INITS.index(r["init"]),
            r.get("model_width") or 0,
            r["seed"],
        ),
    )
    return rows, dict(payloads[0]["machine"])


def write_outputs(
    rows: list[dict[str, Any]],
    out_dir: Path,
    info: Mapping[str, Any],
    *,
    keys: Sequence[str] = KEYS,
    name: str = "accuracy",
    title: str = "Aligned fusion: one-shot accuracy",
    summary: Callable[[Any, Sequence[str]], list[str]] | None = None,
    x: str = "num_clients",
    panels: tuple[str, str] = ("partition", "init"),
    script: str = "benchmarks/aligned",
    command: str | None = None,
    order: Sequence[str] = (),
) -> list[Path]:
    """The CSV, the markdown table (mean and std over seeds, a row per ``keys``) and one plot per dataset and
    architecture (accuracy against ``x``, a panel per ``panels`` pair): ``<name>.csv``, ``<name>.md``,
    ``<name>_<dataset>_<arch>.png``. ``summary``: the markdown after the table (default :func:`summary_lines`);
    ``command``: the script line the page names (default ``<script>/<name>.py``)."""
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    if "locals" in frame:
        frame["locals"] = frame["locals"].map(lambda v: " ".join(f"{x:.4f}" for x in v) if isinstance(v, list) else "")
    csv = out_dir / f"{name}.csv"
    frame.to_csv(csv, index=False)
    keys = list(keys)
    stats = frame.groupby([*keys, "method"], sort=False)["accuracy"].agg(["mean", "std", "count"]).reset_index()
    labels = list(dict.fromkeys(frame["method"]))
    methods = [m for m in (*order, *LABEL_ORDER) if m in labels]
    methods = list(dict.fromkeys(methods))
    methods += [
        m
        for base in labels
        if "+" not in base and base not in methods
        for m in (base, *[x for x in labels if x.startswith(base + "+") and x not in methods])
    ]
    methods += [m for m in labels if m not in methods]
    heads = {"num_clients": "K", "model_width": "model width"}
    lines = [
        f"# {title}",
        "",
        f"Test accuracy, mean (std) over seeds; {info['cpus']} CPUs, {info.get('cpu_model', '')}. "
        f"Produced by `{command or f'{script}/{name}.py'}`; rows per seed in `{name}.csv`.",
        "",
        "| " + " | ".join(heads.get(k, k) for k in keys) + " | seeds | " + " | ".join(methods) + " |",
        "|" + "---|" * (len(keys) + 1 + len(methods)),
    ]
    for key, group in stats.groupby(keys, sort=False):
        by_method = {r["method"]: r for _, r in group.iterrows()}
        seeds = int(max(r["count"] for r in by_method.values()))
        cells = []
        for m in methods:
            r = by_method.get(m)
            if r is None or pd.isna(r["mean"]):
                cells.append("n/a")
            else:
                cells.append(f"{r['mean']:.3f}" + (f" ({r['std']:.3f})" if seeds > 1 and not pd.isna(r["std"]) else ""))
        lines.append("| " + " | ".join(str(k) for k in key) + f" | {seeds} | " + " | ".join(cells) + " |")
    lines += (summary or summary_lines)(stats, methods)
    md = out_dir / f"{name}.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [csv, md, *plot(stats, methods, out_dir, name=name, x=x, panels=panels)]


_PANEL_TITLES = {"num_clients": "K ="}
_AXIS_TITLES = {"num_clients": "clients K", "model_width": "model width (channels / units per hidden layer)"}
TARGET = {"dataset": "digits", "arch": "rescnn", "partition": "dirichlet0.5", "num_clients": 3, "init": "independent"}


def summary_lines(stats: Any, methods: Sequence[str]) -> list[str]:
    """Markdown: per (dataset, arch), the mean over cells of each method's accuracy (cells where the method ran), and
    the issue's target cell (:data:`TARGET`) method by method when the grid holds it."""
    lines = [
        "",
        "## Summary: mean over cells",
        "",
        "Per dataset and architecture, each method's accuracy averaged over the grid's cells (K, partition, init; seed means first).",
        "",
        "| dataset | arch | cells | " + " | ".join(methods) + " |",
        "|" + "---|" * (3 + len(methods)),
    ]
    for (dataset, arch_name), group in stats.groupby(["dataset", "arch"], sort=False):
        means = group.groupby("method")["mean"].mean()
        cells = group.groupby(["partition", "num_clients", "init"]).ngroups
        lines.append(
            f"| {dataset} | {arch_name} | {cells} | "
            + " | ".join(f"{means[m]:.3f}" if m in means and means[m] == means[m] else "n/a" for m in methods)
            + " |"
        )
    mask = np.ones(len(stats), dtype=bool)
    for key, value in TARGET.items():
        mask &= (stats[key] == value).to_numpy()
    target = stats[mask]
    if len(target):
        lines += [
            "",
            "## The target cell",
            "",
            "The issue's target: "
            + ", ".join(f"{k} {v}" for k, v in TARGET.items())
            + " (at least 60 % where averaging gives about 10 %).",
            "",
            "| method | accuracy | seeds |",
            "|---|---|---|",
        ]
        lines += [f"| {r['method']} | {r['mean']:.3f} | {int(r['count'])} |" for _, r in target.iterrows()]
    return lines


def plot(
    stats: Any,
    methods: Sequence[str],
    out_dir: Path,
    *,
    name: str = "accuracy",
    x: str = "num_clients",
    panels: tuple[str, str] = ("partition", "init"),
) -> list[Path]:
    """One figure per (dataset, arch): accuracy against ``x`` (K), a panel per ``panels`` (partition, init), a line per
    method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    first, second = panels
    colors = plt.get_cmap("tab20")
    for (dataset, arch_name), group in stats.groupby(["dataset", "arch"], sort=False):
        pairs = list(dict.fromkeys(zip(group[first], group[second])))
        fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs) + 1.8, 3.6), squeeze=False, sharey=True)
        for ax, (a, b) in zip(axes[0], pairs):
            sub = group[(group[first] == a) & (group[second] == b)]
            for i, method in enumerate(methods):
                line = sub[sub["method"] == method].sort_values(x)
                if len(line):  # 20 distinguishable colours; dashed: the methods that take more than one round
                    ax.errorbar(
                        line[x],
                        line["mean"],
                        yerr=line["std"].fillna(0.0),
                        marker="o",
                        capsize=3,
                        label=method,
                        color=colors(i % 20),
                        linestyle="--" if "round" in method or method.startswith("fedavg") else "-",
                    )
            ax.set_title(f"{a}, {_PANEL_TITLES.get(second, second)} {b}" if second != "init" else f"{a}, {b} init", fontsize=10)
            ax.set_xlabel(_AXIS_TITLES.get(x, x))
            ax.set_xticks(sorted(sub[x].unique()))
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy")
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        fig.suptitle(f"{dataset}, {arch_name}")
        fig.tight_layout()
        path = out_dir / f"{name}_{dataset}_{arch_name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"the quick subset: {QUICK}")
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=[*ARCHS, "resnet18"])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--clients", nargs="+", type=int, default=list(CLIENTS))
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=PARTITIONS)
    parser.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--epochs", type=int, default=None, help="local epochs of each client (default 20; --quick 5)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder of the CSV, markdown table and plots (default {OUT_DIR.relative_to(REPO)}; with --quick, a new temporary "
        "folder, which also holds the quick cell's checkpoints)",
    )
    parser.add_argument(
        "--render",
        nargs="+",
        type=Path,
        default=None,
        help="run nothing: write the outputs from the rows of these raw result files (aligned_accuracy.json); "
        "a later file's row replaces an earlier one of the same cell and method label",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more than the free cores slows tiny models 10-30x)")
    args = parser.parse_args()
    args.out = out_dir(args.out, args.quick, OUT_DIR)
    if args.epochs is None:
        args.epochs = 5 if args.quick else 20
    import torch

    torch.set_num_threads(args.threads)
    if args.render:
        rows, info = read_raw(args.render)
        for path in write_outputs(rows, args.out, info):
            print(f"wrote {path}")
        return
    axes = {k: getattr(args, k) for k in QUICK}
    if args.quick:
        axes = dict(QUICK)
    cells = iterate_cells(axes["archs"], axes["datasets"], axes["clients"], axes["partitions"], axes["inits"], axes["seeds"], args.epochs)
    if "rebasin_mergemany" in args.methods and not REBASIN_PYTHON.exists():
        print(f"rebasin not run: no rebasin environment at {REBASIN_PYTHON} (benchmarks/README.md, 'Aligned fusion')", flush=True)
        args.methods = [m for m in args.methods if m != "rebasin_mergemany"]
    info = machine_info()
    print(f"aligned fusion accuracy: {len(cells)} cells x {len(args.methods)} methods, {info['cpus']} CPUs", flush=True)
    # a quick run trains its cell afresh in its own folder: the same training code, and never the grid's cache
    cache_dir = args.out / "checkpoints" if args.quick else CACHE_DIR
    rows = run_grid(cells, {name: METHODS[name] for name in args.methods}, cache_dir)
    paths = write_outputs(rows, args.out, info)
    raw = write_results(
        "aligned_accuracy_quick" if args.quick else "aligned_accuracy",
        {"machine": info, "axes": axes, "epochs": args.epochs, "methods": args.methods, "rows": rows},
        args.out if args.quick else None,
    )
    for path in [*paths, raw]:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
