"""KL-fusion's BNN application (Claici et al. 2020, section 5.4, Table 2): fusing Bayesian neural networks' neurons.

Each client trains a one-hidden-layer mean-field Gaussian Bayesian MLP with Bayes by backprop (Blundell et al. 2015;
PROPOSED for a CPU replica of the paper's horseshoe BNN): prior ``N(0, prior_sd^2)`` on every
weight, a diagonal-Gaussian posterior ``N(mu, softplus(rho)^2)``, the local reparameterisation trick, Adam. Its
hidden neuron ``k`` is one diagonal Gaussian over ``[w_in (D_in) | b (1) | w_out (C)]`` (the hidden bias appended, as
in PFNM; UNRECOVERABLE from the paper, PROPOSED, docs/methods/kl.md). The server fuses all clients' neurons with
KL-fusion into ``G`` global neurons (``G`` inferred); the output bias is the precision-weighted average of the
clients' output biases. Models are evaluated by the Monte-Carlo predictive (``mc_samples`` weight draws, the paper's
100): accuracy, test log-likelihood and mean predictive entropy, on the test set and on an out-of-distribution set
(the test digits corrupted: each image mirrored and covered with uniform noise; the paper uses computer-font
digits, not available offline).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rayfuse.expfam import DiagGaussian
from rayfuse.method import ClientContext, client_step

__all__ = ["train_bnn", "BNN", "neurons_of", "network_of", "predictive", "predictive_metrics", "corrupt"]

BNN = dict[str, np.ndarray]  # {"w1_mu", "w1_var", "b1_mu", "b1_var", "w2_mu", "w2_var", "b2_mu", "b2_var"}


@client_step("kl.bnn_posterior")
def train_bnn(
    ctx: ClientContext,
    *,
    hidden: int = 150,
    epochs: int = 100,
    lr: float = 1e-3,
    batch_size: int = 32,
    prior_sd: float = 1.0,
    init_rho: float = -5.0,
) -> dict[str, Any]:
    """Bayes by backprop on this client's shard; returns the posterior means and variances (cached per settings)."""
    import torch
    import torch.nn.functional as F

    key = ("kl.bnn_posterior", hidden, epochs, lr, batch_size, prior_sd, init_rho)
    if key in ctx.state:
        return dict(ctx.state[key])
    started = time.perf_counter()
    X = torch.as_tensor(np.asarray(ctx.train.X, dtype=np.float32).reshape(len(ctx.train), -1))
    y = torch.as_tensor(ctx.train.y)
    n, d = X.shape
    C = ctx.num_classes
    gen = torch.Generator().manual_seed(ctx.init_seed % (2**31))
    shapes = {"w1": (hidden, d), "b1": (hidden,), "w2": (C, hidden), "b2": (C,)}
    mu = {k: (torch.randn(s, generator=gen) * (1.0 / np.sqrt(s[-1] if len(s) > 1 else hidden))).requires_grad_() for k, s in shapes.items()}
    rho = {k: torch.full(s, init_rho).requires_grad_() for k, s in shapes.items()}
    opt = torch.optim.Adam([*mu.values(), *rho.values()], lr=lr)
    batches = torch.Generator().manual_seed(ctx.step_seed("bnn-batches") % (2**31))
    prior_var = prior_sd**2
    last = float("nan")
    for _epoch in range(epochs):
        order = torch.randperm(n, generator=batches)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            var = {k: F.softplus(rho[k]) ** 2 for k in shapes}
            # local reparameterisation: sample pre-activations, not weights
            xb = X[idx]
            a_mu, a_var = xb @ mu["w1"].T + mu["b1"], (xb**2) @ var["w1"].T + var["b1"]
            h = torch.relu(a_mu + a_var.sqrt() * torch.randn(a_mu.shape, generator=batches))
            o_mu, o_var = h @ mu["w2"].T + mu["b2"], (h**2) @ var["w2"].T + var["b2"]
            logits = o_mu + o_var.sqrt() * torch.randn(o_mu.shape, generator=batches)
            nll = F.cross_entropy(logits, y[idx], reduction="mean")
            kl = sum((0.5 * (var[k] / prior_var + mu[k] ** 2 / prior_var - 1 - torch.log(var[k] / prior_var))).sum() for k in shapes)
            loss = nll + kl / n
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        last = total / n
    with torch.no_grad():
        out = {}
        for k in shapes:
            out[f"{k}_mu"] = mu[k].detach().numpy().astype(np.float64)
            out[f"{k}_var"] = (F.softplus(rho[k]) ** 2).detach().numpy().astype(np.float64)
    result = {
        "bnn": out,
        "num_examples": int(n),
        "loss": last,
        "seconds": time.perf_counter() - started,
        "class_counts": np.bincount(ctx.train.y, minlength=C).tolist(),
    }
    ctx.state[key] = result
    return dict(result)


def neurons_of(bnn: BNN, *, where: str = "posterior") -> DiagGaussian:
    """Hidden neurons as diagonal Gaussians over ``[w_in | b | w_out]``, one row per neuron."""
    mean = np.concatenate([bnn["w1_mu"], bnn["b1_mu"][:, None], bnn["w2_mu"].T], axis=1)
    var = np.concatenate([bnn["w1_var"], bnn["b1_var"][:, None], bnn["w2_var"].T], axis=1)
    return DiagGaussian(mean, var, where=where)


def network_of(neurons: DiagGaussian, b2_mu: np.ndarray, b2_var: np.ndarray, d_in: int) -> BNN:
    """The BNN whose hidden neurons are ``neurons`` (inverse of :func:`neurons_of`) with output bias ``b2``."""
    m, v = neurons.mean, neurons.var
    return {
        "w1_mu": m[:, :d_in],
        "w1_var": v[:, :d_in],
        "b1_mu": m[:, d_in],
        "b1_var": v[:, d_in],
        "w2_mu": m[:, d_in + 1 :].T.copy(),
        "w2_var": v[:, d_in + 1 :].T.copy(),
        "b2_mu": b2_mu,
        "b2_var": b2_var,
    }


def fuse_output_bias(bnns: list[BNN]) -> tuple[np.ndarray, np.ndarray]:
    """Precision-weighted average of the clients' output biases (the product of their Gaussians, renormalised)."""
    precision = np.stack([1.0 / b["b2_var"] for b in bnns])
    mean = (precision * np.stack([b["b2_mu"] for b in bnns])).sum(0) / precision.sum(0)
    return mean, 1.0 / precision.mean(0)


def predictive(bnn: BNN, X: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """Monte-Carlo predictive ``(1/S) sum_s softmax(f(X; W_s))``, ``W_s ~ q`` (every weight sampled)."""
    X = np.asarray(X, dtype=np.float64).reshape(len(X), -1)
    probs = np.zeros((len(X), bnn["b2_mu"].shape[0]))
    for _ in range(samples):
        w = {k: bnn[f"{k}_mu"] + np.sqrt(bnn[f"{k}_var"]) * rng.standard_normal(bnn[f"{k}_mu"].shape) for k in ("w1", "b1", "w2", "b2")}
        logits = np.maximum(X @ w["w1"].T + w["b1"], 0) @ w["w2"].T + w["b2"]
        logits -= logits.max(1, keepdims=True)
        p = np.exp(logits)
        probs += p / p.sum(1, keepdims=True)
    return probs / samples


def predictive_metrics(probs: np.ndarray, y: np.ndarray | None = None) -> dict[str, float]:
    """Accuracy, mean test log-likelihood (``log_likelihood``; ``nll`` = its negative) and mean predictive entropy."""
    eps = 1e-12
    out = {"entropy": float(-(probs * np.log(probs + eps)).sum(1).mean())}
    if y is not None:
        ll = float(np.log(probs[np.arange(len(y)), y] + eps).mean())
        out.update(accuracy=float((probs.argmax(1) == y).mean()), log_likelihood=ll, nll=-ll)
    return out


def corrupt(X: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The out-of-distribution set: each image mirrored left-right and mixed half-half with uniform noise."""
    X = np.asarray(X, dtype=np.float64)
    mirrored = X[..., ::-1] if X.ndim >= 3 else X
    return 0.5 * mirrored + 0.5 * rng.uniform(X.min(), X.max(), X.shape)
