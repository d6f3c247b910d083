"""Wall time of N-way weight matching on resnet18-sized models: N = 2, 4, 8, 16.

The N models are one random base resnet18 (torchvision, ``weights=None``; BatchNorm affine parameters and running
statistics drawn at random so that every tensor matters), each copy with its channels randomly permuted (a function-
preserving permutation of every residual stream and every block's inner channels, :func:`resnet18_permutation_axes`)
plus Gaussian noise (``--noise`` times each tensor's standard deviation). A matcher that recovers the permutations
brings every copy back onto one base, so its merged model keeps the base's weight norms; a failed matching averages
N unrelated permutations and shrinks them (about 1/sqrt(N) for N independent copies). ``norm_ratio`` is the merged
model's conv / linear weight norm over the mean norm of the inputs' (1.0: aligned).

Measured now: rebasin's MergeMany (``rebasin_runner.py`` with the rebasin virtualenv's Python, in a subprocess, on
``--threads`` torch threads; ``seconds`` is rebasin's own wall time, excluding process start and reading the
checkpoints). rayfuse's weight matching (``rayfuse.alignment.weight_matching``, MergeMany too, on the spec
``rayfuse.symmetry.derive_spec`` derives from the same resnet18, checked against :func:`resnet18_permutation_axes`)
with the serial executor (``rayfuse_wm_serial``) and with threads (``rayfuse_wm_threads``).

Usage (project virtualenv, repository root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/aligned/speed.py [--models 2 4 8 16] [--threads 1] [--noise 0.01]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/aligned/speed.py --quick   # N = 2, every matcher, to a temporary folder

Writes ``benchmarks/results/aligned_speed.json`` and ``docs/results/aligned/speed.md`` (``--quick`` or ``--out DIR``:
both to that folder). Without the rebasin environment its rows are left out, with a printed line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _common import add_quick_arguments, machine_info, out_dir, print_table, write_results  # noqa: E402
from accuracy import OUT_DIR, REBASIN_PYTHON, run_rebasin  # noqa: E402
from arch import build_arch, write_arch_spec  # noqa: E402

from rayfuse.io import load_params, save_params  # noqa: E402

SPEC: dict[str, Any] = {"arch": "resnet18", "kwargs": {}, "input_shape": [3, 32, 32], "num_classes": 10}
Axes = dict[str, list[tuple[str, int]]]  # permutation name -> the (state-dict key, axis) it permutes


def resnet18_permutation_axes(state: Mapping[str, Any]) -> Axes:
    """The permutation groups of torchvision's resnet18 state dict: one residual stream per stage (the stem, every
    block's second conv and BatchNorm and the stage's 1x1 downsample write it; the next stage's first block, its
    downsample and the head read it) and one inner group per block (conv1 + bn1 out, conv2 in)."""
    axes: Axes = {}

    def add(group: str, key: str, axis: int) -> None:
        axes.setdefault(group, []).append((key, axis))

    def stream_name(stage: int) -> str:
        return "stage0" if stage <= 1 else f"stage{stage}"  # layer1 keeps the stem's 64 channels: one stream

    bn_keys = ("weight", "bias", "running_mean", "running_var")
    add("stage0", "conv1.weight", 0)
    for k in bn_keys:
        add("stage0", f"bn1.{k}", 0)
    for stage in range(1, 5):
        stream, previous = stream_name(stage), stream_name(stage - 1)
        for block in (0, 1):
            prefix = f"layer{stage}.{block}"
            inner = f"{prefix}.inner"
            add(previous if block == 0 else stream, f"{prefix}.conv1.weight", 1)
            add(inner, f"{prefix}.conv1.weight", 0)
            for k in bn_keys:
                add(inner, f"{prefix}.bn1.{k}", 0)
            add(inner, f"{prefix}.conv2.weight", 1)
            add(stream, f"{prefix}.conv2.weight", 0)
            for k in bn_keys:
                add(stream, f"{prefix}.bn2.{k}", 0)
            if f"{prefix}.downsample.0.weight" in state:
                add(stream, f"{prefix}.downsample.0.weight", 0)
                add(previous, f"{prefix}.downsample.0.weight", 1)
                for k in bn_keys:
                    add(stream, f"{prefix}.downsample.1.{k}", 0)
    add("stage4", "fc.weight", 1)
    return axes


def permute_state(state: Mapping[str, np.ndarray], axes: Axes, perms: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``state`` with every group's axes reindexed by its permutation."""
    out = {k: np.array(v, copy=True) for k, v in state.items()}
    for group, entries in axes.items():
        for key, axis in entries:
            out[key] = np.take(out[key], perms[group], axis=axis)
    return out


def make_models(n: int, *, noise: float, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], Axes]:
    """A random base resnet18 and ``n`` noisy, randomly permuted copies of it (the first one unpermuted)."""
    rng = np.random.default_rng(seed)
    model = build_arch(SPEC, seed=seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
                assert m.running_mean is not None and m.running_var is not None  # track_running_stats (the default)
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    base = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    axes = resnet18_permutation_axes(base)
    sizes = {g: base[entries[0][0]].shape[entries[0][1]] for g, entries in axes.items()}
    models = []
    for i in range(n):
        perms = {g: (np.arange(size) if i == 0 else rng.permutation(size)) for g, size in sizes.items()}
        permuted = permute_state(base, axes, perms)
        for k, v in permuted.items():
            if np.issubdtype(v.dtype, np.floating) and not k.endswith("running_var"):
                permuted[k] = (v + noise * float(v.std()) * rng.standard_normal(v.shape)).astype(v.dtype)
        models.append(permuted)
    return models, axes


def norm_ratio(merged: Mapping[str, np.ndarray], models: Sequence[Mapping[str, np.ndarray]]) -> float:
    """Norm of the merged conv / linear weights over the inputs' mean norm (1.0: the models were aligned)."""
    keys = [k for k, v in merged.items() if k.endswith("weight") and v.ndim >= 2]
    norm = lambda s: float(np.sqrt(sum(float(np.sum(np.square(s[k], dtype=np.float64))) for k in keys)))  # noqa: E731
    return norm(merged) / float(np.mean([norm(m) for m in models]))


def time_rebasin(models: Sequence[Mapping[str, np.ndarray]], folder: Path, *, threads: int) -> dict[str, Any]:
    """rebasin's MergeMany on ``models`` (written to ``folder``); its wall time and the merged model's norm ratio."""
    checkpoints = folder / "checkpoints"
    checkpoints.mkdir()
    for i, params in enumerate(models):
        save_params(checkpoints / f"model_{i:02d}.safetensors", params)
    write_arch_spec(folder / "arch.json", SPEC)
    result = run_rebasin(checkpoints, folder / "arch.json", folder / "out", modes=("mergemany",), threads=threads)
    run = result["mergemany"]
    if not run.get("ok"):
        return {"seconds": float("nan"), "error": run.get("error")}
    merged = load_params(folder / "out" / run["file"])
    return {"seconds": float(run["seconds"]), "norm_ratio": norm_ratio(merged, models), "rebasin": result["rebasin"]}


def derive_resnet18_spec() -> Any:
    """rayfuse's permutation spec of the benchmark's resnet18, derived from its graph (``rayfuse.symmetry.derive_spec``)."""
    from rayfuse.symmetry import derive_spec

    return derive_spec(build_arch(SPEC), torch.zeros((2, *SPEC["input_shape"])))


def compare_spec_with_axes(spec: Any, axes: Axes) -> list[str]:
    """The differences between a derived spec's groups and the hand-written :func:`resnet18_permutation_axes` (each
    group as the set of its (key, axis) pairs; empty list: the same partition of the weight axes)."""
    derived = {frozenset((a.key, a.dim) for a in g.axes) for g in spec.groups}
    written = {frozenset(entries) for entries in axes.values()}
    problems = [f"derived only: {sorted(g)[:3]}..." for g in derived - written]
    problems += [f"hand-written only: {sorted(g)[:3]}..." for g in written - derived]
    for g in spec.groups:
        for a in g.axes:
            if (a.start, a.outer, a.inner) != (0, 1, 1):
                problems.append(f"{g.name}: partial axis {a}")
    return problems


def time_rayfuse(models: Sequence[Mapping[str, np.ndarray]], folder: Path, *, threads: int, executor: str) -> dict[str, Any]:
    """rayfuse's N-way weight matching (``rayfuse.alignment.weight_matching``, MergeMany) with the derived spec and
    ``executor`` (``serial``: :func:`rayfuse.matching.serial_map`; ``threads``: :func:`rayfuse.matching.thread_map`),
    then ``merge_average``. ``seconds``: matching + merge (the spec is derived beforehand, untimed)."""
    from rayfuse.alignment import apply_alignment, merge_average, weight_matching
    from rayfuse.matching import serial_map, thread_map

    spec = derive_resnet18_spec()
    run = {"serial": serial_map, "threads": thread_map}.get(executor) or _ray_parallel_map()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        alignment = weight_matching(models, spec, executor=run)
        merged = merge_average(apply_alignment(models, spec, alignment))
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(before)
    return {"seconds": seconds, "norm_ratio": norm_ratio(merged, models), "sweeps": alignment.sweeps, "converged": alignment.converged}


def time_rayfuse_serial(models: Sequence[Mapping[str, np.ndarray]], folder: Path, *, threads: int) -> dict[str, Any]:
    """:func:`time_rayfuse` with the serial executor."""
    return time_rayfuse(models, folder, threads=threads, executor="serial")


def time_rayfuse_threads(models: Sequence[Mapping[str, np.ndarray]], folder: Path, *, threads: int) -> dict[str, Any]:
    """:func:`time_rayfuse` with the thread-pool executor (one thread per model of a sweep, up to the CPUs)."""
    return time_rayfuse(models, folder, threads=threads, executor="threads")


def time_rayfuse_ray(models: Sequence[Mapping[str, np.ndarray]], folder: Path, *, threads: int) -> dict[str, Any]:
    """:func:`time_rayfuse` with the federation's executor on a local Ray (``RayFederation.parallel_map``: each sweep's
    N alignments as batched Ray tasks of one CPU each), the path the ``aligned`` method takes on a cluster. Ray is
    started once, before the clock (its start is not the matcher's time)."""
    return time_rayfuse(models, folder, threads=threads, executor="ray")


_RAY_MAP: list[Any] = []


def _ray_parallel_map() -> Any:
    """A local Ray (all this machine's CPUs) and a ``RayFederation`` without clients; its ``parallel_map``."""
    if not _RAY_MAP:
        import ray

        from actors.federation import RayFederation
        from rayfuse.federation import EventLog, FailurePolicy

        if not ray.is_initialized():
            ray.init(
                address="local",
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
            )
        _RAY_MAP.append(RayFederation({}, FailurePolicy(), EventLog(), task_cpus=1.0).parallel_map)
    return _RAY_MAP[0]


# N-way matchers timed on the same models: name -> (models, scratch folder, threads) -> {"seconds", "norm_ratio", ...}.
MATCHERS: dict[str, Callable[..., dict[str, Any]]] = {
    "rebasin_mergemany": time_rebasin,
    "rayfuse_wm_serial": time_rayfuse_serial,
    "rayfuse_wm_threads": time_rayfuse_threads,
    "rayfuse_wm_ray": time_rayfuse_ray,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", type=int, default=None, help="N, the number of models merged (default 2 4 8 16; --quick 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every matcher")
    parser.add_argument("--noise", type=float, default=0.01, help="noise added to each copy, in units of each tensor's std")
    parser.add_argument("--matchers", nargs="+", default=list(MATCHERS), choices=list(MATCHERS))
    add_quick_arguments(parser, "N = 2, every matcher", out=False)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder of speed.md (default docs/results/aligned; the raw rows go there too)"
    )
    parser.add_argument(
        "--rebasin-max-models",
        type=int,
        default=4,
        help="run rebasin only up to this N (its N=4 takes minutes on one thread); larger N: a 'not run' row",
    )
    args = parser.parse_args()
    raw_dir = None if args.out is None and not args.quick else out_dir(args.out, args.quick)
    args.out = raw_dir or OUT_DIR
    if args.models is None:
        args.models = [2] if args.quick else [2, 4, 8, 16]
    if "rebasin_mergemany" in args.matchers and not REBASIN_PYTHON.exists():
        print(f"rebasin not run: no rebasin environment at {REBASIN_PYTHON} (benchmarks/README.md, 'Aligned fusion')", flush=True)
        args.matchers = [m for m in args.matchers if m != "rebasin_mergemany"]

    info = machine_info()
    spec_check = compare_spec_with_axes(derive_resnet18_spec(), resnet18_permutation_axes(make_models(1, noise=0.0)[0][0]))
    print("derived resnet18 spec vs resnet18_permutation_axes: " + ("same groups" if not spec_check else "; ".join(spec_check)), flush=True)
    rows = []
    for n in args.models:
        models, _ = make_models(n, noise=args.noise)
        for name in args.matchers:
            if name == "rebasin_mergemany" and n > args.rebasin_max_models:
                rows.append(
                    {
                        "models": n,
                        "matcher": name,
                        "seconds": float("nan"),
                        "total_s": float("nan"),
                        "error": f"not run (N > --rebasin-max-models {args.rebasin_max_models})",
                    }
                )
                print(f"N={n:3d} {name}: not run", flush=True)
                continue
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix=f"speed-{name}-") as tmp:
                result = MATCHERS[name](models, Path(tmp), threads=args.threads)
            row = {"models": n, "matcher": name, **result, "total_s": time.perf_counter() - started}
            rows.append(row)
            print(
                f"N={n:3d} {name}: {row['seconds']:.2f} s, norm ratio {row.get('norm_ratio', float('nan')):.3f}"
                + (f" ({row['error']})" if row.get("error") else ""),
                flush=True,
            )
    columns = [
        ("models", "N"),
        ("matcher", "matcher"),
        ("seconds", "seconds"),
        ("norm_ratio", "norm ratio"),
        ("total_s", "with process + I/O s"),
    ]
    print_table(rows, columns, f"N-way weight matching of resnet18s, {args.threads} torch thread(s)")
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Aligned fusion: N-way matching time on resnet18",
        "",
        f"{args.threads} torch thread(s), {info['cpus']} CPUs ({info.get('cpu_model', '')}), load {info['load_avg_1m']:.2f}; "
        f"copies = a random base permuted + noise {args.noise} std. `seconds`: the matcher's own wall time; "
        "`norm ratio`: merged weight norm over the inputs' (1.0: aligned). Produced by `benchmarks/aligned/speed.py`.",
        "",
        "The spec rayfuse derives from resnet18's graph has the same groups as the hand-written "
        "`resnet18_permutation_axes`: " + ("yes." if not spec_check else "no: " + "; ".join(spec_check)),
        "",
        "`parallel efficiency`: the serial time over (CPUs x this time), for the thread and Ray-task executors.",
        "",
        "| N | matcher | seconds | norm ratio | x rebasin time | parallel efficiency |",
        "|---|---|---|---|---|---|",
    ]
    reference = {r["models"]: r["seconds"] for r in rows if r["matcher"] == "rebasin_mergemany" and r["seconds"] == r["seconds"]}
    serial = {r["models"]: r["seconds"] for r in rows if r["matcher"] == "rayfuse_wm_serial"}
    for r in rows:
        ratio = f"{r['seconds'] / reference[r['models']]:.3f}" if r["models"] in reference and r["seconds"] == r["seconds"] else ""
        parallel = r["matcher"] in ("rayfuse_wm_threads", "rayfuse_wm_ray") and r["models"] in serial and r["seconds"] == r["seconds"]
        width = min(int(info["cpus"]), int(r["models"]))  # a sweep has N independent alignments
        efficiency = f"{serial[r['models']] / (width * r['seconds']):.2f}" if parallel else ""
        if r.get("error"):
            lines.append(f"| {r['models']} | {r['matcher']} | {r['error']} | | | |")
        else:
            lines.append(
                f"| {r['models']} | {r['matcher']} | {r['seconds']:.2f} | {r.get('norm_ratio', float('nan')):.3f} | {ratio} | "
                f"{efficiency} |"
            )
    md = args.out / "speed.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    raw = write_results(
        "aligned_speed", {"machine": info, "threads": args.threads, "noise": args.noise, "spec_check": spec_check, "rows": rows}, raw_dir
    )
    print(f"wrote {md}\nwrote {raw}")


if __name__ == "__main__":
    main()
