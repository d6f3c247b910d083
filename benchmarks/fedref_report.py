"""The FedRef comparison from a finished run folder (jobs/fedref_digits*.yaml): curves, final numbers, client compute.

    python benchmarks/fedref_report.py RUN_DIR [RUN_DIR...] [--out docs/results/fedref]

For each run it writes ``<out>/<run name>[-s<seed>]_curves.png`` (test loss and test accuracy per round, every method
in one figure) and ``<out>/<run name>[-s<seed>].md`` (final / best accuracy, final test loss, rounds to 90 % accuracy,
the median client compute per round and its ratio to FedProx's and FedAvg's in the same run), and prints the table.
Runs of the same job with different seeds (``--set run.seed=N``) are also summarised together:
``<out>/<run name>_seeds.md`` (mean +- std over seeds) and ``<out>/<run name>_seeds_curves.png`` (mean curves, one
standard deviation shaded).

    python benchmarks/fedref_report.py --quick [--out DIR]

``--quick`` runs a small jobs/fedref_digits.yaml in this process first (3 clients; FedAvg, FedProx and FedRef p = 3,
5 rounds of 1 local epoch) and reports on it, to ``--out`` or a temporary folder; it also writes ``report.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_quick_arguments, check_finite, out_dir, quick_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load(run_dir: Path) -> tuple[dict, pd.DataFrame]:
    results = json.loads((run_dir / "results.json").read_text())
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    return results, metrics[metrics["client"].isna()]


def curves(metrics: pd.DataFrame, metric: str) -> dict[str, pd.Series]:
    rows = metrics[metrics["metric"] == metric]
    return {label: group.set_index("round")["value"].sort_index() for label, group in rows.groupby("method", sort=False)}


def summarize(results: dict, metrics: pd.DataFrame) -> pd.DataFrame:
    acc, nll, work = curves(metrics, "accuracy"), curves(metrics, "nll"), curves(metrics, "client_seconds")
    tuned = curves(metrics, "fine_tuned")
    rows = []
    for label, info in results["methods"].items():
        if label not in acc:
            continue
        a = acc[label]
        above = a[a >= 0.9]
        rows.append(
            {
                "method": label,
                "final acc": info["accuracy"],
                "best acc": float(a.max()),
                "best round": int(a.idxmax()),
                "final test loss": info["nll"],
                "min test loss": float(nll[label].min()),
                "rounds to 90%": str(int(above.index[0])) if len(above) else "never",
                # median over rounds: the first method of a run also pays the clients' warm-up (imports, first batches)
                "client s/round": float(work[label].median()) if label in work else np.nan,
                "fine-tuned rounds": int(tuned[label].sum()) if label in tuned else 0,
            }
        )
    table = pd.DataFrame(rows).set_index("method")
    for ref in ("fedprox", "fedavg"):
        if ref in table.index:
            table[f"compute / {ref}"] = table["client s/round"] / table.loc[ref, "client s/round"]
    return table


def markdown(table: pd.DataFrame) -> str:
    def cell(v: object) -> str:
        if isinstance(v, (float, np.floating)):
            return "" if np.isnan(v) else (f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}")
        return str(v)

    header = [table.index.name or "", *table.columns]
    rows = [[str(i), *(cell(v) for v in row)] for i, row in zip(table.index, table.itertuples(index=False))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def plot(path: Path, runs: list[pd.DataFrame], title: str) -> None:
    """Test loss and accuracy per round, one line per method: the mean over ``runs`` (one standard deviation shaded
    when there are several)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, metric, name in ((axes[0], "nll", "test loss (NLL)"), (axes[1], "accuracy", "test accuracy")):
        per_run = [curves(m, metric) for m in runs]
        for label in per_run[0]:
            stack = pd.concat([c[label] for c in per_run if label in c], axis=1)
            mean, std = stack.mean(axis=1), stack.std(axis=1, ddof=0)
            style = "-" if label.startswith("fedref") else "--"
            (line,) = ax.plot(mean.index, mean.values, style, linewidth=1.3, label=label)
            if len(runs) > 1:
                ax.fill_between(mean.index, (mean - std).values, (mean + std).values, color=line.get_color(), alpha=0.12)
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_ylim(max(0.0, axes[1].get_ylim()[0]), 1.0)
    axes[1].legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def seeds_table(tables: list[pd.DataFrame]) -> pd.DataFrame:
    rows = []
    for label in tables[0].index:

        def stat(col: str) -> str:
            values = np.array([t.loc[label, col] for t in tables if label in t.index], dtype=float)
            return f"{values.mean():.4f} ± {values.std():.4f}"

        reached = [t.loc[label, "rounds to 90%"] for t in tables if label in t.index]
        rows.append(
            {
                "method": label,
                "final acc": stat("final acc"),
                "best acc": stat("best acc"),
                "final test loss": stat("final test loss"),
                "min test loss": stat("min test loss"),
                "rounds to 90%": " / ".join(str(r) for r in reached),
            }
        )
    return pd.DataFrame(rows).set_index("method")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path)
    add_quick_arguments(parser, "a small fedref_digits run: 3 clients, fedavg / fedprox / fedref_p3, 5 rounds of 1 epoch")
    args = parser.parse_args(argv)
    if not args.runs and not args.quick:
        parser.error("give a finished run folder (or --quick)")
    args.out = out_dir(args.out, args.quick, Path("docs/results/fedref"))
    if args.quick:
        small = {"rounds": 5, "local_epochs": 1}  # FedRef p = 3 fine-tunes from round p + 1
        methods = {"fedavg": small, "fedprox": small, "fedref_p3": small}
        args.runs = [quick_run(ROOT / "jobs" / "fedref_digits.yaml", methods, args.out, {"partition.num_clients": 3})]
    report = {}
    groups: dict[str, list[tuple[int, pd.DataFrame, pd.DataFrame, str]]] = {}
    for run_dir in args.runs:
        if not (run_dir / "results.json").is_file():
            print(f"fedref_report: {run_dir}: no results.json (not a finished run folder)", file=sys.stderr)
            return 2
        results, metrics = load(run_dir)
        cfg = results["config"]
        job = cfg["run"]["name"]
        seed = int(cfg["run"]["seed"])
        name = job if seed == 0 else f"{job}-s{seed}"
        part = cfg["partition"]
        title = (
            f"{name}: {cfg['data']['dataset']}, {part['num_clients']} clients, partition {part['method']}, "
            f"{cfg['model']['name']}, {cfg['train']['optimizer']} lr {cfg['train']['lr']}"
        )
        table = summarize(results, metrics)
        report[name] = {label: {k: v for k, v in row.items() if not isinstance(v, str)} for label, row in table.to_dict("index").items()}
        plot(args.out / f"{name}_curves.png", [metrics], title)
        text = f"# {title}\n\n" + markdown(table) + "\n"
        (args.out / f"{name}.md").write_text(text)
        print(text)
        groups.setdefault(job, []).append((seed, table, metrics, title))
    for job, runs in groups.items():
        if len(runs) < 2:
            continue
        runs.sort(key=lambda r: r[0])
        seeds = [r[0] for r in runs]
        title = runs[0][3] + f" | seeds {seeds}"
        plot(args.out / f"{job}_seeds_curves.png", [r[2] for r in runs], title)
        text = f"# {title} (mean ± std over seeds)\n\n" + markdown(seeds_table([r[1] for r in runs])) + "\n"
        (args.out / f"{job}_seeds.md").write_text(text)
        print(text)
    if args.quick:  # the numbers the tables hold, checked: a quick run is a test that the whole path still works
        check_finite(report, "report")
        (args.out / "report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
        print(f"wrote {args.out / 'report.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
