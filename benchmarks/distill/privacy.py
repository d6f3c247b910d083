"""Distillation of clients trained with local DP-SGD: the accuracy at epsilon 1, 4 and 8.

Each client trains its local model with ``train.dp`` (Opacus DP-SGD, the noise set for the ``target_epsilon`` it may
spend at ``delta`` 1e-4). ``distill`` with ``teachers: clients`` then reads nothing of a client but its DP-trained
model's predictions on the server's inputs (and, data-free, the input gradients of its term of the generator's
objective, with ``input_moments: false``): post-processing, so each client's guarantee is the epsilon it spent training.
The run reports the largest (``dp_sgd_epsilon``). Beside it: the clients' mean accuracy (``local``), their ensemble,
and the same without DP.

The quickstart's setting: digits, 5 clients (Dirichlet 0.5), the two-layer MLP (Opacus trains it; BatchNorm it
cannot), 300 public inputs, 20 local epochs.

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/privacy.py [--epsilons 1 4 8] [--seeds 0]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/distill/privacy.py --quick   # epsilon 8 and no DP, 3 clients, 2 epochs

Writes ``docs/results/distill/privacy.md`` and ``benchmarks/results/distill_privacy.json`` (``--quick`` or ``--out
DIR``: both to that folder; ``--quick``: 3 clients trained 2 local epochs, 100 student steps).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import add_quick_arguments, machine_info, out_dir, write_results  # noqa: E402

OUT = HERE.parents[1] / "docs" / "results" / "distill" / "privacy.md"
METHODS = {
    "local": {},
    "ensemble": {},
    "distill": {"method": "distill", "teachers": "clients", "init": "random"},
    "distill-free": {"method": "distill", "teachers": "clients", "init": "random", "transfer": "synthetic", "input_moments": False},
}


def run_one(epsilon: float | None, seed: int, *, quick: bool = False) -> dict[str, Any]:
    import rayfuse

    methods = METHODS
    if quick:  # the same run, smaller: 3 clients, 2 local epochs, 100 student steps
        methods = {label: {**entry, "steps": 100} if entry.get("method") == "distill" else entry for label, entry in METHODS.items()}
    config = {
        "run": {"name": "distill-dp", "seed": seed},
        "data": {"dataset": "digits", "test_size": 0.2, "val_size": 0.1, "public_size": 300},
        "partition": {"method": "dirichlet", "num_clients": 3 if quick else 5, "alpha": 0.5},
        "model": {"name": "mlp", "hidden": [64, 64]},
        "train": {
            "epochs": 2 if quick else 20,
            "batch_size": 32,
            "lr": 0.005,
            **({"dp": {"target_epsilon": epsilon, "delta": 1e-4, "max_grad_norm": 1.0}} if epsilon else {}),
        },
        "federation": {"backend": "local"},
        "methods": methods,
    }
    with tempfile.TemporaryDirectory(prefix="distill-dp-") as tmp, contextlib.redirect_stdout(io.StringIO()):
        result = rayfuse.run(config, run_dir=Path(tmp) / "run", quiet=True)
    row: dict[str, Any] = {"target_epsilon": epsilon, "seed": seed}
    for label in METHODS:
        row[label] = float(result.metrics.loc[label, "accuracy"])
    if epsilon:
        row["dp_sgd_epsilon"] = float(result.metrics.loc["distill", "dp_sgd_epsilon"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", nargs="+", type=float, default=None, help="default 1 4 8; --quick 8")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    add_quick_arguments(parser, "epsilon 8 and no DP, 3 clients trained 2 epochs, 100 student steps")
    args = parser.parse_args()
    if args.epsilons is None:
        args.epsilons = [8.0] if args.quick else [1.0, 4.0, 8.0]
    raw_dir = None if args.out is None and not args.quick else out_dir(args.out, args.quick)
    markdown = OUT if raw_dir is None else raw_dir / "privacy.md"
    rows = []
    for seed in args.seeds:
        for epsilon in [*args.epsilons, None]:
            rows.append(run_one(epsilon, seed, quick=args.quick))
            print(rows[-1], flush=True)
    info = machine_info()
    lines = [
        "# Distillation of DP-trained clients",
        "",
        f"{info['cpus']} CPUs; produced by `benchmarks/distill/privacy.py`. Digits, 5 clients (Dirichlet 0.5), MLP [64, 64], "
        "local DP-SGD (`train.dp`, delta 1e-4, clipping norm 1) at each target epsilon; `distill` with `teachers: clients` "
        "(predictions only, post-processing of the DP-trained models), public transfer (300 inputs) and data-free (without "
        "the input moments, which DP-SGD does not cover). Test accuracy.",
        "",
        "| target epsilon | spent (max over clients) | seed | local (mean) | ensemble | distill (public) | distill (data-free) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "no DP" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        spent = f"{r['dp_sgd_epsilon']:.3g}" if "dp_sgd_epsilon" in r else "-"
        lines.append(
            f"| {eps} | {spent} | {r['seed']} | {r['local']:.3f} | {r['ensemble']:.3f} | {r['distill']:.3f} | {r['distill-free']:.3f} |"
        )
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {markdown}\nwrote {write_results('distill_privacy', {'machine': info, 'quick': args.quick, 'rows': rows}, raw_dir)}")


if __name__ == "__main__":
    main()
