"""Distillation with many clients: K = 10, 20 and 50 on the distillation grid's cells, accuracy against the ensemble
and the cost of a student step as K grows.

Each cell is the grid's (``benchmarks/distill/accuracy.py``: K clients trained apart, independent initialisations, a
public slice of 300 inputs, ``distill_public`` as the ``distill`` method plays it with ``--params`` over its defaults),
at K = 10, 20 and 50 on the partitions that have that many clients (``iid``, ``dirichlet0.5``; ``label-disjoint``
has 10 classes to share). A pass of the public loop has every teacher predict once on the pass's bank, and the student
steps through it; so the teachers' share of the time grows with K and the student's does not. The table gives
the seconds per student step (the column's seconds over its ``steps``) and its ratio to K = 10 against K / 10:
at most linear means the ratio stays at or under K / 10.

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/many.py [--archs mlp cnn] [--datasets digits mnist5k] \\
        [--clients 10 20 50] [--partitions iid dirichlet0.5] [--seeds 0] [--params JSON]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/many.py --quick --out DIR      # K 10 and 20, mlp, 100 steps
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/many.py --render benchmarks/results/distill_many.json

Writes ``benchmarks/results/distill_many.json`` and ``docs/results/distill/many.md`` (``--quick``: both under
``--out`` or a new temporary folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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
from train import CACHE_DIR, Cell  # noqa: E402

from rayfuse.fusion.distill.algorithm import DistillParams  # noqa: E402

REPO = HERE.parents[1]
OUT_DIR = REPO / "docs" / "results" / "distill"
_spec = importlib.util.spec_from_file_location("distill_accuracy", HERE / "accuracy.py")
assert _spec is not None and _spec.loader is not None
grid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grid)


def run(
    archs: Sequence[str],
    datasets: Sequence[str],
    clients: Sequence[int],
    partitions: Sequence[str],
    seeds: Sequence[int],
    params: dict[str, Any],
    *,
    epochs: int,
    cache_dir: Path,
) -> list[dict[str, Any]]:
    cells = [
        Cell(a, d, p, k, "independent", s, epochs, public_size=grid.PUBLIC)
        for d in datasets
        for a in archs
        for p in partitions
        for k in clients
        for s in seeds
    ]
    print(f"distillation with many clients: {len(cells)} cells, params {params}", flush=True)
    return grid.run_grid(cells, ["best_local", "ensemble"], ["distill_public"], params, cache_dir=cache_dir)


def markdown(rows: list[dict[str, Any]], params: dict[str, Any], info: dict[str, Any]) -> str:
    steps = DistillParams(**params).steps
    cells: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["dataset"], r["arch"], r["partition"], r["num_clients"], r["seed"])
        cells.setdefault(key, {})[r["method"]] = r
    lines = [
        "# Distillation with many clients",
        "",
        f"Test accuracy and the seconds of the public transfer's student steps, by the number of clients K; "
        f"`distill_public` with {json.dumps(params) if params else 'the defaults'} ({steps} steps); "
        f"{info.get('cpus', '?')} CPUs, {info.get('cpu_model', '')}. Produced by `benchmarks/distill/many.py`. "
        "`target`: the ensemble distilled, as `combine: auto`'s check against the clients' class counts chose it "
        "(`energy`, or the plain `mean of probabilities`), and `T` the temperature it is distilled at (below 1 where "
        "the check runs and the target is flat: sharpened until its mean entropy on the public inputs is 0.75 of log C; "
        "docs/methods/distill.md).",
        "",
        "| dataset | arch | partition | K | seed | best_local | ensemble | distill_public | student - ensemble | target "
        "| T | per step | ratio to smallest K | K ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gaps: dict[tuple, float] = {}
    linear: list[bool] = []
    for key in sorted(cells):
        got = cells[key]
        if "distill_public" not in got or "ensemble" not in got:
            continue
        d, a, p, k, s = key
        k0 = min(c[3] for c in cells if (c[0], c[1], c[2], c[4]) == (d, a, p, s))
        per_step = got["distill_public"]["seconds"] / steps
        base = cells[(d, a, p, k0, s)].get("distill_public")
        ratio = per_step / (base["seconds"] / steps) if base else float("nan")
        gaps[key] = got["ensemble"]["accuracy"] - got["distill_public"]["accuracy"]
        if k > k0:
            linear.append(ratio <= k / k0)
        lines.append(
            f"| {d} | {a} | {p} | {k} | {s} | {got['best_local']['accuracy']:.3f} | {got['ensemble']['accuracy']:.3f} | "
            f"{got['distill_public']['accuracy']:.3f} | {-gaps[key]:+.3f} | {got['distill_public'].get('target', 'n/a')} | "
            f"{got['distill_public'].get('temperature', 'n/a')} | {per_step * 1000:.2f} ms | {ratio:.2f} | {k / k0:.1f} |"
        )
    largest = max(key[3] for key in gaps) if gaps else 0
    big = [g for key, g in gaps.items() if key[3] == largest]
    worst = max(gaps, key=gaps.__getitem__) if gaps else ()
    worst_gap = gaps[worst] if gaps else 0.0
    lines += [
        "",
        f"The ensemble minus the student: {np.mean(list(gaps.values())):+.3f} on average over {len(gaps)} cells"
        + (f"; at K = {largest}, {np.mean(big):+.3f} on average, {max(big):+.3f} at most" if big else "")
        + (f", the student within 0.05 of the ensemble in {sum(g <= 0.05 for g in big)} of {len(big)} cells" if big else "")
        + (f"; the largest shortfall of any K: {worst_gap:+.3f} ({', '.join(map(str, worst[:4]))})" if gaps else "")
        + f". The cost of a step grows at most linearly from the smallest K in {sum(linear)} of {len(linear)} cells.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="K 10 and 20, mlp on digits, iid, 100 student steps, 3 local epochs")
    parser.add_argument("--archs", nargs="+", default=["mlp", "cnn"], choices=grid.ARCHS)
    parser.add_argument("--datasets", nargs="+", default=["digits", "mnist5k"], choices=("digits", "mnist5k"))
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 20, 50])
    parser.add_argument("--partitions", nargs="+", default=["iid", "dirichlet0.5"], choices=("iid", "dirichlet0.5"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--params", type=json.loads, default={}, help="distill parameters over the defaults, as JSON")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default docs/results/distill; --quick: a new temporary folder")
    parser.add_argument("--render", type=Path, default=None, help="write the page from a raw result file only (many.md under --out)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = out_dir(args.out, args.quick, OUT_DIR)
    if args.render is not None:
        raw = json.loads(args.render.read_text(encoding="utf-8"))
        (out / "many.md").write_text(markdown(raw["rows"], raw["params"], raw["machine"]), encoding="utf-8")
        print(f"wrote {out / 'many.md'}")
        return
    if args.quick:
        args.archs, args.datasets, args.clients, args.partitions, args.seeds = ["mlp"], ["digits"], [10, 20], ["iid"], [0]
        args.params = {"steps": 100, "epochs": 2, **args.params}
    rows = run(
        args.archs,
        args.datasets,
        args.clients,
        args.partitions,
        args.seeds,
        args.params,
        epochs=3 if args.quick else Cell.epochs,
        cache_dir=out / "checkpoints" if args.quick else CACHE_DIR,
    )
    info = machine_info()
    payload = {"machine": info, "params": args.params, "rows": rows}
    path = write_results("distill_many", payload, out if args.quick else None)
    page = out / "many.md"
    page.write_text(markdown(rows, args.params, info), encoding="utf-8")
    print(f"wrote {path} and {page}")


if __name__ == "__main__":
    main()
