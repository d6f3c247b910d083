"""Exponential families for posterior fusion: closed-form KL, natural parameters, KL barycenters.

A *batch* of ``n`` distributions of one family is one object holding stacked arrays (``DiagGaussian(mean (n, d),
var (n, d))``). Every family offers:

* ``kl(other)`` -- elementwise ``KL(self_i || other_i)``; ``kl_matrix(other)`` -- all pairs ``KL(self_g || other_l)``,
  shape ``(len(self), len(other))``, built from matrix products of feature maps (no Python loop over rows);
* ``natural()`` -- an ``(n, p)`` array of (an affine image of) the natural parameters, and ``from_natural(eta)``;
  sums and weighted averages of these rows are what the fusion accumulates;
* ``barycenter(weights)`` -- the minimiser over the family of ``sum_i w_i KL(q || q_i)`` (weights normalised), which is
  the member whose natural parameter is the weighted average of the ``q_i``'s (Banerjee et al. 2005; Claici et al.
  2020, section 3.1). Note the direction: the fused distribution is the *first* argument of the KL.

Families (formulas and their sources: ``docs/methods/kl.md``, "Exponential families"):

* :class:`DiagGaussian` ``N(mu, diag(var))`` -- BNN neurons;
* :class:`NormalWishart` ``N(mu | m, (kappa Lambda)^-1) W(Lambda | W, nu)`` -- full-covariance GMM components, built
  from scikit-learn's ``BayesianGaussianMixture`` with :func:`normal_wishart_from_sklearn`;
* :class:`Dirichlet` ``Dir(alpha)`` -- LDA topics.

Constructors validate their input (shapes, finiteness, positivity) and raise :class:`rayfuse.errors.InputError`
naming ``where`` (e.g. ``posteriors[3].kappa``); the other functions assume validated batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
from scipy.special import digamma, gammaln, multigammaln

from rayfuse.errors import InputError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; only the checker reads it

__all__ = ["Family", "DiagGaussian", "NormalWishart", "Dirichlet", "normal_wishart_from_sklearn", "concat", "FAMILIES"]


def _array(value: Any, where: str, ndim: int, what: str) -> np.ndarray:
    try:
        arr = np.array(value, dtype=np.float64)  # a copy: batches never alias the caller's arrays
    except (TypeError, ValueError):
        raise InputError(where, f"a numeric array ({what})", type(value).__name__) from None
    if arr.ndim != ndim:
        raise InputError(where, f"an array with {ndim} dimension(s) ({what})", f"shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise InputError(where, "finite values", "NaN or Inf")
    return arr


def _positive(arr: np.ndarray, where: str, floor: float = 0.0, what: str = "values > 0") -> None:
    if arr.size and not (arr > floor).all():
        raise InputError(where, what, f"min {arr.min():.6g}")


class Family(ABC):
    """A batch of distributions of one exponential family."""

    name: ClassVar[str]

    @abstractmethod
    def __len__(self) -> int: ...

    @property
    @abstractmethod
    def dim(self) -> int:
        """Dimension of the random variable (``d``, ``D`` or the vocabulary size ``V``)."""

    @abstractmethod
    def kl(self, other: Self) -> np.ndarray:
        """``KL(self_i || other_i)`` for each ``i`` (both batches of the same length)."""

    @abstractmethod
    def kl_matrix(self, other: Self) -> np.ndarray:
        """``KL(self_g || other_l)`` for every pair, shape ``(len(self), len(other))``."""

    @abstractmethod
    def natural(self) -> np.ndarray:
        """``(n, p)`` rows whose weighted average is the barycenter's row (an affine image of the natural parameters)."""

    @abstractmethod
    def from_natural(self, eta: np.ndarray) -> Family:
        """The batch with rows ``eta`` (same family and dimension as ``self``)."""

    @abstractmethod
    def take(self, index: Any) -> Family:
        """The sub-batch ``index`` (an index array, slice or boolean mask)."""

    @abstractmethod
    def means(self) -> np.ndarray:
        """``(n, dim)`` expected values (GMM component means, neuron weights, topic-word probabilities)."""

    def barycenter(self, weights: np.ndarray | None = None) -> Family:
        """``argmin_q sum_i w_i KL(q || self_i)`` over the family: one distribution (a batch of length 1)."""
        n = len(self)
        w = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise InputError("weights", f"{n} finite non-negative weights with a positive sum", w)
        return self.from_natural(((w / w.sum()) @ self.natural())[None])

    def _check_same(self, other: Family) -> None:
        if type(other) is not type(self):
            raise InputError("posteriors", f"components of one family ({self.name})", getattr(other, "name", type(other).__name__))
        if other.dim != self.dim:
            raise InputError("posteriors", f"components of dimension {self.dim}", other.dim)


class DiagGaussian(Family):
    """``N(mean, diag(var))``: ``mean`` and ``var`` of shape ``(n, d)``, ``var > 0``."""

    name = "diag_gaussian"

    def __init__(self, mean: Any, var: Any, *, where: str = "posteriors") -> None:
        self.mean = _array(mean, f"{where}.mean", 2, "(components, dims)")
        self.var = _array(var, f"{where}.var", 2, "(components, dims)")
        if self.var.shape != self.mean.shape:
            raise InputError(f"{where}.var", f"the shape of mean {self.mean.shape}", f"shape {self.var.shape}")
        _positive(self.var, f"{where}.var", what="variances > 0")

    @classmethod
    def _trusted(cls, mean: np.ndarray, var: np.ndarray) -> DiagGaussian:
        obj = cls.__new__(cls)
        obj.mean, obj.var = mean, var
        return obj

    def __len__(self) -> int:
        return self.mean.shape[0]

    @property
    def dim(self) -> int:
        return self.mean.shape[1]

    def kl(self, other: DiagGaussian) -> np.ndarray:
        self._check_same(other)
        v0, v1 = self.var, other.var
        return 0.5 * (np.log(v1 / v0) + (v0 + (self.mean - other.mean) ** 2) / v1 - 1.0).sum(axis=1)

    def kl_matrix(self, other: DiagGaussian) -> np.ndarray:
        # sum_d [ ln s1 - ln s0 + (s0^2 + mu0^2 - 2 mu0 mu1 + mu1^2) / (2 s1^2) - 1/2 ]: matrix products over d
        self._check_same(other)
        p1 = 1.0 / other.var
        out = (self.var + self.mean**2) @ p1.T
        out -= (2.0 * self.mean) @ (other.mean * p1).T
        out += (((other.mean**2) * p1).sum(1) + np.log(other.var).sum(1) - self.dim)[None, :]
        out -= np.log(self.var).sum(1)[:, None]
        out *= 0.5
        return out

    def natural(self) -> np.ndarray:
        # (mu / s^2, 1 / s^2): the precision-weighted mean and the precision (natural parameters up to -1/2)
        precision = 1.0 / self.var
        return np.concatenate([self.mean * precision, precision], axis=1)

    def from_natural(self, eta: np.ndarray) -> DiagGaussian:
        d = self.dim
        precision = eta[:, d:]
        return DiagGaussian._trusted(eta[:, :d] / precision, 1.0 / precision)

    def take(self, index: Any) -> DiagGaussian:
        return DiagGaussian._trusted(self.mean[index].reshape(-1, self.dim), self.var[index].reshape(-1, self.dim))

    def means(self) -> np.ndarray:
        return self.mean


class NormalWishart(Family):
    """``N(mu | m, (kappa Lambda)^-1) W(Lambda | W, nu)``, so ``E[Lambda] = nu W``.

    ``mean (n, D)``, ``kappa (n,) > 0``, ``nu (n,) > D - 1``, ``W (n, D, D)`` symmetric positive definite (the
    Wishart scale; the reference code's ``S``).
    """

    name = "normal_wishart"

    def __init__(self, mean: Any, kappa: Any, nu: Any, W: Any, *, where: str = "posteriors") -> None:
        self.mean = _array(mean, f"{where}.mean", 2, "(components, D)")
        n, D = self.mean.shape
        self.kappa = _array(kappa, f"{where}.kappa", 1, "(components,)")
        self.nu = _array(nu, f"{where}.nu", 1, "(components,)")
        self.W = _array(W, f"{where}.W", 3, "(components, D, D)")
        for key, arr, shape in (("kappa", self.kappa, (n,)), ("nu", self.nu, (n,)), ("W", self.W, (n, D, D))):
            if arr.shape != shape:
                raise InputError(f"{where}.{key}", f"shape {shape}", f"shape {arr.shape}")
        _positive(self.kappa, f"{where}.kappa", what="concentrations kappa > 0")
        _positive(self.nu, f"{where}.nu", D - 1.0, f"degrees of freedom nu > D - 1 = {D - 1}")
        if not np.allclose(self.W, np.swapaxes(self.W, 1, 2), rtol=1e-6, atol=1e-10):
            raise InputError(f"{where}.W", "symmetric scale matrices", "an asymmetric matrix")
        self.W = 0.5 * (self.W + np.swapaxes(self.W, 1, 2))
        if n and np.linalg.eigvalsh(self.W).min() <= 0:
            raise InputError(f"{where}.W", "positive definite scale matrices", "a matrix with an eigenvalue <= 0")
        self._cache: dict[str, np.ndarray] = {}

    @classmethod
    def _trusted(cls, mean: np.ndarray, kappa: np.ndarray, nu: np.ndarray, W: np.ndarray) -> NormalWishart:
        obj = cls.__new__(cls)
        obj.mean, obj.kappa, obj.nu, obj.W = mean, kappa, nu, W
        obj._cache = {}
        return obj

    def __len__(self) -> int:
        return self.mean.shape[0]

    @property
    def dim(self) -> int:
        return self.mean.shape[1]

    # cached factorisations (every W is SPD)
    def _logdet(self) -> np.ndarray:
        if "logdet" not in self._cache:
            self._cache["logdet"] = np.linalg.slogdet(self.W)[1]
        return self._cache["logdet"]

    def _W_inv(self) -> np.ndarray:
        if "inv" not in self._cache:
            self._cache["inv"] = np.linalg.inv(self.W)
        return self._cache["inv"]

    def _psi_D(self) -> np.ndarray:
        # psi_D(nu / 2) = sum_{i=1..D} psi(nu / 2 - (i - 1) / 2)
        if "psi" not in self._cache:
            half = self.nu[:, None] / 2 - np.arange(self.dim)[None, :] / 2
            self._cache["psi"] = digamma(half).sum(1)
        return self._cache["psi"]

    def _lgamma_D(self) -> np.ndarray:
        if "lgamma" not in self._cache:
            self._cache["lgamma"] = np.array([multigammaln(v / 2, self.dim) for v in self.nu]) if len(self) else np.zeros(0)
        return self._cache["lgamma"]

    def kl(self, other: NormalWishart) -> np.ndarray:
        """Closed form (``docs/methods/kl.md``). The Gaussian part uses ``kappa1 / kappa0``; the reference code's
        ``gaus_kl`` swaps the two (``k0 / k1``), a bug not reproduced here."""
        self._check_same(other)
        D = self.dim
        k0, k1, n0, n1 = self.kappa, other.kappa, self.nu, other.nu
        diff = other.mean - self.mean
        quad = np.einsum("ni,nij,nj->n", diff, self.W, diff) * n0  # (m1 - m0)^T (nu0 W0) (m1 - m0)
        gauss = 0.5 * (D * (k1 / k0 - 1.0 + np.log(k0 / k1)) + k1 * quad)
        trace = np.einsum("nij,nji->n", other._W_inv(), self.W)
        wishart = (
            -0.5 * n1 * (self._logdet() - other._logdet())
            + 0.5 * n0 * (trace - D)
            + other._lgamma_D()
            - self._lgamma_D()
            + 0.5 * (n0 - n1) * self._psi_D()
        )
        return gauss + wishart

    def kl_matrix(self, other: NormalWishart) -> np.ndarray:
        # Every cross term is a product of a feature of g (first argument) and a feature of l (second argument):
        #   (m_l - m_g)^T A_g (m_l - m_g) = vec(A_g) . vec(m_l m_l^T) - 2 (A_g m_g) . m_l + m_g^T A_g m_g,  A_g = nu_g W_g
        #   tr(W_l^-1 W_g) = vec(W_g) . vec(W_l^-1)
        self._check_same(other)
        D = self.dim
        k0, k1, n0, n1 = self.kappa[:, None], other.kappa[None, :], self.nu[:, None], other.nu[None, :]
        A = self.W * self.nu[:, None, None]
        Am = np.einsum("gij,gj->gi", A, self.mean)
        outer = np.einsum("li,lj->lij", other.mean, other.mean).reshape(len(other), D * D)
        quad = A.reshape(len(self), D * D) @ outer.T - 2.0 * Am @ other.mean.T + np.einsum("gi,gi->g", Am, self.mean)[:, None]
        gauss = 0.5 * (D * (k1 / k0 - 1.0 + np.log(k0) - np.log(k1)) + k1 * quad)
        trace = self.W.reshape(len(self), D * D) @ other._W_inv().reshape(len(other), D * D).T
        wishart = (
            -0.5 * n1 * (self._logdet()[:, None] - other._logdet()[None, :])
            + 0.5 * n0 * (trace - D)
            + other._lgamma_D()[None, :]
            - self._lgamma_D()[:, None]
            + 0.5 * (n0 - n1) * self._psi_D()[:, None]
        )
        return gauss + wishart

    def natural(self) -> np.ndarray:
        # (kappa, nu, kappa m, W^-1 + kappa m m^T) [KLF : src/nw_KL.py nw_to_natural]: linear in the natural parameters
        # (kappa m, -kappa / 2, -(W^-1 + kappa m m^T) / 2, (nu - D) / 2) of the Normal-Wishart.
        n, D = self.mean.shape
        km = self.kappa[:, None] * self.mean
        second = self._W_inv() + np.einsum("ni,nj->nij", km, self.mean)
        return np.concatenate([self.kappa[:, None], self.nu[:, None], km, second.reshape(n, D * D)], axis=1)

    def from_natural(self, eta: np.ndarray) -> NormalWishart:
        D = self.dim
        kappa, nu = eta[:, 0].copy(), eta[:, 1].copy()
        mean = eta[:, 2 : 2 + D] / kappa[:, None]
        W_inv = eta[:, 2 + D :].reshape(-1, D, D) - kappa[:, None, None] * np.einsum("ni,nj->nij", mean, mean)
        W_inv = 0.5 * (W_inv + np.swapaxes(W_inv, 1, 2))
        return NormalWishart._trusted(mean, kappa, nu, np.linalg.inv(W_inv))

    def take(self, index: Any) -> NormalWishart:
        D = self.dim
        return NormalWishart._trusted(
            self.mean[index].reshape(-1, D), self.kappa[index].reshape(-1), self.nu[index].reshape(-1), self.W[index].reshape(-1, D, D)
        )

    def means(self) -> np.ndarray:
        return self.mean

    def expected_precision(self) -> np.ndarray:
        return self.W * self.nu[:, None, None]


class Dirichlet(Family):
    """``Dir(alpha)`` on the ``V``-simplex: ``alpha (n, V) > 0``."""

    name = "dirichlet"

    def __init__(self, alpha: Any, *, where: str = "posteriors") -> None:
        self.alpha = _array(alpha, f"{where}.alpha", 2, "(components, V)")
        _positive(self.alpha, f"{where}.alpha", what="concentrations alpha > 0")

    @classmethod
    def _trusted(cls, alpha: np.ndarray) -> Dirichlet:
        obj = cls.__new__(cls)
        obj.alpha = alpha
        return obj

    def __len__(self) -> int:
        return self.alpha.shape[0]

    @property
    def dim(self) -> int:
        return self.alpha.shape[1]

    def _per_row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a0 = self.alpha.sum(1)
        elog = digamma(self.alpha) - digamma(a0)[:, None]  # E[ln p_v]
        log_norm = gammaln(a0) - gammaln(self.alpha).sum(1)
        return a0, elog, log_norm

    def kl(self, other: Dirichlet) -> np.ndarray:
        self._check_same(other)
        _, elog, norm0 = self._per_row()
        _, _, norm1 = other._per_row()
        return norm0 - norm1 + ((self.alpha - other.alpha) * elog).sum(1)

    def kl_matrix(self, other: Dirichlet) -> np.ndarray:
        self._check_same(other)
        _, elog, norm0 = self._per_row()
        _, _, norm1 = other._per_row()
        return (norm0 + (self.alpha * elog).sum(1))[:, None] - norm1[None, :] - elog @ other.alpha.T

    def natural(self) -> np.ndarray:
        return self.alpha.copy()  # alpha - 1 is natural; averaging alpha is the same with weights summing to 1

    def from_natural(self, eta: np.ndarray) -> Dirichlet:
        return Dirichlet._trusted(np.asarray(eta, dtype=np.float64))

    def take(self, index: Any) -> Dirichlet:
        return Dirichlet._trusted(self.alpha[index].reshape(-1, self.dim))

    def means(self) -> np.ndarray:
        return self.alpha / self.alpha.sum(1, keepdims=True)


FAMILIES: dict[str, type[Family]] = {cls.name: cls for cls in (DiagGaussian, NormalWishart, Dirichlet)}


def concat(batches: Sequence[Family], *, where: str = "posteriors") -> Family:
    """One batch from several of the same family and dimension (raises :class:`InputError` on a mix)."""
    if not batches:
        raise InputError(where, "at least one batch of components", "none")
    first = batches[0]
    for i, batch in enumerate(batches):
        if not isinstance(batch, Family):
            raise InputError(f"{where}[{i}]", "a batch of exponential-family components", type(batch).__name__)
        if type(batch) is not type(first):
            raise InputError(f"{where}[{i}]", f"components of one family ({first.name})", batch.name)
        if batch.dim != first.dim:
            raise InputError(f"{where}[{i}]", f"components of dimension {first.dim}", batch.dim)
    # every batch has the type of ``first`` (checked above)
    if isinstance(first, DiagGaussian):
        gaussians = cast("Sequence[DiagGaussian]", batches)
        return DiagGaussian._trusted(np.concatenate([b.mean for b in gaussians]), np.concatenate([b.var for b in gaussians]))
    if isinstance(first, NormalWishart):
        wisharts = cast("Sequence[NormalWishart]", batches)
        return NormalWishart._trusted(
            np.concatenate([b.mean for b in wisharts]),
            np.concatenate([b.kappa for b in wisharts]),
            np.concatenate([b.nu for b in wisharts]),
            np.concatenate([b.W for b in wisharts]),
        )
    dirichlets = cast("Sequence[Dirichlet]", batches)
    return Dirichlet._trusted(np.concatenate([b.alpha for b in dirichlets]))


def normal_wishart_from_sklearn(model: Any, *, where: str = "posterior") -> NormalWishart:
    """The Normal-Wishart posteriors of a fitted ``sklearn.mixture.BayesianGaussianMixture``.

    ``kappa = mean_precision_``, ``nu = degrees_of_freedom_``, ``m = means_`` and ``W = precisions_ / nu`` (scikit-learn
    stores ``precisions_ = nu W``) [KLF : src/nw_KL.py ``nw_from_VI``]; ``diag`` / ``spherical`` / ``tied`` precisions are
    expanded to full matrices.
    """
    for attr in ("mean_precision_", "degrees_of_freedom_", "means_", "precisions_"):
        if not hasattr(model, attr):
            raise InputError(where, "a fitted BayesianGaussianMixture", f"an object without {attr}")
    means = np.asarray(model.means_, dtype=np.float64)
    n, D = means.shape
    prec = np.asarray(model.precisions_, dtype=np.float64)
    kind = getattr(model, "covariance_type", "full")
    if kind == "diag":
        prec = np.stack([np.diag(p) for p in prec])
    elif kind == "spherical":
        prec = prec[:, None, None] * np.eye(D)[None]
    elif kind == "tied":
        prec = np.broadcast_to(prec, (n, D, D))
    nu = np.asarray(model.degrees_of_freedom_, dtype=np.float64).reshape(n)
    return NormalWishart(means, np.asarray(model.mean_precision_, dtype=np.float64).reshape(n), nu, prec / nu[:, None, None], where=where)
