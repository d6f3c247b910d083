"""Accuracy of central DP-FedAvg on digits against epsilon (issue 21's "accuracy against epsilon" benchmark).

The unit of privacy is a client (user-level DP), so the noise on the averaged update is ``z C / (q N)``: with 10
clients it would swamp any update. The run therefore splits digits i.i.d. over ``N = 100`` clients and samples each
with probability ``q = 0.1`` (10 clients a round on average), the setting of McMahan et al. 2018 scaled down. For
each target epsilon in {0.5, 1, 2, 4, 8} at delta 1e-5 the noise multiplier is Opacus' (RDP accountant) for the
planned rounds; the non-private reference is FedAvg with the same clients, rounds and sample size (``fraction
0.1``, unweighted), unclipped. Three seeds; each seed is one in-process run (``backend: local``) of every method.

Usage (niced, in-process)::

    nice -n 10 python benchmarks/robust/dp_epsilon.py [--seeds 0 1 2] [--rounds 40] [--out docs/results/robust]
    python benchmarks/robust/dp_epsilon.py --quick   # seed 0, epsilon 8, 20 clients, 2 rounds of 1 epoch; a temporary --out

Writes ``dp_epsilon.csv`` (one row per method x seed), ``dp_epsilon.md`` (mean and spread, the machine, the
command), ``dp_epsilon.json`` (the same summary; epsilon ``null`` for the non-private row) and ``dp_epsilon.png``
(accuracy against epsilon) under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import add_quick_arguments, machine_info, out_dir, write_results  # noqa: E402

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)


def build_config(seed: int, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    """The run: digits over ``args.clients`` i.i.d. clients, the non-private FedAvg and one DP-FedAvg per epsilon."""
    common = {"rounds": args.rounds, "local_epochs": args.local_epochs, "lr": args.lr, "optimizer": "sgd"}
    methods: dict[str, Any] = {"nonprivate": {"method": "fedavg", **common, "fraction": args.sample_rate, "weighted": False}}
    for eps in args.epsilons:
        methods[f"eps{eps:g}"] = {
            "method": "fedavg",
            **common,
            "dp": {
                "target_epsilon": eps,
                "delta": args.delta,
                "clip_norm": args.clip_norm,
                "sample_rate": args.sample_rate,
                "accountant": "rdp",
            },
        }
    return {
        "run": {"name": "dp-epsilon", "seed": seed, "storage": storage},
        "data": {"dataset": "digits"},
        "partition": {"method": "iid", "num_clients": args.clients},
        "model": {"name": "mlp", "hidden": [64]},
        "train": {"shared_init": True},
        "federation": {"backend": "local"},
        "methods": methods,
    }


def plot(path: Path, summary: list[dict[str, Any]], title: str) -> None:
    """Mean accuracy (bars: min..max over seeds) against epsilon, the non-private run as a line."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    dp = [r for r in summary if r["method"] != "nonprivate"]
    base = next(r for r in summary if r["method"] == "nonprivate")
    fig, ax = plt.subplots(figsize=(5.5, 4))
    eps = [r["target_epsilon"] for r in dp]
    mean = np.array([r["accuracy_mean"] for r in dp])
    low, high = np.array([r["accuracy_min"] for r in dp]), np.array([r["accuracy_max"] for r in dp])
    ax.errorbar(eps, mean, yerr=[mean - low, high - mean], marker="o", capsize=4, label="DP-FedAvg (central)")
    ax.axhline(base["accuracy_mean"], linestyle="--", color="gray", label="non-private FedAvg")
    ax.set_xscale("log", base=2)
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.set_xlabel("epsilon (delta 1e-5, client-level)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None, help=f"default {' '.join(map(str, EPSILONS))} (--quick: 8)")
    parser.add_argument("--clients", type=int, default=None, help="default 100 (--quick: 20)")
    parser.add_argument("--sample-rate", type=float, default=None, help="default 0.1 (--quick: 0.25)")
    parser.add_argument("--rounds", type=int, default=None, help="default 40 (--quick: 2)")
    parser.add_argument("--local-epochs", type=int, default=None, help="default 2 (--quick: 1)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    add_quick_arguments(parser, "seed 0, epsilon 8, 20 clients sampled at 0.25, 2 rounds of 1 local epoch")
    args = parser.parse_args(argv)
    quick_defaults = {"seeds": [0], "epsilons": [8.0], "clients": 20, "sample_rate": 0.25, "rounds": 2, "local_epochs": 1}
    full_defaults = {"seeds": [0, 1, 2], "epsilons": list(EPSILONS), "clients": 100, "sample_rate": 0.1, "rounds": 40, "local_epochs": 2}
    for key, value in (quick_defaults if args.quick else full_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = out_dir(args.out, args.quick, ROOT / "docs" / "results" / "robust")

    import rayfuse

    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        for seed in args.seeds:
            result = rayfuse.run(build_config(seed, args, storage), quiet=True)
            for label, entry in result.results["methods"].items():
                dp = entry["info"].get("dp") or {}
                rows.append(
                    {
                        "method": label,
                        "seed": seed,
                        "target_epsilon": float(label[3:]) if dp else float("inf"),
                        "epsilon": dp.get("epsilon", float("inf")),
                        "noise_multiplier": dp.get("noise_multiplier", 0.0),
                        "rounds": entry["rounds"],
                        "accuracy": entry["accuracy"],
                        "nll": entry["nll"],
                    }
                )
            print(f"seed {seed}: " + ", ".join(f"{r['method']} {r['accuracy']:.3f}" for r in rows if r["seed"] == seed), flush=True)
    seconds = time.perf_counter() - started

    with open(args.out / "dp_epsilon.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = []
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label]
        acc = np.array([r["accuracy"] for r in mine])
        summary.append(
            {
                "method": label,
                "target_epsilon": mine[0]["target_epsilon"],
                "epsilon": max(r["epsilon"] for r in mine),
                "noise_multiplier": mine[0]["noise_multiplier"],
                "accuracy_mean": float(acc.mean()),
                "accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
                "accuracy_min": float(acc.min()),
                "accuracy_max": float(acc.max()),
            }
        )
    setting = (
        f"digits, {args.clients} i.i.d. clients, sample rate {args.sample_rate:g}, {args.rounds} rounds, "
        f"{args.local_epochs} local epochs (sgd, lr {args.lr:g}), mlp [64], clip norm {args.clip_norm:g}, delta {args.delta:g}"
    )
    plot(args.out / "dp_epsilon.png", summary, setting)
    machine = machine_info()
    private = [{k: (None if r["method"] == "nonprivate" and "epsilon" in k else v) for k, v in r.items()} for r in summary]
    write_results("dp_epsilon", {"machine": machine, "setting": setting, "seeds": args.seeds, "summary": private}, args.out)
    command = "nice -n 10 python benchmarks/robust/dp_epsilon.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Central DP-FedAvg: accuracy against epsilon",
        "",
        f"Setting: {setting}; seeds {', '.join(map(str, args.seeds))}. The noise multiplier of each row is Opacus' "
        "(RDP) for the target epsilon over the planned rounds; epsilon is what the accountant reports after the "
        "last round (client-level, delta as above). The non-private row is FedAvg with the same sampling, unclipped.",
        "",
        "| method | target epsilon | epsilon spent | noise multiplier z | accuracy (mean ± std) | min | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        target = "-" if r["method"] == "nonprivate" else f"{r['target_epsilon']:g}"
        spent = "-" if r["method"] == "nonprivate" else f"{r['epsilon']:.3f}"
        z = "-" if r["method"] == "nonprivate" else f"{r['noise_multiplier']:.3f}"
        lines.append(
            f"| {r['method']} | {target} | {spent} | {z} | {r['accuracy_mean']:.4f} ± {r['accuracy_std']:.4f} | "
            f"{r['accuracy_min']:.4f} | {r['accuracy_max']:.4f} |"
        )
    lines += [
        "",
        f"Machine: {machine['cpu_model']} ({machine['cpus']} CPUs, {machine['memory_gib']} GiB), Python "
        f"{machine['python']}, numpy {machine['numpy']}, {machine['platform']}; {machine['date']}; {seconds:.0f} s wall "
        f"(load average {machine['load_avg_1m']:.1f} at the end: the machine was shared).",
        "",
        f"Command: `{command.strip()}`",
        "",
        "Per-seed rows: `dp_epsilon.csv`; plot: `dp_epsilon.png`.",
        "",
    ]
    (args.out / "dp_epsilon.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}/dp_epsilon.{{md,csv,json,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
