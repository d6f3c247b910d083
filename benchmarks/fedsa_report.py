"""The FedSA comparison from finished run folders (jobs/fedsa_digits*.yaml, any label fractions and seeds).

    python benchmarks/fedsa_report.py RUN_DIR [RUN_DIR...] [--out docs/results/fedsa]

Writes to ``--out`` and prints:

* ``table1.md`` -- Table-1 style: test accuracy of scratch, transfer (oracle: needs the teachers' weights), FedAvg+
  and FedSA (both saliency variants) per labelled fraction, mean +- std over seeds, next to the paper's CIFAR-10 row;
* ``table2.md`` -- Table-2 style: the selection / weighting ablations;
* ``table3.md`` -- Table-3 style: each teacher's transfer accuracy (linear probe and fine-tuning on the target set)
  and its normalised saliency similarity to the weak target model (FedSA's first selection), with the Pearson and
  Spearman correlations (pooled over runs, and per run);
* ``selections.png`` -- Figure 4a: which teachers FedSA drew in each round (one panel per labelled fraction, first
  seed), and how often each teacher was drawn over all seeds;
* ``curves.png`` -- test accuracy after adaptation over the rounds (mean over seeds), per labelled fraction;
* ``paired.md`` -- each method minus scratch and minus FedAvg+ on the same seed (same target set, same teachers):
  mean ± standard error of the paired differences and the number of seeds where the method is ahead.

    python benchmarks/fedsa_report.py --quick [--out DIR]

``--quick`` runs a small jobs/fedsa_digits.yaml in this process first (teachers trained 2 epochs; scratch, transfer,
FedAvg+ and FedSA, 2 rounds of 1 local epoch, re-selected every round) and reports on it, to ``--out`` or a temporary
folder; it also writes ``report.json`` (each method's accuracy, checked finite).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_quick_arguments, check_finite, out_dir, quick_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# [FEDSA] Table 1 / Table 2, CIFAR-10, 1 % / 5 % / 10 % labelled (the paper's numbers; docs/references.md)
PAPER_T1 = {
    "scratch": (40.00, 62.14, 75.43),
    "transfer": (63.70, 79.38, 83.34),
    "fedavg+": (69.96, 71.58, 78.04),
    "fedsa": (77.15, 85.30, 87.57),
}
PAPER_T2 = {
    "fixed": (73.46, 82.22, 85.28),
    "top-k": (75.14, 84.15, 85.55),
    "top-k+pos": (74.65, 79.89, 87.38),
    "top-k+neg": (76.54, 83.52, 85.87),
    "least-k+pos": (75.50, 84.44, 85.16),
    "random+pos": (75.81, 84.15, 86.45),
    "fedsa": (77.15, 85.30, 87.57),
}
PAPER_FRACTIONS = (0.01, 0.05, 0.10)
TABLE1 = ["scratch", "transfer", "fedavg+", "fedsa", "fedsa-gradcam"]
TABLE2 = ["fixed", "top-k", "top-k+pos", "top-k+neg", "least-k+pos", "random+pos", "fedsa", "fedavg+"]


def load(run_dir: Path) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    cfg = results["config"]
    return {
        "dir": run_dir,
        "results": results,
        "metrics": metrics,
        "seed": cfg["run"]["seed"],
        "fraction": float(cfg["data"]["public_size"]),
        "target_size": results["partition"]["public_size"],
        "teachers": teacher_names(cfg["partition"]),
        "data": cfg["data"]["dataset"] + (f" teachers -> {cfg['data']['target']['dataset']} target" if cfg["data"].get("target") else ""),
    }


def teacher_names(partition: dict) -> dict[int, str]:
    groups = partition.get("groups") or []
    corrupt = {int(k): v for k, v in (partition.get("corrupt") or {}).items()}
    names = {}
    for i in range(partition["num_clients"]):
        g = groups[i] if i < len(groups) else []
        classes = f"{min(g)}-{max(g)}" if g and sorted(g) == list(range(min(g), max(g) + 1)) else ",".join(map(str, g))
        names[i] = f"{i}: {classes}" + (f" {corrupt[i].replace('_', ' ')}" if i in corrupt else "")
    return names


def pct(fraction: float) -> str:
    return f"{fraction * 100:g} %"


def mean_std(values: list[float]) -> str:
    if not values:
        return ""
    v = 100 * np.asarray(values)
    return f"{v.mean():.2f} ± {v.std():.2f} ({len(v)})" if len(v) > 1 else f"{v[0]:.2f}"


def accuracy_table(runs: list[dict], labels: list[str], paper: dict[str, tuple[float, ...]]) -> str:
    fractions = sorted({r["fraction"] for r in runs})
    by = defaultdict(list)
    for r in runs:
        for label, entry in r["results"]["methods"].items():
            by[(label, r["fraction"])].append(entry["accuracy"])
    sizes = {f: sorted({r["target_size"] for r in runs if r["fraction"] == f}) for f in fractions}
    header = [
        "method",
        *(f"{pct(f)} ({'/'.join(map(str, sizes[f]))} labels)" for f in fractions),
        *(f"paper CIFAR-10 {pct(f)}" for f in PAPER_FRACTIONS),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in labels + sorted({name for name, _ in by} - set(labels) - set(TABLE1) - set(TABLE2)):
        if not any((label, f) in by for f in fractions):
            continue
        name = label + (" (oracle: model access)" if label == "transfer" else "")
        ref = paper.get(label, ("",) * 3)
        lines.append("| " + " | ".join([name, *(mean_std(by[(label, f)]) for f in fractions), *(str(x) for x in ref)]) + " |")
    return "\n".join(lines)


def paired_table(runs: list[dict], labels: list[str], baselines: tuple[str, ...] = ("scratch", "fedavg+")) -> str:
    """Paired differences (percentage points) against each baseline over the seeds that ran both, per fraction."""
    acc: dict[tuple[float, int], dict[str, float]] = defaultdict(dict)
    for r in runs:
        for label, entry in r["results"]["methods"].items():
            acc[(r["fraction"], r["seed"])][label] = 100 * entry["accuracy"]
    fractions = sorted({f for f, _ in acc})
    present = {label for cell in acc.values() for label in cell}
    order = [label for label in labels if label in present] + sorted(present - set(labels))
    header = ["method", *(f"{pct(f)}: - {b}" for f in fractions for b in baselines)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in order:
        cells = []
        for f in fractions:
            for base in baselines:
                diffs = np.array(
                    [cell[label] - cell[base] for (ff, _), cell in sorted(acc.items()) if ff == f and label in cell and base in cell]
                )
                if label == base or len(diffs) == 0:
                    cells.append("")
                    continue
                se = diffs.std(ddof=1) / np.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
                cells.append(f"{diffs.mean():+.2f} ± {se:.2f} ({int((diffs > 0).sum())}/{len(diffs)})")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def teacher_rows(runs: list[dict]) -> pd.DataFrame:
    rows = []
    for r in runs:
        methods = r["results"]["methods"]
        if "transfer" not in methods or "fedsa" not in methods:
            continue
        first = methods["fedsa"]["info"]["selections"][0]
        similarity = dict(zip(first["teachers"], first["similarity"]))
        normalized = dict(zip(first["teachers"], first["similarity_normalized"]))
        p = dict(zip(first["teachers"], first["p"]))
        for row in methods["transfer"]["info"]["per_teacher"]:
            c = row["client"]
            rows.append(
                {
                    "fraction": r["fraction"],
                    "seed": r["seed"],
                    "teacher": r["teachers"][c],
                    "client": c,
                    "probe": row["probe_accuracy"],
                    "finetune": row["finetune_accuracy"],
                    "similarity": similarity.get(c, np.nan),
                    "normalized": normalized.get(c, np.nan),
                    "p": p.get(c, np.nan),
                }
            )
    return pd.DataFrame(rows)


def correlation_table(rows: pd.DataFrame) -> str:
    from scipy.stats import pearsonr, spearmanr

    out = []
    for fraction, group in rows.groupby("fraction"):
        mean = group.groupby(["client", "teacher"])[["probe", "finetune", "similarity", "normalized", "p"]].mean().reset_index()
        out.append(f"\n### {pct(fraction)} labelled (mean over {group['seed'].nunique()} seeds)\n")
        out.append(
            "| teacher | transfer acc % (linear probe) | transfer acc % (fine-tune) | saliency similarity | normalised | p (eq. 3) |"
        )
        out.append("|---|---|---|---|---|---|")
        for _, m in mean.iterrows():
            out.append(
                f"| {m['teacher']} | {100 * m['probe']:.2f} | {100 * m['finetune']:.2f} | {m['similarity']:.4f} | "
                f"{m['normalized']:.2f} | {m['p']:.3f} |"
            )
        per_run = [
            (
                pearsonr(g["probe"], g["similarity"])[0],
                spearmanr(g["probe"], g["similarity"])[0],
                pearsonr(g["finetune"], g["similarity"])[0],
            )
            for _, g in group.groupby("seed")
            if len(g) > 2
        ]
        per_run = np.asarray(per_run)
        out.append("")
        out.append(
            f"Correlation with the saliency similarity, per seed (mean ± std over {len(per_run)} seeds): "
            f"Pearson (linear probe) {per_run[:, 0].mean():+.2f} ± {per_run[:, 0].std():.2f}, "
            f"Spearman (linear probe) {per_run[:, 1].mean():+.2f} ± {per_run[:, 1].std():.2f}, "
            f"Pearson (fine-tune) {per_run[:, 2].mean():+.2f} ± {per_run[:, 2].std():.2f}."
        )
    return "\n".join(out)


def selection_counts(runs: list[dict], label: str = "fedsa") -> pd.DataFrame:
    """Draws per teacher and round of ``label`` in each run (rows: fraction, seed, round, client, count)."""
    rows = []
    for r in runs:
        if label not in r["results"]["methods"]:
            continue
        m = r["metrics"]
        m = m[(m["method"] == label) & m["metric"].str.startswith("selected_")]
        for _, row in m.iterrows():
            rows.append(
                {
                    "fraction": r["fraction"],
                    "seed": r["seed"],
                    "round": int(row["round"]),
                    "client": int(row["metric"].split("_")[1]),
                    "count": row["value"],
                    "teacher": r["teachers"][int(row["metric"].split("_")[1])],
                }
            )
    return pd.DataFrame(rows)


def plot_selections(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    counts = selection_counts(runs)
    if counts.empty:
        return
    fractions = sorted(counts["fraction"].unique())
    fig, axes = plt.subplots(2, len(fractions), figsize=(4.2 * len(fractions), 6.4), squeeze=False, gridspec_kw={"height_ratios": [3, 2]})
    for j, fraction in enumerate(fractions):
        group = counts[counts["fraction"] == fraction]
        seed = group["seed"].min()
        one = group[group["seed"] == seed].pivot_table(index="teacher", columns="round", values="count", aggfunc="sum")
        ax = axes[0, j]
        image = ax.imshow(one.values, aspect="auto", cmap="Blues", vmin=0, vmax=max(2, one.values.max()), interpolation="nearest")
        ax.set_yticks(range(len(one.index)), one.index, fontsize=8)
        ax.set_xticks(range(0, len(one.columns), 5), one.columns[::5])
        ax.set_xlabel("round")
        ax.set_title(f"FedSA draws, {pct(fraction)} labels (seed {seed})", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04, label="times drawn")
        share = group.groupby("teacher")["count"].sum() / group["count"].sum()
        ax = axes[1, j]
        ax.barh(range(len(share)), share.values, color="tab:blue")
        ax.set_yticks(range(len(share)), share.index, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"share of all draws ({group['seed'].nunique()} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(path: Path, runs: list[dict], labels: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fractions = sorted({r["fraction"] for r in runs})
    fig, axes = plt.subplots(1, len(fractions), figsize=(4.6 * len(fractions), 3.6), squeeze=False)
    for j, fraction in enumerate(fractions):
        ax = axes[0, j]
        group = [r for r in runs if r["fraction"] == fraction]
        for label in labels:
            series = []
            for r in group:
                m = r["metrics"]
                m = m[(m["method"] == label) & (m["metric"] == "accuracy") & m["client"].isna()]
                if len(m):
                    series.append(m.set_index("round")["value"].sort_index())
            if not series:
                continue
            frame = pd.concat(series, axis=1)
            if label == "scratch":
                ax.axhline(frame.mean(axis=1).iloc[0], color="k", ls="--", lw=1, label="scratch")
                continue
            ax.plot(frame.index, frame.mean(axis=1), marker="o", ms=3, label=label, ls="--" if label.endswith("whole") else "-")
        ax.set_title(f"{pct(fraction)} labels", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (after adaptation)")
        ax.grid(alpha=0.3)
    axes[0, -1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path)
    add_quick_arguments(parser, "a small fedsa_digits run: teachers trained 2 epochs, scratch / transfer / fedavg+ / fedsa, 2 rounds")
    args = parser.parse_args(argv)
    if not args.runs and not args.quick:
        parser.error("give finished run folders (or --quick)")
    args.out = out_dir(args.out, args.quick, Path("docs/results/fedsa"))
    if args.quick:
        small = {"rounds": 2, "select_every": 1, "local_epochs": 1, "evaluate_every": 1}
        methods = {"scratch": {}, "transfer": {}, "fedavg+": small, "fedsa": small}
        args.runs = [quick_run(ROOT / "jobs" / "fedsa_digits.yaml", methods, args.out, {"train.epochs": 2})]
    runs = sorted((load(d) for d in args.runs if (d / "results.json").is_file()), key=lambda r: (r["fraction"], r["seed"]))
    if not runs:
        raise SystemExit("no finished runs (results.json) among the given folders")
    seeds = sorted({r["seed"] for r in runs})
    data = ", ".join(sorted({r["data"] for r in runs}))
    head = (
        f"Test accuracy % (mean ± std over seeds, number of seeds); {data}, {len(runs)} runs, seeds {seeds}; "
        "the paper's numbers are CIFAR-10 with ResNet-34 teachers and are shown for the ordering only.\n\n"
    )
    t1 = "## Table 1 (style): FedSA against its baselines\n\n" + head + accuracy_table(runs, TABLE1, PAPER_T1)
    t2 = "## Table 2 (style): selection and aggregation ablations\n\n" + head + accuracy_table(runs, TABLE2, {**PAPER_T1, **PAPER_T2})
    rows = teacher_rows(runs)
    t3 = (
        "## Table 3 (style): teachers' transfer accuracy against their saliency similarity\n\n"
        "Similarity: the per-image saliency similarity of each teacher to the weak target model at FedSA's first "
        "selection (sum_j (0.5 + 0.5 cos) / M); normalised: min-max over the teachers (the paper's Table 3 row); "
        "transfer accuracy: the `transfer` oracle (each teacher with a new head trained on the target set, or fully "
        "fine-tuned).\n" + (correlation_table(rows) if not rows.empty else "\n(no run has both transfer and fedsa)")
    )
    (args.out / "table1.md").write_text(t1 + "\n")
    (args.out / "table2.md").write_text(t2 + "\n")
    (args.out / "table3.md").write_text(t3 + "\n")
    tp = (
        "## Paired differences: each method minus scratch / minus FedAvg+ on the same seed\n\n"
        "Percentage points, mean ± standard error over the seeds that ran both (same seed = same target set, teachers "
        "and draw stream); in brackets, the seeds on which the method is ahead.\n\n"
        + paired_table(runs, TABLE1 + [label for label in TABLE2 if label not in TABLE1] + ["fedavg+whole", "fedsa-whole"])
    )
    (args.out / "paired.md").write_text(tp + "\n")
    plot_selections(args.out / "selections.png", runs)
    plot_curves(
        args.out / "curves.png",
        runs,
        ["scratch", "fedavg+", "fedsa", "fedsa-gradcam", "top-k", "fixed", "random+pos", "fedavg+whole", "fedsa-whole"],
    )
    print(t1, t2, t3, tp, sep="\n\n")
    if args.quick:  # each method's accuracy, checked: a quick run is a test that the whole path still works
        report = {r["dir"].name: {label: e["accuracy"] for label, e in r["results"]["methods"].items()} for r in runs}
        check_finite(report, "report")
        (args.out / "report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(f"\nwritten: {', '.join(sorted(p.name for p in args.out.iterdir()))} in {args.out}")


if __name__ == "__main__":
    main()
