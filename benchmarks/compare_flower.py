"""rayfuse against Flower's Ray simulation on the same work: the two target cells, no local training.

1. rayfuse: ``bench_round.run_cells`` on 100 clients x 100 k float32 (400 KB) and 20 clients x 10 M float32
   (40 MB), in this process (Ray started and stopped here), in both layouts: one actor per client (the deployment
   model) and ``federation.clients_per_actor = clients / CPUs`` (the simulation mode; Flower likewise runs its
   clients on a pool of a few actors), each in bench_round's aggregation modes (``flat`` and, packed, ``per_actor``
   streaming; ``gathered``), each row compared with the same Flower cell.
2. Flower: ``flower_round.py`` in a subprocess with the Python of ``benchmarks/.flwr-venv`` (Flower pins its own
   Ray), after rayfuse's Ray has stopped, so the two never share the machine.

The targets (from the issues): rayfuse's round at least 15x faster than Flower's on both target cells (the
``speed-up`` column, Flower's round over rayfuse's, with the bare Ray round on the same actors beside it), and the
older ones on the round *overhead*: at most 1/10 of Flower's round time at 100 x 400 KB and at most 1/20 at
20 x 40 MB. When the Flower environment is missing or fails, the output says why and compares the 100-client cell
with the issue's stated Flower figure (4.5 s per round), labelled as such: it is not a measurement.

Usage::

    python -m venv benchmarks/.flwr-venv && benchmarks/.flwr-venv/bin/pip install "flwr[simulation]<2" numpy
    python benchmarks/compare_flower.py [--rounds 5] [--flower-client-cpus 0.5] [--out DIR]
    python benchmarks/compare_flower.py --quick   # 4 clients x 100 k (both layouts), 2 rounds; no load wait

Writes ``benchmarks/results/compare_flower.json`` (``--out``; ``--quick``: a temporary folder). ``--quick`` runs
both engines on one small cell that the issue sets no target for (the same code paths as the target cells), so its
table compares the rounds without a target.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from _common import add_quick_arguments, machine_info, out_dir, print_table, write_results
from bench_round import TARGET_CELLS, Cell, run_cells

HERE = Path(__file__).resolve().parent
FLOWER_PYTHON = HERE / ".flwr-venv" / "bin" / "python"
TARGET_RATIO = {(100, 100_000): 1 / 10, (20, 10_000_000): 1 / 20}
SPEEDUP_TARGET = 15.0  # the round at least 15x faster than Flower's on the target cells
ISSUE_FLOWER_ROUND_S = {(100, 100_000): 4.5}  # the issue's stated figure for Flower, not a measurement
QUICK_CELLS = [Cell(4, 100_000), Cell(4, 100_000, per_actor=2)]  # --quick: both layouts of one small cell


def run_flower(
    python: Path,
    *,
    rounds: int,
    warmup: int,
    client_cpus: float,
    store_gib: float,
    cells: list[Cell] | None = None,
    quiet_timeout_s: float | None = None,
    out: Path | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """Run ``flower_round.py`` with ``python`` on ``cells`` (default the target cells); return its JSON payload, or
    ``None`` and why not."""
    if not python.exists():
        return None, f"no Flower environment at {python} (see the usage in this script's docstring)"
    specs = list(dict.fromkeys(f"{c.clients}x{c.num_params}" for c in cells or TARGET_CELLS))  # each layout runs the same Flower cell
    cmd = [
        str(python),
        str(HERE / "flower_round.py"),
        "--cells",
        *specs,
        "--rounds",
        str(rounds),
        "--warmup",
        str(warmup),
        "--client-cpus",
        str(client_cpus),
        "--object-store-gib",
        str(store_gib),
        *([] if quiet_timeout_s is None else ["--quiet-timeout", str(quiet_timeout_s)]),
        *([] if out is None else ["--out", str(out)]),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        return None, f"flower_round.py exited with {proc.returncode}:\n{tail}"
    for line in lines:
        if line.startswith("flower "):
            print(f"  {line}")
    return json.loads(lines[-1]), ""


def compare(rayfuse_rows: list[dict[str, Any]], flower: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per target cell and reference: rayfuse's overhead over the reference round time, and the target."""
    flower_rows = {(r["clients"], r["num_params"]): r for r in (flower or {}).get("rows", [])}
    rows = []
    for row in rayfuse_rows:
        key = (row["clients"], row["param_bytes"] // 4)
        references = []
        if key in flower_rows:
            references.append((f"Flower {flower['flwr']} (measured)", flower_rows[key]["round_s"]))
        if key in ISSUE_FLOWER_ROUND_S:
            references.append(("Flower per the issue (stated, not measured)", ISSUE_FLOWER_ROUND_S[key]))
        target = TARGET_RATIO.get(key)  # None: a cell the issue sets no target for (a smoke run's small cell)
        if not references:
            rows.append(
                {
                    "cell": row["cell"],
                    "reference": "none (Flower not measured; the issue states no figure)",
                    "rayfuse_round_s": row["round_s"],
                    "rayfuse_overhead_s": row["overhead_s"],
                    "target_ratio": target,
                    "target_met": None,
                }
            )
        for name, reference_s in references:
            ratio = row["overhead_s"] / reference_s
            rows.append(
                {
                    "cell": row["cell"],
                    "reference": name,
                    "reference_round_s": reference_s,
                    "rayfuse_round_s": row["round_s"],
                    "bare_round_s": row["bare_round_s"],
                    "rayfuse_overhead_s": row["overhead_s"],
                    "round_ratio": row["round_s"] / reference_s,
                    "speedup": reference_s / row["round_s"],
                    "speedup_met": None if target is None else reference_s / row["round_s"] >= SPEEDUP_TARGET,
                    "coordinator_peak_x_model": row.get("coordinator_peak_x_model"),
                    "coordinator_private_x_model": row.get("coordinator_anon_peak_x_model"),
                    "client_actor_peak_x_model": row.get("client_actor_peak_x_model"),
                    "load_avg_1m": row.get("load_avg_1m"),
                    "overhead_ratio": ratio,
                    "target_ratio": target,
                    "target_met": None if target is None else ratio <= target,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per cell (both engines)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (both engines)")
    parser.add_argument("--flower-python", type=Path, default=FLOWER_PYTHON)
    parser.add_argument(
        "--flower-client-cpus",
        type=float,
        default=0.5,
        help="Flower client_resources num_cpus; 0.5 (4 actors on 2 CPUs) was Flower's fastest setting here",
    )
    parser.add_argument("--object-store-gib", type=float, default=4.0, help="object store of each engine's Ray")
    add_quick_arguments(parser, "4 clients x 100 k float32 in both layouts, 2 rounds after 1 warm-up, no wait for a quiet machine")
    args = parser.parse_args()
    out = out_dir(args.out, args.quick)
    cells = QUICK_CELLS if args.quick else list(TARGET_CELLS)
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.object_store_gib = min(args.object_store_gib, 1.0)
    quiet = {"max_load": 1e9, "quiet_timeout_s": 0.0} if args.quick else {}  # a smoke run measures whatever the load is

    info = machine_info()
    store_bytes = int(args.object_store_gib * 2**30)
    print(f"rayfuse vs Flower, {info['cpus']} CPUs, load average {info['load_avg_1m']:.2f}", flush=True)
    print("rayfuse:", flush=True)
    rayfuse = run_cells(cells, rounds=args.rounds, warmup=args.warmup, store_bytes=store_bytes, **quiet)
    print("Flower:", flush=True)
    flower, why_not = run_flower(
        args.flower_python,
        rounds=args.rounds,
        warmup=args.warmup,
        client_cpus=args.flower_client_cpus,
        store_gib=args.object_store_gib,
        cells=cells,
        quiet_timeout_s=0.0 if args.quick else None,
        out=out if args.quick else None,
    )
    if flower is None:
        print(f"  Flower not measured: {why_not}")

    rows = compare(rayfuse["rows"], flower)
    shown = [
        {
            **r,
            **{k: 1e3 * r[k] for k in ("rayfuse_round_s", "rayfuse_overhead_s", "bare_round_s") if k in r},
            "target": "none" if r["target_ratio"] is None else f"<= 1/{round(1 / r['target_ratio'])}",
            "target_met": "n/a" if r["target_met"] is None else r["target_met"],
            "speedup_met": "n/a" if r.get("speedup_met") is None else r["speedup_met"],
        }
        for r in rows
    ]
    print_table(
        shown,
        [
            ("cell", "clients x params"),
            ("reference", "reference"),
            ("reference_round_s", "ref round s"),
            ("rayfuse_round_s", "rayfuse round ms"),
            ("bare_round_s", "bare Ray ms"),
            ("speedup", "speed-up"),
            ("speedup_met", f">= {SPEEDUP_TARGET:g}x"),
            ("coordinator_peak_x_model", "coord. peak x model"),
            ("coordinator_private_x_model", "coord. private x model"),
            ("client_actor_peak_x_model", "actor peak x model"),
            ("load_avg_1m", "load"),
            ("rayfuse_overhead_s", "rayfuse overhead ms"),
            ("round_ratio", "round / ref"),
            ("overhead_ratio", "overhead / ref"),
            ("target", "target"),
            ("target_met", "met"),
        ],
        "rayfuse overhead against Flower's round time on the same work",
    )
    path = write_results(
        "compare_flower",
        {"machine": info, "quick": args.quick, "rayfuse": rayfuse, "flower": flower, "flower_error": why_not or None, "comparison": rows},
        out,
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
