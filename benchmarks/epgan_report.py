"""EP-GAN's toy experiment from a finished run folder (jobs/epgan_toy.yaml): the paper's Figure 1 and the scores.

    python benchmarks/epgan_report.py RUN_DIR [--out docs/results/epgan] [--suffix NAME]

Writes, for a run named N:

* ``<out>/N_maps.png`` -- Figure 1: one row per backbone; the centralised oracle, then the global model after the
  warm-up (turn 0), the first, the middle and the last FedAvg turn. Each panel is the min-max normalised critic map
  (red high, blue low) with 500 generator samples (black dots) and that model's D-MSE; the top row is the true mixture.
* ``<out>/N_curves.png`` -- D-MSE, generator-sample D-MSE and modes covered per turn (oracles dashed).
* ``<out>/N.md`` -- the final table (D-MSE, raw D-MSE, sample D-MSE, modes, high-quality fraction, seconds).

For the digits jobs (jobs/epgan_digits*.yaml) the table holds FD / IS / classes covered, the curves follow them per
turn and ``<out>/N_samples.png`` shows 16 samples of every method's final generator.

With several runs of one job (different ``run.seed``), ``--summary NAME`` also writes ``<out>/NAME.md``: every score
as mean ± std over the runs, per method, with the number of runs and the per-seed values of ``modes`` / ``classes``.

    python benchmarks/epgan_report.py --quick [--out DIR]

``--quick`` runs a small jobs/epgan_toy.yaml in this process first (500 points per mode; WGAN-GP, EP-ProbGAN and the
WGAN-GP oracle; 2 warm-up epochs, 2 turns of 1 epoch, a 30 x 30 map) and reports on it, to ``--out`` or a temporary
folder; it also writes ``report.json`` (the table's numbers, checked finite).
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

SCORES = [
    ("d_mse", "D-MSE (critic map, min-max)"),
    ("d_mse_raw", "D-MSE raw"),
    ("g_dmse", "D-MSE (G samples)"),
    ("modes", "modes (of 4)"),
    ("high_quality", "high-quality samples"),
]


def load(run_dir: Path) -> tuple[dict, pd.DataFrame]:
    """``results.json`` and the per-round metrics; for a run stopped before its end (no ``results.json``), the methods
    that finished, from ``state/<label>.json`` and ``config.yaml``."""
    if (run_dir / "results.json").is_file():
        results = json.loads((run_dir / "results.json").read_text())
        metrics = pd.read_parquet(run_dir / "metrics.parquet")
        return results, metrics[metrics["client"].isna()]
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    methods, rows = {}, []
    for label in config["methods"]:
        path = run_dir / "state" / f"{label}.json"
        if not path.is_file():
            continue
        state = json.loads(path.read_text())
        methods[label] = {
            "method": state["method"],
            **state["metrics"],
            "oracle": state.get("oracle", False),
            "info": state.get("info", {}),
            "seconds": state.get("seconds"),
        }
        rows += [
            {"method": label, "round": r["round"], "metric": r["metric"], "value": r["value"], "client": r.get("client")}
            for r in state.get("history", [])
        ]
    results = {
        "methods": methods,
        "config": config,
        "run": {"name": config["run"]["name"], "seconds": float("nan"), "backend": "stopped before the end: finished methods only"},
    }
    metrics = pd.DataFrame(rows)
    return results, metrics[metrics["client"].isna()]


IMAGE_SCORES = [("fd", "FD (classifier features)"), ("is", "IS (digits classifier)"), ("classes", "classes (of 10)")]


def table(results: dict) -> pd.DataFrame:
    image = any("fd" in e for e in results["methods"].values())
    scores = IMAGE_SCORES if image else SCORES
    rows = []
    for label, entry in results["methods"].items():
        if entry["method"] not in ("epgan", "epgan-oracle"):
            continue
        info = entry.get("info", {})
        cfg = results["config"]["methods"][label]
        rows.append(
            {
                "method": label + (" (oracle)" if entry.get("oracle") else ""),
                "backbone": cfg["backbone"],
                "J": cfg["components"] if cfg["backbone"].startswith("ep-") else "-",
                **{name: entry.get(key, np.nan) for key, name in scores},
                "rejected": info.get("rejected_updates", 0),
                "seconds": entry.get("seconds"),
            }
        )
    return pd.DataFrame(rows)


def _panel(ax, snap: dict, truth: dict, title: str) -> None:
    ax.imshow(np.asarray(snap["critic"]), origin="lower", extent=(-5, 5, -5, 5), cmap="coolwarm", vmin=0, vmax=1)
    samples = np.asarray(snap["samples"], dtype=float).reshape(-1, 2)
    inside = (np.abs(samples) <= 5).all(1)
    ax.scatter(samples[inside, 0], samples[inside, 1], s=1.0, c="black", alpha=0.5)
    centres = np.asarray(truth["centres"])
    ax.scatter(centres[:, 0], centres[:, 1], marker="+", s=40, c="lime", linewidths=1)
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_maps(results: dict, metrics: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    cfgs = results["config"]["methods"]
    federated = [label for label, e in methods.items() if e["method"] == "epgan" and e["info"].get("maps")]
    oracles = {cfgs[label]["backbone"]: label for label, e in methods.items() if e["method"] == "epgan-oracle"}
    truth = next((e["info"]["truth"] for e in methods.values() if e["info"].get("truth")), None)
    if not federated or truth is None:
        return
    turns = sorted({int(t) for label in federated for t in methods[label]["info"]["maps"]})
    cols = 1 + len(turns)
    fig, axes = plt.subplots(len(federated) + 1, cols, figsize=(2.2 * cols, 2.3 * (len(federated) + 1)), squeeze=False)
    for ax in axes[0]:
        ax.axis("off")
    axes[0, 0].axis("on")
    _panel(axes[0, 0], {"critic": truth["density"], "samples": []}, truth, "true mixture density")
    for row, label in enumerate(federated, start=1):
        info = methods[label]["info"]
        d_mse = metrics[(metrics["method"] == label) & (metrics["metric"] == "d_mse")].set_index("round")["value"]
        oracle = oracles.get(cfgs[label]["backbone"]) if cfgs[label]["components"] == 1 else None
        ax = axes[row, 0]
        if oracle and methods[oracle]["info"].get("maps"):
            _panel(ax, methods[oracle]["info"]["maps"]["oracle"], truth, f"{oracle}\nD-MSE {methods[oracle]['d_mse']:.3f}")
        else:
            ax.axis("off")
        for col, turn in enumerate(turns, start=1):
            snap = info["maps"].get(str(turn))
            if snap is None:
                axes[row, col].axis("off")
                continue
            name = "warm-up" if turn == 0 else f"turn {turn}"
            _panel(axes[row, col], snap, truth, f"{label}, {name}\nD-MSE {d_mse.get(turn, np.nan):.3f}")
    fig.suptitle(f"{results['run']['name']}: critic maps (red high) and generator samples", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_images(results: dict, path: Path) -> None:
    """16 samples of each method's final generator (federated: the last turn; oracles: the end of training)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for label, entry in results["methods"].items():
        maps = entry.get("info", {}).get("maps") or {}
        if maps:
            last = maps.get("oracle") or maps[str(max(int(k) for k in maps))]
            rows.append((label, np.asarray(last["images"]), entry))
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 1.4 * len(rows)), squeeze=False)
    for ax, (label, images, entry) in zip(axes[:, 0], rows):
        strip = np.concatenate([np.pad(im, 1, constant_values=1.0) for im in images], axis=1)
        ax.imshow(strip, cmap="gray_r", vmin=0, vmax=1)
        ax.set_axis_off()
        ax.set_title(
            f"{label}: FD {entry.get('fd', np.nan):.1f}, IS {entry.get('is', np.nan):.2f}, classes {entry.get('classes', np.nan):.0f}",
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(results: dict, metrics: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if (metrics["metric"] == "fd").any():
        panels = [("fd", "FD (classifier features)"), ("is", "IS (digits classifier)"), ("classes", "classes covered")]
    else:
        panels = [("d_mse", "D-MSE (critic map)"), ("g_dmse", "D-MSE (generator samples)"), ("modes", "modes covered (of 4)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (metric, name) in zip(axes, panels):
        for label, entry in results["methods"].items():
            if entry["method"] == "epgan":
                series = metrics[(metrics["method"] == label) & (metrics["metric"] == metric)].set_index("round")["value"].sort_index()
                ax.plot(series.index, series.values, marker="o", markersize=3, label=label)
            elif entry["method"] == "epgan-oracle" and metric in entry:
                ax.axhline(entry[metric], linestyle="--", linewidth=0.8, color="gray")
                ax.text(ax.get_xlim()[1], entry[metric], f" {label}", fontsize=7, color="gray", va="center")
        ax.set_xlabel("turn (0 = after the warm-up)")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(frame: pd.DataFrame) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return "-" if not np.isfinite(v) else f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def summary(frames: list[tuple[int, pd.DataFrame]]) -> str:
    """Mean ± std of every score over runs (seeds), per method, in the order of the first run."""
    every = pd.concat([frame.assign(seed=seed) for seed, frame in frames], ignore_index=True)
    scores = [c for c in every.columns if c not in ("method", "backbone", "J", "rejected", "seconds", "seed")]
    count_col = "modes (of 4)" if "modes (of 4)" in every.columns else "classes (of 10)" if "classes (of 10)" in every.columns else None
    rows = []
    for method in dict.fromkeys(every["method"]):
        part = every[every["method"] == method]
        row = {"method": method, "runs": len(part)}
        for col in scores:
            values = part[col].astype(float)
            row[col] = f"{values.mean():.4g} ± {values.std(ddof=1):.2g}" if len(values) > 1 else f"{values.mean():.4g}"
        if count_col:
            row[f"{count_col.split(' ')[0]} per seed"] = " / ".join(f"{v:.0f}" for v in part.sort_values("seed")[count_col])
        rows.append(row)
    frame = pd.DataFrame(rows)
    seeds = sorted({seed for seed, _ in frames})
    return f"Mean ± std over {len(seeds)} runs (run.seed {', '.join(map(str, seeds))}).\n\n" + markdown(frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--suffix", default="", help="appended to the output names (several runs of one job)")
    parser.add_argument("--summary", default=None, metavar="NAME", help="also write NAME.md: mean ± std over the runs")
    add_quick_arguments(parser, "a small epgan_toy run: wgan, ep-probgan and wgan-central, 2 warm-up epochs, 2 turns of 1 epoch")
    args = parser.parse_args()
    if not args.runs and not args.quick:
        parser.error("give a finished run folder (or --quick)")
    args.out = out_dir(args.out, args.quick, Path("docs/results/epgan"))
    if args.quick:
        small = {"warmup_epochs": 2, "rounds": 2, "local_epochs": 1, "grid": 30, "eval_samples": 500}
        methods = {"wgan": small, "ep-probgan": small, "wgan-central": {**small, "epochs": 2}}
        args.runs = [quick_run(ROOT / "jobs" / "epgan_toy.yaml", methods, args.out, {"data.options.n_per_mode": 500})]
    report = {}
    frames = []
    for run_dir in args.runs:
        results, metrics = load(run_dir)
        frames.append((int(results["config"]["run"]["seed"]), table(results)))
        name = results["run"]["name"] + (f"-{args.suffix}" if args.suffix else "") + f"-s{results['config']['run']['seed']}"
        frame = table(results)
        report[name] = [
            {k: v for k, v in row.items() if k == "method" or (isinstance(v, (int, float)) and not isinstance(v, bool))}
            for row in frame.to_dict("records")
        ]
        text = markdown(frame)
        seconds = results["run"]["seconds"]
        where = f"{seconds:.0f} s ({results['run'].get('backend', '?')} backend)" if np.isfinite(seconds) else results["run"]["backend"]
        (args.out / f"{name}.md").write_text(f"# {name}\n\nRun folder: `{run_dir}`, {where}.\n\n{text}\n")
        if any("fd" in e for e in results["methods"].values()):
            plot_images(results, args.out / f"{name}_samples.png")
        else:
            plot_maps(results, metrics, args.out / f"{name}_maps.png")
        plot_curves(results, metrics, args.out / f"{name}_curves.png")
        picture = "samples" if any("fd" in e for e in results["methods"].values()) else "maps"
        print(f"{name}\n{text}\n-> {args.out}/{name}.md, {name}_{picture}.png, {name}_curves.png")
    if args.summary:
        text = summary(frames)
        (args.out / f"{args.summary}.md").write_text(f"# {args.summary}\n\nRuns: {', '.join(f'`{r}`' for r in args.runs)}.\n\n{text}\n")
        print(f"{args.summary}\n{text}")
    if args.quick:  # the table's numbers, checked: a quick run is a test that the whole path still works
        check_finite(report, "report")
        (args.out / "report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
        print(f"wrote {args.out / 'report.json'}")


if __name__ == "__main__":
    main()
