"""Good-enough model spaces: the math of GEMS (Guha & Smith 2019), as plain functions on arrays.

A *good-enough ball* of client ``k`` is the set of parameter vectors ``w`` around its local optimum ``c_k`` whose
models still pass the client's test ``Q_k`` (validation accuracy ``>= epsilon``, eq. 1 of [1]; or, for one hidden
neuron, an activation distance ``<= epsilon_j``, eq. 3). It is approximated by a ball (or an ellipsoid, App. A)::

    H_k = { w : || a_k * (w - c_k) ||_2 <= 1 },   a_k = m_k / (sigma_k * r_k)

with ``r_k`` the radius found by a binary search (Algorithm 2), ``sigma_k`` the ellipsoid's relative axes
(``sigma = 1``: a sphere) and ``m_k`` a 0/1 mask of the searched coordinates (Fisher top-``fisher_prop``; masked-out
coordinates are unconstrained). The server looks for a point in the intersection of the balls (eq. 2)::

    min_w  sum_k max(0, || a_k * (w - c_k) ||_2 - 1)

Everything here is batched: the ``p`` models sampled at one radius, for every ball being searched at once (all the
hidden neurons of a layer), are evaluated as one tensor computation (``torch.einsum``), never one model at a time.
The functions assume validated inputs unless they say otherwise; the public boundary is :mod:`rayfuse.fusion.gems.algorithm`.

References
----------
[1] N. Guha, V. Smith. Model Aggregation via Good-Enough Model Spaces. arXiv:1805.07782 (2019).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from rayfuse.errors import InputError

__all__ = [
    "RadiusSearch",
    "Intersection",
    "FusedNeurons",
    "sample_surface",
    "search_radii",
    "ellipsoid_axes",
    "compute_fisher",
    "fisher_mask",
    "softmax_accuracy",
    "neuron_distance",
    "intersect_balls",
    "balls_intersect_pairwise",
    "cluster_neurons",
    "fuse_neurons",
    "flatten_linear",
    "unflatten_linear",
]


# -----------------------------------------------------------------------------------------------------------------
# Parameter layout of one linear layer as one vector: [W.ravel() (out*in), b (out)]


def flatten_linear(weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``[W.ravel(), b]``: the vector a ball is built around (weights and bias, as in the reference code)."""
    return np.concatenate([np.asarray(weight, dtype=np.float64).ravel(), np.asarray(bias, dtype=np.float64).ravel()])


def unflatten_linear(vector: np.ndarray, out_features: int, in_features: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`flatten_linear`: ``(W (out, in), b (out,))`` as float32."""
    n = out_features * in_features
    weight = np.asarray(vector[:n], dtype=np.float32).reshape(out_features, in_features)
    return np.ascontiguousarray(weight), np.ascontiguousarray(vector[n : n + out_features], dtype=np.float32)


# -----------------------------------------------------------------------------------------------------------------
# Sampling on the surface and the binary search on the radius (Algorithm 2)


def sample_surface(
    centers: np.ndarray,
    radii: np.ndarray,
    num_samples: int,
    rng: np.random.Generator,
    *,
    axes: np.ndarray | None = None,
    masks: np.ndarray | None = None,
    dtype: str = "float64",
    device: str | torch.device = "cpu",
    shared: bool = False,
) -> np.ndarray | torch.Tensor:
    """``num_samples`` points on the surface of each of ``B`` balls or ellipsoids, shape ``(B, p, d)``.

    For ball ``b`` with centre ``c``, radius ``R``, axes ``sigma`` and mask ``m``::

        z ~ N(0, I_d),   w' = c + R * sigma * (m * z) / || m * z ||_2

    so ``|| m * (w' - c) / (sigma R) ||_2 = 1``: a uniform direction on the (masked) sphere, stretched along the
    ellipsoid's axes. This equals the reference ellipsoid sampler ``g ~ N(0, (sigma R)^2)``,
    ``w' = c + g / sqrt(sum_i g_i^2 / (sigma_i R)^2)`` [GEMS: utils/ellipsoid_sampler.py], and with ``sigma = 1`` the
    sphere sampler of Algorithm 2.

    Parameters
    ----------
    centers : (B, d) array
    radii : (B,) array
    num_samples : int
        ``p``.
    rng : numpy.random.Generator
    axes : (B, d) array, optional
        Relative ellipsoid axes ``sigma`` in ``(0, 1]``; ``None`` for spheres.
    masks : (B, d) 0/1 array, optional
        Searched coordinates; ``None`` for all.
    dtype : ``"float64"`` or ``"float32"``
        ``float64`` (default): a numpy array, drawn from ``rng``. ``float32``: a torch tensor on ``device``, drawn by a
        torch generator seeded from ``rng`` -- the models are float32 anyway, and torch's float32 normals are ~4x
        cheaper than numpy's float64 ones, which dominate the cost of the radius search (the GEMS client steps use
        this path; tests of the geometry use float64).
    shared : bool
        Draw one set of ``p`` normals for all ``B`` balls (common random numbers). Each ball still gets ``p``
        independent uniform directions -- its radius search sees exactly the distribution of the reference's draws --
        only the draws of *different* balls are correlated, which no ball's test looks at. The neuron balls of a
        layer use this: it divides the cost of drawing, which dominates their search, by the layer's width.
    """
    if dtype == "float32":
        return _sample_surface_torch(centers, radii, num_samples, rng, axes=axes, masks=masks, device=device, shared=shared)
    if dtype != "float64":
        raise ValueError(f"dtype: expected 'float64' or 'float32', got {dtype!r}")
    centers = np.asarray(centers, dtype=np.float64)
    B, d = centers.shape
    z = rng.standard_normal((1 if shared else B, num_samples, d))
    if masks is not None:
        z = z * masks[:, None, :]
    z = z / np.maximum(np.linalg.norm(z, axis=2, keepdims=True), 1e-300)
    if axes is not None:
        z = z * axes[:, None, :]
    return centers[:, None, :] + np.asarray(radii, dtype=np.float64)[:, None, None] * z


@torch.no_grad()
def _sample_surface_torch(
    centers: np.ndarray,
    radii: np.ndarray,
    num_samples: int,
    rng: np.random.Generator,
    *,
    axes: np.ndarray | None,
    masks: np.ndarray | None,
    device: str | torch.device,
    shared: bool = False,
) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**63 - 1)))
    c = _as_tensor(centers, device)
    B, d = c.shape
    z = torch.randn((1 if shared else B, num_samples, d), generator=gen, dtype=torch.float32, device=device)
    if masks is not None:
        z = z * _as_tensor(masks, device)[:, None, :]
    z = z / torch.linalg.vector_norm(z, dim=2, keepdim=True).clamp_min(1e-30)
    if axes is not None:
        z = z * _as_tensor(axes, device)[:, None, :]
    return torch.addcmul(c[:, None, :], _as_tensor(radii, device)[:, None, None], z)


@dataclass
class RadiusSearch:
    """Result of :func:`search_radii` for ``B`` balls.

    ``radius`` is the largest radius at which all ``p`` sampled models passed (0 when none did), ``upper`` the
    smallest at which one failed (``r_max`` when none did); ``upper - radius < tol`` unless ``radius == r_max``.
    ``steps`` counts the bisection steps, ``evaluations`` the sampled models evaluated.
    """

    radius: np.ndarray
    upper: np.ndarray
    steps: int
    evaluations: int
    history: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # (ball ids, R, passed)


def search_radii(
    passes: Callable[[np.ndarray | torch.Tensor, np.ndarray], np.ndarray],
    centers: np.ndarray,
    *,
    num_samples: int,
    r_max: float,
    tol: float,
    rng: np.random.Generator,
    axes: np.ndarray | None = None,
    masks: np.ndarray | None = None,
    record: bool = False,
    dtype: str = "float64",
    device: str | torch.device = "cpu",
    shared: bool = False,
) -> RadiusSearch:
    """Binary search on each ball's radius (Algorithm 2 of [1]), all balls at once.

    ::

        lo = 0, hi = r_max
        while hi - lo >= tol:
            R = (lo + hi) / 2
            sample w'_1..w'_p on the surface of radius R
            lo = R if Q(w'_i) passes for every i else hi = R

    Parameters
    ----------
    passes : callable ``(samples (b, p, d), ball_ids (b,)) -> bool (b, p)``
        The test ``Q`` of every sampled model of the ``b`` balls still being searched (one batched computation).
    centers : (B, d) array
    num_samples, r_max, tol : the search settings ``p``, ``R_max``, ``Delta``.
    rng : numpy.random.Generator
    axes, masks, dtype, device, shared : see :func:`sample_surface` (``passes`` gets torch tensors with
        ``dtype="float32"``).
    record : bool
        Keep ``(ball ids, R, passed)`` of every step in ``history`` (tests).

    Notes
    -----
    The reference code stops a radius at the first failing sample (a Python loop over samples); evaluating all ``p``
    at once gives the same decision for the same draws. It returns the midpoint ``(lo + hi) / 2``, a radius that was
    never tested; we return ``lo``, the largest radius whose samples all passed (at most ``tol / 2`` smaller).
    """
    centers = np.asarray(centers, dtype=np.float64)
    B = centers.shape[0]
    lo = np.zeros(B)
    hi = np.full(B, float(r_max))
    steps = evaluations = 0
    history = []
    done = np.zeros(B, dtype=bool)  # balls whose interval has no float left between its ends (tol below the spacing)
    while True:
        active = np.flatnonzero((hi - lo >= tol) & ~done)
        if active.size == 0:
            break
        R = (lo[active] + hi[active]) / 2
        moving = (R > lo[active]) & (R < hi[active])
        if not moving.all():  # bounded whatever tol is: such a ball's search ends here
            done[active[~moving]] = True
            active, R = active[moving], R[moving]
            if active.size == 0:
                break
        passed = np.ones(active.size, dtype=bool)
        # Two batches: a first chunk of the p samples, then the rest only for the balls whose chunk all passed (the
        # batched form of the reference's early exit at the first failing sample; a failing radius usually fails early).
        first = min(num_samples, max(1, num_samples // 10))
        for count in (first, num_samples - first):
            todo = np.flatnonzero(passed)
            if count == 0 or todo.size == 0:
                continue
            ids = active[todo]
            samples = sample_surface(
                centers[ids],
                R[todo],
                count,
                rng,
                axes=None if axes is None else axes[ids],
                masks=None if masks is None else masks[ids],
                dtype=dtype,
                device=device,
                shared=shared,
            )
            passed[todo] = np.asarray(passes(samples, ids), dtype=bool).all(axis=1)
            evaluations += samples.shape[0] * samples.shape[1]
        lo[active[passed]] = R[passed]
        hi[active[~passed]] = R[~passed]
        steps += 1
        if record:
            history.append((active.copy(), R.copy(), passed.copy()))
    # A ball that passed at every step keeps growing toward r_max: report r_max's neighbourhood as found.
    return RadiusSearch(lo, hi, steps, evaluations, history)


# -----------------------------------------------------------------------------------------------------------------
# Test functions, batched over (balls, samples)


def _as_tensor(array: np.ndarray | torch.Tensor, device: str | torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array.to(device=device, dtype=dtype)
    return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)


@torch.no_grad()
def softmax_accuracy(
    samples: np.ndarray | torch.Tensor, X: np.ndarray, y: np.ndarray, num_classes: int, *, device: str | torch.device = "cpu"
) -> np.ndarray:
    """Accuracy on ``(X, y)`` of every sampled softmax-regression model, shape ``(B, p)``.

    ``samples`` ``(B, p, C*D + C)`` in the :func:`flatten_linear` layout; the logits of all ``B*p`` models are one
    ``einsum('nd,bpcd->bpnc')``.
    """
    B, p, _ = samples.shape
    D = X.shape[1]
    C = num_classes
    s = _as_tensor(samples, device)
    weights = s[..., : C * D].reshape(B, p, C, D)
    bias = s[..., C * D :]
    Xt = _as_tensor(X, device)
    logits = torch.einsum("nd,bpcd->bpnc", Xt, weights) + bias[:, :, None, :]
    correct = logits.argmax(dim=-1) == torch.as_tensor(y, device=device)[None, None, :]
    return correct.float().mean(dim=-1).cpu().numpy()


_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "gelu": torch.nn.functional.gelu}


@torch.no_grad()
def neuron_distance(
    samples: np.ndarray | torch.Tensor, X: np.ndarray, targets: np.ndarray, *, activation: str = "relu", device: str | torch.device = "cpu"
) -> np.ndarray:
    """Eq. (3) of [1] for every sampled neuron: ``|| act(X w' + b') - z ||_2 / n``, shape ``(B, p)``.

    ``samples`` ``(B, p, D + 1)`` are ``[w, b]`` of neuron ``b``'s samples; ``targets`` ``(n, B)`` the activations
    ``z`` of the original neurons on the same ``n`` inputs ``X`` ``(n, D)``.
    """
    s = _as_tensor(samples, device)
    act = _ACTIVATIONS[activation]
    out = act(torch.einsum("nd,bpd->bpn", _as_tensor(X, device), s[..., :-1]) + s[..., -1:])
    z = _as_tensor(targets, device).T[:, None, :]
    return (torch.linalg.vector_norm(out - z, dim=-1) / max(X.shape[0], 1)).cpu().numpy()


# -----------------------------------------------------------------------------------------------------------------
# Fisher information and the ellipsoid (App. A)


def compute_fisher(weight: np.ndarray, bias: np.ndarray, X: np.ndarray, num_samples: int, rng: np.random.Generator) -> np.ndarray:
    """Diagonal empirical Fisher of a softmax regression, in the :func:`flatten_linear` layout.

    For ``num_samples`` inputs ``x`` drawn from ``X`` and a class ``c ~ softmax(W x + b)``, accumulate
    ``(d log p_c / d theta)^2`` and average [GEMS: utils/epsilon_space.py ``compute_fisher``]. For softmax regression
    the gradient is closed-form: ``d log p_c / dW = (e_c - p) x^T`` and ``d log p_c / db = e_c - p``.
    """
    n = X.shape[0]
    idx = rng.choice(n, size=num_samples, replace=num_samples > n)
    x = np.asarray(X[idx], dtype=np.float64)
    logits = x @ np.asarray(weight, dtype=np.float64).T + np.asarray(bias, dtype=np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    c = (p.cumsum(axis=1) > rng.random((num_samples, 1))).argmax(axis=1)
    e = -p
    e[np.arange(num_samples), c] += 1.0
    fisher_w = (e**2).T @ (x**2) / num_samples  # mean over samples of (e_i x_j)^2
    fisher_b = (e**2).mean(axis=0)
    return np.concatenate([fisher_w.ravel(), fisher_b])


def ellipsoid_axes(fisher: np.ndarray, floor: float) -> np.ndarray:
    """Relative axes ``sigma_i = max(min_j F_j / F_i, c)`` (eq. 5 of [1], App. A), in ``[c, 1]``.

    Computed as the reference does: ``(1 / (|F_i| + 1e-5)) / max_j (1 / (|F_j| + 1e-5))``; high-Fisher (sensitive)
    parameters get short axes, flat ones the full radius.
    """
    inverse = 1.0 / (np.abs(fisher) + 1e-5)
    return np.maximum(inverse / inverse.max(), floor)


def fisher_mask(fisher: np.ndarray, proportion: float) -> np.ndarray:
    """0/1 mask of the parameters whose Fisher value is in the top ``proportion`` (1.0: every parameter)."""
    if proportion >= 1.0:
        return np.ones_like(fisher)
    return (fisher >= np.quantile(fisher, 1.0 - proportion)).astype(np.float64)


# -----------------------------------------------------------------------------------------------------------------
# Intersection (eq. 2)


@dataclass
class Intersection:
    """A point of (or, when ``found`` is false, closest to) the intersection of the balls.

    ``distances`` are the normalised distances ``|| a_k (w - c_k) ||`` (<= 1 inside ball k); ``distance_left`` is
    eq. (2)'s objective in parameter units, ``sum_k r_k max(0, distance_k - 1)`` (exactly eq. 2 for spheres).
    """

    point: np.ndarray
    found: bool
    distances: np.ndarray
    distance_left: float
    iterations: int


def _inverse_scales(radii: np.ndarray, axes: np.ndarray | None, masks: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    scale = np.maximum(radii, 1e-12)[:, None] * (np.ones(shape) if axes is None else axes)
    inv = 1.0 / scale
    return inv if masks is None else inv * masks


def _check_balls(centers: np.ndarray, radii: np.ndarray, axes: np.ndarray | None, masks: np.ndarray | None) -> None:
    if centers.ndim != 2 or centers.shape[0] < 1:
        raise InputError("centers", "an array (K, d) with one ball centre per row", f"shape {centers.shape}")
    if radii.shape != (centers.shape[0],):
        raise InputError("radii", f"one radius per centre, shape ({centers.shape[0]},)", f"shape {radii.shape}")
    if np.any(radii < 0) or not np.all(np.isfinite(radii)):
        raise InputError("radii", "finite radii >= 0", radii.tolist()[:5])
    for name, arr in (("axes", axes), ("masks", masks)):
        if arr is not None and arr.shape != centers.shape:
            raise InputError(name, f"the centres' shape {centers.shape}", f"shape {arr.shape}")


def intersect_balls(
    centers: np.ndarray,
    radii: np.ndarray,
    *,
    axes: np.ndarray | None = None,
    masks: np.ndarray | None = None,
    max_iter: int = 1000,
    margin: float = 1e-3,
    init: np.ndarray | None = None,
) -> Intersection:
    """A point in the intersection of ``K`` balls / ellipsoids, or the closest one (eq. 2 of [1]).

    The paper minimises ``sum_k max(0, || a_k (w - c_k) || - 1)`` by plain gradient descent from the average of the
    centres (lr 0.01 for spheres, 0.001 for ellipsoids, [GEMS: utils/ellipsoid_sampler.py]). That subgradient method
    oscillates at the boundary and needs its step size tuned to the radii; we minimise instead the smooth squared
    hinge ``sum_k max(0, || a_k (w - c_k) || - (1 - margin))^2`` with L-BFGS from the same start. Both objectives
    are zero exactly on the (slightly shrunk) intersection, so ``found`` is decided on eq. (2) itself.

    Parameters
    ----------
    centers : (K, d) array
    radii : (K,) array
    axes : (K, d) array, optional
        Ellipsoid axes ``sigma_k`` (``None``: spheres).
    masks : (K, d) 0/1 array, optional
        Coordinates each ball constrains (``None``: all). The reference code builds this mask from the client's
        *weights* (``tf_mask.append(tf.constant(agent_vars[v]))``), a bug; we use the mask, as the paper intends.
    max_iter : int
        L-BFGS iterations.
    margin : float
        Shrink the balls by this relative amount while solving, so the returned point is strictly inside when the
        intersection has an interior.
    init : (d,) array, optional
        Start point; default: the plain average of the centres, as in the reference.
    """
    from scipy.optimize import minimize

    centers = np.asarray(centers, dtype=np.float64)
    radii = np.asarray(radii, dtype=np.float64)
    axes = None if axes is None else np.asarray(axes, dtype=np.float64)
    masks = None if masks is None else np.asarray(masks, dtype=np.float64)
    _check_balls(centers, radii, axes, masks)
    inv = _inverse_scales(radii, axes, masks, centers.shape)
    inv2 = inv**2

    def distances(w: np.ndarray) -> np.ndarray:
        return np.linalg.norm(inv * (w[None, :] - centers), axis=1)

    start = centers.mean(axis=0) if init is None else np.asarray(init, dtype=np.float64)
    d0 = distances(start)
    if np.all(d0 <= 1.0):  # already inside every ball (one client: its own centre)
        return Intersection(start, True, d0, 0.0, 0)
    target = 1.0 - margin

    def objective(w: np.ndarray) -> tuple[float, np.ndarray]:
        diff = w[None, :] - centers
        dist = np.linalg.norm(inv * diff, axis=1)
        excess = np.maximum(dist - target, 0.0)
        coef = np.where(excess > 0, 2 * excess / np.maximum(dist, 1e-300), 0.0)
        return float(np.sum(excess**2)), (coef[:, None] * inv2 * diff).sum(axis=0)

    result = minimize(objective, start, jac=True, method="L-BFGS-B", options={"maxiter": max_iter, "gtol": 1e-12, "ftol": 1e-15})
    point = result.x
    dist = distances(point)
    found = bool(np.all(dist <= 1.0 + 1e-9))
    left = float(np.sum(radii * np.maximum(dist - 1.0, 0.0)))
    if not found and result.status == 1:  # hit max_iter while still improving: the balls may still intersect
        warnings.warn(
            f"GEMS intersection: no point found in {max_iter} L-BFGS iterations (distance left {left:.4g}); "
            "raise max_iter to tell an empty intersection from slow convergence",
            RuntimeWarning,
            stacklevel=2,
        )
    return Intersection(point, found, dist, left, int(result.nit))


def balls_intersect_pairwise(center_a: np.ndarray, radius_a: float, centers_b: np.ndarray, radii_b: np.ndarray) -> np.ndarray:
    """Whether ball ``a`` meets each ball ``b`` (spheres): ``|| c_a - c_b || <= r_a + r_b``, shape ``(n_b,)``."""
    return np.linalg.norm(centers_b - center_a[None, :], axis=1) <= radius_a + radii_b


# -----------------------------------------------------------------------------------------------------------------
# Neurons: k-means and the greedy intersection within clusters (Section 3.2 of [1])


def cluster_neurons(centers: np.ndarray, num_clusters: int, *, random_state: int = 0) -> np.ndarray:
    """k-means labels of the neurons ``[w, b]`` (rows of ``centers``) into ``num_clusters`` clusters (m_epsilon).

    scikit-learn's ``KMeans`` on the unscaled vectors, as the reference code does (its default ``k-means++`` init;
    ``n_init='auto'``).
    """
    from sklearn.cluster import KMeans

    n = centers.shape[0]
    if not 1 <= num_clusters <= n:
        raise InputError("m_epsilon", f"a number of clusters in 1..{n} (the number of neurons across clients)", num_clusters)
    if num_clusters == 1:
        return np.zeros(n, dtype=np.int64)
    with warnings.catch_warnings():  # identical neurons (shared init, dead units) make fewer distinct points than k
        warnings.simplefilter("ignore")
        km = KMeans(n_clusters=num_clusters, n_init="auto", random_state=random_state).fit(np.asarray(centers, dtype=np.float64))
    return km.labels_.astype(np.int64)


@dataclass
class FusedNeurons:
    """The fused layer: ``vectors`` ``(H', D + 1)`` (rows ``[w, b]``) and, per output unit, the input neurons it
    came from (``groups``; a group of one is that neuron unchanged). ``found`` says, per merged group, whether the
    intersection solve found a common point."""

    vectors: np.ndarray
    groups: list[list[int]]
    found: list[bool]
    dropped: list[int] = field(default_factory=list)


def fuse_neurons(
    centers: np.ndarray, radii: np.ndarray, labels: np.ndarray, *, skip_first_cluster: bool = False, max_iter: int = 1000
) -> FusedNeurons:
    """Greedy intersection of neuron balls inside each k-means cluster (Section 3.2 of [1]).

    Visit the cluster's neurons in index order; neuron ``i`` joins the set ``A`` if its ball meets every ball already
    in ``A`` (``|| c_i - c_j || <= r_i + r_j``), otherwise it is emitted unchanged as its own hidden unit. At the end
    ``A`` becomes one unit: the point of eq. (2) for ``|A| > 1``, the neuron itself for ``|A| = 1``. Every input
    neuron ends up in exactly one output unit.

    Parameters
    ----------
    centers : (N, D + 1) array
        All clients' neurons, in the reference's neuron-major order (neuron ``i`` of client ``t`` at ``i * K + t``).
    radii : (N,) array
    labels : (N,) int array
        Cluster of each neuron (:func:`cluster_neurons`).
    skip_first_cluster : bool
        Reproduce the reference code's bug (``for cluster in range(1, k + 1)`` over labels ``0..k-1``): cluster 0's
        neurons are dropped. Off by default; ``dropped`` lists them.
    """
    centers = np.asarray(centers, dtype=np.float64)
    radii = np.asarray(radii, dtype=np.float64)
    _check_balls(centers, radii, None, None)
    vectors: list[np.ndarray] = []
    groups: list[list[int]] = []
    found: list[bool] = []
    dropped: list[int] = []
    for cluster in np.unique(labels):
        members = np.flatnonzero(labels == cluster)  # ascending index order
        if skip_first_cluster and cluster == 0:
            dropped.extend(int(i) for i in members)
            continue
        joined: list[int] = []
        for i in members:
            if not joined or np.all(balls_intersect_pairwise(centers[i], radii[i], centers[joined], radii[joined])):
                joined.append(int(i))
            else:
                vectors.append(centers[i])
                groups.append([int(i)])
        if len(joined) == 1:
            vectors.append(centers[joined[0]])
            groups.append(joined)
        elif joined:
            result = intersect_balls(centers[joined], radii[joined], max_iter=max_iter)
            vectors.append(result.point)
            groups.append(joined)
            found.append(result.found)
    width = centers.shape[1]
    return FusedNeurons(np.stack(vectors) if vectors else np.zeros((0, width)), groups, found, dropped)
