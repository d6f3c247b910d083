"""GEMS ball construction: batched evaluation of the sampled models against one-model-at-a-time loops.

The reference code evaluates the ``p`` models sampled at one radius one at a time, drawing each sample on its own and
stopping at the first failure: for the convex model a Keras ``model.set_weights(w); model.evaluate(X_val, y_val)`` per
sample [GEMS: utils/ellipsoid_sampler.py ``sample_ellipse`` / ``evaluate_model``], for a neuron a numpy
``ReLU(X w + b)`` per sample, one neuron after the other [GEMS: utils/neuron_act_sampling.py]. rayfuse draws and
evaluates all ``p`` samples of every ball still being searched as one tensor computation.

Three variants per cell, on the same client data, one thread each:

* ``batched``: rayfuse (:func:`rayfuse.fusion.gems.balls.search_radii` + the batched test);
* ``reference``: the reference code's structure in torch/numpy -- one binary search per ball, each sample drawn on its
  own, the convex model's weights copied into a torch module and evaluated with a ``DataLoader`` of batch 32 (Keras's
  ``evaluate`` default), the neuron's distance in numpy -- the issue's baseline (target: batched >= 20x faster);
* ``tight loop``: rayfuse's batched search and draws (float64 numpy) but each sampled model tested by a numpy
  one-liner, stopping at the first failure -- a stronger baseline than the reference (no per-sample draw or framework
  call), shown so the gain from batching the tests alone is visible.

``batched`` draws float32 samples with torch, as the client steps do, and for the neurons one set of draws per step
shared by the layer's neurons (``shared=True``: each neuron still sees p independent directions per radius); the three variants draw different samples, so
their radii agree statistically (the median radius of each is shown), not exactly.

Cells: one client of the K = 5 label-disjoint digits split (labels {0, 1}):
* ``convex``: the softmax-regression ellipsoid (p = 500, R_max = 4000, Delta = 0.1, epsilon = 0.4);
* ``neurons``: the 50 hidden neurons of a 64-50-10 MLP (p = 500, R_max = 4000, Delta = 1.0, epsilon_j = 1.0).

k-means: GEMS uses scikit-learn's ``KMeans`` directly (allowed by the issue); its time on the K x H neurons is shown.

Usage: ``python benchmarks/bench_gems.py [--quick]``; writes ``benchmarks/results/bench_gems.json``
(``--out``; ``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_quick_arguments, machine_info, out_dir, print_table, write_results  # noqa: E402

from rayfuse.fusion.gems.balls import (  # noqa: E402
    cluster_neurons,
    compute_fisher,
    ellipsoid_axes,
    flatten_linear,
    neuron_distance,
    search_radii,
    softmax_accuracy,
)
from rayfuse.models import get_params, train_model  # noqa: E402
from rayfuse.models.registry import MLP, LogisticRegression  # noqa: E402


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
                acc = np.mean((X @ w[: C * D].reshape(C, D).T + w[C * D :]).argmax(1) == y)
                if acc < epsilon:
                    break
                out[b, s] = True
        return out

    return passes


def reference_search(center, sample_one, passes_one, *, num_samples, r_max, tol):
    """One ball's binary search as the reference code runs it: each sample drawn on its own, first failure stops."""
    lo, hi = 0.0, r_max
    while hi - lo >= tol:
        R = (lo + hi) / 2
        ok = True
        for _ in range(num_samples):
            if not passes_one(sample_one(R)):
                ok = False
                break
        lo, hi = (R, hi) if ok else (lo, R)
    return lo  # the largest radius that passed (as rayfuse; the reference returns the untested midpoint)


def reference_convex(model, X, y, center, axes, epsilon, rng, *, num_samples, r_max, tol):
    """Ellipsoid search with a torch module evaluated per sample (``set_weights`` + ``evaluate``, batch 32)."""
    C, D = model.linear.weight.shape
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.as_tensor(X), torch.as_tensor(y)), batch_size=32)
    model.eval()

    def sample_one(R):
        g = rng.normal(0.0, axes * R)  # the reference's sample_ellipse: g ~ N(0, (sigma R)^2), scaled to the surface
        return center + g / np.sqrt(np.sum(g**2 / (axes * R) ** 2))

    @torch.no_grad()
    def passes_one(w):
        model.linear.weight.copy_(torch.as_tensor(w[: C * D].reshape(C, D)))
        model.linear.bias.copy_(torch.as_tensor(w[C * D :]))
        correct = 0
        for xb, yb in loader:
            correct += int((model(xb).argmax(1) == yb).sum())
        return correct / len(y) >= epsilon

    return reference_search(center, sample_one, passes_one, num_samples=num_samples, r_max=r_max, tol=tol)


def reference_neurons(X, neurons, targets, epsilon, rng, *, num_samples, r_max, tol):
    """One neuron after the other, each sample drawn on its own (``sample_uniform``) and tested in numpy."""
    radii = []
    for j, c in enumerate(neurons):
        w0, b0 = c[:-1], c[-1]

        def sample_one(R):
            gw, gb = rng.normal(0.0, 1.0, w0.shape), rng.normal(0.0, 1.0, ())
            norm = np.sqrt(np.sum(gw**2) + gb**2)
            return R * gw / norm + w0, R * gb / norm + b0

        def passes_one(wb, z=targets[:, j]):
            return np.linalg.norm(z - np.maximum(X @ wb[0] + wb[1], 0)) / len(X) <= epsilon

        radii.append(reference_search(c, sample_one, passes_one, num_samples=num_samples, r_max=r_max, tol=tol))
    return np.array(radii)


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
    add_quick_arguments(parser, "p = 100", quick=False)
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
        "convex": dict(
            centers=center,
            axes=axes,
            tol=0.1,
            batched=lambda s, ids: softmax_accuracy(s, Xval, yval, C) >= 0.4,
            loop=loop_passes_softmax(Xval, yval, C, 0.4),
            reference=lambda rng: np.array(
                [reference_convex(logreg, Xval, yval, center[0], axes[0], 0.4, rng, num_samples=p, r_max=4000.0, tol=0.1)]
            ),
        ),
        "neurons": dict(
            centers=neurons,
            axes=None,
            tol=1.0,
            batched=lambda s, ids: neuron_distance(s, Xval, targets[:, ids]) <= 1.0,
            loop=loop_passes_neurons(Xval, targets, 1.0),
            reference=lambda rng: reference_neurons(Xval, neurons, targets, 1.0, rng, num_samples=p, r_max=4000.0, tol=1.0),
        ),
    }
    rows, results = [], {}
    for name, cell in cells.items():
        times: dict[str, list[float]] = {"batched": [], "reference": [], "loop": []}
        radii = {}
        for _ in range(args.repeats):
            for variant in times:  # interleaved passes
                started = time.perf_counter()
                if variant == "reference":
                    radii[variant] = cell["reference"](np.random.default_rng(1))
                else:  # rayfuse's client steps draw float32 samples with torch; the tight loop tests float64 numpy draws
                    radii[variant] = search_radii(
                        cell[variant],
                        cell["centers"],
                        num_samples=p,
                        r_max=4000.0,
                        tol=cell["tol"],
                        rng=np.random.default_rng(1),
                        axes=cell["axes"],
                        dtype="float32" if variant == "batched" else "float64",
                        shared=variant == "batched" and name == "neurons",
                    ).radius
                times[variant].append(time.perf_counter() - started)
        tb, tr, tl = (float(np.median(times[v])) for v in ("batched", "reference", "loop"))
        rows.append(
            {
                "cell": name,
                "balls": len(cell["centers"]),
                "p": p,
                "batched": f"{tb * 1e3:.1f}",
                "reference": f"{tr * 1e3:.1f}",
                "ref_speedup": f"{tr / tb:.1f}x",
                "loop": f"{tl * 1e3:.1f}",
                "speedup": f"{tl / tb:.1f}x",
                "radius": " / ".join(f"{np.median(radii[v]):.2f}" for v in ("batched", "reference", "loop")),
            }
        )
        results[name] = {
            "balls": len(cell["centers"]),
            "p": p,
            "batched_s": tb,
            "reference_s": tr,
            "reference_speedup": tr / tb,
            "loop_s": tl,
            "loop_speedup": tl / tb,
            "median_radius": {v: float(np.median(radii[v])) for v in radii},
        }
    print_table(
        rows,
        [
            ("cell", "cell"),
            ("balls", "balls"),
            ("p", "p"),
            ("batched", "batched (ms)"),
            ("reference", "reference (ms)"),
            ("ref_speedup", "vs reference"),
            ("loop", "tight loop (ms)"),
            ("speedup", "vs tight loop"),
            ("radius", "median radius (batched / reference / loop)"),
        ],
        title="GEMS ball construction, one client",
    )

    # k-means on K x H neurons (K = 5 copies of the neurons, jittered): scikit-learn's KMeans, as GEMS uses it
    rng = np.random.default_rng(2)
    all_neurons = np.concatenate([neurons + 0.05 * rng.standard_normal(neurons.shape) for _ in range(5)])
    started = time.perf_counter()
    labels = cluster_neurons(all_neurons, 100, random_state=0)
    kmeans_s = time.perf_counter() - started
    print(
        f"k-means (scikit-learn KMeans, n_init='auto'): {len(all_neurons)} neurons -> 100 clusters in {kmeans_s * 1e3:.1f} ms "
        f"({len(set(labels))} non-empty clusters)"
    )
    results["kmeans"] = {"neurons": len(all_neurons), "clusters": 100, "seconds": kmeans_s, "implementation": "sklearn.cluster.KMeans"}
    path = write_results(
        "bench_gems", {"machine": machine_info(), "threads": 1, "quick": args.quick, **results}, out_dir(args.out, args.quick)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
