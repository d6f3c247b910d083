"""Throughput of the aggregation kernel (``rayfuse.updates.aggregate``) against copying the same bytes.

For each case (K client parameter dicts of a given layout) it measures, in interleaved passes:

* ``weighted_average``: the full API (normalises weights, allocates the outputs, rounds integer buffers);
* ``weighted_sum``: the raw kernel, key by key, into preallocated outputs;
* ``np.copyto``: copying all K input dicts into preallocated destinations (the reference: a kernel that reads every
  input byte once should be at least this fast, since copying reads *and* writes every byte);
* two naive references: the loop ``out += w * a`` and ``np.average(np.stack(arrays), axis=0, weights=w)``.

Throughput is GB/s of *input bytes read* (K x dict size / median time), with BLAS on one thread. Before timing, the
result of ``weighted_average`` is checked against ``np.average`` (rtol 1e-5), so a fast but wrong kernel cannot pass.
A sweep over the ``chunk=`` argument of ``weighted_sum`` shows which chunk size is best on this machine.

Usage::

    python benchmarks/bench_aggregate.py [--repeats 7] [--quick]

Writes ``benchmarks/results/bench_aggregate.json`` (``--out``; ``--quick``: small cases, to a temporary folder).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from _common import add_quick_arguments, interleaved_times, machine_info, median, out_dir, print_table, wait_for_quiet, write_results
from threadpoolctl import threadpool_limits

from rayfuse.updates.aggregate import CHUNK, normalize_weights, weighted_average, weighted_sum

Layout = dict[str, tuple[tuple[int, ...], np.dtype]]

CHUNK_SWEEP = [1 << p for p in range(12, 21)]  # 4 Ki .. 1 Mi elements


@dataclass(frozen=True)
class Case:
    """K clients, each sending a parameter dict with this layout."""

    name: str
    clients: int
    layout: Layout
    sweep_chunks: bool = False

    @property
    def dict_bytes(self) -> int:
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.layout.values())

    @property
    def input_bytes(self) -> int:
        return self.clients * self.dict_bytes


def _flat(n: int) -> Layout:
    return {"w": ((n,), np.dtype(np.float32))}


def _model_layout(name: str, input_shape: tuple[int, ...], **model_options: object) -> Layout:
    """Keys, shapes and dtypes of a rayfuse model's parameter dict (buffers included)."""
    from rayfuse.config import ModelConfig
    from rayfuse.models import build_model

    state = build_model(ModelConfig(name=name, **model_options), input_shape, 10).state_dict()
    return {k: (tuple(v.shape), np.dtype(str(v.dtype).removeprefix("torch."))) for k, v in state.items()}


def make_cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("4 x 1M f32 (4 MB)", 4, _flat(1_000_000), sweep_chunks=True), Case("20 x 100k f32 (400 KB)", 20, _flat(100_000))]
    return [
        Case("20 x 10M f32 (40 MB)", 20, _flat(10_000_000), sweep_chunks=True),
        Case("10 x 25M f32 (100 MB)", 10, _flat(25_000_000), sweep_chunks=True),
        Case("100 x 100k f32 (400 KB)", 100, _flat(100_000), sweep_chunks=True),
        Case("10 x resnet18 dict (122 tensors, 45 MB)", 10, _model_layout("torchvision:resnet18", (3, 32, 32))),
        Case("100 x mlp dict (6 tensors, 0.94 MB)", 100, _model_layout("mlp", (784,), hidden=[256, 128])),
    ]


def make_inputs(case: Case, rng: np.random.Generator) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    """K parameter dicts and sample-count weights.

    Float values are drawn from [0.5, 1.5) so sums do not cancel and a relative tolerance is meaningful; integer
    buffers (BatchNorm step counters) are equal across clients, as they are when clients train the same steps.
    """
    params = []
    for _ in range(case.clients):
        d = {}
        for key, (shape, dtype) in case.layout.items():
            if dtype.kind == "f":
                d[key] = rng.uniform(0.5, 1.5, size=shape).astype(dtype)
            else:
                d[key] = np.full(shape, 100, dtype=dtype)
        params.append(d)
    weights = rng.integers(100, 1000, size=case.clients).astype(float).tolist()
    return params, weights


def check_correct(params: list[dict[str, np.ndarray]], weights: list[float]) -> None:
    """Raise unless ``weighted_average`` equals ``np.average`` (rtol 1e-5) for every key."""
    for name, got in [("weighted_average", weighted_average(params, weights))]:
        for key in params[0]:
            stacked = np.stack([p[key] for p in params])
            expected = np.average(stacked, axis=0, weights=weights)
            if stacked.dtype.kind != "f":
                expected = np.rint(expected)
            np.testing.assert_allclose(got[key], expected, rtol=1e-5, atol=0, err_msg=f"{name} differs from np.average for {key!r}")
            if got[key].dtype != params[0][key].dtype:
                raise AssertionError(f"{name}, {key!r}: dtype {got[key].dtype}, expected {params[0][key].dtype}")


def _functions(params: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, Callable[[], object]]:
    keys = list(params[0])
    columns = {k: [p[k] for p in params] for k in keys}
    w = normalize_weights(weights, len(params))
    copies = [{k: np.empty_like(v) for k, v in p.items()} for p in params]
    sums = {k: np.empty(params[0][k].shape, np.float64 if params[0][k].dtype.kind != "f" else params[0][k].dtype) for k in keys}

    def copyto() -> None:
        for src, dst in zip(params, copies):
            for k in keys:
                np.copyto(dst[k], src[k])

    def raw_sum() -> None:
        for k in keys:
            weighted_sum(columns[k], w, out=sums[k])

    def loop() -> dict[str, np.ndarray]:
        out = {}
        for k in keys:
            acc = np.zeros_like(sums[k])
            for a, wk in zip(columns[k], w):
                acc += wk * a
            out[k] = acc
        return out

    def stack_average() -> dict[str, np.ndarray]:
        return {k: np.average(np.stack(columns[k]), axis=0, weights=w) for k in keys}

    return {
        "np.copyto": copyto,
        "weighted_average": lambda: weighted_average(params, weights),
        "weighted_sum": raw_sum,
        "loop out += w*a": loop,
        "np.average(stack)": stack_average,
    }


def bench_case(case: Case, repeats: int, rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    params, weights = make_inputs(case, rng)
    check_correct(params, weights)
    times = interleaved_times(_functions(params, weights), repeats)
    copy_s = median(times["np.copyto"])
    rows = []
    for method, ts in times.items():
        t = median(ts)
        rows.append(
            {
                "case": case.name,
                "method": method,
                "median_ms": 1e3 * t,
                "gb_s": case.input_bytes / t / 1e9,
                "vs_copyto": copy_s / t,
                "times_s": ts,
            }
        )
    sweep = []
    if case.sweep_chunks:
        w = normalize_weights(weights, len(params))
        columns = [p["w"] for p in params]
        out = np.empty_like(columns[0])
        fns = {chunk: (lambda c=chunk: weighted_sum(columns, w, out=out, chunk=c)) for chunk in CHUNK_SWEEP}
        fns["np.copyto"] = _functions(params, weights)["np.copyto"]
        chunk_times = interleaved_times(fns, repeats)
        copy_s = median(chunk_times.pop("np.copyto"))
        for chunk, ts in chunk_times.items():
            t = median(ts)
            sweep.append(
                {
                    "case": case.name,
                    "chunk": chunk,
                    "chunk_kib_f32": chunk * 4 // 1024,
                    "median_ms": 1e3 * t,
                    "gb_s": case.input_bytes / t / 1e9,
                    "vs_copyto": copy_s / t,
                    "current": chunk == CHUNK,
                }
            )
    del params
    gc.collect()
    return rows, sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per case (medians are reported)")
    parser.add_argument("--quick", action="store_true", help="small cases only (a smoke run)")
    parser.add_argument("--max-load", type=float, default=1.0, help="before each case, wait for the 1-min load average to drop below this")
    parser.add_argument("--quiet-timeout", type=float, default=60.0, help="... for at most this many seconds")
    add_quick_arguments(parser, "small cases", quick=False)
    args = parser.parse_args()

    threadpool_limits(limits=1, user_api="blas")  # every kernel here runs on one thread, as rayfuse's does
    rng = np.random.default_rng(0)
    info = machine_info()
    print(
        f"aggregation kernel throughput ({info['cpus']} CPUs, {info['cpu_model']}, numpy {info['numpy']}); "
        f"GB/s of input bytes read, median of {args.repeats}; CHUNK = {CHUNK}"
    )
    rows, sweep = [], []
    for case in make_cases(args.quick):
        load = wait_for_quiet(args.max_load, args.quiet_timeout)
        print(f"  {case.name}: {case.input_bytes / 1e6:.0f} MB of input (load average {load:.1f}) ...", flush=True)
        case_rows, case_sweep = bench_case(case, args.repeats, rng)
        for row in case_rows + case_sweep:
            row["load_avg_1m"] = load
        rows += case_rows
        sweep += case_sweep

    columns = [("case", "case"), ("method", "method"), ("median_ms", "median ms"), ("gb_s", "GB/s"), ("vs_copyto", "x copyto")]
    print_table(rows, columns, "throughput (weighted_average checked against np.average, rtol 1e-5)")
    targets = []
    for case in {r["case"]: None for r in rows}:
        by = {r["method"]: r for r in rows if r["case"] == case}
        for method in ("weighted_average", "weighted_sum"):
            targets.append(
                {"case": case, "method": method, "vs_copyto": by[method]["vs_copyto"], "target_met": by[method]["vs_copyto"] >= 1.0}
            )
    print_table(
        targets,
        [("case", "case"), ("method", "kernel"), ("vs_copyto", "x copyto"), ("target_met", "kernel >= copyto")],
        "target: kernel throughput >= np.copyto on the same bytes",
    )

    best = {}
    if sweep:
        print_table(
            sweep,
            [
                ("case", "case"),
                ("chunk", "chunk"),
                ("chunk_kib_f32", "KiB/f32 chunk"),
                ("median_ms", "median ms"),
                ("gb_s", "GB/s"),
                ("vs_copyto", "x copyto"),
                ("current", "current CHUNK"),
            ],
            "weighted_sum chunk sweep (elements per chunk)",
        )
        for case in {r["case"]: None for r in sweep}:
            case_rows = [r for r in sweep if r["case"] == case]
            fastest = max(case_rows, key=lambda r: r["gb_s"])
            current = next(r for r in case_rows if r["current"])
            best[case] = {
                "best_chunk": fastest["chunk"],
                "best_gb_s": fastest["gb_s"],
                "current_chunk": CHUNK,
                "current_gb_s": current["gb_s"],
                "speedup_vs_current": fastest["gb_s"] / current["gb_s"],
            }
            print(
                f"  {case}: best chunk {fastest['chunk']} ({fastest['gb_s']:.2f} GB/s) vs current {CHUNK} "
                f"({current['gb_s']:.2f} GB/s): x{best[case]['speedup_vs_current']:.2f}"
            )

    path = write_results(
        "bench_aggregate",
        {
            "machine": info,
            "repeats": args.repeats,
            "chunk": CHUNK,
            "rows": rows,
            "targets": targets,
            "chunk_sweep": sweep,
            "best_chunk": best,
        },
        out_dir(args.out, args.quick),
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
