"""Accuracy of one-shot fusion by distillation: the aligned grid's cells with distillation columns.

Cells are the aligned benchmark's (``benchmarks/aligned/train.py``: K clients trained apart on one split) with a public
slice of 300 samples (``Cell.public_size``; the aligned grid's cells hold 100, so these clients are trained again on
the split that leaves 300 out). Every cell gets the references on the same clients (``best_local``, ``ensemble``, the
aligned merges, ``fedavg_5``) and the distillation columns, each played as the ``distill`` method plays it (its
defaults, ``rayfuse.fusion.distill``), in-process:

* ``distill_public`` / ``distill_public_random``: the 300 public inputs (labels unread), shifted and mixed up, from
  ``init: aligned`` (``rayfuse_am``: activation matching, average, the clients' BatchNorm repair) or a random start;
* ``distill_free`` / ``distill_free_random``: data-free, the generator against the ensemble, the clients' input moments;
* ``distill_predictions`` / ``distill_free_predictions``: predictions only (``teachers: clients``, random start): each
  client's logits on the transfer inputs, and at each generator step each client's logits, then its input gradient
  against the server's cotangent (``rayfuse.fusion.distill.student.teacher_vjp``), computed by a stand-in client
  holding only its own model (the grid's recorded ``distill_free_predictions`` predates that protocol: one call a
  round, each client's own term of the objective; docs/methods/distill.md gives the exact protocol's cells);
* ``distill_rounds``: the few-round mode (``rounds: 3``): ``distill_public``'s student, then two rounds in which
  each client refines it on its own data, anchored on the public inputs, and it is distilled again from the refined
  clients (:func:`few_rounds`); its seconds include round 1's;
* ``pooled`` (a reference): the oracle trained on the clients' data pooled, as each client trained on its own;
* ``best_merge``: the best of the one-shot aligned merges of the cell (``rayfuse_am``, ``rayfuse_am_fisher``,
  ``rayfuse_np``, ``rayfuse_am+rescale``), the bar the data-free target is measured against.

Teacher weights are per class by each client's class counts (``weighting: classes``, the default).

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/accuracy.py --quick
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/accuracy.py [--archs ...] [--datasets ...] [--clients ...] \\
        [--partitions ...] [--inits ...] [--seeds ...] [--columns ...] [--params JSON] [--out docs/results/distill]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/accuracy.py --render RAW.json [RAW2.json ...]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/accuracy.py --heterogeneous      # mlp + cnn + rescnn clients

Writes ``<out>/accuracy.{csv,md}`` and ``<out>/accuracy_<dataset>_<arch>.png`` and the raw rows to
``benchmarks/results/distill_accuracy.json``. ``--quick``: the quick cell with 3 local epochs and 100 student steps
(``--params`` over that), its clients trained afresh; the raw rows (``distill_accuracy_quick.json``) and nothing else go
to ``--out`` or a new temporary folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "aligned"))
sys.path.insert(0, str(HERE.parent))
import accuracy as aligned  # noqa: E402
from _common import machine_info, out_dir, write_results  # noqa: E402
from arch import build_arch  # noqa: E402
from train import CACHE_DIR, PARTITIONS, Cell, TrainedCell, accuracy_of, build_model, train_cell  # noqa: E402

from rayfuse.fusion.distill.algorithm import DistillParams, checked_target  # noqa: E402
from rayfuse.fusion.distill.student import distill_public, distill_synthetic, refine_student, teacher_vjp  # noqa: E402
from rayfuse.fusion.distill.teachers import Teachers, teacher_weights  # noqa: E402
from rayfuse.fusion.distill.transfer import pooled_moments  # noqa: E402
from rayfuse.models import get_params  # noqa: E402
from rayfuse.seeding import derive_seed  # noqa: E402

REPO = HERE.parents[1]
OUT_DIR = REPO / "docs" / "results" / "distill"
PUBLIC = 300
ARCHS = ("mlp", "cnn", "rescnn", "transformer")
QUICK = {
    "archs": ["rescnn"],
    "datasets": ["digits"],
    "clients": [3],
    "partitions": ["dirichlet0.5"],
    "inits": ["independent"],
    "seeds": [0],
}
# column -> (transfer, init, teachers)
COLUMNS: dict[str, tuple[str, str, str]] = {
    "distill_public": ("public", "aligned", "parameters"),
    "distill_public_random": ("public", "random", "parameters"),
    "distill_predictions": ("public", "random", "clients"),
    "distill_free": ("synthetic", "aligned", "parameters"),
    "distill_free_random": ("synthetic", "random", "parameters"),
    "distill_free_predictions": ("synthetic", "random", "clients"),
    # the few-round mode (rounds: 3 unless --params says): distill_public's student, then rounds of the clients'
    # refinement and the server's distillation of the refined students (few_rounds)
    "distill_rounds": ("public", "aligned", "parameters"),
}
MERGES = ("rayfuse_am", "rayfuse_am_fisher", "rayfuse_np", "rayfuse_am+rescale")
ORDER = ("best_local", "ensemble", "pooled", "best_merge", "fedavg_5", *COLUMNS)
REFERENCES = ("best_local", "ensemble", "pooled", "best_merge", "fedavg_5")


class StandInClients:
    """The clients as predictions-only teachers, in-process: each holds its own model and answers what the
    ``distill.predict`` / ``distill.vjp`` client steps answer."""

    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        self.models = list(models)
        self.num_teachers = len(self.models)

    def predict(self, X: torch.Tensor) -> torch.Tensor:
        return torch.stack([Teachers([m], batched=False, freeze=False).predict(X)[0] for m in self.models])

    def vjp(self, X: torch.Tensor, cotangents: torch.Tensor, settings: Any) -> tuple[torch.Tensor, float]:
        replies = [teacher_vjp(m, X, cotangents[k], num_teachers=self.num_teachers, settings=settings) for k, m in enumerate(self.models)]
        return torch.stack([r[0] for r in replies]).sum(0), sum(r[1] for r in replies)


def few_rounds(
    trained: TrainedCell, start: dict[str, np.ndarray], p: DistillParams, weights: np.ndarray, counts: np.ndarray
) -> dict[str, np.ndarray]:
    """Rounds 2 .. ``p.rounds`` of the ``distill`` method's few-round mode on the cell's clients, in-process, from the
    round-1 student ``start``: each client refines the student on its own training split
    (:func:`~rayfuse.fusion.distill.student.refine_student`, the method's settings), and the student is distilled
    again from where it was, on the public inputs, with the refined students as the teachers (their class weights, or
    what ``combine: auto``'s check against the clients' class ``counts`` picks)."""
    spec, cell = trained.spec, trained.cell
    public = torch.as_tensor(trained.public.X, dtype=torch.float32)
    params = start
    for rnd in range(2, p.rounds + 1):
        refined = []
        for k, split in enumerate(trained.train_sets):
            model = build_model(spec, params)
            refine_student(
                model,
                torch.as_tensor(split.X, dtype=torch.float32),
                torch.as_tensor(split.y),
                public,
                epochs=p.refine_epochs,
                lr=p.refine_lr,
                batch_size=p.refine_batch_size or int(trained.config["train"]["batch_size"]),
                anchor=p.anchor,
                seed=derive_seed(cell.seed, "refine", rnd, k),
            )
            refined.append(model)
        student = build_model(spec, params).train()
        settings = p.settings(derive_seed(cell.seed, "distill", "round", rnd), one_architecture=True)
        teachers = Teachers(refined, batched=False)
        settings, round_weights, _ = checked_target(p, teachers, trained.public.X, weights, counts, settings)
        distill_public(student, teachers, trained.public.X, round_weights, settings)
        params = get_params(student.eval())
    return params


def pooled(trained: TrainedCell) -> dict[str, dict[str, Any]]:
    """The pooled-data oracle: one model trained on every client's training split together, as each client trained on
    its own (the cell's epochs, batch size, learning rate and optimiser; the shared initialisation's seed)."""
    from rayfuse.models import train_model

    train = trained.config["train"]
    started = time.perf_counter()
    model = build_arch(trained.spec, seed=derive_seed(trained.cell.seed, "init"))
    X = np.concatenate([s.X for s in trained.train_sets])
    y = np.concatenate([s.y for s in trained.train_sets])
    train_model(
        model,
        X,
        y,
        epochs=int(train["epochs"]),
        batch_size=int(train["batch_size"]),
        lr=float(train["lr"]),
        optimizer=train["optimizer"],
        seed=derive_seed(trained.cell.seed, "pooled"),
    )
    accuracy = accuracy_of(trained.spec, get_params(model.eval()), trained.test)
    return {"pooled": {"accuracy": accuracy, "seconds": time.perf_counter() - started}}


def distill_columns(
    trained: TrainedCell, columns: Sequence[str], params: Mapping[str, Any], *, both_repair: bool = False
) -> dict[str, dict[str, Any]]:
    """The distillation columns of one cell (module docstring); ``both_repair``: also each column with the other
    ``repair`` setting (``<column>+repair`` / ``<column>-repair``)."""
    spec, cell = trained.spec, trained.cell
    counts = np.stack([np.bincount(s.y, minlength=spec["num_classes"]) for s in trained.train_sets]).astype(np.float64)
    data = [s.X[:2048] for s in trained.train_sets]
    moments = pooled_moments(
        [(len(s.X), s.X.astype(np.float64).sum(0), np.square(s.X.astype(np.float64)).sum(0)) for s in trained.train_sets]
    )
    out: dict[str, dict[str, Any]] = {}
    start: dict[str, Any] | None = None
    first_rounds: dict[tuple[str, str, str], Any] = {}  # a one-shot column's student and its seconds: distill_rounds' round 1
    for column in columns:
        transfer, init, teachers_mode = COLUMNS[column]
        few = {"rounds": params.get("rounds", 3)} if column == "distill_rounds" else {"rounds": 1}
        p = DistillParams(**{**params, **few, "transfer": transfer, "init": init, "teachers": teachers_mode})
        # one seed per (transfer, start): a predictions-only column draws the same transfer inputs as its parameter-upload twin
        settings = p.settings(derive_seed(cell.seed, "distill", transfer, init), transfer=transfer)
        weights = class_weights = teacher_weights(p.weighting, counts)
        started = time.perf_counter()
        if init == "aligned":
            if start is None:
                found = aligned.align_by_activations(trained)
                from rayfuse.alignment import merge_average

                start = aligned.repair_with_clients(trained, merge_average(found.aligned, trained.num_examples), data)
            student = build_model(spec, start).train()
        else:
            student = build_arch(spec, seed=derive_seed(cell.seed, "student")).train()
        models = [build_model(spec, c) for c in trained.clients]
        teachers: Any = Teachers(models, batched=False) if teachers_mode == "parameters" else StandInClients(models)
        settings, weights, target = checked_target(p, teachers, trained.public.X, weights, counts, settings)
        if (transfer, init, teachers_mode) in first_rounds:  # the one-shot student of these settings: round 1, done
            history, student, begun = first_rounds[(transfer, init, teachers_mode)]
            started -= begun
        elif transfer == "public":
            history = distill_public(student, teachers, trained.public.X, weights, settings)
        else:
            history, _ = distill_synthetic(
                student,
                teachers,
                spec["input_shape"],
                weights,
                settings,
                label_prior=counts.sum(0),
                moments=moments if p.input_moments else None,
            )
        plain = get_params(student.eval())
        if p.rounds == 1:
            first_rounds[(transfer, init, teachers_mode)] = (history, student, time.perf_counter() - started)
        if p.rounds > 1:
            plain = few_rounds(trained, plain, p, class_weights, counts)  # each round checks its own target
        repaired = aligned.repair_with_clients(trained, plain, data)
        repair = p.repair
        fused = repaired if repair else plain
        out[column] = {
            "accuracy": accuracy_of(spec, fused, trained.test),
            "seconds": time.perf_counter() - started,
            "agreement": round(history[-1]["agreement"], 4),
            **({"target": target["chosen"], "temperature": target["temperature"]} if target is not None else {}),
        }
        if both_repair and repaired is not plain:
            out[column + ("-repair" if repair else "+repair")] = {
                "accuracy": accuracy_of(spec, plain if repair else repaired, trained.test),
                "seconds": out[column]["seconds"],
            }
    return out


def reference_columns(trained: TrainedCell, methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``best_local``, ``ensemble``, ``pooled``, the aligned merges (and ``best_merge``, their best) and ``fedavg_5`` on
    the cell."""
    out: dict[str, dict[str, Any]] = {}
    if "best_local" in methods:
        out.update(aligned.best_local(trained))
    if "ensemble" in methods:
        out.update(aligned.ensemble(trained))
    if "pooled" in methods:
        out.update(pooled(trained))
    if "best_merge" in methods:
        merges = {**aligned.rayfuse_am(trained), **aligned.rayfuse_np(trained, variants=(aligned.NP_DEFAULTS,))}
        merges = {k: v for k, v in merges.items() if k in MERGES}
        out.update(merges)
        best = max(merges, key=lambda k: merges[k]["accuracy"])
        out["best_merge"] = {"accuracy": merges[best]["accuracy"], "seconds": merges[best]["seconds"], "merge": best}
    if "fedavg_5" in methods:
        out.update({k: v for k, v in aligned.fedavg(trained, rounds=(5,)).items()})
    return out


def run_grid(
    cells: Sequence[Cell],
    references: Sequence[str],
    columns: Sequence[str],
    params: Mapping[str, Any],
    *,
    both_repair: bool = False,
    save: Any = None,
    cache_dir: Path = CACHE_DIR,
) -> list[dict[str, Any]]:
    """Every cell's references and distillation columns; ``save(rows)`` after each cell (a long grid interrupted keeps
    what it finished). The clients' checkpoints are cached in ``cache_dir``."""
    rows: list[dict[str, Any]] = []
    for cell in cells:
        trained = train_cell(cell, cache_dir)
        print(f"{cell.key()} (clients trained in {trained.train_seconds:.1f} s)", flush=True)
        results: dict[str, dict[str, Any]] = {}
        steps = (
            ("references", lambda t: reference_columns(t, references)),
            ("distill", lambda t: distill_columns(t, columns, params, both_repair=both_repair)),
        )
        for name, fn in steps:
            try:
                results.update(fn(trained))
            except Exception as exc:  # one failing cell must not stop the grid: recorded in its row
                results[name] = {"accuracy": float("nan"), "seconds": float("nan"), "error": f"{type(exc).__name__}: {exc}"[:300]}
        for label, result in results.items():
            rows.append({**cell.fields(), "method": label, **result})
            note = f"  ({result['error']})" if result.get("error") else ""
            print(f"  {label:26s} {result['accuracy']:.4f}  {result['seconds']:.1f} s{note}", flush=True)
        if save is not None:
            save(rows)
    return rows


def summary_lines(stats: Any, methods: Sequence[str]) -> list[str]:
    """The issue's targets, checked over the grid's cells (seed means): group means, and cell by cell."""
    import pandas as pd

    wide = stats.pivot_table(index=["dataset", "arch", "partition", "num_clients", "init"], columns="method", values="mean")
    seeds = int(stats["count"].max())
    lines = [
        "",
        "## Coverage",
        "",
        "Cells run, per architecture: "
        + "; ".join(
            f"{d}, {i} init: K {sorted(set(g.index.get_level_values('num_clients')))} x "
            f"{', '.join(sorted(set(g.index.get_level_values('partition'))))}"
            for (d, i), g in wide.groupby(level=["dataset", "init"])
        )
        + f"; at most {seeds} seed(s) per cell.",
    ]
    lines += aligned.summary_lines(stats, methods)
    lines += ["", "## Targets", ""]

    def have(*cols: str) -> Any:
        return wide.dropna(subset=[c for c in cols if c in wide.columns]) if all(c in wide.columns for c in cols) else None

    public = have("distill_public", "ensemble", "best_local")
    if public is not None:
        lines += [
            "**Public transfer (300 samples), `init: aligned`**: mean accuracy per (dataset, architecture) group against the "
            "ensemble (target: within 0.03), and the cells above the best local model (target: at least 90 %).",
            "",
            "| dataset | arch | cells | distill_public | ensemble | gap | above best local |",
            "|---|---|---|---|---|---|---|",
        ]
        for (dataset, arch_name), group in public.groupby(level=["dataset", "arch"]):
            gap = group["ensemble"].mean() - group["distill_public"].mean()
            above = int((group["distill_public"] > group["best_local"]).sum())
            lines.append(
                f"| {dataset} | {arch_name} | {len(group)} | {group['distill_public'].mean():.3f} | {group['ensemble'].mean():.3f} | "
                f"{gap:+.3f}{' (missed)' if gap > 0.03 else ''} | {above}/{len(group)} |"
            )
        total_above = int((public["distill_public"] > public["best_local"]).sum())
        lines += ["", f"Above the best local model in {total_above} of {len(public)} cells ({100 * total_above / len(public):.0f} %).", ""]
    free = have("distill_free", "ensemble", "best_merge")
    if free is not None:
        lines += [
            "**Data-free, `init: aligned`**: against the best one-shot merge of each cell (target: above it in every cell) and "
            "the ensemble (target: within 0.08 on average for mlp, cnn and rescnn).",
            "",
            "| dataset | arch | cells | distill_free | best_merge | ensemble | gap to ensemble | cells above best_merge |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (dataset, arch_name), group in free.groupby(level=["dataset", "arch"]):
            gap = group["ensemble"].mean() - group["distill_free"].mean()
            above = int((group["distill_free"] > group["best_merge"]).sum())
            lines.append(
                f"| {dataset} | {arch_name} | {len(group)} | {group['distill_free'].mean():.3f} | {group['best_merge'].mean():.3f} | "
                f"{group['ensemble'].mean():.3f} | {gap:+.3f} | {above}/{len(group)} |"
            )
        three = free[free.index.get_level_values("arch").isin(["mlp", "cnn", "rescnn"])]
        if len(three):
            gap3 = float((three["ensemble"] - three["distill_free"]).mean())
            lines += [
                "",
                f"Over the {len(three)} mlp, cnn and rescnn cells: mean gap to the ensemble {gap3:+.3f}"
                + (" (target met)" if gap3 <= 0.08 else " (missed)")
                + "; per architecture: "
                + ", ".join(f"{a} {float((g['ensemble'] - g['distill_free']).mean()):+.3f}" for a, g in three.groupby(level="arch"))
                + ".",
            ]
        below = free[free["distill_free"] <= free["best_merge"]]
        if len(below):
            lines += ["", "Cells where data-free distillation is not above the best merge:", ""]
            lines += [
                f"- {', '.join(str(k) for k in key)}: distill_free {row['distill_free']:.3f}, best_merge {row['best_merge']:.3f}"
                for key, row in below.iterrows()
            ]
        lines.append("")
    few = have("distill_rounds", "ensemble", "pooled")
    if few is not None:
        gap = few["distill_rounds"] - few["ensemble"]
        above = int((gap > 0).sum())
        near = int((few["distill_rounds"] >= few["pooled"] - 0.03).sum())
        lines += [
            "**Few rounds** (`rounds: 3`): one model against the ensemble (targets: above it by 0.03 on average, in at least "
            "90 % of the cells) and the pooled-data oracle (target: within 0.03 in at least half).",
            "",
            "| dataset | arch | partition | cells | distill_rounds | distill_public | ensemble | pooled | rounds - ensemble |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for (dataset, arch_name, partition), group in few.groupby(level=["dataset", "arch", "partition"]):
            one = f"{group['distill_public'].mean():.3f}" if "distill_public" in group else "n/a"
            lines.append(
                f"| {dataset} | {arch_name} | {partition} | {len(group)} | {group['distill_rounds'].mean():.3f} | {one} | "
                f"{group['ensemble'].mean():.3f} | {group['pooled'].mean():.3f} | {(group['distill_rounds'] - group['ensemble']).mean():+.3f} |"
            )
        lines += [
            "",
            f"Over {len(few)} cells: {gap.mean():+.3f} above the ensemble on average; above it in {above} "
            f"({100 * above / len(few):.0f} %); within 0.03 of the pooled oracle in {near} ({100 * near / len(few):.0f} %).",
            "",
        ]
    pairs = [
        (a, b)
        for a, b in (("distill_predictions", "distill_public_random"), ("distill_free_predictions", "distill_free_random"))
        if a in wide.columns and b in wide.columns
    ]
    if pairs:
        lines += [
            "**Predictions only** against the parameter upload with the same start (random) and the same seeds (target: within 0.01).",
            "",
            "| pair | cells | mean difference | largest |",
            "|---|---|---|---|",
        ]
        for a, b in pairs:
            diff = (wide[a] - wide[b]).dropna()
            lines.append(f"| {a} - {b} | {len(diff)} | {diff.mean():+.4f} | {diff.abs().max():.4f} |")
    del pd
    return lines


def heterogeneous_cell(seed: int, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``jobs/distill_heterogeneous.yaml`` (mlp, cnn and rescnn clients on label-skewed digits, a rescnn student) at
    ``seed``, in-process: the best local model, the ensemble of the three and the job's distillations."""
    import contextlib
    import io
    import tempfile

    import rayfuse
    from rayfuse.config import read_config_file

    config = read_config_file(REPO / "jobs" / "distill_heterogeneous.yaml")
    config["run"]["seed"] = seed
    config.setdefault("federation", {})["backend"] = "local"
    labels = [label for label in config["methods"] if label.startswith("distill")]
    for label in labels:
        config["methods"][label] = {**config["methods"][label], **params}
    with tempfile.TemporaryDirectory(prefix="distill-hetero-") as tmp, contextlib.redirect_stdout(io.StringIO()):
        result = rayfuse.run(config, run_dir=Path(tmp) / "run", quiet=True)
    methods = result.results["methods"]
    cell = "heterogeneous: mlp + cnn + rescnn clients, rescnn student, digits dirichlet0.5, K = 3"
    locals_ = methods["local"]["info"]["per_client"]
    rows = [
        {
            "cell": cell,
            "seed": seed,
            "method": "best_local",
            "accuracy": max(r["accuracy"] for r in locals_),
            "locals": [round(r["accuracy"], 4) for r in locals_],
        }
    ]
    for label in ("ensemble", *labels):
        rows.append(
            {
                "cell": cell,
                "seed": seed,
                "method": label,
                "accuracy": float(result.metrics.loc[label, "accuracy"]),
                "seconds": float(methods[label]["seconds"]),
                "init": methods[label]["info"].get("init", ""),
            }
        )
    return rows


def write_heterogeneous(rows: Sequence[Mapping[str, Any]], out_dir: Path) -> Path:
    """``<out>/heterogeneous.md``: the heterogeneous cell's table (mean over seeds)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    stats = frame.groupby("method", sort=False)["accuracy"].agg(["mean", "std", "count"])
    lines = [
        "# Distillation: clients of three architectures",
        "",
        f"{rows[0]['cell']}; `jobs/distill_heterogeneous.yaml` run in-process, seeds {sorted(set(frame['seed']))}. Test accuracy, "
        "mean (std) over seeds. `best_local` is the best client's model in its own architecture (an oracle choice).",
        "",
        "| method | accuracy | seeds |",
        "|---|---|---|",
    ]
    lines += [
        f"| {m} | {r['mean']:.3f}" + (f" ({r['std']:.3f})" if r["count"] > 1 else "") + f" | {int(r['count'])} |"
        for m, r in stats.iterrows()
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "heterogeneous.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"the quick subset: {QUICK}")
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--datasets", nargs="+", default=["digits", "mnist5k"], choices=("digits", "mnist5k"))
    parser.add_argument("--clients", nargs="+", type=int, default=[2, 3, 5])
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=PARTITIONS)
    parser.add_argument("--inits", nargs="+", default=["shared", "independent"], choices=("shared", "independent"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--references",
        nargs="*",
        default=["best_local", "ensemble", "best_merge", "fedavg_5"],
        choices=REFERENCES,
    )
    parser.add_argument("--columns", nargs="*", default=list(COLUMNS), choices=list(COLUMNS))
    parser.add_argument("--params", type=json.loads, default={}, help="distill parameters over the defaults, as JSON")
    parser.add_argument("--out", type=Path, default=None, help="default docs/results/distill; --quick: a new temporary folder")
    parser.add_argument(
        "--raw",
        default=None,
        help="name of the raw result file under benchmarks/results/ (default distill_accuracy; "
        "with --quick, distill_accuracy_quick: a quick run never replaces the grid's rows)",
    )
    parser.add_argument("--render", nargs="+", type=Path, default=None, help="write the outputs from raw result files only")
    parser.add_argument("--name", default="accuracy", help="the outputs' name: <out>/<name>.{csv,md} and <name>_<dataset>_<arch>.png")
    parser.add_argument("--heterogeneous", action="store_true", help="the heterogeneous cell (seeds from --seeds)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--both-repair", action="store_true", help="also record each column with the other repair setting")
    args = parser.parse_args()
    args.out = out_dir(args.out, args.quick, OUT_DIR)
    raw_dir = args.out if args.quick else None  # a quick run's raw rows stay in its own folder
    epochs = 3 if args.quick else Cell.epochs
    if args.quick:
        args.params = {"steps": 100, **args.params}
    if args.raw is None:
        args.raw = "distill_accuracy_quick" if args.quick else "distill_accuracy"
    torch.set_num_threads(args.threads)
    if args.render:
        rows, info = aligned.read_raw(args.render)
        rows = [r for r in rows if "cell" not in r]
        title = "Distillation: one-shot accuracy" if args.name == "accuracy" else f"Distillation: {args.name}"
        paths = aligned.write_outputs(
            rows,
            args.out,
            info,
            name=args.name,
            title=title,
            summary=summary_lines,
            script="benchmarks/distill",
            command=None if args.name == "accuracy" else f"benchmarks/distill/accuracy.py --name {args.name}",
            order=ORDER,
        )
        for path in paths:
            print(f"wrote {path}")
        return
    info = machine_info()
    if args.heterogeneous:
        rows = []
        for seed in args.seeds:
            found = heterogeneous_cell(seed, args.params)
            rows += found
            for row in found:
                print(row, flush=True)
        print(f"wrote {write_results(args.raw + '_heterogeneous', {'machine': info, 'params': args.params, 'rows': rows})}")
        print(f"wrote {write_heterogeneous(rows, args.out)}")
        return
    axes = dict(QUICK) if args.quick else {k: getattr(args, k) for k in QUICK}
    cells = [
        Cell(a, d, p, k, i, s, epochs, public_size=PUBLIC)
        for d in axes["datasets"]
        for a in axes["archs"]
        for p in axes["partitions"]
        for k in axes["clients"]
        for i in axes["inits"]
        for s in axes["seeds"]
    ]
    print(
        f"distillation accuracy: {len(cells)} cells, references {args.references}, columns {args.columns}, params {args.params}", flush=True
    )

    def save(rows: list[dict[str, Any]]) -> Any:
        return write_results(args.raw, {"machine": info, "axes": axes, "params": args.params, "rows": rows}, raw_dir)

    # a quick run trains its cell afresh in its own folder: the same training code, and never the grid's cache
    cache_dir = args.out / "checkpoints" if args.quick else CACHE_DIR
    rows = run_grid(cells, args.references, args.columns, args.params, both_repair=args.both_repair, save=save, cache_dir=cache_dir)
    print(f"wrote {save(rows)}")


if __name__ == "__main__":
    main()
