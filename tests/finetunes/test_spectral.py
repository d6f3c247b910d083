"""The spectral merges (rayfuse/finetunes/spectral.py) against references written here from the papers' equations
in plain numpy (another route to each orthogonalisation: ``X (X^T X)^(-1/2)``; WUDI's gradient by hand and Adam as
the textbook writes it), their properties, their degenerate cases, and their memory counted tensor by tensor."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rayfuse.finetunes import spectral
from rayfuse.finetunes.spectral import MERGES, WUDI_LR, WUDI_STEPS, wudi_loss

METHODS = ["tsv_m", "iso_c", "iso_cts", "wudi"]


def _models(
    shape: tuple[int, ...], count: int, dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen, dtype=dtype)
    return base, [base + 0.1 * torch.randn(shape, generator=gen, dtype=dtype) for _ in range(count)]


def _run(method: str, base: torch.Tensor, tuned: Sequence[torch.Tensor], **globals_: float) -> torch.Tensor:
    """The merge on copies (it overwrites its inputs), with its defaults and ``globals_``."""
    merge = MERGES[method]
    params = {**merge.globals, **globals_}
    return merge.fn(base.clone(), [x.clone() for x in tuned], [{} for _ in tuned], params, [])


# --- references, from the papers' equations -------------------------------------------------------------------------


def _orth_columns(x: np.ndarray) -> np.ndarray:
    """The orthonormal polar factor of a full-column-rank ``x``: ``x (x^T x)^(-1/2)``."""
    w, q = np.linalg.eigh(x.T @ x)
    return x @ (q / np.sqrt(w)) @ q.T


def _svd(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    return u, s, vt.T


def ref_tsv_m(taus: list[np.ndarray]) -> np.ndarray:
    """TSV-M (Gargiulo et al. 2025, Sec. 4): keep each task's top ``r / T`` components, orthogonalise the
    concatenated left and right singular vectors, recombine with the concatenated singular values."""
    k = min(taus[0].shape) // len(taus)
    parts = [_svd(t) for t in taus]
    u = np.concatenate([p[0][:, :k] for p in parts], axis=1)
    s = np.concatenate([p[1][:k] for p in parts])
    v = np.concatenate([p[2][:, :k] for p in parts], axis=1)
    return _orth_columns(u) @ np.diag(s) @ _orth_columns(v).T


def ref_iso_c(taus: list[np.ndarray]) -> np.ndarray:
    """Iso-C (Marczak et al. 2025, Eq. 6): the task-arithmetic sum with every singular value replaced by their mean."""
    u, s, v = _svd(sum(taus))
    return s.mean() * u @ v.T


def ref_iso_cts(taus: list[np.ndarray], fraction: float = 0.8) -> np.ndarray:
    """Iso-CTS (Marczak et al. 2025, Sec. 4.2): the sum's top ``k`` directions, each task's top ``(r - k) / T``
    directions after projecting out the common left subspace, orthogonalised, with one singular value, their mean."""
    r, count = min(taus[0].shape), len(taus)
    per_task = round((r - int(r * fraction)) / count)
    k = r - per_task * count
    u, s, v = _svd(sum(taus))
    us, ss, vs = [u[:, :k]], [s[:k]], [v[:, :k]]
    for tau in taus:
        ut, st, vt = _svd(tau - u[:, :k] @ u[:, :k].T @ tau)
        us.append(ut[:, :per_task])
        ss.append(st[:per_task])
        vs.append(vt[:, :per_task])
    return np.concatenate(ss).mean() * _orth_columns(np.concatenate(us, axis=1)) @ _orth_columns(np.concatenate(vs, axis=1)).T


def ref_wudi(taus: list[np.ndarray]) -> np.ndarray:
    """WUDI (Cheng et al. 2025, Eq. 11): minimise ``sum_i ||(tau_m - tau_i) tau_i^T||^2 / ||tau_i||^2`` from the sum of
    the task vectors, by Adam (lr 1e-5, betas 0.9 / 0.999, eps 1e-8, 300 steps); the gradient by hand."""
    merged = sum(taus)
    m1, m2 = np.zeros_like(merged), np.zeros_like(merged)
    for step in range(1, WUDI_STEPS + 1):
        grad = sum(2 * (merged - t) @ t.T @ t / np.sum(t * t) for t in taus)
        m1 = 0.9 * m1 + 0.1 * grad
        m2 = 0.999 * m2 + 0.001 * grad**2
        merged = merged - WUDI_LR * (m1 / (1 - 0.9**step)) / (np.sqrt(m2 / (1 - 0.999**step)) + 1e-8)
    return merged


REFERENCES: dict[str, Callable[[list[np.ndarray]], np.ndarray]] = {
    "tsv_m": ref_tsv_m,
    "iso_c": ref_iso_c,
    "iso_cts": ref_iso_cts,
    "wudi": ref_wudi,
}


# --- against the references -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "shape", "dtype", "atol"),
    [
        ("tsv_m", (16, 12), torch.float64, 1e-9),
        ("tsv_m", (12, 16), torch.float32, 1e-5),
        ("iso_c", (16, 12), torch.float64, 1e-9),
        ("iso_c", (12, 16), torch.float32, 1e-5),
        ("iso_cts", (16, 12), torch.float64, 1e-9),
        ("iso_cts", (12, 16), torch.float32, 1e-5),
        ("wudi", (16, 12), torch.float64, 1e-9),  # n <= m: through the Gram
        ("wudi", (12, 16), torch.float64, 1e-9),  # n > m: model by model
        ("wudi", (16, 12), torch.float32, 1e-5),
    ],
)
def test_each_merge_of_a_matrix_agrees_with_its_reference(method: str, shape: tuple[int, int], dtype: torch.dtype, atol: float) -> None:
    base, tuned = _models(shape, 3, dtype)
    out = _run(method, base, tuned, **{"lambda": 0.7})
    assert out.dtype == dtype
    expected = REFERENCES[method]([(x - base).double().numpy() for x in tuned])
    np.testing.assert_allclose((out.double() - base.double()).numpy(), 0.7 * expected, rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("method", "shape"),
    [("tsv_m", (16,)), ("iso_c", (16,)), ("iso_cts", (16,)), ("tsv_m", (2, 3, 4)), ("iso_cts", ())],
)
def test_tsv_and_iso_give_other_tensors_the_mean_of_the_task_vectors(method: str, shape: tuple[int, ...]) -> None:
    base, tuned = _models(shape, 3)
    out = _run(method, base, tuned, **{"lambda": 0.7})
    torch.testing.assert_close(out, base + 0.7 * sum(x - base for x in tuned) / 3)


@pytest.mark.parametrize("shape", [(16,), (2, 3, 4), ()])
def test_wudi_leaves_other_tensors_at_the_base(shape: tuple[int, ...]) -> None:
    base, tuned = _models(shape, 3)
    assert torch.equal(_run("wudi", base, tuned), base)


# --- properties ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["iso_c", "iso_cts"])
def test_iso_merges_have_a_flat_spectrum(method: str) -> None:
    base, tuned = _models((16, 12), 3)
    s = torch.linalg.svdvals(_run(method, base, tuned) - base)
    torch.testing.assert_close(s, s.mean().expand(12), rtol=1e-10, atol=0)


def test_tsv_m_orthonormal_bases_keep_exactly_the_kept_singular_values() -> None:
    base, tuned = _models((16, 12), 3)
    kept = torch.cat([torch.linalg.svdvals(x - base)[:4] for x in tuned])  # k = 12 / 3
    s = torch.linalg.svdvals(_run("tsv_m", base, tuned) - base)
    torch.testing.assert_close(s, kept.sort(descending=True).values, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(16, 12), (12, 16)])
def test_wudi_lowers_its_loss_below_task_arithmetics(shape: tuple[int, int]) -> None:
    base, tuned = _models(shape, 3)
    taus = [x - base for x in tuned]
    out = _run("wudi", base, tuned)
    assert wudi_loss(out - base, taus) < 0.99 * wudi_loss(sum(taus), taus)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(16, 12), (16,)])
def test_lambda_0_gives_the_base(method: str, shape: tuple[int, ...]) -> None:
    base, tuned = _models(shape, 3)
    assert torch.equal(_run(method, base, tuned, **{"lambda": 0.0}), base)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_kept_and_deterministic(method: str, dtype: torch.dtype) -> None:
    base, tuned = _models((16, 12), 3, dtype)
    first, second = _run(method, base, tuned), _run(method, base, tuned)
    assert first.dtype == dtype and torch.equal(first, second)


# --- degenerate cases -----------------------------------------------------------------------------------------------------


def _iso_of(tau: torch.Tensor) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(tau, full_matrices=False)
    return s.mean() * u @ vh


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("tsv_m", lambda tau: tau),  # k = r: every component, orthonormal already
        ("iso_c", _iso_of),
        ("iso_cts", _iso_of),  # the task's directions complete the common ones
        ("wudi", lambda tau: tau),  # the start is the optimum
    ],
)
def test_one_model(method: str, expected: Callable[[torch.Tensor], torch.Tensor]) -> None:
    base, (x,) = _models((16, 12), 1)
    torch.testing.assert_close(_run(method, base, [x], **{"lambda": 0.5}), base + 0.5 * expected(x - base), rtol=0, atol=1e-12)
    bias, (y,) = _models((16,), 1)
    torch.testing.assert_close(_run(method, bias, [y]), bias if method == "wudi" else y)


def test_tsv_m_keeps_the_base_where_the_matrix_has_fewer_components_than_models() -> None:
    base, tuned = _models((16, 2), 3)  # int(2 / 3) = 0 components each, as the authors' code
    assert torch.equal(_run("tsv_m", base, tuned), base)


def test_wudi_leaves_a_zero_task_vector_out() -> None:
    base, (x1, x2) = _models((16, 12), 2)
    out = _run("wudi", base, [x1, base, x2])  # the authors' 0 / 0 would be NaN
    torch.testing.assert_close(out, _run("wudi", base, [x1, x2]), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "count", "fraction"),
    [
        ((16, 12), 3, 0.8),  # int(9.6) = 9 common, round(3 / 3) = 1 per task
        ((16, 12), 5, 0.8),  # round(3 / 5) = 1 per task: 7 common
        ((16, 12), 3, 1.0),  # the common subspace alone
    ],
)
def test_iso_cts_splits_the_directions_as_the_authors_round(shape: tuple[int, int], count: int, fraction: float) -> None:
    base, tuned = _models(shape, count)
    out = _run("iso_cts", base, tuned, common_space_fraction=fraction)
    expected = ref_iso_cts([(x - base).numpy() for x in tuned], fraction)
    np.testing.assert_allclose((out - base).numpy(), expected, rtol=0, atol=1e-9)


def test_iso_cts_with_the_common_subspace_alone_is_iso_c() -> None:
    base, tuned = _models((16, 12), 3)
    torch.testing.assert_close(_run("iso_cts", base, tuned, common_space_fraction=1.0), _run("iso_c", base, tuned), rtol=0, atol=1e-12)


def test_iso_cts_rounds_down_where_the_task_directions_would_not_fit() -> None:
    base, tuned = _models((16, 3), 2)  # round(3 / 2) = 2 per task needs 4 > 3 directions: 1 per task, 1 common
    s = torch.linalg.svdvals(_run("iso_cts", base, tuned, common_space_fraction=0.0) - base)
    torch.testing.assert_close(s, s.mean().expand(3), rtol=1e-10, atol=0)
    assert s.min() > 0.01


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_iso_cts_refuses_a_fraction_outside_0_1(fraction: float) -> None:
    base, tuned = _models((16, 12), 2)
    with pytest.raises(ValueError, match="common_space_fraction must be in \\[0, 1\\]"):
        _run("iso_cts", base, tuned, common_space_fraction=fraction)


# --- the registry and the memory declared ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_each_entry_needs_a_base_is_spectral_and_takes_lambda(method: str) -> None:
    merge = MERGES[method]
    assert (merge.name, merge.base, merge.spectral, merge.exact, dict(merge.per_model)) == (method, "required", True, True, {})
    assert merge.globals["lambda"] == 1.0
    assert set(merge.globals) == ({"lambda", "common_space_fraction"} if method == "iso_cts" else {"lambda"})


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors alive (by storage) under the mode, the ``held`` ones from the start; keeps the
    peak. Sees what torch returns, not LAPACK's own workspace."""

    def __init__(self, held: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.refs: dict[int, float] = {}
        self.size: dict[int, int] = {}
        self.now = 0
        for t in held:
            self._add(t, permanent=True)
        self.peak = self.now

    def _add(self, t: torch.Tensor, permanent: bool = False) -> None:
        key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if not nbytes:
            return
        if key not in self.refs:
            self.refs[key], self.size[key] = 0, nbytes
            self.now += nbytes
            self.peak = max(getattr(self, "peak", 0), self.now)
        if permanent:
            self.refs[key] = float("inf")
        else:
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(64, 48), (48, 64)])
def test_peak_counts_the_tensors_held(method: str, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The declared peak covers what is counted (plus one copy of the matrix for LAPACK where there is an SVD), for 2
    and 6 models, and is not loose by more than 2 tensors. WUDI's steps all hold the same: 3 of them are counted."""
    monkeypatch.setattr(spectral, "WUDI_STEPS", 3)
    lapack = 0 if method == "wudi" else 1
    for count in (2, 6):
        base, tuned = _models(shape, count, torch.float32)
        live = _LiveBytes([base, *tuned])
        with live:
            MERGES[method].fn(base, tuned, [{}] * count, dict(MERGES[method].globals), [])
        counted = live.peak / base.untyped_storage().nbytes() + lapack
        declared = MERGES[method].peak(count + 1)
        assert declared - 2 <= counted <= declared, (count, counted, declared)
