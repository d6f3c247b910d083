"""Flower's robust aggregation functions on arrays written by ``compare_flower_robust.py``.

Run with the Python of the separate Flower environment (it imports nothing from rayfuse)::

    benchmarks/.flwr-venv/bin/python benchmarks/flower_robust.py IN.npz OUT.npz [--repeats 3] [--f 1] [--m 3] [--beta 0.2]

``IN.npz`` holds ``client<k>/layer<i>`` arrays and ``num_examples``. Each aggregator of
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs")
    parser.add_argument("outputs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--f", type=int, default=1)
    parser.add_argument("--m", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.2)
    args = parser.parse_args()
    data = np.load(args.inputs)
    counts = [int(c) for c in data["num_examples"]]
    layers = sorted({k.split("/")[1] for k in data.files if k.startswith("client")}, key=lambda s: int(s[5:]))
    results = [([data[f"client{c}/{layer}"] for layer in layers], counts[c]) for c in range(len(counts))]
    rules = {
        "mean": lambda: aggregate(results),
        "median": lambda: aggregate_median(results),
        "trimmed_mean": lambda: aggregate_trimmed_avg(results, args.beta),
        "krum": lambda: aggregate_krum(results, args.f, 0),
        "multi_krum": lambda: aggregate_krum(results, args.f, args.m),
        "bulyan": lambda: aggregate_bulyan(list(results), args.f, aggregate_krum, to_keep=0),
    }
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
