"""Exponential families: KL properties, closed forms against Monte Carlo, barycenters, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from rayfuse.errors import InputError
from rayfuse.expfam import DiagGaussian, Dirichlet, NormalWishart, concat, normal_wishart_from_sklearn


def random_nw(rng: np.random.Generator, n: int, D: int = 3) -> NormalWishart:
    A = rng.normal(size=(n, D, D))
    W = A @ A.transpose(0, 2, 1) / D + 0.3 * np.eye(D)
    return NormalWishart(rng.normal(size=(n, D)), rng.uniform(0.5, 50, n), rng.uniform(D + 0.5, 40, n), W)


def random_batch(family: str, rng: np.random.Generator, n: int):
    if family == "diag_gaussian":
        return DiagGaussian(rng.normal(0, 2, (n, 4)), rng.uniform(0.05, 3, (n, 4)))
    if family == "normal_wishart":
        return random_nw(rng, n)
    return Dirichlet(rng.uniform(0.05, 8, (n, 6)))


FAMILIES = ["diag_gaussian", "normal_wishart", "dirichlet"]


@pytest.mark.parametrize("family", FAMILIES)
def test_kl_is_zero_on_itself_and_nonnegative(family):
    rng = np.random.default_rng(0)
    for _seed in range(5):
        a, b = random_batch(family, rng, 40), random_batch(family, rng, 40)
        np.testing.assert_allclose(a.kl(a), 0.0, atol=1e-8)
        assert (a.kl(b) >= -1e-9).all()
        assert (a.kl_matrix(b) >= -1e-9).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_kl_matrix_equals_elementwise_kl(family):
    rng = np.random.default_rng(1)
    a, b = random_batch(family, rng, 6), random_batch(family, rng, 7)
    expected = np.array([[a.take([g]).kl(b.take([l]))[0] for l in range(7)] for g in range(6)])
    np.testing.assert_allclose(a.kl_matrix(b), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_barycenter_of_one_is_itself_and_natural_round_trip(family):
    rng = np.random.default_rng(2)
    a = random_batch(family, rng, 5)
    np.testing.assert_allclose(a.from_natural(a.natural()).natural(), a.natural(), rtol=1e-9, atol=1e-9)
    one = a.take([3]).barycenter()
    np.testing.assert_allclose(one.natural(), a.take([3]).natural(), rtol=1e-9, atol=1e-9)
    assert one.kl(a.take([3]))[0] == pytest.approx(0.0, abs=1e-8)


@pytest.mark.parametrize("family", FAMILIES)
def test_barycenter_minimises_weighted_kl(family):
    rng = np.random.default_rng(3)
    a = random_batch(family, rng, 4)
    w = np.array([0.1, 0.2, 0.3, 0.4])
    bary = a.barycenter(w)

    def objective(q):
        return float((w * q.kl_matrix(a)[0]).sum())

    best = objective(bary)
    eta = bary.natural()
    for _ in range(30):  # any nearby member of the family does worse
        other = a.from_natural(eta + 1e-3 * np.abs(eta).mean() * rng.normal(size=eta.shape) * (family != "normal_wishart" or 1))
        try:
            value = objective(other)
        except np.linalg.LinAlgError:
            continue
        if np.isfinite(value):
            assert value >= best - 1e-9


def test_normal_wishart_kl_matches_monte_carlo():
    rng = np.random.default_rng(4)
    D = 2
    q0 = NormalWishart([[0.3, -0.2]], [8.0], [6.0], [[[0.8, 0.2], [0.2, 0.5]]])
    q1 = NormalWishart([[0.0, 0.4]], [1.5], [9.0], [[[0.4, -0.1], [-0.1, 0.6]]])

    def log_density(q, mu, lam):
        d = mu - q.mean[0]  # log N(mu | m, (kappa Lambda)^-1), vectorised over samples
        gauss = 0.5 * (D * np.log(q.kappa[0] / (2 * np.pi)) + np.linalg.slogdet(lam)[1] - q.kappa[0] * np.einsum("ni,nij,nj->n", d, lam, d))
        return stats.wishart(df=q.nu[0], scale=q.W[0]).logpdf(np.moveaxis(lam, 0, -1)) + gauss

    n = 20000
    lam = stats.wishart(df=q0.nu[0], scale=q0.W[0]).rvs(n, random_state=rng)
    chol = np.linalg.cholesky(np.linalg.inv(q0.kappa[0] * lam))
    mu = q0.mean[0] + np.einsum("nij,nj->ni", chol, rng.normal(size=(n, D)))
    sample = log_density(q0, mu, lam) - log_density(q1, mu, lam)
    estimate, se = sample.mean(), sample.std() / np.sqrt(n)
    exact = q0.kl(q1)[0]
    assert abs(estimate - exact) < 4 * se + 1e-3
    # the reference code's Gaussian part swaps kappa0 / kappa1 (docs/methods/kl.md): that value is far off
    k0, k1 = q0.kappa[0], q1.kappa[0]
    swapped = exact - 0.5 * D * (k1 / k0 - 1 + np.log(k0 / k1)) + 0.5 * D * (k0 / k1 - 1 + np.log(k1 / k0))
    assert abs(estimate - swapped) > 10 * se


def test_diag_gaussian_and_dirichlet_kl_match_monte_carlo():
    rng = np.random.default_rng(5)
    g0, g1 = DiagGaussian([[0.0, 1.0]], [[1.0, 0.5]]), DiagGaussian([[0.5, 0.0]], [[2.0, 0.3]])
    x = g0.mean[0] + np.sqrt(g0.var[0]) * rng.normal(size=(50000, 2))
    mc = (stats.norm(g0.mean[0], np.sqrt(g0.var[0])).logpdf(x) - stats.norm(g1.mean[0], np.sqrt(g1.var[0])).logpdf(x)).sum(1)
    assert abs(mc.mean() - g0.kl(g1)[0]) < 4 * mc.std() / np.sqrt(len(mc))
    d0, d1 = Dirichlet([[2.0, 3.0, 1.5]]), Dirichlet([[1.0, 4.0, 2.0]])
    p = rng.dirichlet(d0.alpha[0], size=50000)
    mc = stats.dirichlet(d0.alpha[0]).logpdf(p.T) - stats.dirichlet(d1.alpha[0]).logpdf(p.T)
    assert abs(mc.mean() - d0.kl(d1)[0]) < 4 * mc.std() / np.sqrt(len(mc))


def test_normal_wishart_from_sklearn_gives_the_expected_precision():
    from sklearn.mixture import BayesianGaussianMixture

    rng = np.random.default_rng(6)
    X = np.concatenate([rng.normal(-3, 1, (100, 2)), rng.normal(3, 0.5, (100, 2))])
    model = BayesianGaussianMixture(n_components=2, random_state=0).fit(X)
    nw = normal_wishart_from_sklearn(model)
    np.testing.assert_allclose(nw.expected_precision(), model.precisions_, rtol=1e-10)
    np.testing.assert_allclose(nw.mean, model.means_)
    diag = normal_wishart_from_sklearn(BayesianGaussianMixture(n_components=2, covariance_type="diag", random_state=0).fit(X))
    assert diag.W.shape == (2, 2, 2)


BAD = [
    ("mean", lambda: DiagGaussian([[0.0, np.nan]], [[1.0, 1.0]]), "posteriors.mean"),
    ("var shape", lambda: DiagGaussian([[0.0, 1.0]], [[1.0]]), "posteriors.var"),
    ("var zero", lambda: DiagGaussian([[0.0]], [[0.0]]), "posteriors.var"),
    ("kappa", lambda: NormalWishart([[0.0]], [-1.0], [3.0], [[[1.0]]]), "kappa"),
    ("nu", lambda: NormalWishart([[0.0, 0.0]], [1.0], [0.5], [np.eye(2)]), "nu"),
    ("W not PD", lambda: NormalWishart([[0.0, 0.0]], [1.0], [3.0], [[[1.0, 2.0], [2.0, 1.0]]]), "posteriors.W"),
    ("W shape", lambda: NormalWishart([[0.0, 0.0]], [1.0], [3.0], [np.eye(3)]), "posteriors.W"),
    ("alpha", lambda: Dirichlet([[1.0, 0.0]]), "alpha"),
    ("alpha NaN", lambda: Dirichlet([[1.0, np.nan]]), "alpha"),
    ("mixed families", lambda: concat([Dirichlet([[1.0, 2.0]]), DiagGaussian([[0.0, 0.0]], [[1.0, 1.0]])]), r"posteriors\[1\]"),
    ("mixed dims", lambda: concat([Dirichlet([[1.0, 2.0]]), Dirichlet([[1.0, 2.0, 3.0]])]), r"posteriors\[1\]"),
    ("weights", lambda: Dirichlet([[1.0, 2.0]]).barycenter([-1.0]), "weights"),
]


@pytest.mark.parametrize("name,build,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error(name, build, match):
    with pytest.raises(InputError, match=match):
        build()
