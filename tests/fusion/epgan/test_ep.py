"""EP-GAN's closed-form EP prior (rayfuse.fusion.epgan.ep) against numerical quadrature, with the paper's errors shown."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import expit

from rayfuse.fusion.epgan.ep import (
    cavity,
    gaussian_product,
    paper_second_moment,
    probit_coefficients,
    sigmoid_power_mean,
    site_update,
    stein_moments,
    tilted_moments,
)

NODES, WEIGHTS = np.polynomial.hermite_e.hermegauss(200)
WEIGHTS = WEIGHTS / WEIGHTS.sum()


def expect(fn, mean, var):
    """E[fn(X)] for X ~ N(mean, var), Gauss-Hermite with 200 nodes."""
    return float((fn(mean + math.sqrt(var) * NODES) * WEIGHTS).sum())


GRID = [(m, s) for m in np.linspace(-6, 6, 13) for s in np.geomspace(1e-3, 31, 12)]


def test_probit_coefficients_with_the_corrected_sign_of_b2():
    assert probit_coefficients(1) == (1.0, 0.0)
    a2, b2 = probit_coefficients(2)
    assert a2 == pytest.approx(4 - 2 * math.sqrt(2)) and b2 == pytest.approx(math.log(math.sqrt(2) - 1)) and b2 < 0
    a3, b3 = probit_coefficients(3)
    assert a3 == pytest.approx(1.2378, abs=1e-4) and b3 == pytest.approx(-1.3474, abs=1e-4)  # ln(2^(1/3) - 1)
    # the median of sigma^d(C) is where sigma^d = 1/2: sigma(-b_d)^d = 1/2 exactly
    for d in (1, 2, 3):
        assert expit(-probit_coefficients(d)[1]) ** d == pytest.approx(0.5)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_lemma_moments_against_quadrature_over_a_grid(d):
    errors = [abs(float(sigmoid_power_mean(d, m, s)) - expect(lambda c: expit(c) ** d, m, s)) for m, s in GRID]
    assert max(errors) < 0.04  # probit matching: 0.013 / 0.027 / 0.038 worst over the grid for d = 1 / 2 / 3


def test_the_papers_sign_of_b2_is_far_off():
    exact = expect(lambda c: expit(c) ** 2, 0.0, 1.0)
    a = 4 - 2 * math.sqrt(2)
    paper = expit(a * (0.0 + math.log(math.sqrt(2) + 1)) / math.sqrt(1 + math.pi / 8 * a * a))
    assert exact == pytest.approx(0.29, abs=0.01) and paper == pytest.approx(0.70, abs=0.01)
    assert float(sigmoid_power_mean(2, 0.0, 1.0)) == pytest.approx(exact, abs=0.01)


def test_stein_identities_are_exact_given_exact_moments():
    for m, s in [(0.0, 1.0), (1.0, 0.5), (-2.0, 3.0), (3.0, 0.1)]:
        e = [expect(lambda c, d=d: expit(c) ** d, m, s) for d in (1, 2, 3)]
        c_sigma, c_sigma2, c2_sigma = stein_moments(m, s, *e)
        assert c_sigma == pytest.approx(expect(lambda c: c * expit(c), m, s), abs=1e-9)
        assert c_sigma2 == pytest.approx(expect(lambda c: c * expit(c) ** 2, m, s), abs=1e-9)
        assert c2_sigma == pytest.approx(expect(lambda c: c * c * expit(c), m, s), abs=1e-9)


@pytest.mark.parametrize("f", [0.5, 1.0, 2.0, -1.0])
def test_tilted_moments_against_quadrature(f):
    for m in np.linspace(-2, 2, 9):
        for s in np.geomspace(1e-2, 1.0, 8):
            if abs(f * m) > 2 or f * f * s > 1:
                continue
            z = expect(lambda t: expit(f * t), m, s)
            s1 = expect(lambda t: t * expit(f * t), m, s) / z
            var = expect(lambda t: t * t * expit(f * t), m, s) / z - s1 * s1
            mean, new_var = tilted_moments(f, np.array(m), np.array(s))
            assert abs(float(mean) - s1) < 0.15 * math.sqrt(s)  # the Lemma's approximation error, in cavity sds
            assert abs(float(new_var) - var) < 0.07 * s


def test_corrected_variance_stays_positive_where_the_papers_goes_negative():
    m, s = np.meshgrid(np.linspace(-6, 6, 49), np.geomspace(1e-3, 31, 40))
    mean, var = tilted_moments(1.0, m, s)
    assert np.all(var > 0) and np.all(np.isfinite(mean))
    s1 = mean
    paper_var = paper_second_moment(1.0, m, s) - s1 * s1
    assert (paper_var < 0).any()
    # the case of docs/methods/epgan.md: (C_m, C_s) = (1, 0.5)
    exact_var = (
        expect(lambda t: t * t * expit(t), 1.0, 0.5) / expect(expit, 1.0, 0.5)
        - (expect(lambda t: t * expit(t), 1.0, 0.5) / expect(expit, 1.0, 0.5)) ** 2
    )
    mean1, var1 = tilted_moments(1.0, np.array(1.0), np.array(0.5))
    assert float(var1) == pytest.approx(exact_var, rel=0.02)
    assert float(paper_second_moment(1.0, np.array(1.0), np.array(0.5)) - mean1**2) < 0


def test_an_uninformative_f_returns_the_cavity():
    mean, var = tilted_moments(np.array([0.0, 1e-9, 1.0]), np.array([0.3, 0.3, 0.3]), np.array([2.0, 2.0, 2.0]))
    assert mean[:2].tolist() == [0.3, 0.3] and var[:2].tolist() == [2.0, 2.0] and mean[2] != 0.3


def test_tilted_moments_reject_non_positive_variances():
    with pytest.raises(ValueError, match="positive"):
        tilted_moments(1.0, np.zeros(3), np.array([1.0, 0.0, 1.0]))


def test_product_of_two_gaussians_closed_form():
    m, v = gaussian_product([np.array([1.0]), np.array([3.0])], [np.array([1.0]), np.array([3.0])])
    # precision 1 + 1/3 = 4/3 -> variance 3/4 (the paper's "sum of 1/s" is this precision, not the variance)
    assert v[0] == pytest.approx(0.75) and m[0] == pytest.approx(0.75 * (1.0 / 1.0 + 3.0 / 3.0))
    # pointwise: N(x; m1, v1) N(x; m2, v2) ∝ N(x; m, v)
    x = np.linspace(-3, 5, 7)
    log_ratio = (-((x - 1) ** 2) / 2 - (x - 3) ** 2 / 6) - (-((x - m[0]) ** 2) / (2 * v[0]))
    assert np.ptp(log_ratio) < 1e-12
    with pytest.raises(ValueError, match="positive"):
        gaussian_product([np.zeros(2)], [np.array([1.0, -1.0])])


def test_cavity_divides_out_the_site_and_site_update_damps():
    site_m, site_v = np.array([2.0]), np.array([4.0])
    other_m, other_v = np.array([-1.0]), np.array([2.0])
    g_m, g_v = gaussian_product([site_m, other_m], [site_v, other_v])
    c_m, c_v = cavity(g_m, g_v, site_m, site_v)
    assert c_m[0] == pytest.approx(-1.0) and c_v[0] == pytest.approx(2.0)
    # a site as precise as the whole prior leaves no cavity: the global prior is used
    f_m, f_v = cavity(np.array([0.5]), np.array([1.0]), np.array([0.5]), np.array([1.0]))
    assert f_m[0] == 0.5 and f_v[0] == 1.0
    d_m, d_v = site_update(np.array([0.0]), np.array([1.0]), np.array([2.0]), np.array([0.5]), damping=0.5)
    assert 1.0 / d_v[0] == pytest.approx(0.5 * 1.0 + 0.5 * 2.0) and d_m[0] * (1.0 / d_v[0]) == pytest.approx(0.5 * 2.0 / 0.5)
    with pytest.raises(ValueError, match="damping"):
        site_update(None, None, np.ones(1), np.ones(1), damping=0.0)
