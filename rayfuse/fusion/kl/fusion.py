"""KL-fusion's algorithms (Claici, Yurochkin, Ghosh, Solomon, ICML 2020) [1]: pure numpy / scipy, no Ray.

Local posteriors ``p_j = prod_l q(. | theta^j_l)`` (one :class:`rayfuse.expfam.Family` batch per dataset ``j``) are
fused into global components ``theta_bar_g``.

**Homogeneous fusion** (eq. 3), every dataset with the same ``L`` components::

    min_{theta_bar, P^j permutations}  sum_j sum_{l,g} P^j_{lg} KL(q(.|theta_bar_g) || q(.|theta^j_l))

alternating a Hungarian solve per dataset (the paper; the reference code uses Sinkhorn instead) and the
natural-parameter barycenter of the matched components (:func:`fuse_homogeneous`).

**Heterogeneous, nonparametric fusion** (eq. 9, garbled in the paper's text; recovered in ``docs/methods/kl.md``)::

    min_{theta_bar, P}  sum_j sum_{l,g} P^j_{lg} KL(q(.|theta_bar_g) || q(.|theta^j_l)) + lambda sum_g ||P_{.g.}||_2
    s.t. sum_g P^j_{lg} = 1,  sum_l P^j_{lg} <= 1,  P in {0, 1} (exact) or [0, 1] (relaxed)

The group norm is the paper's L_{2,2,1} norm (eq. 8, over datasets *and* local components), with uniform weights; the
cost is ``KL(global || local)``, the direction the barycenter minimises (the reference code uses KL(local || global)
and per-index weights, see ``docs/methods/kl.md``). ``lambda`` is relative: the effective value is ``lambda`` times the
standard deviation of the KL costs between the initial globals and every local component (the paper: "scale the
divergences by their standard deviation and set lambda = 0.1"). With binary ``P`` the regulariser is
``lambda sum_g sqrt(m_g)``, ``m_g`` the number of datasets matched to ``g``.

Two P-step solvers (:func:`fuse_heterogeneous`):

* ``exact`` (default; PROPOSED in docs/methods/kl.md): block coordinate descent over datasets on the binary
  problem. For dataset ``j``, with ``j``'s own contribution removed from every count and barycenter, one
  linear assignment of its ``L_j`` components to the ``G`` existing globals plus ``L_j`` new-component columns::

      C[l, g]     = KL(theta_bar_{g,-j} || theta^j_l) + lambda (sqrt(m_{g,-j} + 1) - sqrt(m_{g,-j}))
      C[l, G + n] = lambda                    (a new global at theta^j_l: its own KL is 0)

  Globals are created by the new columns and deleted when their count drops to 0, so ``G`` is inferred. A sweep
  solves the ``D`` problems *in parallel* against the state at the sweep's start (through the executor), then
  commits them one by one in a random order: a proposal is kept when it lowers eq. (9) itself (binary ``P``,
  barycenters re-optimised) against the state as committed so far; otherwise (a conflict, e.g. two datasets that
  opened the same new component at once, or a move the leave-one-out cost favours but eq. (9) does not) the dataset
  is re-solved serially against the current state and that answer is kept only if it lowers eq. (9). The objective
  therefore never increases; the sweeps stop when nothing changes or the decrease is below ``tol``.
* ``relaxed``: the paper's relaxed convex P-step with a fixed, over-complete set of globals from KL-k-means++,
  solved by Frank-Wolfe (the linear minimisation oracle over the constraint set is one rectangular assignment per
  dataset, also fanned out) on the group norm smoothed by ``eps``; then the P-weighted barycenters; repeated
  ``max_iter`` times; globals with total mass ``< 0.999`` are pruned (the reference code's rule). The reference code
  solves this P-step with cvxpy + SCS; cvxpy is not a dependency here. With the paper's uniform group weights the
  relaxation is degenerate (splitting every entry of ``P`` in half between two near-identical globals leaves the
  L_{2,2,1} norm unchanged, so duplicates of an over-complete start are never pruned); the reference code's
  per-rank weights ``sqrt(max(0, g + 1 - Lmax))`` break the tie and are this solver's default (``reg_weights``).

[1] S. Claici, M. Yurochkin, S. Ghosh, J. Solomon. Model Fusion with Kullback-Leibler Divergence. ICML 2020.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from rayfuse.errors import InputError, NonFiniteError
from rayfuse.expfam import Family, concat
from rayfuse.matching import Executor, map_chunked, solve_assignment

__all__ = ["FusionResult", "check_posteriors", "kl_kmeanspp", "fuse_homogeneous", "fuse_heterogeneous", "hausdorff"]


@dataclass
class FusionResult:
    """Fused global components and how every local component was assigned.

    ``assignments[j][l]`` is the global index of local component ``l`` of dataset ``j`` (for the relaxed solver, the
    global with the largest ``P``; ``-1`` if that global was pruned). ``weights`` are the soft ``P^j`` (``L_j x G``,
    relaxed solver only).
    """

    globals: Family
    assignments: list[np.ndarray]
    counts: np.ndarray
    lam: float = 0.0
    objective: list[float] = field(default_factory=list)
    weights: list[np.ndarray] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_globals(self) -> int:
        return len(self.globals)


def check_posteriors(posteriors: Sequence[Family], *, where: str = "posteriors", min_components: int = 1) -> Family:
    """Validate a list of per-dataset batches (one family and dimension, finite, non-empty) and return them concatenated."""
    if not isinstance(posteriors, (list, tuple)) or not posteriors:
        raise InputError(
            where, "a non-empty list of per-dataset posterior batches", posteriors if not isinstance(posteriors, (list, tuple)) else "[]"
        )
    flat = concat(list(posteriors), where=where)
    for j, batch in enumerate(posteriors):
        if len(batch) < min_components:
            raise InputError(f"{where}[{j}]", f"at least {min_components} component(s)", len(batch))
    if not np.isfinite(flat.natural()).all():
        raise InputError(where, "finite natural parameters", "NaN or Inf")
    return flat


def _offsets(posteriors: Sequence[Family]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(p) for p in posteriors])])


def hausdorff(estimated: np.ndarray, truth: np.ndarray) -> float:
    """Hausdorff distance between two point sets: ``max(max_e min_t ||e - t||, max_t min_e ||e - t||)`` [KLF : min_match]."""
    estimated, truth = np.atleast_2d(estimated), np.atleast_2d(truth)
    if len(estimated) == 0 or len(truth) == 0:
        return float("inf")
    d = np.sqrt(((estimated[:, None, :] - truth[None, :, :]) ** 2).sum(-1))
    return float(max(d.min(1).max(), d.min(0).max()))


# -----------------------------------------------------------------------------------------------------------------
# Initialisation


def kl_kmeanspp(components: Family, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``k`` centres among ``components`` chosen by k-means++ with ``d(c, x) = KL(c || x)``.

    As in [KLF : src/initialize.py]: the first centre uniformly at random, then candidates drawn with probability
    proportional to the current minimum divergence (not squared, a divergence is already "squared"), ``2 + ln k`` local
    trials per centre. Departure from the reference code, which keeps the candidate with the *largest* summed
    divergence (a quirk): keep the one with the smallest new potential, as k-means++ and scikit-learn do.
    """
    n = len(components)
    if k >= n:
        return np.arange(n)
    centers = [int(rng.integers(n))]

    def divergences(idx: Any) -> np.ndarray:  # KL from candidate centres; rounding noise of identical pairs -> 0
        kl = components.take(idx).kl_matrix(components)
        return np.where(kl > 1e-8, kl, 0.0)

    min_dist = divergences([centers[0]])[0]
    trials = 2 + int(math.log(k))  # [KLF : src/initialize.py] n_local_trials
    for _ in range(1, k):
        total = min_dist.sum()
        if total <= 0:  # every point coincides with a centre: no more distinct centres to add
            break
        cand = rng.choice(n, size=min(trials, int((min_dist > 0).sum())), replace=False, p=min_dist / total)
        pot = np.minimum(divergences(cand), min_dist[None, :])
        best = int(np.argmin(pot.sum(1)))
        centers.append(int(cand[best]))
        min_dist = pot[best]
    return np.asarray(centers, dtype=np.int64)


# -----------------------------------------------------------------------------------------------------------------
# Homogeneous fusion (eq. 3)


def _assign_to(centers: Family, local: Family) -> np.ndarray:
    return solve_assignment(centers.kl_matrix(local).T)


def fuse_homogeneous(posteriors: Sequence[Family], *, max_iter: int = 20, executor: Executor | None = None, init: int = 0) -> FusionResult:
    """Permutation fusion, eq. (3): every dataset has the same number ``L`` of components, each matched to one global.

    Initialised with dataset ``init``'s components; alternates the per-dataset Hungarian solves (fanned out through
    ``executor``) and the uniform natural-parameter barycenters until the assignments stop changing.
    """
    flat = check_posteriors(posteriors)
    sizes = {len(p) for p in posteriors}
    if len(sizes) != 1:
        raise InputError("posteriors", "the same number of components in every dataset (homogeneous fusion)", sorted(sizes))
    L = sizes.pop()
    D = len(posteriors)
    eta = np.stack([p.natural() for p in posteriors])  # (D, L, p)
    centers = posteriors[init].take(np.arange(L))
    assignments: list[np.ndarray] = [np.full(L, -1)] * D
    objective: list[float] = []
    for it in range(max_iter):  # noqa: B007 (it is read after the loop: the iteration count)
        new = map_chunked(partial(_assign_to, centers), list(posteriors), executor)
        sums = np.zeros((L, eta.shape[2]))
        for j, a in enumerate(new):
            sums[a] += eta[j]
        centers = flat.from_natural(sums / D)
        objective.append(float(sum(centers.take(a).kl(p).sum() for a, p in zip(new, posteriors))))
        changed = any((a != b).any() for a, b in zip(new, assignments))
        assignments = new
        if not changed:
            break
    return FusionResult(centers, [np.asarray(a) for a in assignments], np.full(L, D), objective=objective, info={"iterations": it + 1})


# -----------------------------------------------------------------------------------------------------------------
# Heterogeneous fusion: exact binary BCD with parallel proposals


@dataclass
class _Snapshot:
    """What each dataset's proposal needs: the active globals, their sums and counts (shared by all tasks)."""

    ids: np.ndarray  # active global ids
    sums: np.ndarray  # (G, p) natural-parameter sums of the active globals
    counts: np.ndarray  # (G,)
    bary: Family  # barycenters sums / counts
    lam: float


def _dataset_costs(snap: _Snapshot, local: Family, eta: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dataset ``j``'s augmented cost matrix (``L_j x (G' + L_j)``) against ``snap`` with ``j`` left out, and the ids
    of its ``G'`` existing-global columns (globals holding only ``j``'s components are left out)."""
    L = len(local)
    rows = np.full(L, -1)  # position of each local's current global in snap.ids (sorted); -1: none
    if len(snap.ids):
        at = np.minimum(np.searchsorted(snap.ids, own), len(snap.ids) - 1)
        rows = np.where(snap.ids[at] == own, at, -1)
    counts = snap.counts.astype(np.float64).copy()
    mine = rows >= 0
    counts[rows[mine]] -= 1
    kl = snap.bary.kl_matrix(local)  # (G, L)
    if mine.any():  # leave-one-out barycenters of the globals that hold j's components
        loo = snap.sums[rows[mine]] - eta[mine]
        left = counts[rows[mine]]
        keep = left > 0
        if keep.any():
            kl[rows[mine][keep]] = local.from_natural(loo[keep] / left[keep, None]).kl_matrix(local)
    alive = counts > 0
    G = int(alive.sum())
    reg = snap.lam * (np.sqrt(counts[alive] + 1.0) - np.sqrt(counts[alive]))
    cost = np.empty((L, G + L))
    np.add((kl if G == len(counts) else kl[alive]).T, reg[None, :], out=cost[:, :G])
    cost[:, G:] = snap.lam
    return cost, snap.ids[alive]


def _propose(snap: _Snapshot, item: tuple[Family, np.ndarray, np.ndarray]) -> np.ndarray:
    """The exact block-coordinate step of one dataset against ``snap``: a global id per local component, ``-1`` = new."""
    local, eta, own = item
    cost, ids = _dataset_costs(snap, local, eta, own)
    if not np.isfinite(cost).all():
        raise NonFiniteError(f"KL cost matrix of shape {cost.shape} has NaN or Inf entries")
    cols = solve_assignment(cost)
    out = np.full(len(cols), -1, dtype=np.int64)
    existing = cols < len(ids)
    out[existing] = ids[cols[existing]]
    return out


class _State:
    """Globals as natural-parameter sums and counts, with ids that stay stable while globals come and go."""

    def __init__(self, template: Family, p: int, lam: float) -> None:
        self.template = template
        self.sums = np.zeros((0, p))
        self.counts = np.zeros(0, dtype=np.int64)
        self.lam = lam

    def new_global(self, eta_row: np.ndarray) -> int:
        free = np.flatnonzero(self.counts == 0)
        if free.size:
            g = int(free[0])
            self.sums[g] = eta_row
            self.counts[g] = 1
            return g
        self.sums = np.vstack([self.sums, eta_row[None]])
        self.counts = np.append(self.counts, 1)
        return len(self.counts) - 1

    def remove(self, assign: np.ndarray, eta: np.ndarray) -> None:
        ok = assign >= 0
        np.subtract.at(self.sums, assign[ok], eta[ok])
        np.subtract.at(self.counts, assign[ok], 1)
        self.sums[self.counts == 0] = 0.0

    def add(self, assign: np.ndarray, eta: np.ndarray) -> np.ndarray:
        out = assign.copy()
        for l in np.flatnonzero(assign < 0):
            out[l] = self.new_global(eta[l])
        old = assign >= 0
        np.add.at(self.sums, assign[old], eta[old])
        np.add.at(self.counts, assign[old], 1)
        return out

    def snapshot(self) -> _Snapshot:
        ids = np.flatnonzero(self.counts > 0)
        sums = self.sums[ids].copy()
        counts = self.counts[ids].copy()
        return _Snapshot(ids, sums, counts, self.template.from_natural(sums / counts[:, None]), self.lam)

    def exact_delta(self, flat: Family, owner: np.ndarray, span: slice, eta: np.ndarray, own: np.ndarray, target: np.ndarray) -> float:
        """The change of eq. (9), barycenters re-optimised, if dataset ``j`` (local components ``flat[span]``, current
        globals ``own``) were assigned ``target`` instead (``-1``: a new global of its own). Only the globals either
        assignment touches change; their other members come from ``owner`` (the global of every local component)."""
        touched = np.union1d(own[own >= 0], target[target >= 0])
        others = np.flatnonzero(np.isin(owner, touched))
        others = others[(others < span.start) | (others >= span.stop)]
        other_pos = np.searchsorted(touched, owner[others])
        base_sums = self.sums[touched].copy()
        base_counts = self.counts[touched].astype(np.float64)
        mine = own >= 0
        np.subtract.at(base_sums, np.searchsorted(touched, own[mine]), eta[mine])
        np.subtract.at(base_counts, np.searchsorted(touched, own[mine]), 1.0)
        local_idx = np.arange(span.start, span.stop)

        def cost(assign: np.ndarray) -> float:
            sums, counts = base_sums.copy(), base_counts.copy()
            placed = assign >= 0
            pos = np.searchsorted(touched, assign[placed])
            np.add.at(sums, pos, eta[placed])
            np.add.at(counts, pos, 1.0)
            alive = counts > 0
            where = np.cumsum(alive) - 1
            bary = self.template.from_natural(sums[alive] / counts[alive, None])
            member_pos = np.concatenate([other_pos, pos])
            member_idx = np.concatenate([others, local_idx[placed]])
            kl = float(bary.take(where[member_pos]).kl(flat.take(member_idx)).sum()) if len(member_idx) else 0.0
            return kl + self.lam * (float(np.sqrt(counts[alive]).sum()) + int((~placed).sum()))

        return cost(target) - cost(own)

    def objective(self, posteriors: Sequence[Family], assignments: Sequence[np.ndarray]) -> float:
        ids = np.flatnonzero(self.counts > 0)
        bary = self.template.from_natural(self.sums[ids] / self.counts[ids, None])
        where = np.full(len(self.counts), -1)
        where[ids] = np.arange(len(ids))
        kl = sum(float(bary.take(where[a]).kl(p).sum()) for a, p in zip(assignments, posteriors))
        return kl + self.lam * float(np.sqrt(self.counts[ids]).sum())


def _initial_globals(flat: Family, posteriors: Sequence[Family], n_init: int | None, rng: np.random.Generator) -> tuple[Family, int]:
    max_l = max(len(p) for p in posteriors)
    k = n_init if n_init is not None else min(len(flat), 2 * max_l)  # PROPOSED (the demo: 8; docs/methods/kl.md)
    if k < max_l:
        raise InputError("n_init_components", f"at least the largest local count ({max_l}) so every dataset can be assigned", k)
    chosen = kl_kmeanspp(flat, min(k, len(flat)), rng)
    if len(chosen) < max_l:  # fewer distinct components than the largest dataset: repeat some so it can be assigned
        chosen = np.concatenate([chosen, rng.choice(np.setdiff1d(np.arange(len(flat)), chosen), max_l - len(chosen), replace=False)])
    return flat.take(chosen), k


def fuse_heterogeneous(
    posteriors: Sequence[Family],
    *,
    lam: float = 0.1,
    solver: str = "exact",
    max_iter: int | None = None,
    n_init_components: int | None = None,
    executor: Executor | None = None,
    random_state: int | np.random.Generator | None = 0,
    fw_iterations: int = 100,
    eps: float = 1e-3,
    min_mass: float = 0.999,
    reg_weights: str = "code",
    tol: float = 1e-6,
) -> FusionResult:
    """Nonparametric KL-fusion, eq. (9): the number of global components is inferred.

    Parameters
    ----------
    posteriors : list of Family batches
        One batch per dataset, all of one family and dimension.
    lam : float
        ``lambda`` of eq. (9), relative to the standard deviation of the KL costs (paper default 0.1).
    solver : {"exact", "relaxed"}
        See the module docstring.
    max_iter : int, optional
        Sweeps (exact; default 20, stops early when nothing changes) or P/theta alternations (relaxed; default 10).
    n_init_components : int, optional
        ``G_init`` of the KL-k-means++ initialisation (default ``min(sum_j L_j, 2 max_j L_j)``).
    executor : callable, optional
        ``executor(fn, items)`` fanning the per-dataset solves out (default: threads).
    random_state : int or Generator
        k-means++ and the commit order of the sweeps.
    fw_iterations, eps, min_mass : relaxed solver only
        Frank-Wolfe iterations per P-step, the smoothing of the group norm, and the pruning mass.
    tol : float
        Exact solver: stop when a sweep lowers the objective by less than ``tol`` (relative).
    reg_weights : {"uniform", "code"}
        Relaxed solver only: the paper's uniform group weights, or the reference code's ``sqrt(max(0, g + 1 - Lmax))``
        by mass rank. With uniform weights the relaxed problem cannot tell two near-identical globals apart (splitting
        every entry of ``P`` in half between them leaves the group norm unchanged), so duplicates from an
        over-complete initialisation survive pruning; the code's weights break that tie, so they are the default here.
    """
    if solver not in ("exact", "relaxed"):
        raise InputError("solver", "'exact' or 'relaxed'", solver)
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise InputError("lam", "a finite number >= 0", lam)
    flat = check_posteriors(posteriors)
    rng = random_state if isinstance(random_state, np.random.Generator) else np.random.default_rng(random_state)
    started = time.perf_counter()
    centers, k = _initial_globals(flat, posteriors, n_init_components, rng)
    kl0 = centers.kl_matrix(flat)
    scale = float(np.std(kl0))
    lam_eff = lam * (scale if scale > 0 else 1.0)
    # initial hard assignment: each dataset's components to distinct centres (no regulariser), in parallel
    init = map_chunked(partial(_assign_to, centers), list(posteriors), executor)
    if solver == "exact":
        result = _fuse_exact(posteriors, flat, centers, init, lam_eff, max_iter or 20, executor, rng, tol)
    else:
        if reg_weights not in ("uniform", "code"):
            raise InputError("reg_weights", "'uniform' or 'code'", reg_weights)
        result = _fuse_relaxed(
            posteriors, flat, centers, init, lam_eff, max_iter or 10, executor, fw_iterations, eps, min_mass, reg_weights
        )
    result.lam = lam_eff
    result.info.update(solver=solver, n_init_components=int(len(centers)), kl_std=scale, seconds=time.perf_counter() - started)
    if not np.isfinite(result.globals.natural()).all():
        raise NonFiniteError("KL-fusion produced non-finite global parameters")
    return result


def _fuse_exact(
    posteriors: Sequence[Family],
    flat: Family,
    centers: Family,
    init: list[np.ndarray],
    lam: float,
    max_iter: int,
    executor: Executor | None,
    rng: np.random.Generator,
    tol: float,
) -> FusionResult:
    etas = [p.natural() for p in posteriors]
    state = _State(flat, etas[0].shape[1], lam)
    # start from the centres' assignment: every centre that received components becomes a global
    state.sums = np.zeros((len(centers), etas[0].shape[1]))
    state.counts = np.zeros(len(centers), dtype=np.int64)
    assignments = [a.copy() for a in init]
    for a, eta in zip(assignments, etas):
        np.add.at(state.sums, a, eta)
        np.add.at(state.counts, a, 1)
    objective = [state.objective(posteriors, assignments)]
    offsets = _offsets(posteriors)
    owner = np.concatenate(assignments)  # the global of every local component
    accepted = resolved = 0
    sweeps = 0
    for _sweep in range(max_iter):
        sweeps += 1
        snap = state.snapshot()
        proposals = map_chunked(partial(_propose, snap), [(p, e, a) for p, e, a in zip(posteriors, etas, assignments)], executor)
        changed = False
        for j in rng.permutation(len(posteriors)):
            local, eta, own, prop = posteriors[j], etas[j], assignments[j], proposals[j]
            span = slice(int(offsets[j]), int(offsets[j + 1]))
            tiny = 1e-12 * max(1.0, abs(objective[-1]))
            target = None
            if not (prop == own).all():
                if state.exact_delta(flat, owner, span, eta, own, prop) < -tiny:
                    target = prop
                    accepted += 1
                else:  # stale against this sweep's earlier commits: solve again against the current state
                    again = _propose(state.snapshot(), (local, eta, own))
                    resolved += 1
                    if not (again == own).all() and state.exact_delta(flat, owner, span, eta, own, again) < -tiny:
                        target = again
            if target is None:
                continue
            state.remove(own, eta)
            assignments[j] = state.add(target, eta)
            owner[span] = assignments[j]
            changed = True
        objective.append(state.objective(posteriors, assignments))
        if not changed or objective[-2] - objective[-1] <= tol * max(1.0, abs(objective[-2])):
            break
    ids = np.flatnonzero(state.counts > 0)
    remap = np.full(len(state.counts), -1)
    remap[ids] = np.arange(len(ids))
    globals_ = flat.from_natural(state.sums[ids] / state.counts[ids, None])
    return FusionResult(
        globals_,
        [remap[a] for a in assignments],
        state.counts[ids].copy(),
        objective=objective,
        info={"sweeps": sweeps, "proposals_accepted": accepted, "resolved": resolved, "converged": sweeps < max_iter or not changed},
    )


# -----------------------------------------------------------------------------------------------------------------
# Heterogeneous fusion: the relaxed convex P-step (Frank-Wolfe)


def _lmo(cost: np.ndarray) -> np.ndarray:
    """Vertex of ``{P >= 0 : rows sum to 1, columns sum to <= 1}`` minimising ``<P, cost>`` (an assignment)."""
    cols = solve_assignment(cost)
    vertex = np.zeros_like(cost)
    vertex[np.arange(cost.shape[0]), cols] = 1.0
    return vertex


def _relaxed_objective(P: list[np.ndarray], C: list[np.ndarray], lam: np.ndarray, eps: float) -> float:
    sq = sum((p**2).sum(0) for p in P)
    return float(sum((p * c).sum() for p, c in zip(P, C)) + (lam * np.sqrt(sq + eps**2)).sum())


def _frank_wolfe(
    P: list[np.ndarray], C: list[np.ndarray], lam: np.ndarray, eps: float, iterations: int, executor: Executor | None
) -> list[np.ndarray]:
    """Minimise ``sum_j <P^j, C^j> + sum_g lam_g sqrt(sum_{j,l} (P^j_lg)^2 + eps^2)`` over the assignment polytopes."""
    P = [p.copy() for p in P]
    for _t in range(iterations):
        sq = sum((p**2).sum(0) for p in P)
        norm = np.sqrt(sq + eps**2)
        grads = [c + lam * p / norm[None, :] for p, c in zip(P, C)]
        vertices = map_chunked(_lmo, grads, executor)
        dirs = [v - p for v, p in zip(vertices, P)]
        gap = -sum((g * d).sum() for g, d in zip(grads, dirs))
        if gap <= 1e-9 * max(1.0, abs(_relaxed_objective(P, C, lam, eps))):
            break
        # exact line search on [0, 1]: the objective along the segment is convex; bisect its derivative
        lin = sum((c * d).sum() for c, d in zip(C, dirs))
        pd = sum((p * d).sum(0) for p, d in zip(P, dirs))
        dd = sum((d**2).sum(0) for d in dirs)

        def slope(s: float) -> float:
            return lin + float((lam * (pd + s * dd) / np.sqrt(sq + 2 * s * pd + s * s * dd + eps**2)).sum())

        if slope(1.0) <= 0:
            step = 1.0
        else:
            lo, hi = 0.0, 1.0
            for _ in range(40):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if slope(mid) < 0 else (lo, mid)
            step = 0.5 * (lo + hi)
        P = [p + step * d for p, d in zip(P, dirs)]
    return P


def _fuse_relaxed(
    posteriors: Sequence[Family],
    flat: Family,
    centers: Family,
    init: list[np.ndarray],
    lam: float,
    max_iter: int,
    executor: Executor | None,
    fw_iterations: int,
    eps: float,
    min_mass: float,
    reg_weights: str,
) -> FusionResult:
    G = len(centers)
    P = []
    for a, p in zip(init, posteriors):
        m = np.zeros((len(p), G))
        m[np.arange(len(p)), a] = 1.0
        P.append(m)
    etas = [p.natural() for p in posteriors]
    globals_ = centers
    objective = []
    max_l = max(len(p) for p in posteriors)
    for _it in range(max_iter):
        if reg_weights == "code":
            # [KLF : src/assignment.py]: weight sqrt(max(0, g + 1 - Lmax)) for the g-th global by decreasing mass (the
            # globals are re-sorted after every iteration): the heaviest Lmax are free, the rest ever more expensive.
            rank = np.empty(G, dtype=np.int64)
            rank[np.argsort(-sum(p.sum(0) for p in P), kind="stable")] = np.arange(G)
            lam_g = lam * np.sqrt(np.maximum(0, rank + 1 - max_l))
        else:
            lam_g = np.full(G, lam)
        C = [globals_.kl_matrix(p).T for p in posteriors]  # (L_j, G)
        P = _frank_wolfe(P, C, lam_g, eps, fw_iterations, executor)
        objective.append(_relaxed_objective(P, C, lam_g, eps))
        # theta-step: P-weighted barycenters; entries below 1e-3 are dropped (PROPOSED; docs/methods/kl.md)
        W = [np.where(p >= 1e-3, p, 0.0) for p in P]
        mass = sum(w.sum(0) for w in W)
        sums = sum(w.T @ e for w, e in zip(W, etas))
        eta_old = globals_.natural()
        has = mass > 0
        eta_new = np.where(has[:, None], sums / np.where(has, mass, 1.0)[:, None], eta_old)
        globals_ = flat.from_natural(eta_new)
    mass = sum(p.sum(0) for p in P)
    keep = np.flatnonzero(mass >= min_mass)
    remap = np.full(G, -1)
    remap[keep] = np.arange(len(keep))
    assignments = [remap[np.argmax(p, axis=1)] for p in P]
    return FusionResult(
        globals_.take(keep),
        assignments,
        mass[keep],
        objective=objective,
        weights=[p[:, keep] for p in P],
        info={"iterations": max_iter, "pruned": int(G - len(keep))},
    )
