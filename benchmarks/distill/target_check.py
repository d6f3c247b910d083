"""``combine: auto``'s check of the target against the clients' class counts, on the distillation grid's clients: which
ensemble each cell distils, and how accurate each candidate's labels are on the test set.

For every cell (``benchmarks/distill/accuracy.py``'s: K clients trained apart, a public slice of 300 inputs) the
teachers label the public inputs and the test inputs once; the two candidates of the check
(:func:`rayfuse.fusion.distill.student.check_target`) are the energy ensemble with class-count weights (the default)
and the plain mean of the teachers' probabilities (uniform weights). Per cell the table gives the clients' effective
holders a class (:func:`rayfuse.fusion.distill.teachers.class_holders`; the check runs only from 1.5), each candidate's
gap to the pooled class frequencies on the public inputs (:func:`~rayfuse.fusion.distill.teachers.prior_gap`, labels
unread) and its accuracy on the test set (labels read here, never by the check), the choice, and what the choice gains
in the target's accuracy. No student is trained: the students of the cells where the check switches are
``accuracy.py``'s and ``many.py``'s runs (``docs/methods/distill.md``).

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/target_check.py [--cells digits:cnn:dirichlet0.5:10,20,50:0,1,2 ...]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/target_check.py --quick --out DIR   # two small cells, 3 local epochs

A cell is ``dataset:arch:partition:K[,K...]:seed[,seed...][:init]`` (init ``independent`` unless given). Writes
``benchmarks/results/distill_target_check.json`` and ``docs/results/distill/target_check.md`` (``--quick``: both under
``--out`` or a new temporary folder).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "aligned"))
sys.path.insert(0, str(HERE.parent))
from _common import machine_info, out_dir, write_results  # noqa: E402
from train import CACHE_DIR, PARTITIONS, Cell, build_model, train_cell  # noqa: E402

from rayfuse.fusion.distill.student import DistillSettings, check_target  # noqa: E402
from rayfuse.fusion.distill.teachers import Teachers, class_holders, combine_teachers, teacher_weights  # noqa: E402

OUT_DIR = HERE.parents[1] / "docs" / "results" / "distill"
PUBLIC = 300
# The grid the check was measured on (docs/methods/distill.md): accuracy.py's and many.py's cells, seed 0, and seeds
# 1-2 where the grid has them for mlp and cnn
DEFAULT_CELLS = (
    "digits:mlp:iid:2,3,5,10,20,50:0",
    "digits:cnn:iid:2,3,5,10,20,50:0",
    "digits:mlp:dirichlet0.5:2,3,5,10,20,50:0",
    "digits:cnn:dirichlet0.5:2,3,5,10,20,50:0,1,2",
    "digits:mlp:dirichlet0.5:2,3,5:1,2",
    "digits:mlp:iid:2,3,5:1,2",
    "digits:cnn:iid:2,3,5:1,2",
    "digits:rescnn:iid:2,3,5:0",
    "digits:transformer:iid:2,3,5:0",
    "digits:rescnn:dirichlet0.5:2,3,5:0",
    "digits:transformer:dirichlet0.5:2,3,5:0",
    "digits:mlp:label-disjoint:2,3,5:0",
    "digits:cnn:label-disjoint:2,3,5:0",
    "digits:rescnn:label-disjoint:2,3,5:0",
    "digits:transformer:label-disjoint:2,3,5:0",
    "digits:mlp:iid:3:0:shared",
    "digits:cnn:iid:3:0:shared",
    "digits:mlp:dirichlet0.5:3:0:shared",
    "digits:cnn:dirichlet0.5:3:0:shared",
    "digits:rescnn:dirichlet0.5:3:0:shared",
    "digits:transformer:dirichlet0.5:3:0:shared",
    "mnist5k:mlp:iid:3,10,20,50:0",
    "mnist5k:cnn:iid:3,10,20,50:0",
    "mnist5k:mlp:dirichlet0.5:3,10,20,50:0",
    "mnist5k:cnn:dirichlet0.5:3,10,20,50:0",
    "mnist5k:cnn:dirichlet0.5:3:1,2",
    "mnist5k:rescnn:iid:3:0",
    "mnist5k:transformer:iid:3:0",
    "mnist5k:rescnn:dirichlet0.5:3:0",
    "mnist5k:transformer:dirichlet0.5:3:0",
    "mnist5k:mlp:label-disjoint:3:0",
    "mnist5k:cnn:label-disjoint:3:0",
    "mnist5k:rescnn:label-disjoint:3:0",
    "mnist5k:transformer:label-disjoint:3:0",
)
QUICK_CELLS = ("digits:mlp:dirichlet0.5:3:0", "digits:mlp:label-disjoint:2:0")


def parse_cells(specs: Sequence[str], epochs: int) -> list[Cell]:
    """The cells of ``dataset:arch:partition:K[,K...]:seed[,seed...][:init]`` specs."""
    cells = []
    for spec in specs:
        fields = spec.split(":")
        if len(fields) not in (5, 6) or fields[2] not in PARTITIONS:
            raise SystemExit(f"--cells: expected dataset:arch:partition:K[,K...]:seed[,seed...][:init], got {spec!r}")
        dataset, arch, partition, ks, seeds = fields[:5]
        init = fields[5] if len(fields) == 6 else "independent"
        for k in ks.split(","):
            for seed in seeds.split(","):
                cells.append(Cell(arch, dataset, partition, int(k), init, int(seed), epochs, public_size=PUBLIC))
    return cells


def check_cell(cell: Cell, cache_dir: Path) -> dict[str, Any]:
    """One cell's check, as the ``distill`` method makes it, and each candidate's test accuracy."""
    trained = train_cell(cell, cache_dir)
    spec = trained.spec
    counts = np.stack([np.bincount(s.y, minlength=spec["num_classes"]) for s in trained.train_sets]).astype(np.float64)
    teachers = Teachers([build_model(spec, c) for c in trained.clients], batched=False)
    weights = teacher_weights("classes", counts)
    uniform = np.full_like(weights, 1.0 / len(weights))
    with torch.no_grad():
        public = teachers.predict(torch.as_tensor(trained.public.X))
        test = teachers.predict(torch.as_tensor(trained.test.X))

    def accuracy(how: str, w: np.ndarray) -> float:
        return float((combine_teachers(test, torch.as_tensor(w), how).argmax(1).numpy() == trained.test.y).mean())

    _, _, record = check_target(
        lambda how, w: combine_teachers(public, torch.as_tensor(w), how),
        weights,
        counts,
        DistillSettings(combine="energy", temperature=1.0),
    )  # temperature unset (None): a flat target is sharpened, as the method's default does
    energy, mean = accuracy("energy", weights), accuracy("probabilities", uniform)
    switched = record["chosen"] != "energy"
    return {
        **cell.fields(),
        "class_holders": class_holders(counts),
        "prior_gap": record.get("prior_gap"),
        "top2_margin": record.get("top2_margin"),
        "entropy": record.get("entropy"),
        "temperature": record["temperature"],
        "accuracy": {"energy": energy, "mean of probabilities": mean},
        "chosen": record["chosen"],
        "gain": (mean - energy) if switched else 0.0,
    }


def markdown(rows: Sequence[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [
        "# Distillation: the check of the target against the class counts",
        "",
        "Per cell: the clients' effective holders a class, each candidate target's gap to the pooled class frequencies "
        "on the 300 public inputs (total variation of its top-1 histogram) and its mean top-2 margin of probability "
        "there (`-` where the check does not run: under 10 clients or 1.5 holders), its accuracy on the test set, the "
        "check's choice and the gain in the target's accuracy, and the chosen target's mean entropy on the public inputs "
        "(a share of log C) and the temperature it is distilled at (below 1 where the entropy is above 0.75: the target "
        "sharpened until it is 0.75). "
        f"{info.get('cpus', '?')} CPUs, {info.get('cpu_model', '')}. Produced by `benchmarks/distill/target_check.py`.",
        "",
        "| dataset | arch | partition | K | init | seed | holders | gap energy | gap mean | margin energy | margin mean "
        "| acc energy | acc mean | chosen | gain | entropy | T |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap, margin = r["prior_gap"] or {}, r.get("top2_margin") or {}
        g_e, g_m = (f"{gap['energy']:.3f}", f"{gap['mean of probabilities']:.3f}") if gap else ("-", "-")
        m_e, m_m = (f"{margin['energy']:.3f}", f"{margin['mean of probabilities']:.3f}") if margin else ("-", "-")
        lines.append(
            f"| {r['dataset']} | {r['arch']} | {r['partition']} | {r['num_clients']} | {r['init']} | {r['seed']} | "
            f"{r['class_holders']:.2f} | {g_e} | {g_m} | {m_e} | {m_m} | {r['accuracy']['energy']:.3f} | "
            f"{r['accuracy']['mean of probabilities']:.3f} | {r['chosen']} | {r['gain']:+.3f} | "
            f"{'-' if r.get('entropy') is None else format(r['entropy'], '.3f')} | {r['temperature']:g} |"
        )
    switched = [r for r in rows if r["chosen"] != "energy"]
    better = [r for r in rows if r["accuracy"]["mean of probabilities"] > r["accuracy"]["energy"]]
    gains = ", ".join(f"{r['gain']:+.3f}" for r in switched) or "none"
    sharpened = [r for r in rows if r["temperature"] < 1]
    lines += [
        "",
        f"{len(rows)} cells; the check ran in {sum(r['prior_gap'] is not None for r in rows)} and chose the plain mean in "
        f"{len(switched)} (gains {gains}); its mean gain in the target's "
        f"accuracy over all cells {np.mean([r['gain'] for r in rows]):+.4f}. The plain mean's labels are the more accurate "
        f"in {len(better)} cells, {sum(r['prior_gap'] is None for r in better)} of them where the check does not run "
        "(fewer than 10 clients, or each class about one client's: there the plain mean, distilled, lost where its "
        "labels were the more accurate; docs/methods/distill.md). "
        f"The target is sharpened in {len(sharpened)} cells (temperature "
        f"{min((r['temperature'] for r in sharpened), default=1):g} to {max((r['temperature'] for r in sharpened), default=1):g}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"the cells {QUICK_CELLS}, 3 local epochs, trained afresh")
    parser.add_argument("--cells", nargs="+", default=None, help="dataset:arch:partition:K[,K...]:seed[,seed...][:init]")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default docs/results/distill; --quick: a new temporary folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = out_dir(args.out, args.quick, OUT_DIR)
    specs = args.cells or (QUICK_CELLS if args.quick else DEFAULT_CELLS)
    cells = parse_cells(specs, 3 if args.quick else Cell.epochs)
    rows = []
    for cell in cells:
        row = check_cell(cell, out / "checkpoints" if args.quick else CACHE_DIR)
        print(f"{cell.key()}: holders {row['class_holders']:.2f}, chosen {row['chosen']}, gain {row['gain']:+.3f}", flush=True)
        rows.append(row)
    info = machine_info()
    path = write_results("distill_target_check", {"machine": info, "cells": list(specs), "rows": rows}, out if args.quick else None)
    page = out / "target_check.md"
    page.write_text(markdown(rows, info), encoding="utf-8")
    print(f"wrote {path} and {page}")


if __name__ == "__main__":
    main()
