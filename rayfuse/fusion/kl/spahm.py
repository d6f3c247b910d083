"""``spahm``: Statistical Model Aggregation via Parameter Matching (Yurochkin et al., NeurIPS 2019) [1] on local atoms.

KL-fusion's GMM baseline (Claici et al. 2020, section 5.1): the local posterior *means* of every client are matched to
global atoms with the Beta-Bernoulli-process matcher of [SPAHM : simulation/gaus_marginal_matching.py], summarised in
``docs/methods/kl.md``. Per global ``i`` with ``m_i`` matched atoms summing to ``S_i`` (noise variance ``sigma``, prior
``N(mu0, sigma0)`` per dimension, ``J`` groups), group ``j``'s atoms ``x_l`` are matched by one Hungarian solve that
*maximises*::

    param_cost[l, i] = sum_d [(s0/s)(x+S)^2 + 2 mu0 (x+S)] / ((m+1) s0 + s) - sum_d [(s0/s) S^2 + 2 mu0 S] / (m s0 + s)
                       + sum_d [ln(m s0 + s) - ln((m+1) s0 + s)] + sum_d [m mu0^2 / (m s0 + s) - (m+1) mu0^2 / ((m+1) s0 + s)]
                       + 2 ln(m~ / (J - m~)),   m~ = min(m, 10)
    new_cost[l, n]   = sum_d [(s0/s) x^2 + 2 mu0 x - mu0^2] / (s0 + s) - 2 ln n + 2 ln(gamma / J) + sum_d [ln s - ln(s0 + s)]

initialised with the largest group, then ``iterations`` passes in random order (remove a group, re-match it), the
hyperparameters re-estimated after each pass; the output is the MAP ``(mu0 s + S s0) / (m s0 + s)``.

[1] M. Yurochkin, M. Agarwal, S. Ghosh, K. Greenewald, T. N. Hoang. Statistical Model Aggregation via Parameter
Matching. NeurIPS 2019.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from rayfuse.errors import InputError
from rayfuse.fusion import references
from rayfuse.fusion.kl.gmm import GMMMethod, GMMPosteriorParams, gather_gmm_posteriors, gmm_metrics
from rayfuse.matching import solve_assignment
from rayfuse.method import MethodResult, ServerContext, register_method

__all__ = ["spahm_match", "SPAHM", "SPAHMParams"]


def _cost(x: np.ndarray, S: np.ndarray, m: np.ndarray, mu0: np.ndarray, s: np.ndarray, s0: np.ndarray, J: int, gamma: float) -> np.ndarray:
    L = len(S)
    r = s0 / s
    xs = x[:, None, :] + S[None, :, :]  # (Lj, L, d)
    a1 = (m[:, None] + 1) * s0[None, :] + s[None, :]  # (L, d)
    a0 = m[:, None] * s0[None, :] + s[None, :]
    param = ((r * xs**2 + 2 * mu0 * xs) / a1[None]).sum(-1)
    param -= ((r * S**2 + 2 * mu0 * S) / a0).sum(-1)[None]
    param += (np.log(a0) - np.log(a1)).sum(-1)[None]
    param += (m[:, None] * mu0**2 / a0 - (m[:, None] + 1) * mu0**2 / a1).sum(-1)[None]
    mt = np.minimum(m, 10).astype(np.float64)
    param += 2 * np.log(mt / np.maximum(J - mt, 1e-12))[None]
    max_added = min(len(x), max(700 - L, 1))
    new = ((r * x**2 + 2 * mu0 * x - mu0**2) / (s0 + s)).sum(-1)[:, None] + (np.log(s) - np.log(s0 + s)).sum()
    new = new + 2 * np.log(gamma / J) - 2 * np.log(np.arange(1, max_added + 1))[None]
    return np.concatenate([param, new], axis=1)


def spahm_match(
    atoms: Sequence[np.ndarray],
    *,
    sigma: float = 1.0,
    sigma0: float = 1.0,
    mu0: float = 0.0,
    gamma: float = 1.0,
    iterations: int = 10,
    optimize_hyper: bool = True,
    random_state: int = 0,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Global atoms (MAP) and each group's assignment (global index per local atom). Defaults: [SPAHM : simulation/main.py]."""
    if not atoms or any(np.ndim(a) != 2 for a in atoms):
        raise InputError("atoms", "a non-empty list of (atoms, dims) arrays", [np.shape(a) for a in atoms] if atoms else atoms)
    atoms = [np.asarray(a, dtype=np.float64) for a in atoms]
    d = atoms[0].shape[1]
    if any(a.shape[1] != d for a in atoms) or not all(np.isfinite(a).all() for a in atoms):
        raise InputError("atoms", f"finite atoms of dimension {d} in every group", [a.shape for a in atoms])
    J = len(atoms)
    rng = np.random.default_rng(random_state)
    s, s0, m0 = np.full(d, float(sigma)), np.full(d, float(sigma0)), np.full(d, float(mu0))
    order = sorted(range(J), key=lambda j: -len(atoms[j]))
    S = atoms[order[0]].copy()
    S2 = atoms[order[0]] ** 2
    m = np.ones(len(S))
    assign: list[np.ndarray | None] = [None] * J
    assign[order[0]] = np.arange(len(S))

    def match(j: int) -> None:
        nonlocal S, S2, m
        x = atoms[j]
        L = len(S)
        cols = solve_assignment(-_cost(x, S, m, m0, s, s0, J, gamma))
        out = np.empty(len(x), dtype=np.int64)
        for l, c in enumerate(cols):
            if c < L:
                S[c] += x[l]
                S2[c] += x[l] ** 2
                m[c] += 1
                out[l] = c
            else:
                S = np.vstack([S, x[l]])
                S2 = np.vstack([S2, x[l] ** 2])
                m = np.append(m, 1.0)
                out[l] = len(S) - 1
        assign[j] = out

    def unmatch(j: int) -> None:
        nonlocal S, S2, m
        a = assign[j]
        S[a] -= atoms[j]
        S2[a] -= atoms[j] ** 2
        m[a] -= 1
        keep = m > 0
        remap = np.cumsum(keep) - 1
        S, S2, m = S[keep], S2[keep], m[keep]
        for k in range(J):
            if assign[k] is not None and k != j:
                assign[k] = remap[assign[k]]
        assign[j] = None

    for j in order[1:]:
        match(j)
    for _ in range(iterations):
        for j in rng.permutation(J):
            unmatch(j)
            match(j)
        if optimize_hyper:
            means = S / m[:, None]
            m0 = means.mean(0)
            total = m.sum()
            if total > len(m):
                s = np.maximum((S2 - S**2 / m[:, None]).sum(0) / (total - len(m)), 1e-8)
            s0 = np.maximum(((means - m0) ** 2).mean(0) - s * (1 / m).mean(), 1e-8)
    globals_ = (m0 * s + S * s0) / (m[:, None] * s0 + s)
    return globals_, [np.asarray(a) for a in assign]


# -----------------------------------------------------------------------------------------------------------------
# The method (GMM application: matches the clients' local posterior means)


class SPAHMParams(GMMPosteriorParams):
    sigma: float = Field(1.0, gt=0, description="initial local noise variance")
    sigma0: float = Field(1.0, gt=0, description="initial prior variance")
    mu0: float = Field(0.0, description="initial prior mean")
    gamma: float = Field(1.0, gt=0, description="new-atom mass of the Beta-Bernoulli process")
    iterations: int = Field(10, ge=0, description="matching passes")
    optimize_hyper: bool = Field(True, description="re-estimate mu0, sigma, sigma0 after each pass")


@register_method
class SPAHM(GMMMethod[SPAHMParams]):
    name = "spahm"
    Params = SPAHMParams
    summary = "SPAHM (Yurochkin et al. 2019) on the clients' local posterior means (KL-fusion's GMM baseline)"
    reference = references.SPAHM

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        posteriors, _ = gather_gmm_posteriors(server, p)
        means, _ = spahm_match(
            [q.means() for q in posteriors],
            sigma=p.sigma,
            sigma0=p.sigma0,
            mu0=p.mu0,
            gamma=p.gamma,
            iterations=p.iterations,
            optimize_hyper=p.optimize_hyper,
            random_state=server.step_seed("spahm") % (2**31),
        )
        metrics = gmm_metrics(server, means)
        server.log(0, metrics)
        return MethodResult(metrics, info={"means": means.tolist()})
