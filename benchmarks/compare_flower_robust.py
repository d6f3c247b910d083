"""rayfuse's robust aggregators against Flower's on the same random arrays: equal results, and the time ratio.

1. rayfuse: each rule of :mod:`rayfuse.updates.robust` on ``--clients`` random models of ``--params`` float32
   parameters (three tensors), and ``weighted_average`` on the same models (the cost reference), timed in
   interleaved passes in this process. With ``--clip-norm C``, also the mean after update-norm clipping
   (``mean_clip``) around a random global model; with several ``--beta``, one trimmed mean per value.
2. Flower: ``flower_robust.py`` in a subprocess with the Python of ``benchmarks/.flwr-venv`` (the environment of
   ``compare_flower.py``), on the same arrays passed through an ``.npz`` file: ``aggregate`` (FedAvg),
   ``aggregate_median``, ``aggregate_trimmed_avg``, ``aggregate_krum`` (Krum and Multi-Krum), ``aggregate_bulyan``,
   and for ``mean_clip`` its DP wrappers' ``compute_clip_model_update`` on each client then ``aggregate``.
   Flower has no geometric median.

Each row: the largest absolute difference between the two results (both computed from the same float32 inputs;
rayfuse in float64 cast back to float32, Flower in float32), whether they are equal within float32 rounding, and
the time of each and their ratio. Without the Flower environment the script says so, reports rayfuse's times against
``weighted_average`` alone and compares nothing. Nothing is installed or downloaded.

Usage::

    python benchmarks/compare_flower_robust.py [--clients 10] [--params 1000000] [--repeats 3] [--f 1] [--m 3] [--beta 0.2 ...]
                                               [--clip-norm C] [--out DIR]
    python benchmarks/compare_flower_robust.py --quick   # 10 clients x 10,000 parameters, clipping at 1.0, one pass

``benchmarks/robust/aggregator_cost.py`` runs :func:`compare` on two model sizes and writes the tables to
``docs/results/robust/``.

Writes ``benchmarks/results/compare_flower_robust.json`` (``--out``; ``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_quick_arguments, interleaved_times, machine_info, median, out_dir, print_table, write_results

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # rayfuse from this checkout

from rayfuse.updates.aggregate import weighted_average  # noqa: E402
from rayfuse.updates.robust import AggregatorSettings, aggregate  # noqa: E402

FLOWER_PYTHON = HERE / ".flwr-venv" / "bin" / "python"


def make_models(clients: int, params: int, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """``clients`` random float32 models of about ``params`` parameters in three tensors, and their sample counts."""
    rng = np.random.default_rng(seed)
    side = max(1, int(np.sqrt(params * 0.9)))
    shapes = {"layer0": (side, side), "layer1": (max(1, params - side * side - 10),), "layer2": (10,)}
    models = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(clients)]
    return models, [int(c) for c in rng.integers(50, 500, size=clients)]


def list_betas(args: argparse.Namespace) -> dict[str, float]:
    """The trimmed means' rule names and betas: ``trimmed_mean`` for one beta, ``trimmed_mean_<beta>`` for several."""
    betas = args.beta if isinstance(args.beta, list) else [args.beta]
    return {"trimmed_mean": float(betas[0])} if len(betas) == 1 else {f"trimmed_mean_{b:g}": float(b) for b in betas}


def rayfuse_rules(args: argparse.Namespace) -> dict[str, AggregatorSettings]:
    """The rules compared, by name (``mean_clip`` with ``args.clip_norm``)."""
    rules = {"mean": AggregatorSettings(), "median": AggregatorSettings(name="median")}
    rules.update({name: AggregatorSettings(name="trimmed_mean", beta=beta) for name, beta in list_betas(args).items()})
    rules.update(
        {
            "krum": AggregatorSettings(name="krum", f=args.f),
            "multi_krum": AggregatorSettings(name="krum", f=args.f, m=args.m),
            "bulyan": AggregatorSettings(name="bulyan", f=args.f),
            "geometric_median": AggregatorSettings(name="geometric_median"),
        }
    )
    if getattr(args, "clip_norm", None) is not None:
        rules["mean_clip"] = AggregatorSettings(clip_norm=args.clip_norm)
    return rules


def run_flower(
    models: list[dict[str, np.ndarray]],
    counts: list[int],
    args: argparse.Namespace,
    python: Path = FLOWER_PYTHON,
    reference: dict[str, np.ndarray] | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """Flower's results and median seconds per rule, or ``None`` and why not."""
    if not python.exists():
        return None, f"no Flower environment at {python} (see benchmarks/README.md); Flower not compared"
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        arrays: dict[str, Any] = {f"client{c}/{k}": a for c, m in enumerate(models) for k, a in m.items()}
        if reference is not None:
            arrays.update({f"reference/{k}": a for k, a in reference.items()})
        np.savez(inputs, num_examples=np.array(counts), **arrays)
        betas = [f"{b:g}" for b in list_betas(args).values()]
        cmd = [
            str(python),
            str(HERE / "flower_robust.py"),
            str(inputs),
            str(outputs),
            "--repeats",
            str(args.repeats),
            "--f",
            str(args.f),
            "--m",
            str(args.m),
            "--beta",
            *betas,
        ]
        if getattr(args, "clip_norm", None) is not None:
            cmd += ["--clip-norm", str(args.clip_norm)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            return None, f"flower_robust.py exited with {proc.returncode}:\n{tail}"
        payload = json.loads(lines[-1])
        with np.load(outputs) as data:
            payload["results"] = {}
            for key in data.files:
                rule, layer = key.split("/")
                payload["results"].setdefault(rule, {})[layer] = data[key]
    return payload, ""


def compare(args: argparse.Namespace) -> dict[str, Any]:
    models, counts = make_models(args.clients, args.params)
    reference = make_models(1, args.params, seed=1)[0][0]  # the global model clipping measures updates from
    rules = rayfuse_rules(args)
    ours = {name: aggregate(models, counts, s, reference=reference) for name, s in rules.items()}

    def timed(settings: AggregatorSettings) -> Callable[[], Any]:
        return lambda: aggregate(models, counts, settings, reference=reference)

    fns = {name: timed(s) for name, s in rules.items()}
    fns["weighted_average"] = lambda: weighted_average(models, counts)
    times = {name: median(t) for name, t in interleaved_times(fns, args.repeats).items()}
    flower, why = run_flower(models, counts, args, getattr(args, "flower_python", FLOWER_PYTHON), reference)
    rows = []
    for name in rules:
        row: dict[str, Any] = {"rule": name, "rayfuse_s": times[name], "vs_weighted_average": times[name] / times["weighted_average"]}
        if flower is not None and name in flower["results"]:
            theirs = flower["results"][name]
            diff = max(float(np.max(np.abs(ours[name][k].astype(np.float64) - theirs[k].astype(np.float64)))) for k in theirs)
            scale = max(float(np.max(np.abs(theirs[k]))) for k in theirs)
            row.update(
                {
                    "flower_s": flower["seconds"][name],
                    "rayfuse_over_flower": times[name] / flower["seconds"][name],
                    "max_abs_diff": diff,
                    "equal": bool(diff <= 1e-5 * max(scale, 1.0)),
                }
            )
        rows.append(row)
    return {
        "clients": args.clients,
        "params": args.params,
        "f": args.f,
        "m": args.m,
        "beta": args.beta,
        "clip_norm": getattr(args, "clip_norm", None),
        "rows": rows,
        "weighted_average_s": times["weighted_average"],
        "flower": None if flower is None else flower["flwr"],
        "flower_missing": why,
        "machine": machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--params", type=int, default=None, help="float32 parameters of each model (default 1,000,000; --quick 10,000)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes (default 3; --quick 1)")
    parser.add_argument("--f", type=int, default=1)
    parser.add_argument("--m", type=int, default=3)
    parser.add_argument("--beta", type=float, nargs="+", default=[0.2], help="trimmed mean's beta; several: one rule each")
    parser.add_argument("--clip-norm", type=float, default=None, help="also compare the mean after update-norm clipping to this norm")
    parser.add_argument("--flower-python", type=Path, default=FLOWER_PYTHON, help="the Python of Flower's environment")
    add_quick_arguments(parser, "10 clients x 10,000 parameters, every rule and clipping at norm 1.0, one pass")
    args = parser.parse_args()
    if args.params is None:
        args.params = 10_000 if args.quick else 1_000_000
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.quick and args.clip_norm is None:
        args.clip_norm = 1.0
    payload = compare(args)
    if payload["flower_missing"]:
        print(payload["flower_missing"])
    print_table(
        payload["rows"],
        [
            ("rule", "rule"),
            ("rayfuse_s", "rayfuse s"),
            ("vs_weighted_average", "x weighted_average"),
            ("flower_s", "Flower s"),
            ("rayfuse_over_flower", "rayfuse / Flower"),
            ("max_abs_diff", "max |diff|"),
            ("equal", "equal"),
        ],
        title=f"{args.clients} clients x {args.params} float32 parameters, f = {args.f}, m = {args.m}, beta = {args.beta}",
    )
    print(f"wrote {write_results('compare_flower_robust', payload, out_dir(args.out, args.quick))}")


if __name__ == "__main__":
    main()
