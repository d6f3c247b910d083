"""Each robust aggregator's cost per round against ``weighted_average``, and against Flower's on the same arrays.

:func:`compare_flower_robust.compare` (rayfuse's rules and ``weighted_average`` timed in interleaved passes here;
Flower's ``aggregate_*`` functions in its own virtualenv on the same arrays) on 10 clients' random float32 updates the
size of the quickstart model (MLP [64, 64] on digits: 8,970 parameters) and of a 1,000,000-parameter model; f = 1,
Multi-Krum m = n - f = 9, trimmed mean beta 0.1 and 0.2, clipping to norm 1 around a random global model. Writes
``docs/results/robust/cost.{md,csv,json,png}``::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/robust/aggregator_cost.py   # ~2 min
    PYTHONPATH=$PWD .venv/bin/python benchmarks/robust/aggregator_cost.py --quick   # the quickstart size, 2 passes, to a temporary folder
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import add_quick_arguments, out_dir  # noqa: E402
from compare_flower_robust import FLOWER_PYTHON, compare  # noqa: E402

OUT_DIR = HERE.parent.parent / "docs" / "results" / "robust"
QUICKSTART_PARAMS = 8_970  # rayfuse's quickstart MLP [64, 64] on digits
SIZES = {QUICKSTART_PARAMS: 50, 1_000_000: 5}  # parameters: timed repeats
QUICK_SIZES = {QUICKSTART_PARAMS: 2}


def measure(clients: int, sizes: Mapping[int, int], flower_python: Path) -> list[dict[str, Any]]:
    """One :func:`compare` payload per model size."""
    payloads = []
    for params, repeats in sizes.items():
        args = argparse.Namespace(
            clients=clients, params=params, repeats=repeats, f=1, m=clients - 1, beta=[0.1, 0.2], clip_norm=1.0, flower_python=flower_python
        )
        payloads.append(compare(args))
        print(f"{params} parameters done", flush=True)
    return payloads


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def render(payloads: Sequence[Mapping[str, Any]], command: str, out: Path = OUT_DIR) -> None:
    """Write ``cost.md``, ``cost.csv``, ``cost.json`` and ``cost.png`` to ``out``."""
    machine = payloads[0]["machine"]
    flower = payloads[0]["flower"]
    lines = [
        "# Cost of each aggregator per round",
        "",
        f"{payloads[0]['clients']} clients' random float32 updates (three tensors), f = 1, Multi-Krum m = {payloads[0]['m']}, "
        "clipping to norm 1 around a random global model. rayfuse's times: median of interleaved passes with "
        "`weighted_average` (the plain FedAvg mean) in the same process; Flower's: its `aggregate_*` functions in its "
        f"own virtualenv (flwr {flower or 'not available'}) on the same arrays. `mean_clip` on Flower's side is its DP "
        "wrappers' `compute_clip_model_update` per client, then `aggregate`. Flower has no geometric median.",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpus']} CPUs shared with other work (1-minute load "
        f"{min(p['machine']['load_avg_1m'] for p in payloads):.1f}-{max(p['machine']['load_avg_1m'] for p in payloads):.1f} at the "
        f"start), one thread, Python {machine['python']}, numpy {machine['numpy']}. Date: {machine['date']}. Command: `{command}`.",
        "",
    ]
    csv = ["params,rule,rayfuse_s,x_weighted_average,flower_s,rayfuse_over_flower,max_abs_diff,equal"]
    for p in payloads:
        lines += [
            f"## {p['params']:,} parameters per client (`weighted_average`: {p['weighted_average_s']:.3g} s)",
            "",
            "| rule | rayfuse s | x `weighted_average` | Flower s | rayfuse / Flower | max abs diff | equal |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in p["rows"]:
            equal = "" if "equal" not in r else ("yes" if r["equal"] else "NO")
            lines.append(
                f"| {r['rule']} | {r['rayfuse_s']:.3g} | {r['vs_weighted_average']:.3g} | {_fmt(r.get('flower_s'), '.3g') or '(none)'} | "
                f"{_fmt(r.get('rayfuse_over_flower'), '.3g')} | {_fmt(r.get('max_abs_diff'), '.2g')} | {equal} |"
            )
            csv.append(
                f"{p['params']},{r['rule']},{r['rayfuse_s']:.6g},{r['vs_weighted_average']:.4g},{_fmt(r.get('flower_s'), '.6g')},"
                f"{_fmt(r.get('rayfuse_over_flower'), '.4g')},{_fmt(r.get('max_abs_diff'), '.3g')},{r.get('equal', '')}"
            )
        lines.append("")
    if payloads[0]["flower_missing"]:
        lines += [f"Flower not measured: {payloads[0]['flower_missing']}", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.md").write_text("\n".join(lines))
    (out / "cost.csv").write_text("\n".join(csv) + "\n")
    (out / "cost.json").write_text(json.dumps({"command": command, "payloads": payloads}, indent=2, default=float) + "\n")
    plot(payloads, out)
    print(f"wrote {out / 'cost.md'}, cost.csv, cost.json, cost.png")


def plot(payloads: Sequence[Mapping[str, Any]], out: Path = OUT_DIR) -> None:
    """``cost.png``: each rule's time over ``weighted_average``'s and over Flower's, one panel per size (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(payloads), figsize=(6 * len(payloads), 3.6), squeeze=False)
    for ax, p in zip(axes[0], payloads):
        rules = [r["rule"] for r in p["rows"]]
        x = np.arange(len(rules))
        ax.bar(x - 0.2, [r["vs_weighted_average"] for r in p["rows"]], 0.4, label="rayfuse / weighted_average")
        ax.bar(x + 0.2, [r.get("rayfuse_over_flower", np.nan) for r in p["rows"]], 0.4, label="rayfuse / Flower")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(x, rules, rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{p['params']:,} parameters x {p['clients']} clients", fontsize=9)
        ax.set_ylabel("time ratio")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "cost.png", dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure both sizes and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--flower-python", type=Path, default=FLOWER_PYTHON)
    add_quick_arguments(parser, f"{QUICKSTART_PARAMS:,} parameters only, 2 passes")
    args = parser.parse_args(argv)
    command = "PYTHONPATH=$PWD OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/robust/aggregator_cost.py" + (
        " --quick" if args.quick else ""
    )
    render(measure(args.clients, QUICK_SIZES if args.quick else SIZES, args.flower_python), command, out_dir(args.out, args.quick, OUT_DIR))
    return 0


if __name__ == "__main__":
    sys.exit(main())
