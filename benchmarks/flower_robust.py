"""Flower's robust aggregation functions on arrays written by ``compare_flower_robust.py``.

Run with the Python of the separate Flower environment (it imports nothing from rayfuse)::

    benchmarks/.flwr-venv/bin/python benchmarks/flower_robust.py IN.npz OUT.npz [--repeats 3] [--f 1] [--m 3] [--beta 0.2 ...]
                                                                 [--clip-norm C]

``IN.npz`` holds ``client<k>/layer<i>`` arrays and ``num_examples`` (and ``reference/layer<i>``, the global model,
for ``--clip-norm``: each client's update clipped by the DP wrappers' ``compute_clip_model_update``, then
``aggregate``). Several ``--beta``: one ``trimmed_mean_<beta>`` rule each. Each aggregator of
``flwr.server.strategy.aggregate`` runs ``--repeats`` times after one untimed run; ``OUT.npz`` gets each result as
``<rule>/layer<i>`` and the last line of the output is a JSON object of the median seconds per rule and Flower's
version.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no network here; set before flwr is imported

import flwr
import numpy as np
from flwr.server.strategy.aggregate import aggregate, aggregate_bulyan, aggregate_krum, aggregate_median, aggregate_trimmed_avg


def clip_update(params: list, reference: list, clip_norm: float) -> list:
    """A copy of ``params`` with its update from ``reference`` clipped by Flower's ``compute_clip_model_update``."""
    try:
        from flwr.common.differential_privacy import compute_clip_model_update
    except ImportError:  # flwr >= 1.2x moved the DP helpers
        from flwr.supercore.differential_privacy import compute_clip_model_update
    out = [np.array(a, copy=True) for a in params]
    compute_clip_model_update(out, reference, clip_norm)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs")
    parser.add_argument("outputs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--f", type=int, default=1)
    parser.add_argument("--m", type=int, default=3)
    parser.add_argument("--beta", type=float, nargs="+", default=[0.2])
    parser.add_argument("--clip-norm", type=float, default=None)
    args = parser.parse_args()
    data = np.load(args.inputs)
    counts = [int(c) for c in data["num_examples"]]
    layers = sorted({k.split("/")[1] for k in data.files if k.startswith("client")}, key=lambda s: int(s[5:]))
    results = [([data[f"client{c}/{layer}"] for layer in layers], counts[c]) for c in range(len(counts))]
    rules = {
        "mean": lambda: aggregate(results),
        "median": lambda: aggregate_median(results),
        "krum": lambda: aggregate_krum(results, args.f, 0),
        "multi_krum": lambda: aggregate_krum(results, args.f, args.m),
        "bulyan": lambda: aggregate_bulyan(list(results), args.f, aggregate_krum, to_keep=0),
    }
    trims = {"trimmed_mean": args.beta[0]} if len(args.beta) == 1 else {f"trimmed_mean_{b:g}": b for b in args.beta}
    rules.update({name: (lambda b=b: aggregate_trimmed_avg(results, b)) for name, b in trims.items()})
    if args.clip_norm is not None:
        reference = [data[f"reference/{layer}"] for layer in layers]
        rules["mean_clip"] = lambda: aggregate([(clip_update(params, reference, args.clip_norm), n) for params, n in results])
    out, seconds = {}, {}
    for name, rule in rules.items():
        value = rule()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            rule()
            times.append(time.perf_counter() - start)
        seconds[name] = float(np.median(times))
        out.update({f"{name}/{layer}": np.asarray(a) for layer, a in zip(layers, value)})
    np.savez(args.outputs, **out)
    print(json.dumps({"flwr": flwr.__version__, "seconds": seconds}))


if __name__ == "__main__":
    main()
