"""KL-fusion's assignment work: parallel solves, wrapper overhead, exact vs relaxed P-step.

Three measurements, each against a reference timed in the same run (interleaved passes):

1. **Throughput, D datasets x L components.** One sweep's ``D`` augmented cost matrices ``L x 2L`` (``G = L`` existing
   globals plus ``L`` new-component columns, KL costs of 16-d diagonal Gaussians built with matrix products):
   ``solve_assignments`` through threads and through Ray tasks (``RayFederation.parallel_map``, batched) against a
   serial ``scipy.optimize.linear_sum_assignment`` loop; and the engine's whole sweep step (each task builds its own
   leave-one-out cost matrix from the shared globals, then solves) against two serial references: the same step in a
   serial loop (``_propose`` per dataset: cost matrix by matrix products, then ``linear_sum_assignment``; the same
   work, so this is the parallel efficiency of the engine's path), and the bare solve loop (cost building then counts
   as overhead). Efficiency = serial / (cores x wall). Target (issue 3): >= 0.7 once the serial work is >= 50 ms per
   core. Chunking is the engine's default (``rayfuse.matching.balanced_chunks`` over the executor's width).
2. **Wrapper overhead** of ``rayfuse.matching.solve_assignment`` over raw scipy on single solves, L = 50 .. 1000
   (target <= 10 % for L >= 200).
3. **Exact vs relaxed** on the same GMM problems (the paper's generator, local ``BayesianGaussianMixture`` fits):
   the default per-dataset augmented Hungarian against the relaxed convex P-step (Frank-Wolfe, the reference code's
   approach with cvxpy replaced), fusion time and Hausdorff error (target: exact >= 10x faster at equal or better
   error).

Usage: ``python benchmarks/bench_kl.py [--quick] [--no-ray]``; writes ``benchmarks/results/kl_bench.json``
(``--out``; ``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np
from scipy.optimize import linear_sum_assignment

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_quick_arguments, interleaved_times, machine_info, median, out_dir, print_table, wait_for_quiet, write_results  # noqa: E402

from rayfuse.expfam import DiagGaussian  # noqa: E402
from rayfuse.fusion.kl.fusion import _propose, _Snapshot, fuse_heterogeneous, hausdorff  # noqa: E402
from rayfuse.matching import map_chunked, solve_assignment, solve_assignments, thread_map  # noqa: E402


def make_problem(D: int, L: int, rng: np.random.Generator, dim: int = 16):
    """``L`` global diagonal Gaussians and ``D`` datasets of ``L`` noisy, permuted copies; the sweep's snapshot."""
    means = rng.normal(0, 3, (L, dim))
    var = rng.uniform(0.5, 2, (L, dim))
    globals_ = DiagGaussian(means, var)
    locals_ = [DiagGaussian(means[p] + rng.normal(0, 0.5, (L, dim)), var[p]) for p in (rng.permutation(L) for _ in range(D))]
    counts = np.full(L, D // 2 + 1)
    snap = _Snapshot(np.arange(L), globals_.natural() * counts[:, None], counts, globals_, lam=float(dim))
    return globals_, locals_, snap


def augmented_cost(globals_: DiagGaussian, local: DiagGaussian, lam: float, counts: np.ndarray) -> np.ndarray:
    reg = lam * (np.sqrt(counts + 1.0) - np.sqrt(counts))
    return np.concatenate([globals_.kl_matrix(local).T + reg[None, :], np.full((len(local), len(local)), lam)], axis=1)


def throughput(cells, repeats: int, ray_fed, cores: int, quiet: tuple[float, float]) -> list[dict]:
    rows = []
    for D, L in cells:
        load = wait_for_quiet(*quiet)
        rng = np.random.default_rng(D * 1000 + L)
        globals_, locals_, snap = make_problem(D, L, rng)
        t0 = time.perf_counter()
        costs = [augmented_cost(globals_, q, snap.lam, snap.counts) for q in locals_]
        build = time.perf_counter() - t0
        items = [(q, q.natural(), np.full(L, -1)) for q in locals_]  # the engine's item: the dataset's own posterior
        fns = {
            "serial": lambda: [linear_sum_assignment(c) for c in costs],
            "serial_sweep": lambda: [_propose(snap, item) for item in items],
            "threads": lambda: solve_assignments(costs, thread_map),
            "sweep_threads": lambda: map_chunked(partial(_propose, snap), items, thread_map),
        }
        if ray_fed is not None:
            if sum(c.nbytes for c in costs) <= 1 << 30:  # shipping > 1 GiB of matrices through the object store: skipped
                fns["ray"] = lambda: solve_assignments(costs, ray_fed.parallel_map)
            fns["sweep_ray"] = lambda: map_chunked(partial(_propose, snap), items, ray_fed.parallel_map)
        times = {k: median(v) for k, v in interleaved_times(fns, repeats).items()}
        row = {
            "D": D,
            "L": L,
            "serial_s": times["serial"],
            "work_per_core_ms": 1000 * times["serial"] / cores,
            "serial_sweep_s": times["serial_sweep"],
            "sweep_work_per_core_ms": 1000 * times["serial_sweep"] / cores,
            "cost_build_s": build,
            "load": load,
            "load_after": os.getloadavg()[0],
        }
        for key in fns:
            if key.startswith("serial"):
                continue
            row[f"{key}_s"] = times[key]
            row[f"{key}_eff"] = times["serial"] / (cores * times[key])  # against the bare solve loop
            if key.startswith("sweep"):  # against the same step run serially: the parallel efficiency proper
                row[f"{key}_eff_same_work"] = times["serial_sweep"] / (cores * times[key])
        rows.append(row)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        fns.clear()
        costs = items = None  # free the matrices before the next cell is built
    return rows


def overhead(sizes, repeats: int) -> list[dict]:
    rows = []
    for L in sizes:
        rng = np.random.default_rng(L)
        globals_, locals_, snap = make_problem(1, L, rng)
        cost = augmented_cost(globals_, locals_[0], snap.lam, snap.counts)
        times = interleaved_times(
            {"scipy": lambda: linear_sum_assignment(cost), "rayfuse": lambda: solve_assignment(cost)},
            repeats if L < 1000 else max(3, repeats // 4),
        )
        raw, ours = median(times["scipy"]), median(times["rayfuse"])
        rows.append({"L": L, "scipy_ms": 1000 * raw, "rayfuse_ms": 1000 * ours, "overhead_pct": 100 * (ours / raw - 1)})
        print(rows[-1], flush=True)
    return rows


def gmm_problems(separations, seeds, n_init: int):
    from sklearn.mixture import BayesianGaussianMixture

    from rayfuse.data.gmm import generate_gmm_groups
    from rayfuse.expfam import normal_wishart_from_sklearn

    for s in separations:
        for seed in seeds:
            out = generate_gmm_groups(separation=s, local_sd=0.5, seed=seed)
            posteriors = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for X, atoms in zip(out["groups"], out["atoms"]):
                    model = BayesianGaussianMixture(
                        n_components=len(atoms),
                        covariance_type="full",
                        n_init=n_init,
                        weight_concentration_prior_type="dirichlet_distribution",
                        random_state=seed,
                    ).fit(X)
                    posteriors.append(normal_wishart_from_sklearn(model))
            yield s, seed, posteriors, out["global_means"]


def exact_vs_relaxed(separations, seeds, n_init: int, lam: float, repeats: int) -> list[dict]:
    rows = []
    for s, seed, posteriors, truth in gmm_problems(separations, seeds, n_init):
        results = {}
        fns = {
            solver: (lambda solver=solver: results.__setitem__(solver, fuse_heterogeneous(posteriors, lam=lam, solver=solver)))
            for solver in ("exact", "relaxed")
        }
        times = {k: median(v) for k, v in interleaved_times(fns, repeats, warmup=0).items()}
        row = {"separation": s, "seed": seed, "G": len(truth)}
        for solver, r in results.items():
            row[f"{solver}_s"] = times[solver]
            row[f"{solver}_hausdorff"] = hausdorff(r.globals.means(), truth)
            row[f"{solver}_G"] = r.num_globals
        row["speedup"] = times["relaxed"] / times["exact"]
        rows.append(row)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--cells", nargs="+", default=None, help="throughput cells as DxL (default: the issue's grid, 10-200 x 50-1000)")
    parser.add_argument(
        "--parts", type=int, nargs="+", default=[1, 2, 3], help="which measurements (1 throughput, 2 overhead, 3 exact vs relaxed)"
    )
    parser.add_argument("--lam", type=float, default=3.0, help="KL-fusion lambda for part 3 (jobs/kl_gmm.yaml's value)")
    parser.add_argument("--max-load", type=float, default=2.5, help="wait for the 1-minute load to drop below this before each cell")
    parser.add_argument("--quiet-timeout", type=float, default=120.0, help="seconds to wait for that at most")
    add_quick_arguments(parser, "two small throughput cells, one GMM problem", quick=False)
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    cores = os.cpu_count() or 1
    cells = [(10, 50), (50, 50), (200, 50), (10, 200), (50, 200), (200, 200), (10, 1000), (50, 1000), (200, 1000)]
    if args.quick:
        cells = [(10, 50), (10, 200)]
    if args.cells:
        cells = [tuple(int(v) for v in cell.split("x")) for cell in args.cells]
    ray_fed = None
    if not args.no_ray and 1 in args.parts:
        import ray

        from actors.federation import RayFederation
        from rayfuse.federation import EventLog, FailurePolicy

        ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
        ray_fed = RayFederation({}, FailurePolicy(), EventLog())
    info = machine_info()
    print("1. throughput (one sweep: D solves of L x 2L)")
    tp = throughput(cells, repeats, ray_fed, cores, (args.max_load, args.quiet_timeout)) if 1 in args.parts else []
    if ray_fed is not None:
        import ray

        ray.shutdown()
    print("2. wrapper overhead")
    ov = overhead([50, 200] if args.quick else [50, 200, 500, 1000], 10 if args.quick else 20) if 2 in args.parts else []
    print("3. exact vs relaxed on GMM problems")
    seeds = [100] if args.quick else [100, 101, 102]
    separations = [0.5] if args.quick else [0.15, 0.5, 1.0]
    er = exact_vs_relaxed(separations, seeds, 4 if args.quick else 16, args.lam, 1 if args.quick else 3) if 3 in args.parts else []
    cols = [
        ("D", "D"),
        ("L", "L"),
        ("load", "load"),
        ("serial_s", "solves s"),
        ("work_per_core_ms", "ms/core"),
        ("sweep_work_per_core_ms", "sweep ms/core"),
        ("threads_eff", "eff threads"),
        ("ray_eff", "eff ray"),
        ("sweep_threads_eff_same_work", "eff sweep thr"),
        ("sweep_ray_eff_same_work", "eff sweep ray"),
        ("sweep_ray_eff", "eff sweep ray vs solves"),
    ]
    print_table(tp, cols, f"throughput on {cores} cores (efficiency = serial / (cores x wall))")
    print_table(
        ov, [("L", "L"), ("scipy_ms", "scipy ms"), ("rayfuse_ms", "wrapper ms"), ("overhead_pct", "overhead %")], "wrapper overhead"
    )
    print_table(
        er,
        [
            ("separation", "s"),
            ("seed", "seed"),
            ("G", "G"),
            ("exact_s", "exact s"),
            ("relaxed_s", "relaxed s"),
            ("speedup", "speedup"),
            ("exact_hausdorff", "H exact"),
            ("relaxed_hausdorff", "H relaxed"),
            ("exact_G", "G exact"),
            ("relaxed_G", "G relaxed"),
        ],
        "exact (default) vs relaxed P-step",
    )
    summary = (
        {
            "median_speedup": median([r["speedup"] for r in er]),
            "mean_hausdorff_exact": float(np.mean([r["exact_hausdorff"] for r in er])),
            "mean_hausdorff_relaxed": float(np.mean([r["relaxed_hausdorff"] for r in er])),
        }
        if er
        else {}
    )
    print(summary)
    path = write_results(
        "kl_bench" if args.parts == [1, 2, 3] else "kl_bench_parts" + "".join(map(str, args.parts)),
        {
            "machine": info,
            "quick": args.quick,
            "lam": args.lam,
            "throughput": tp,
            "overhead": ov,
            "exact_vs_relaxed": er,
            "summary": summary,
        },
        out_dir(args.out, args.quick),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
