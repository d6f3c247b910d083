"""KL-fusion's synthetic GMM generator (Claici et al. 2020, section 5.1; docs/methods/kl.md) as a dataset.

A port of [KLF : src/data_sampling.py ``gen_partition``, ``make_spd_matrix``, ``gen_gaus_mixture``] and the driver
[KLF : run_simulation_with_plots.py], with the same calls in the same order on one ``RandomState(seed)``::

    centers_g ~ N(mu0, s L)                                  (L global atoms in D dims, s = separation)
    Sigma_g   = make_spd_matrix(D, diag=sqrt(1 + g))         (U (sqrt(1+g) 11^T + diag(min(s, 1))) V: the scalar is
                                                              added to every entry, as the reference code does)
    p_g ~ Beta(1, 1); group j uses {g : Bernoulli(p_g) = 1}, redrawn until it has >= 2 atoms
    centers_jg ~ N(centers_g, tau^2)                         (tau = local_sd)
    Sigma_jg  ~ Wishart(df, Sigma_g) / df                    (df = 100 D)
    mixing_j  ~ Dir(10 1);  M points per group

The points of group ``j`` get label ``j``; partition with ``labels`` and groups ``[[0], [1], ...]`` so client ``j``
holds group ``j`` (jobs/kl_gmm.yaml). A test split of ``test_fraction * M`` further points per group, drawn after
everything else, is the dataset's own test split, so the clients keep all ``M`` points. Atoms no group uses are
removed from the truth, as in the reference. The truth (``Dataset.meta``: global means and covariances, each
group's atoms and local means) is for evaluation only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.stats import wishart

from rayfuse.data.datasets import Dataset, register_dataset
from rayfuse.errors import InputError

__all__ = ["generate_gmm_groups"]


def _make_spd_matrix(rs: np.random.RandomState, n_dim: int, diag: float) -> np.ndarray:
    A = rs.normal(size=(n_dim, n_dim))
    U, s, V = np.linalg.svd(A.T @ A)
    s = np.minimum(s, 1)
    return U @ (diag + np.diag(s)) @ V  # diag + matrix broadcasts to every entry: kept as is (docs/methods/kl.md)


def _sample_mixture(rs: np.random.RandomState, centers: np.ndarray, sigmas: np.ndarray, M: int, mixing: np.ndarray) -> np.ndarray:
    assignments = rs.choice(len(centers), size=M, p=mixing)
    data = np.zeros((M, centers.shape[1]))
    for k in range(len(centers)):
        data[assignments == k] = rs.multivariate_normal(mean=centers[k], cov=sigmas[k], size=int((assignments == k).sum()))
    return data


def generate_gmm_groups(
    *,
    num_atoms: int = 3,
    num_groups: int = 10,
    dim: int = 2,
    points: int = 300,
    mu0: float = 0.0,
    separation: float = 0.1,
    local_sd: float = 0.1,
    local_df: float | None = None,
    test_fraction: float = 0.2,
    seed: int = 17,
) -> dict[str, Any]:
    """The groups' points and the truth; see the module docstring. Defaults are the reference driver's."""
    checks = (("num_atoms", num_atoms, 1), ("num_groups", num_groups, 1), ("dim", dim, 1), ("points", points, 2), ("seed", seed, 0))
    for key, value, low in checks:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InputError(f"data.options.{key}", f"an integer >= {low}", value)
    for key, number in (("separation", separation), ("local_sd", local_sd), ("test_fraction", test_fraction)):
        if not isinstance(number, (int, float)) or isinstance(number, bool) or not np.isfinite(number) or number < 0:
            raise InputError(f"data.options.{key}", "a finite number >= 0", number)
    if num_atoms < 2:
        raise InputError("data.options.num_atoms", "an integer >= 2 (each group uses at least 2 atoms)", num_atoms)
    df = float(100 * dim if local_df is None else local_df)
    if df <= dim - 1:
        raise InputError("data.options.local_df", f"degrees of freedom > dim - 1 = {dim - 1}", local_df)
    rs = np.random.RandomState(seed)
    L, D = num_atoms, dim
    centers = rs.normal(mu0, np.sqrt(separation * L), (L, D))
    sigmas = np.array([_make_spd_matrix(rs, D, np.sqrt(1 + g)) for g in range(L)])
    global_p = rs.beta(a=1, b=1, size=L)
    groups: list[np.ndarray] = []
    atoms: list[list[int]] = []
    local_centers, local_sigmas, mixings = [], [], []
    for _j in range(num_groups):
        idx: list[int] = []
        while len(idx) < 2:
            idx = [g for g in range(L) if rs.binomial(1, global_p[g])]
        c = rs.normal(centers[idx], scale=local_sd) if local_sd > 0 else centers[idx]
        s = np.array([wishart.rvs(df, sig, random_state=rs) / df for sig in sigmas[idx]])
        mixing = rs.dirichlet(10 * np.ones(len(idx)))
        groups.append(_sample_mixture(rs, c, s, points, mixing))
        atoms.append(idx)
        local_centers.append(c)
        local_sigmas.append(s)
        mixings.append(mixing)
    n_test = int(round(test_fraction * points))
    tests = [_sample_mixture(rs, c, s, n_test, m) for c, s, m in zip(local_centers, local_sigmas, mixings)] if n_test else []
    used = sorted({g for a in atoms for g in a})  # unused atoms are removed from the truth, as in the reference
    return {
        "groups": groups,
        "tests": tests,
        "global_means": centers[used],
        "global_covariances": sigmas[used],
        "atoms": [[used.index(g) for g in a] for a in atoms],
        "local_means": local_centers,
        "local_covariances": local_sigmas,
    }


@register_dataset(
    "kl_gmm",
    description="KL-fusion's synthetic GMM groups (label = group); data.options: num_atoms, num_groups, "
    "dim, points, mu0, separation, local_sd, local_df, test_fraction, seed",
    source="generator",
)
def _load_kl_gmm(
    *,
    num_atoms: int = 3,
    num_groups: int = 10,
    dim: int = 2,
    points: int = 300,
    mu0: float = 0.0,
    separation: float = 0.1,
    local_sd: float = 0.1,
    local_df: float | None = None,
    test_fraction: float = 0.2,
    seed: int = 17,
    **_: Any,
) -> Dataset:
    out = generate_gmm_groups(
        num_atoms=num_atoms,
        num_groups=num_groups,
        dim=dim,
        points=points,
        mu0=mu0,
        separation=separation,
        local_sd=local_sd,
        local_df=local_df,
        test_fraction=test_fraction,
        seed=seed,
    )
    X = np.concatenate(out["groups"]).astype(np.float32)
    y = np.repeat(np.arange(num_groups), points).astype(np.int64)
    X_test = y_test = None
    if out["tests"]:
        X_test = np.concatenate(out["tests"]).astype(np.float32)
        y_test = np.repeat(np.arange(num_groups), len(out["tests"][0])).astype(np.int64)
    meta = {
        "kind": "gmm",
        "global_means": out["global_means"],
        "global_covariances": out["global_covariances"],
        "atoms": out["atoms"],
        "local_counts": [len(a) for a in out["atoms"]],
        "local_means": out["local_means"],
    }
    return Dataset("kl_gmm", X, y, num_groups, tuple(f"group{j}" for j in range(num_groups)), X_test, y_test, meta=meta)
