"""The 2025 spectral merges of fine-tunes of one base model, one tensor at a time, as :class:`TensorMerge` entries.

Each merges the task vectors ``tau_i = x_i - base`` of one tensor name and returns ``base + lambda * tau``:

- ``tsv_m`` [TSV]: each task matrix's top ``1/T`` singular components, their bases concatenated and orthogonalised;
- ``iso_c`` [ISOMERGE]: the sum of the task matrices with its spectrum flattened to its mean;
- ``iso_cts`` [ISOMERGE]: the sum's top subspace and each task's own top directions outside it, orthogonalised,
  with a flat spectrum;
- ``wudi`` [WUDI]: the matrix closest to every task matrix on the inputs that task matrix acts on, found by Adam.

The matrix rule applies to every 2-D tensor; the authors apply it by parameter name (TSV and Iso leave CLIP's 2-D
``text_projection`` to the mean; WUDI only touches the blocks' four linear weights), which a tensor-by-tensor merge is
not told, so 2-D embeddings, heads and projections get the matrix rule here too. Other tensors (biases, norms,
convolutions) get what the authors give them: the mean of the task vectors, ``base + lambda * mean_i tau_i``, for
TSV and Iso; nothing for WUDI (the base's own value). ``lambda``'s default is 1; TSV and Iso pick it on validation
accuracy from ``linspace(0, 3, 31)[1:]`` (no default of theirs), WUDI's runs use 1 (``wudi_main.py``).

Everything runs in torch on the tensors' device and dtype (float64 stays float64), and nothing is random: the same
inputs give the same tensor. No result depends on the signs an SVD picks for its singular vectors.

Memory (``peak``, in tensors of one tensor's size; ``models``: every model read, the base included, all of which the
caller hands over at once): the inputs, overwritten in place by the task vectors, and beside them, counted in
tests/finetunes/test_spectral.py with one more for LAPACK's copy of the matrix an SVD works on: for ``tsv_m`` the
concatenated bases and one SVD's factors (6), for ``iso_c`` one SVD (4), for ``iso_cts`` the common subspace, the
concatenated bases and one SVD (7), for ``wudi`` the merged matrix, its gradient, Adam's two moments, the gradient's
fixed part and a Gram (6): its Grams are ``min(m, n)`` square, where the authors' autograd holds a ``T x m x m``
product. A non-2-D tensor needs nothing beside the inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rayfuse.finetunes.tensor_merge import TensorMerge

__all__ = ["MERGES", "tsv_m", "iso_c", "iso_cts", "wudi", "wudi_loss"]

PerModel = Sequence[Mapping[str, float]]
Globals = Mapping[str, float | bool]

# WUDI's optimiser [WUDI : vit/wudi_main.py ``get_redundant_task_vector``]: Adam (torch's defaults: betas 0.9,
# 0.999, eps 1e-8), no weight decay, 300 steps of 1e-5 (the ViT runs; the RoBERTa code uses 2e-5)
WUDI_STEPS = 300
WUDI_LR = 1e-5


def _task_vectors(base: torch.Tensor, tuned: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``x_i - base``, in the inputs' own memory (the merge is given copies it may overwrite)."""
    return [x.sub_(base) for x in tuned]


def _mean_merge(base: torch.Tensor, tuned: Sequence[torch.Tensor], lam: float) -> torch.Tensor:
    """``base + lambda * mean_i (x_i - base)``: what TSV and Iso do to the tensors that are not 2-D (the authors' running
    mean ``m += (tau_i - m) / (i + 1)``, here a sum divided once: the same up to rounding)."""
    taus = _task_vectors(base, tuned)
    total = taus[0]
    for tau in taus[1:]:
        total.add_(tau)
    return total.div_(len(taus)).mul_(lam).add_(base)


def _polar(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal factor ``P Q^T`` of ``x = P S Q^T`` (the closest matrix with orthonormal columns or rows): how
    TSV and Iso-CTS orthogonalise a concatenation of singular vectors. Unique where ``x`` has full rank."""
    p, _, qh = torch.linalg.svd(x, full_matrices=False)
    return p @ qh


def _is_matrix(base: torch.Tensor) -> bool:
    return base.dim() == 2 and min(base.shape) > 0


def tsv_m(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """TSV-Merge: Gargiulo et al., *Task Singular Vectors: Reducing Task Interference in Model Merging*, CVPR 2025,
    as [TSV : src/utils/TSVM_utils.py ``compute_and_sum_svd_mem_reduction``] (AntoAndGar/task_singular_vectors at
    a6c9718; method ``TSVM``, the SVD orthogonalisation, not ``TSVM_2``'s eigendecomposition).

    For a 2-D tensor: each ``tau_i = U_i S_i V_i^T`` keeps its first ``k = int(min(m, n) * (1 / T))`` components;
    the kept ``U``'s are set side by side (``m x kT``), the ``V^T``'s stacked (``kT x n``), each concatenation replaced by
    its polar factor, and ``merged = polar(U) diag(S) polar(V^T)``. The authors place the blocks in a ``min(m, n)``-wide
    buffer whose last ``min(m, n) - kT`` columns stay zero; those columns carry zero singular values and, for
    full-rank concatenations, leave the other columns' polar factor as it is, so they are left out here. Where
    ``min(m, n) < T``, ``k`` is 0 and the authors' merged matrix is 0 (the base is kept), as here. One model: ``k`` is
    every component and the merge is that model's task vector. Other tensors: the mean of the task vectors."""
    assert base is not None  # base="required"
    lam = float(g["lambda"])
    if not _is_matrix(base):
        return _mean_merge(base, tuned, lam)
    count = len(tuned)
    m, n = base.shape
    k = int(min(m, n) * (1 / count))  # the authors' sv_reduction = 1 / T, as they compute it
    if k == 0:
        return base
    us = base.new_empty((m, k * count))
    ss = base.new_empty((k * count,))
    vs = base.new_empty((k * count, n))
    for i, tau in enumerate(_task_vectors(base, tuned)):
        u, s, vh = torch.linalg.svd(tau, full_matrices=False)
        us[:, i * k : (i + 1) * k] = u[:, :k]
        ss[i * k : (i + 1) * k] = s[:k]
        vs[i * k : (i + 1) * k, :] = vh[:k, :]
        del u, s, vh
    left = _polar(us).mul_(ss)  # polar(U) diag(S)
    del us
    merged = left @ _polar(vs)
    return merged.mul_(lam).add_(base)


def iso_c(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Iso-C: Marczak et al., *No Task Left Behind: Isotropic Model Merging with Common and Task-Specific Subspaces*,
    ICML 2025, as [ISOMERGE : src/utils/iso.py ``iso_c``] (danielm1405/iso-merging at d34010a).

    For a 2-D tensor: the sum of the task vectors ``U S V^T`` with every singular value replaced by their mean,
    ``merged = mean(S) U V^T`` (its singular values all equal). One model: ``mean(S_1) U_1 V_1^T``. Other tensors: the
    mean of the task vectors."""
    assert base is not None  # base="required"
    lam = float(g["lambda"])
    if not _is_matrix(base):
        return _mean_merge(base, tuned, lam)
    taus = _task_vectors(base, tuned)
    total = taus[0]
    for tau in taus[1:]:
        total.add_(tau)
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    del total, taus
    merged = u.mul_(s.mean()) @ vh
    return merged.mul_(lam).add_(base)


def iso_cts(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Iso-CTS: Marczak et al., ICML 2025 (see :func:`iso_c`), as [ISOMERGE : src/utils/iso.py ``iso_cts``]
    (danielm1405/iso-merging at d34010a; ``common_space_fraction`` 0.8 from its ``config/method/iso_cts.yaml``).

    For a 2-D tensor with ``r = min(m, n)``: the common subspace is the top ``c`` singular directions of the sum of the
    task vectors, ``c = r - T * d`` with ``d = round((r - int(r * common_space_fraction)) / T)`` (Python's round, so
    that the rest divides evenly; rounded down instead where ``T * d`` would pass ``r``, which the authors' slices do
    not handle); each task adds the top ``d`` singular directions of its task vector with the common left subspace
    projected out, ``tau_i - U_c U_c^T tau_i``. The ``r`` left and right directions (the task ones first, as the
    authors order them) are orthogonalised by their polar factors and given one singular value, the mean of the ``r``
    singular values gathered. One model: ``d`` makes up what the common subspace leaves of ``tau``, so the
    merge is ``iso_c``'s. Other tensors: the mean of the task vectors.

    ``common_space_fraction`` must be in [0, 1] (others are for the fuse file's checks to refuse before the run)."""
    assert base is not None  # base="required"
    lam = float(g["lambda"])
    fraction = float(g["common_space_fraction"])
    if not 0 <= fraction <= 1:
        raise ValueError(f"iso_cts: common_space_fraction must be in [0, 1], got {fraction}")
    if not _is_matrix(base):
        return _mean_merge(base, tuned, lam)
    count = len(tuned)
    m, n = base.shape
    r = min(m, n)
    per_task = round((r - int(r * fraction)) / count)  # Python's round, as the authors'
    if per_task * count > r:  # rounded up past r (small fractions, many models): the authors' slices go negative
        per_task -= 1
    common = r - per_task * count
    taus = _task_vectors(base, tuned)
    total = torch.zeros_like(base)
    for tau in taus:
        total.add_(tau)
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    del total
    u_c = u[:, :common]
    us = base.new_empty((m, r))
    ss = base.new_empty((r,))
    vs = base.new_empty((r, n))
    if per_task:
        for i, tau in enumerate(taus):
            residual = tau.sub_(u_c @ (u_c.T @ tau))  # tau_i with the common left subspace projected out
            u_t, s_t, vh_t = torch.linalg.svd(residual, full_matrices=False)
            us[:, i * per_task : (i + 1) * per_task] = u_t[:, :per_task]
            ss[i * per_task : (i + 1) * per_task] = s_t[:per_task]
            vs[i * per_task : (i + 1) * per_task, :] = vh_t[:per_task, :]
            del residual, u_t, s_t, vh_t
    del taus
    start = count * per_task
    us[:, start:] = u_c
    ss[start:] = s[:common]
    vs[start:, :] = vh[:common, :]
    del u, s, vh, u_c
    left = _polar(us).mul_(ss.mean())
    del us
    merged = left @ _polar(vs)
    return merged.mul_(lam).add_(base)


def wudi_loss(merged: torch.Tensor, taus: Sequence[torch.Tensor]) -> torch.Tensor:
    """WUDI's objective ``sum_i ||(merged - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2`` (a zero task vector's term is 0)."""
    total = merged.new_zeros(())
    for tau in taus:
        norm = torch.linalg.vector_norm(tau) ** 2
        if norm > 0:
            total = total + ((merged - tau) @ tau.T).square().sum() / norm
    return total


def wudi(
    base: torch.Tensor | None, tuned: Sequence[torch.Tensor], per_model: PerModel, g: Globals, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """WUDI-Merging: Cheng et al., *Whoever Started the Interference Should End It: Guiding Data-Free Model Merging via
    Task Vectors*, ICML 2025, as [WUDI : vit/wudi_main.py ``get_redundant_task_vector``] (nathanielyvo/WUDI-Merging at
    dc3cd12; the loss divided by the squared norm, as in the paper and ``nlp_roberta/lamassu.py``; the older
    ``vit/coef.py`` divides by the norm).

    For a 2-D tensor: ``tau_m`` starts at the sum of the task vectors and takes :data:`WUDI_STEPS` steps of Adam
    (learning rate :data:`WUDI_LR`, torch's defaults otherwise) on :func:`wudi_loss`. Adam is torch's single-tensor
    update (``torch.optim.Adam`` on the CPU) written out in place, so that it needs no temporaries. The gradient
    ``2 sum_i (tau_m - tau_i) tau_i^T tau_i / ||tau_i||^2`` is computed in closed form instead of by autograd through
    the authors' ``T x m x m`` product (the same up to rounding): ``2 (tau_m A - B)`` with ``A = sum_i tau_i^T tau_i /
    ||tau_i||^2`` when ``n <= m``, else ``2 (sum_i (tau_m tau_i^T) tau_i / ||tau_i||^2 - B)`` model by model, so that no
    product larger than ``min(m, n)`` squared is formed. A zero task vector's term (0 / 0 in the authors' code: NaN) is
    left out: the authors never meet one, and it asks nothing of ``tau_m``. One model (one nonzero task vector): the
    start is the optimum, the authors' gradient there is exactly 0, and the merge is that task vector. Other tensors:
    the base's value (the authors merge only linear weights; the rest of the merged model is the base's).
    ``spectral`` is set as for the others: a 2-D tensor is merged whole, as a matrix."""
    assert base is not None  # base="required"
    lam = float(g["lambda"])
    if not _is_matrix(base):
        return base
    m, n = base.shape
    taus = _task_vectors(base, tuned)
    norms = [float(torch.linalg.vector_norm(tau)) ** 2 for tau in taus]
    kept = [(tau, 1 / norm) for tau, norm in zip(taus, norms) if norm > 0]
    gram = base.new_zeros((n, n)) if n <= m else None
    fixed = base.new_zeros((m, n))  # B = sum_i tau_i tau_i^T tau_i / ||tau_i||^2
    for tau, scale in kept:
        if gram is not None:
            gram_i = tau.T @ tau
            gram.add_(gram_i, alpha=scale)
            fixed.addmm_(tau, gram_i, alpha=scale)
            del gram_i
        else:
            fixed.addmm_(tau @ tau.T, tau, alpha=scale)
    merged = torch.zeros_like(base)
    for tau in taus:
        merged.add_(tau)
    # one nonzero task vector: the sum is the optimum, where the authors' gradient is exactly 0; the closed form's
    # rounding there is a gradient far below Adam's eps, which Adam would amplify 1 / eps-fold into a walk of ~lr
    steps = WUDI_STEPS if len(kept) > 1 else 0
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    grad, exp_avg, exp_avg_sq = torch.empty_like(base), torch.zeros_like(base), torch.zeros_like(base)
    for step in range(1, steps + 1):
        if gram is not None:
            torch.mm(merged, gram, out=grad)
        else:
            grad.zero_()
            for tau, scale in kept:
                grad.addmm_(merged @ tau.T, tau, alpha=scale)
        grad.sub_(fixed).mul_(2)
        # torch's _single_tensor_adam, in place: the denominator goes into the gradient's memory
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = torch.sqrt(exp_avg_sq, out=grad).div_((1 - beta2**step) ** 0.5).add_(eps)
        merged.addcdiv_(exp_avg, denom, value=-WUDI_LR / (1 - beta1**step))
    del grad, exp_avg, exp_avg_sq, gram, fixed, kept, taus
    return merged.mul_(lam).add_(base)


_LAMBDA = {"lambda": 1.0}

MERGES: dict[str, TensorMerge] = {
    "tsv_m": TensorMerge(
        "tsv_m",
        tsv_m,
        "each task matrix's top 1/T singular components, their singular vectors orthogonalised together "
        "(Task Singular Vectors, Gargiulo et al. 2025)",
        "TSV (AntoAndGar/task_singular_vectors at a6c9718)",
        globals=dict(_LAMBDA),
        spectral=True,
        peak=lambda models: models + 6.0,
    ),
    "iso_c": TensorMerge(
        "iso_c",
        iso_c,
        "the sum of the task matrices with a flat spectrum: every singular value their mean (Iso-C, Marczak et al. 2025)",
        "ISOMERGE (danielm1405/iso-merging at d34010a)",
        globals=dict(_LAMBDA),
        spectral=True,
        peak=lambda models: models + 4.0,
    ),
    "iso_cts": TensorMerge(
        "iso_cts",
        iso_cts,
        "the sum's top subspace and each task's own top directions, orthogonalised, with a flat spectrum (Iso-CTS, Marczak et al. 2025)",
        "ISOMERGE (danielm1405/iso-merging at d34010a)",
        globals={**_LAMBDA, "common_space_fraction": 0.8},
        spectral=True,
        peak=lambda models: models + 7.0,
    ),
    "wudi": TensorMerge(
        "wudi",
        wudi,
        "the matrix closest to each task matrix on that task matrix's own input directions, by 300 Adam steps from "
        "their sum; other tensors stay the base's (WUDI-Merging, Cheng et al. 2025)",
        "WUDI (nathanielyvo/WUDI-Merging at dc3cd12)",
        globals=dict(_LAMBDA),
        spectral=True,
        peak=lambda models: models + 6.0,
    ),
}
