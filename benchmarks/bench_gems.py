"""GEMS ball construction: batched evaluation of the sampled models against a one-model-at-a-time loop.

The reference code [GEMS: utils/convex_sampling.py, utils/neuron_act_sampling.py] evaluates the ``p`` models sampled
at one radius one at a time (a Keras ``evaluate`` per sample, stopping at the first failure) and searches one neuron
after the other. rayfuse evaluates all ``p`` samples of every neuron still being searched as one ``einsum``. Both
variants run here on the same client data, with the same random draws, so they find the same radii; the loop uses
numpy per model (far faster than a Keras call per model, so the ratio is conservative).

Cells: one client of the K = 5 label-disjoint digits split (labels {0, 1}):
* ``convex``: the softmax-regression ellipsoid (p = 500, R_max = 4000, Delta = 0.1, epsilon = 0.4);
* ``neurons``: the 50 hidden neurons of a 64-50-10 MLP (p = 500, R_max = 4000, Delta = 1.0, epsilon_j = 1.0).

k-means: GEMS uses scikit-learn's ``KMeans`` directly (allowed by the issue); its time on the K x H neurons is shown.

Usage: ``python benchmarks/bench_gems.py [--quick]``; writes ``benchmarks/results/bench_gems.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayfuse.fusion.gems_balls import (  # noqa: E402
    cluster_neurons, compute_fisher, ellipsoid_axes, flatten_linear, neuron_distance, search_radii, softmax_accuracy,
)
from rayfuse.models import get_params, train_model  # noqa: E402
from rayfuse.models.registry import MLP, LogisticRegression  # noqa: E402

from _common import machine_info, print_table, write_results  # noqa: E402


def client_data(labels=(0, 1), seed=0):
    from sklearn.datasets import load_digits

    d = load_digits()
    X = (d.data / 16.0).astype(np.float32)
    keep = np.isin(d.target, labels)
    X, y = X[keep], d.target[keep].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = int(0.15 * len(y))
    return X[order[n_val:]], y[order[n_val:]], X[order[:n_val]], y[order[:n_val]]


def loop_passes_softmax(X, y, C, epsilon):
    D = X.shape[1]

    def passes(samples, ids):
        out = np.zeros(samples.shape[:2], dtype=bool)
        for b in range(samples.shape[0]):
            for s in range(samples.shape[1]):  # one model at a time, stop at the first failure (the reference)
                w = samples[b, s]
                acc = np.mean((X @ w[: C * D].reshape(C, D).T + w[C * D:]).argmax(1) == y)
                if acc < epsilon:
                    break
                out[b, s] = True
        return out

    return passes


def loop_passes_neurons(X, targets, epsilon):
    def passes(samples, ids):
        out = np.zeros(samples.shape[:2], dtype=bool)
        for b, neuron in enumerate(ids):  # one neuron, then one sample, at a time
            for s in range(samples.shape[1]):
                w = samples[b, s]
                if np.linalg.norm(np.maximum(X @ w[:-1] + w[-1], 0) - targets[:, neuron]) / len(X) > epsilon:
                    break
                out[b, s] = True
        return out

    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p = 100 instead of 500")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    p = 100 if args.quick else 500
    torch.set_num_threads(1)  # both variants on one core: the ratio is the batching, not the thread count
    Xtr, ytr, Xval, yval = client_data()
    C = 10

    torch.manual_seed(0)
    logreg = LogisticRegression(64, C)
    train_model(logreg, Xtr, ytr, epochs=20, batch_size=32, lr=0.005, seed=0)
    params = get_params(logreg)
    W, b = params["linear.weight"], params["linear.bias"]
    center = flatten_linear(W, b)[None, :]
    axes = ellipsoid_axes(compute_fisher(W, b, Xval, 200, np.random.default_rng(0)), 0.1)[None, :]

    torch.manual_seed(0)
    mlp = MLP(64, [50], C)
    train_model(mlp, Xtr, ytr, epochs=20, batch_size=32, lr=0.005, seed=0)
    mp = get_params(mlp)
    neurons = np.concatenate([mp["layers.0.weight"], mp["layers.0.bias"][:, None]], axis=1).astype(np.float64)
    targets = np.maximum(Xval @ mp["layers.0.weight"].T + mp["layers.0.bias"], 0)

    cells = {
        "convex": dict(centers=center, axes=axes, tol=0.1,
                       batched=lambda s, ids: softmax_accuracy(s, Xval, yval, C) >= 0.4,
                       loop=loop_passes_softmax(Xval, yval, C, 0.4)),
        "neurons": dict(centers=neurons, axes=None, tol=1.0,
                        batched=lambda s, ids: neuron_distance(s, Xval, targets[:, ids]) <= 1.0,
                        loop=loop_passes_neurons(Xval, targets, 1.0)),
    }
    rows, results = [], {}
    for name, cell in cells.items():
        times: dict[str, list[float]] = {"batched": [], "loop": []}
        radii = {}
        for _ in range(args.repeats):
            for variant in ("batched", "loop"):  # interleaved passes
                started = time.perf_counter()
                search = search_radii(cell[variant], cell["centers"], num_samples=p, r_max=4000.0, tol=cell["tol"],
                                      rng=np.random.default_rng(1), axes=cell["axes"])
                times[variant].append(time.perf_counter() - started)
                radii[variant] = search.radius
        same = bool(np.array_equal(radii["batched"], radii["loop"]))
        tb, tl = float(np.median(times["batched"])), float(np.median(times["loop"]))
        rows.append({"cell": name, "balls": len(cell["centers"]), "p": p, "batched": f"{tb * 1e3:.1f}", "loop": f"{tl * 1e3:.1f}",
                     "speedup": f"{tl / tb:.1f}x", "same": str(same)})
        results[name] = {"balls": len(cell["centers"]), "p": p, "batched_s": tb, "loop_s": tl, "speedup": tl / tb,
                         "same_radii": same, "median_radius": float(np.median(radii["batched"]))}
    print_table(rows, [("cell", "cell"), ("balls", "balls"), ("p", "p"), ("batched", "batched (ms)"), ("loop", "loop (ms)"),
                       ("speedup", "speed-up"), ("same", "same radii")], title="GEMS ball construction, one client")

    # k-means on K x H neurons (K = 5 copies of the neurons, jittered): scikit-learn's KMeans, as GEMS uses it
    rng = np.random.default_rng(2)
    all_neurons = np.concatenate([neurons + 0.05 * rng.standard_normal(neurons.shape) for _ in range(5)])
    started = time.perf_counter()
    labels = cluster_neurons(all_neurons, 100, random_state=0)
    kmeans_s = time.perf_counter() - started
    print(f"k-means (scikit-learn KMeans, n_init='auto'): {len(all_neurons)} neurons -> 100 clusters in {kmeans_s * 1e3:.1f} ms "
          f"({len(set(labels))} non-empty clusters)")
    results["kmeans"] = {"neurons": len(all_neurons), "clusters": 100, "seconds": kmeans_s, "implementation": "sklearn.cluster.KMeans"}
    write_results("bench_gems", {"machine": machine_info(), "threads": 1, **results})


if __name__ == "__main__":
    main()
