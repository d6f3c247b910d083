"""The closed-form expectation-propagation prior of EP-GAN (Wu et al., "Unsupervised Federated Learning with
Expectation-Propagation Prior GAN"; docs/methods/epgan.md), elementwise over parameters and vectorised.

Each generator parameter ``theta`` has a Gaussian EP prior; a client's likelihood of a data item is approximated by
``sigma(f theta)`` with ``f`` the output of an auxiliary network. With the cavity ``theta ~ N(m, s)`` (mean, variance),
``C = f theta ~ N(C_m, C_s)`` with ``C_m = f m`` and ``C_s = f^2 s``, and the tilted distribution
``h(theta) ∝ sigma(f theta) N(theta; m, s)`` has closed-form moments:

* :func:`sigmoid_power_mean`: Lemma 4.1, ``E[sigma^d(C)] ~ sigma(a_d (C_m + b_d) / sqrt(1 + zeta^2 a_d^2 C_s))`` with
  ``zeta^2 = pi / 8``, ``a_d = 2d (1 - 2^(-1/d))``, ``b_d = ln(2^(1/d) - 1)``. **Paper error corrected:** eq. 26
  gives ``b_2 = ln(sqrt 2 + 1)``; the right value is ``ln(sqrt 2 - 1)`` (the wrong sign gives E[sigma^2] ~ 0.70 where
  the exact value at (0, 1) is 0.29).
* :func:`tilted_moments`: Theorem 4.1 through Stein's lemma, ``S1 = E_h[theta] = E[C sigma] / (f S0)`` and
  ``S2 = E_h[theta^2] = E[C^2 sigma] / (f^2 S0)``. **Paper error corrected:** eq. 13/23/38 use
  ``E[C sigma^2]`` in place of ``E[C^2 sigma]`` for S2, which can give negative variances
  (:func:`paper_second_moment` keeps the paper's form for the test that shows it).
* :func:`gaussian_product`: the server's product of the clients' Gaussian factors. **Paper error corrected:** the
  paper writes the combined variance as ``sum_k 1 / s_k``, which is the precision; the variance is its inverse.
* :func:`cavity` and :func:`site_update`: EP's cavity (global prior divided by the client's site, in natural
  parameters) and the damped site update (docs/methods/epgan.md, PROPOSED: once per round per client, damping 0.5).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import expit

__all__ = [
    "ZETA2",
    "probit_coefficients",
    "sigmoid_power_mean",
    "stein_moments",
    "tilted_moments",
    "paper_second_moment",
    "gaussian_product",
    "cavity",
    "site_update",
    "MIN_VARIANCE",
]

ZETA2 = math.pi / 8.0  # probit matching: sigma(x) ~ Phi(zeta x)
MIN_VARIANCE = 1e-8  # the variance floor (docs/methods/epgan.md)
MIN_F = 1e-6  # |f| below this carries no information about theta: the moments are the cavity's


def probit_coefficients(d: int) -> tuple[float, float]:
    """``(a_d, b_d)`` of Lemma 4.1, with the corrected sign of ``b_d`` (``b_1 = 0``, ``b_2 = ln(sqrt 2 - 1)``...)."""
    if d < 1:
        raise ValueError(f"d must be a positive integer, got {d}")
    root = 2.0 ** (1.0 / d)
    return 2.0 * d * (1.0 - 1.0 / root), math.log(root - 1.0)


def sigmoid_power_mean(d: int, c_mean: np.ndarray, c_var: np.ndarray) -> np.ndarray:
    """Lemma 4.1: ``E[sigma(C)^d]`` for ``C ~ N(c_mean, c_var)``, elementwise."""
    a, b = probit_coefficients(d)
    c_mean, c_var = np.asarray(c_mean, np.float64), np.asarray(c_var, np.float64)
    return expit(a * (c_mean + b) / np.sqrt(1.0 + ZETA2 * a * a * c_var))


def stein_moments(
    c_mean: np.ndarray, c_var: np.ndarray, e1: np.ndarray, e2: np.ndarray, e3: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``E[C sigma]``, ``E[C sigma^2]`` and ``E[C^2 sigma]`` from ``E_d = E[sigma^d(C)]`` (eq. 31, 37, 35; exact given
    exact ``E_d``: Stein's lemma ``E[g(C)(C - C_m)] = C_s E[g'(C)]`` with ``sigma' = sigma - sigma^2``)."""
    c_sigma = (c_mean + c_var) * e1 - c_var * e2  # E[C s] = C_m E1 + C_s E[s'] and s' = s - s^2
    c_sigma2 = (c_mean + 2.0 * c_var) * e2 - 2.0 * c_var * e3  # (s^2)' = 2 s^2 - 2 s^3
    c2_sigma = c_var * e1 + (c_mean + c_var) * c_sigma - c_var * c_sigma2  # E[C (C s)] by Stein once more
    return c_sigma, c_sigma2, c2_sigma


def _stein_moments(c_mean: np.ndarray, c_var: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``S0 = E[sigma]`` and :func:`stein_moments` with Lemma 4.1's ``E_d``."""
    e1, e2, e3 = (sigmoid_power_mean(d, c_mean, c_var) for d in (1, 2, 3))
    return (e1, *stein_moments(c_mean, c_var, e1, e2, e3))


def tilted_moments(f: np.ndarray | float, mean: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Theorem 4.1 (corrected): mean and variance of ``h(theta) ∝ sigma(f theta) N(theta; mean, var)``, elementwise.

    Parameters
    ----------
    f : float or ndarray
        The auxiliary network's output (a scalar per client, or one per parameter); broadcast against ``mean``.
    mean, var : ndarray
        The cavity's mean and variance (``var > 0``).

    Returns
    -------
    (new_mean, new_var) : ndarray
        ``S1`` and ``max(S2 - S1^2, MIN_VARIANCE)``; where ``|f| < 1e-6`` the cavity itself.
    """
    mean = np.asarray(mean, np.float64)
    var = np.asarray(var, np.float64)
    if np.any(~(var > 0)):
        raise ValueError("tilted_moments: every variance must be positive")
    f = np.broadcast_to(np.asarray(f, np.float64), mean.shape)
    informative = np.abs(f) >= MIN_F
    f_safe = np.where(informative, f, 1.0)
    s0, c_sigma, _, c2_sigma = _stein_moments(f_safe * mean, f_safe * f_safe * var)
    s1 = c_sigma / (f_safe * s0)
    s2 = c2_sigma / (f_safe * f_safe * s0)
    new_var = np.maximum(s2 - s1 * s1, MIN_VARIANCE)
    return np.where(informative, s1, mean), np.where(informative, new_var, var)


def paper_second_moment(f: float, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """The paper's S2 (eq. 13/23/38): ``E[C sigma^2] / (f^2 S0)``, kept only to show that it is wrong."""
    s0, _, c_sigma2, _ = _stein_moments(f * np.asarray(mean, np.float64), f * f * np.asarray(var, np.float64))
    return c_sigma2 / (f * f * s0)


def gaussian_product(means: list[np.ndarray] | np.ndarray, variances: list[np.ndarray] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The product of Gaussian factors ``prod_k N(theta; m_k, s_k)`` up to normalisation, elementwise.

    Precision ``Lambda = sum_k 1 / s_k``; variance ``1 / Lambda``; mean ``(sum_k m_k / s_k) / Lambda``.
    """
    means = np.asarray(means, np.float64)
    variances = np.asarray(variances, np.float64)
    if means.shape != variances.shape:
        raise ValueError(f"gaussian_product: means {means.shape} and variances {variances.shape} differ in shape")
    if np.any(~(variances > 0)):
        raise ValueError("gaussian_product: every variance must be positive")
    precision = (1.0 / variances).sum(axis=0)
    var = 1.0 / precision
    return var * (means / variances).sum(axis=0), var


def cavity(
    global_mean: np.ndarray, global_var: np.ndarray, site_mean: np.ndarray | None, site_var: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The cavity ``q_{-k} = q_global / q_k`` in natural parameters; the global prior where that is not a Gaussian.

    ``lambda_{-k} = 1/s_g - 1/s_k``, ``eta_{-k} = m_g/s_g - m_k/s_k``. Where ``lambda_{-k} <= 0`` (the site holds
    as much precision as the whole prior, e.g. in the first round when the prior is the client's own site) the
    global prior is used, as Algorithm 2 does.
    """
    global_mean = np.asarray(global_mean, np.float64)
    global_var = np.asarray(global_var, np.float64)
    if site_mean is None or site_var is None:
        return global_mean, global_var
    lam = 1.0 / global_var - 1.0 / np.asarray(site_var, np.float64)
    eta = global_mean / global_var - np.asarray(site_mean, np.float64) / np.asarray(site_var, np.float64)
    ok = lam > 1.0 / np.maximum(global_var, MIN_VARIANCE) * 1e-6  # a positive precision, not rounding noise
    safe = np.where(ok, lam, 1.0)
    return np.where(ok, eta / safe, global_mean), np.where(ok, 1.0 / safe, global_var)


def site_update(
    old_mean: np.ndarray | None, old_var: np.ndarray | None, new_mean: np.ndarray, new_var: np.ndarray, damping: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Damped update in natural parameters: ``(1 - rho) old + rho new`` for precision and precision-mean."""
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"damping must be in (0, 1], got {damping}")
    new_mean, new_var = np.asarray(new_mean, np.float64), np.asarray(new_var, np.float64)
    if old_mean is None or old_var is None or damping == 1.0:
        return new_mean, new_var
    lam = (1.0 - damping) / np.asarray(old_var, np.float64) + damping / new_var
    eta = (1.0 - damping) * np.asarray(old_mean, np.float64) / old_var + damping * new_mean / new_var
    return eta / lam, 1.0 / lam
