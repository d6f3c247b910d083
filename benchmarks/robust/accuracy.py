"""Accuracy of FedAvg and one-shot averaging with each robust aggregator under attack (issue 21's benchmark).

Not a timing. Digits, 10 clients (Dirichlet 0.5 and i.i.d.), the quickstart MLP (hidden [64, 64]) from a shared
initialisation; FedAvg 15 rounds of 1 local epoch; one-shot ``average`` of local models trained 5 epochs. Each
aggregator of :mod:`rayfuse.updates.robust` (and the mean with update-norm clipping) under 0, 1, 2, 3 attacking clients
(clients ``0..k-1``) for each attack (``sign_flip``, ``scale``, ``gaussian``, ``little_is_enough`` through
``federation.attacks``; label flipping through ``partition.corrupt``), 3 seeds. Krum, Multi-Krum and Bulyan are told
``f = max(k, 1)`` (a defender configured for one bad client when none attacks); a rule whose precondition fails for
``(n, f)`` is not run and its cell reads ``n/a``.

One run of rayfuse per (partition, seed, attack, k), in-process (``federation.backend: local``), every aggregator a
method of that run (the one-shot ``average`` methods share the run's local models). Each finished run appends its
rows to ``RAW`` (JSON lines), so an interrupted grid resumes where it stopped; ``--render`` rebuilds the tables, the
csv and the plot from ``RAW`` alone::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/robust/accuracy.py   # the grid (~25 min, 1 core)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/robust/accuracy.py --quick               # one cell, a smoke run (--out)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/robust/accuracy.py --render              # tables from the raw rows
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import add_quick_arguments, machine_info, out_dir, write_results  # noqa: E402

OUT_DIR = HERE.parent.parent / "docs" / "results" / "robust"
RAW = OUT_DIR / "accuracy_raw.jsonl"
N_CLIENTS = 10
ROUNDS = 15
LOCAL_EPOCHS = 1
AVERAGE_EPOCHS = 5
CLIP_NORM = 1.0
PARTITIONS: dict[str, dict[str, Any]] = {"dirichlet0.5": {"method": "dirichlet", "alpha": 0.5}, "iid": {"method": "iid"}}
ATTACKS = ("sign_flip", "scale", "gaussian", "little_is_enough", "flip_labels")
ATTACKERS = (0, 1, 2, 3)
SEEDS = (0, 1, 2)
AGGREGATORS = ("mean", "median", "trimmed_mean_0.1", "trimmed_mean_0.2", "krum", "multi_krum", "bulyan", "geometric_median", "mean_clip")
FAMILIES = ("fedavg", "average")


def describe_aggregator(label: str, f: int) -> dict[str, Any]:
    """The ``aggregator`` setting of ``label`` for a defender told ``f`` bad clients."""
    if label.startswith("trimmed_mean_"):
        return {"name": "trimmed_mean", "beta": float(label.rsplit("_", 1)[1])}
    if label == "krum":
        return {"name": "krum", "f": f, "m": 1}
    if label == "multi_krum":
        return {"name": "krum", "f": f, "m": N_CLIENTS - f}
    if label == "bulyan":
        return {"name": "bulyan", "f": f}
    if label == "mean_clip":
        return {"name": "mean", "clip_norm": CLIP_NORM}
    return {"name": label}


def find_precondition_failure(label: str, f: int, n: int = N_CLIENTS) -> str | None:
    """``None`` when ``label`` runs on ``n`` clients with ``f``, else the cell's text (``n/a (needs ...)``)."""
    if label in ("krum", "multi_krum") and n < 2 * f + 3:
        return "n/a (needs n >= 2f+3)"
    if label == "bulyan" and n < 4 * f + 3:
        return "n/a (needs n >= 4f+3)"
    return None


def build_config(partition: str, seed: int, attack: str, k: int, storage: str) -> dict[str, Any]:
    """The run of one grid cell: every aggregator that runs for ``k`` attackers, as FedAvg and as ``average``."""
    f = max(k, 1)
    methods: dict[str, Any] = {}
    for label in AGGREGATORS:
        if find_precondition_failure(label, f) is not None:
            continue
        agg = describe_aggregator(label, f)
        methods[f"fedavg@{label}"] = {"method": "fedavg", "rounds": ROUNDS, "local_epochs": LOCAL_EPOCHS, "aggregator": agg}
        methods[f"average@{label}"] = {"method": "average", "aggregator": agg}
    cfg: dict[str, Any] = {
        "run": {"name": f"robust-{partition}-{attack}-{k}-s{seed}", "seed": seed, "storage": storage},
        "data": {"dataset": "digits"},
        "partition": {**PARTITIONS[partition], "num_clients": N_CLIENTS},
        "model": {"name": "mlp", "hidden": [64, 64]},
        "train": {"epochs": AVERAGE_EPOCHS, "shared_init": True},
        "federation": {"backend": "local"},
        "methods": methods,
    }
    if k and attack == "flip_labels":
        cfg["partition"]["corrupt"] = {i: "flip_labels" for i in range(k)}
    elif k:
        cfg["federation"]["attacks"] = [{"client": i, "kind": attack} for i in range(k)]
    return cfg


def list_cells(quick: bool) -> list[tuple[str, int, str, int]]:
    """``(partition, seed, attack, k)`` of every run; ``k = 0`` once per (partition, seed) (attack ``none``)."""
    if quick:
        return [("dirichlet0.5", 0, "sign_flip", 1)]
    cells = []
    for seed in SEEDS:
        for partition in PARTITIONS:
            cells.append((partition, seed, "none", 0))
            cells.extend((partition, seed, attack, k) for attack in ATTACKS for k in ATTACKERS if k)
    return cells


def read_raw(path: Path = RAW) -> list[dict[str, Any]]:
    """The rows written so far (one per method of each finished run)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_cell(partition: str, seed: int, attack: str, k: int) -> list[dict[str, Any]]:
    """Run one cell in-process; one row per method: accuracy and the attack events it recorded."""
    import rayfuse

    storage = tempfile.mkdtemp(prefix="rayfuse-robust-")
    try:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            result = rayfuse.run(build_config(partition, seed, attack, k, storage), quiet=True)
        seconds = time.perf_counter() - start
        events = [e for e in result.results["events"] if e["kind"] == "attack"]
        rows = []
        for name, m in result.results["methods"].items():
            family, label = name.split("@", 1)
            rows.append(
                {
                    "partition": partition,
                    "seed": seed,
                    "attack": attack,
                    "attackers": k,
                    "family": family,
                    "aggregator": label,
                    "accuracy": m["accuracy"],
                    "attack_events": sum(e["method"] == name for e in events),
                    "run_seconds": round(seconds, 2),
                }
            )
        return rows
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str, str, int], tuple[float, float, int]]:
    """``(partition, family, aggregator, attack, k) -> (mean, std, seeds)``; ``k = 0`` rows serve every attack."""
    groups: dict[tuple[str, str, str, str, int], list[float]] = {}
    for r in rows:
        attacks = ATTACKS if r["attackers"] == 0 else (r["attack"],)
        for attack in attacks:
            groups.setdefault((r["partition"], r["family"], r["aggregator"], attack, r["attackers"]), []).append(r["accuracy"])
    return {key: (statistics.fmean(v), statistics.pstdev(v) if len(v) > 1 else 0.0, len(v)) for key, v in groups.items()}


def format_cell(stats: Mapping[tuple[str, str, str, str, int], tuple[float, float, int]], key: tuple[str, str, str, str, int]) -> str:
    """``mean ± std`` (with ``(s seeds)`` when fewer than all), ``n/a (...)``, or ``missing``."""
    label, k = key[2], key[4]
    na = find_precondition_failure(label, max(k, 1))
    if na is not None:
        return na
    if key not in stats:
        return "missing"
    mean, std, seeds = stats[key]
    if seeds == 1:
        return f"{mean:.3f} (1 seed)"
    text = f"{mean:.3f} ± {std:.3f}"
    return text if seeds == len(SEEDS) else f"{text} ({seeds} seeds)"


def find_worst(
    stats: Mapping[tuple[str, str, str, str, int], tuple[float, float, int]], partition: str, family: str, label: str, k: int
) -> str:
    """The lowest mean accuracy over the attacks with ``k`` attackers (and which attack), ``n/a``, or ``missing``."""
    if k and find_precondition_failure(label, k) is not None:
        return "n/a"
    if k == 0:
        key = (partition, family, label, ATTACKS[0], 0)
        return f"{stats[key][0]:.3f}" if key in stats else "missing"
    found = [(stats[(partition, family, label, a, k)][0], a) for a in ATTACKS if (partition, family, label, a, k) in stats]
    if not found:
        return "missing"
    mean, attack = min(found)
    return f"{mean:.3f} ({attack}{', partial' if len(found) < len(ATTACKS) else ''})"


def summarise_worst(stats: Mapping[tuple[str, str, str, str, int], tuple[float, float, int]]) -> list[str]:
    """Markdown: per family and aggregator, the clean accuracy and the worst over the attacks with 1 and 3 attackers."""
    lines = ["## Summary: clean, and the worst attack with 1 and with 3 attackers (mean over the seeds run)", ""]
    for family in FAMILIES:
        head = " | ".join(f"{p} {c}" for p in PARTITIONS for c in ("clean", "worst, 1", "worst, 3"))
        lines += [f"**{family}**", "", f"| aggregator | {head} |", "|---|" + "---|" * (3 * len(PARTITIONS))]
        for label in AGGREGATORS:
            cells = [find_worst(stats, p, family, label, k) for p in PARTITIONS for k in (0, 1, 3)]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def render(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> None:
    """Write ``accuracy.md`` (one table per family and partition), ``accuracy.csv`` and ``accuracy.png``."""
    stats = summarise(rows)
    missing = 0
    lines = [
        "# Accuracy under attack: each aggregator, FedAvg and one-shot average",
        "",
        f"Digits, {N_CLIENTS} clients, MLP [64, 64] from a shared initialisation (Adam, lr 0.005, batch 32); FedAvg "
        f"{ROUNDS} rounds x {LOCAL_EPOCHS} local epoch; `average`: local models trained {AVERAGE_EPOCHS} epochs, "
        "merged once. Attackers are clients 0..k-1; Krum, Multi-Krum (m = n - f) and Bulyan are told "
        f"f = max(k, 1); `mean_clip` is the mean with `clip_norm: {CLIP_NORM}`. Test accuracy, mean ± std (population) "
        f"over seeds {', '.join(map(str, SEEDS))}. The 0 column is the clean run (the same for every attack).",
        "",
        f"Machine: {meta.get('cpu_model')}, {meta.get('cpus')} CPUs (shared; the grid ran on one core, niced), "
        f"Python {meta.get('python')}, numpy {meta.get('numpy')}. Date: {meta.get('date')}. Command: `{meta.get('command')}`.",
        "",
    ]
    csv = ["family,partition,aggregator,attack,attackers,mean,std,seeds,note"]
    lines += summarise_worst(stats)
    for family in FAMILIES:
        for partition in PARTITIONS:
            lines += [f"## {family}, {partition}", "", "| aggregator | attack | 0 | 1 | 2 | 3 |", "|---|---|---|---|---|---|"]
            for label in AGGREGATORS:
                for attack in ATTACKS:
                    cells = []
                    for k in ATTACKERS:
                        key = (partition, family, label, attack, k)
                        text = format_cell(stats, key)
                        missing += text == "missing"
                        cells.append(text)
                        mean, std, seeds = stats.get(key, (float("nan"), float("nan"), 0))
                        note = text if text.startswith(("n/a", "missing")) else ""
                        csv.append(f"{family},{partition},{label},{attack},{k},{mean:.4f},{std:.4f},{seeds},{note}")
                    lines.append(f"| {label} | {attack} | " + " | ".join(cells) + " |")
            lines.append("")
    if missing:
        lines += [f"{missing} cells are missing (the grid did not finish); the command above resumes it.", ""]
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "accuracy.md").write_text("\n".join(lines))
    (OUT_DIR / "accuracy.csv").write_text("\n".join(csv) + "\n")
    plot(stats)


def plot(stats: Mapping[tuple[str, str, str, str, int], tuple[float, float, int]]) -> None:
    """``accuracy.png``: accuracy against attackers, one panel per (family, partition, attack), a line per aggregator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(fam, part) for fam in FAMILIES for part in PARTITIONS]
    fig, axes = plt.subplots(len(panels), len(ATTACKS), figsize=(3.2 * len(ATTACKS), 2.6 * len(panels)), sharey=True, squeeze=False)
    for row, (family, partition) in enumerate(panels):
        for col, attack in enumerate(ATTACKS):
            ax = axes[row][col]
            for label in AGGREGATORS:
                pts = [
                    (k, stats[(partition, family, label, attack, k)][0])
                    for k in ATTACKERS
                    if (partition, family, label, attack, k) in stats
                ]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
            ax.set_title(f"{family}, {partition}\n{attack}", fontsize=8)
            ax.set_xticks(list(ATTACKERS))
            ax.grid(alpha=0.3)
            if row == len(panels) - 1:
                ax.set_xlabel("attacking clients")
            if col == 0:
                ax.set_ylabel("test accuracy")
    axes[0][-1].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(OUT_DIR / "accuracy.png", dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the missing cells of the grid (or ``--quick``'s one), then render."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render", action="store_true", help="only rebuild the tables from the raw rows")
    add_quick_arguments(parser, "Dirichlet, seed 0, one sign-flipper; its rows go to --out/robust_accuracy.json, not to the grid's")
    args = parser.parse_args(argv)
    meta_path = OUT_DIR / "accuracy_meta.json"
    if args.render:
        render(read_raw(), json.loads(meta_path.read_text()) if meta_path.exists() else {})
        return 0
    if args.quick:
        rows = run_cell(*list_cells(True)[0])
        for row in rows:
            print(row)
        print(
            f"wrote {write_results('robust_accuracy', {'machine': machine_info(), 'quick': True, 'rows': rows}, out_dir(args.out, True))}"
        )
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    meta = {**machine_info(), "command": "PYTHONPATH=$PWD OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/robust/accuracy.py"}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    done = {(r["partition"], r["seed"], r["attack"], r["attackers"]) for r in read_raw()}
    todo = [c for c in list_cells(False) if c not in done]
    print(f"{len(done)} runs done, {len(todo)} to run", flush=True)
    for i, cell in enumerate(todo, 1):
        rows = run_cell(*cell)
        with RAW.open("a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"[{i}/{len(todo)}] {cell} {rows[0]['run_seconds']} s", flush=True)
    render(read_raw(), meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
