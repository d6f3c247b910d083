"""Merging aligned models, and the client-side statistics the weighted merges need.

* :func:`merge_average`: the weighted average of the parameters.
* :func:`merge_fisher`: Fisher-weighted averaging (Matena & Raffel 2022), per parameter, with diagonal Fishers
  (:func:`diagonal_fisher`, computed by each client on its own data).
* :func:`merge_regmean`: RegMean (Jin et al. 2023): every Linear / Conv2d weight is the minimiser of the summed
  squared distances between the merged layer's outputs and each model's, on each model's inputs; it needs only the
  inputs' Gram matrices (:func:`input_grams`; :func:`masked_grams` for token-id rows of texts), never the inputs. An
  embedding table is a Linear on one-hot inputs, whose Gram is diagonal: the count of each row's use; given those
  counts, each row is merged by them.

The models must be aligned first (:mod:`rayfuse.alignment.weight`, :mod:`rayfuse.alignment.activation`), and the
statistics must be in the same frame: compute them on the aligned models, or permute them with
:func:`permute_fisher` / :func:`permute_grams`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F
from torch import nn

from rayfuse.alignment._common import (
    Params,
    batches,
    check_models,
    evaluating,
    normalize_weights,
    param_dtype,
    resolve_device,
    weighted_average,
)
from rayfuse.errors import InputError
from rayfuse.symmetry import Perms, PermutationSpec

__all__ = [
    "merge_average",
    "merge_fisher",
    "merge_regmean",
    "diagonal_fisher",
    "input_grams",
    "masked_grams",
    "permute_fisher",
    "permute_grams",
]

#: :func:`merge_fisher`'s default floor added to every Fisher entry
FISHER_EPS = 1e-8


def merge_average(aligned: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None = None) -> Params:
    """The weighted average of aligned models, per tensor (non-float tensors: model 0's)."""
    check_models(aligned, where="aligned")
    return weighted_average(aligned, normalize_weights(weights, len(aligned)))


def merge_fisher(
    aligned: Sequence[Mapping[str, np.ndarray]],
    fishers: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | None = None,
    eps: float = FISHER_EPS,
) -> Params:
    """Fisher-weighted averaging: ``theta = sum_k w_k (F_k + eps) theta_k / sum_k w_k (F_k + eps)`` per parameter.

    Parameters
    ----------
    aligned : list of dict
        The aligned models.
    fishers : list of dict
        One diagonal Fisher per model (same keys and shapes as the parameters it covers); tensors without a Fisher
        are averaged.
    weights : list of float, optional
        The models' weights (default equal).
    eps : float
        Added to every Fisher entry (the merge of entries no model is sure of is the average).
    """
    check_models(aligned, where="aligned")
    if len(fishers) != len(aligned):
        raise InputError("fishers", f"one Fisher per model ({len(aligned)})", len(fishers))
    if eps < 0:
        raise InputError("eps", "a non-negative number", eps)
    w = normalize_weights(weights, len(aligned))
    out = weighted_average(aligned, w)
    covered = set(fishers[0])
    for k, fisher in enumerate(fishers):
        if set(fisher) != covered:
            raise InputError(f"fishers.{k}", "the keys of fishers.0", sorted(set(fisher) ^ covered)[:3])
    for key in covered:
        if key not in aligned[0]:
            raise InputError(f"fishers.0.{key}", "keys of the models' parameters", key)
        first = np.asarray(aligned[0][key])
        num = np.zeros(first.shape, dtype=np.float64)
        den = np.zeros(first.shape, dtype=np.float64)
        for k, (weight, model, fisher) in enumerate(zip(w, aligned, fishers)):
            f = np.asarray(fisher[key], dtype=np.float64)
            if f.shape != first.shape:
                raise InputError(f"fishers.{k}.{key}", f"shape {first.shape}", f.shape)
            if (f < 0).any() or not np.isfinite(f).all():
                raise InputError(f"fishers.{k}.{key}", "finite non-negative Fisher values", "negative or non-finite entries")
            num += weight * (f + eps) * np.asarray(model[key], dtype=np.float64)
            den += weight * (f + eps)
        safe = den > 0
        merged = np.where(safe, num / np.where(safe, den, 1.0), out[key].astype(np.float64))
        out[key] = merged.astype(first.dtype, copy=False)
    return out


def merge_regmean(
    aligned: Sequence[Mapping[str, np.ndarray]],
    grams: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    *,
    device: str | torch.device | None = None,
) -> Params:
    """RegMean: ``W = (sum_k W_k G_k') (sum_k G_k')^-1`` for every weight with a Gram, ``G' = alpha G + (1 - alpha) diag(G)``.

    Parameters
    ----------
    aligned : list of dict
        The aligned models.
    grams : list of dict
        One dict per model: the weight's state-dict key -> the Gram matrix of that layer's inputs (summed over the
        model's data, :func:`input_grams`): ``(in, in)`` for a Linear ``(out, in)``, ``(C_in kh kw, C_in kh kw)`` for a
        Conv2d ``(out, C_in, kh, kw)`` (its unfolded inputs); or, for an embedding table ``(rows, dim)``, a vector
        ``(rows,)``: how often the model's data used each row. An embedding is a Linear on one-hot inputs, its Gram
        the diagonal matrix of those counts, so RegMean's solve is each row's average weighted by its counts
        (``alpha`` keeps a diagonal Gram as it is); a row no model's data used keeps the models' weighted average.
        Tensors without a Gram (biases...) are averaged.
    weights : list of float, optional
        Multiply each model's Gram (default: none; sums over more data weigh more, as in the paper).
    alpha : float
        In ``[0, 1]``: the share of the off-diagonal Gram entries kept (1: the exact least-squares merge).
    device : str or torch.device, optional
        Where the products and the solves run with torch, in float64 (the coordinator's GPU); default: numpy and
        scipy on the CPU. The two agree to float rounding.
    """
    check_models(aligned, where="aligned")
    if len(grams) != len(aligned):
        raise InputError("grams", f"one dict of Grams per model ({len(aligned)})", len(grams))
    if not 0.0 <= alpha <= 1.0:
        raise InputError("alpha", "a number in [0, 1]", alpha)
    scale = normalize_weights(weights, len(aligned)) * len(aligned)
    out = weighted_average(aligned, normalize_weights(weights, len(aligned)))
    covered = set(grams[0])
    for k, model_grams in enumerate(grams):
        if set(model_grams) != covered:
            raise InputError(f"grams.{k}", "the keys of grams.0", sorted(set(model_grams) ^ covered)[:3])
    for key in sorted(covered):
        if key not in aligned[0]:
            raise InputError(f"grams.0.{key}", "the key of a Linear or Conv2d weight of the models", key)
        first = np.asarray(aligned[0][key])
        if first.ndim not in (2, 4):
            raise InputError(f"grams.0.{key}", "the key of a 2-d (Linear) or 4-d (Conv2d) weight", first.shape)
        if np.ndim(grams[0][key]) == 1 and first.ndim == 2:  # an embedding's row counts: its diagonal Gram
            out[key] = _merge_rows(aligned, grams, weights, key)
            continue
        width = int(np.prod(first.shape[1:]))
        if device is not None:
            out[key] = _regmean_torch(aligned, grams, scale, key, first, width, alpha, out[key], resolve_device(device))
            continue
        lhs = np.zeros((width, width))
        rhs = np.zeros((first.shape[0], width))
        for k, (s, model) in enumerate(zip(scale, aligned)):
            g = np.asarray(grams[k][key], dtype=np.float64)
            if g.shape != (width, width):
                raise InputError(f"grams.{k}.{key}", f"a ({width}, {width}) Gram matrix", g.shape)
            g = alpha * g + (1.0 - alpha) * np.diag(np.diag(g))
            lhs += s * g
            rhs += s * np.asarray(model[key], dtype=np.float64).reshape(first.shape[0], width) @ g
        out[key] = _solve_right(rhs, lhs, out[key].reshape(first.shape[0], width)).reshape(first.shape).astype(first.dtype, copy=False)
    return out


def _merge_rows(
    aligned: Sequence[Mapping[str, np.ndarray]], grams: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float] | None, key: str
) -> np.ndarray:
    """One embedding table of :func:`merge_regmean` from each model's row counts (its diagonal Gram): each row's
    count-weighted average, the weighted average where no model counted the row. That is :func:`merge_fisher` of the
    table with each row's count as every entry's weight and no floor (a common scale of the weights cancels)."""
    first = np.asarray(aligned[0][key])
    counts = []
    for k in range(len(aligned)):
        c = np.asarray(grams[k][key], dtype=np.float64)
        if c.shape != (first.shape[0],):
            raise InputError(f"grams.{k}.{key}", f"({first.shape[0]},) row counts (the table's rows)", c.shape)
        if (c < 0).any() or not np.isfinite(c).all():
            raise InputError(f"grams.{k}.{key}", "finite non-negative row counts", "negative or non-finite entries")
        counts.append({key: np.broadcast_to(c[:, None], first.shape)})
    return merge_fisher([{key: model[key]} for model in aligned], counts, weights, eps=0.0)[key]


def _regmean_torch(
    aligned: Sequence[Mapping[str, np.ndarray]],
    grams: Sequence[Mapping[str, np.ndarray]],
    scale: np.ndarray,
    key: str,
    first: np.ndarray,
    width: int,
    alpha: float,
    default: np.ndarray,
    dev: torch.device,
) -> np.ndarray:
    """One weight of :func:`merge_regmean` with torch on ``dev`` (float64): the same sums, then ``rhs @ inv(lhs)`` by a
    Cholesky solve (least squares where ``lhs`` is singular; ``default`` where it is 0)."""
    lhs = torch.zeros((width, width), dtype=torch.float64, device=dev)
    rhs = torch.zeros((first.shape[0], width), dtype=torch.float64, device=dev)
    for k, (s, model) in enumerate(zip(scale, aligned)):
        g_np = np.asarray(grams[k][key], dtype=np.float64)
        if g_np.shape != (width, width):
            raise InputError(f"grams.{k}.{key}", f"a ({width}, {width}) Gram matrix", g_np.shape)
        g = torch.as_tensor(g_np, device=dev)
        g = alpha * g + (1.0 - alpha) * torch.diag(torch.diagonal(g))
        lhs += float(s) * g
        w = torch.as_tensor(np.asarray(model[key], dtype=np.float64).reshape(first.shape[0], width), device=dev)
        rhs += float(s) * (w @ g)
    if not bool(lhs.any()):
        merged = np.asarray(default, dtype=np.float64).reshape(first.shape[0], width)
    else:
        factor, info = torch.linalg.cholesky_ex(lhs)
        if int(info) == 0:
            solved = torch.cholesky_solve(rhs.T, factor).T
        else:  # not positive definite: least squares, as the CPU path falls back to
            solved = torch.linalg.lstsq(lhs.cpu(), rhs.T.cpu(), driver="gelsd").solution.T  # gelsd: CPU only, like numpy's
        merged = solved.cpu().numpy()
    return merged.reshape(first.shape).astype(first.dtype, copy=False)


def _solve_right(rhs: np.ndarray, lhs: np.ndarray, default: np.ndarray) -> np.ndarray:
    """``rhs @ inv(lhs)`` for a symmetric PSD ``lhs`` (least squares where it is singular; ``default`` where it is 0)."""
    if not lhs.any():
        return np.asarray(default, dtype=np.float64)
    try:
        return scipy.linalg.solve(lhs, rhs.T, assume_a="pos").T
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError):
        return np.linalg.lstsq(lhs, rhs.T, rcond=None)[0].T


def masked_grams(model: nn.Module, X: np.ndarray, *, batch_size: int = 32) -> dict[str, np.ndarray]:
    """The Gram matrices (float64 sums) of the inputs of every ``nn.Linear`` of ``model`` on token-id rows ``X`` (a
    text's padding is ``-1``, :data:`rayfuse.data.text.PAD`; ``model`` takes such rows, as a Hugging Face classifier
    built by :func:`rayfuse.models.hf.hf_model` does): at each text's tokens only (a layer whose input is ``(batch,
    length, in)`` drops the padded positions; one whose input is a row a text, the pooler's and the classifier's, keeps
    every row). Keys: ``<module>.weight``.

    And of every ``nn.Embedding`` (the word, position and token-type tables): a table is a Linear on one-hot inputs,
    so its Gram is diagonal, and it is kept as that diagonal, ``(rows,)``: how often the text's tokens used each row
    (an index broadcast over the batch, such as a position, counted at each text's tokens). RegMean then merges each
    row by those counts (:func:`merge_regmean`): a word's row comes from the models whose data held
    the word, not diluted by those that never saw it."""
    sums: dict[str, torch.Tensor] = {}
    current: dict[str, torch.Tensor] = {}

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            x = inputs[0].detach()
            mask = current["mask"]
            rows = x[mask] if x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape) else x.reshape(-1, x.shape[-1])
            rows = rows.to(torch.float64)
            gram = rows.T @ rows
            sums[name] = sums[name] + gram if name in sums else gram

        return hook

    def count_for(name: str, table: nn.Embedding) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            index, mask = inputs[0].detach(), current["mask"]
            try:
                index = torch.broadcast_to(index, tuple(mask.shape))[mask] if index.dim() == mask.dim() else index.reshape(-1)
            except RuntimeError:  # an index of another shape: every entry counted
                index = index.reshape(-1)
            counts = torch.bincount(index.long(), minlength=table.num_embeddings).to(torch.float64)
            sums[name] = sums[name] + counts if name in sums else counts

        return hook

    handles = [
        layer.register_forward_hook(hook_for(f"{name}.weight")) for name, layer in model.named_modules() if isinstance(layer, nn.Linear)
    ]
    handles += [
        layer.register_forward_hook(count_for(f"{name}.weight", layer))
        for name, layer in model.named_modules()
        if isinstance(layer, nn.Embedding)
    ]
    device = next(model.parameters()).device
    with evaluating(model, device, handles), torch.no_grad():
        for i in range(0, len(X), batch_size):  # not _common.batches: it casts to the parameters' dtype (token ids)
            xb = torch.as_tensor(X[i : i + batch_size]).to(device)
            current["mask"] = xb >= 0
            model(xb)
    return {k: v.cpu().numpy() for k, v in sums.items()}


def permute_fisher(fisher: Mapping[str, np.ndarray], spec: PermutationSpec, perms: Perms) -> Params:
    """A model's Fisher in the aligned frame (the Fisher has the parameters' shapes: ``spec.apply``)."""
    return spec.apply(fisher, perms)


def permute_grams(grams: Mapping[str, np.ndarray], spec: PermutationSpec, perms: Perms, shapes: Mapping[str, Sequence[int]]) -> Params:
    """A model's Grams in the aligned frame: each Gram's rows and columns follow the weight's permuted input axes.

    ``shapes``: the weights' shapes (e.g. ``{k: v.shape for k, v in params.items()}``)."""
    out = dict(grams)
    for key, gram in grams.items():
        if key not in shapes:
            raise InputError(f"grams.{key}", "the key of a weight of the model", key)
        shape = tuple(shapes[key])
        index = np.arange(int(np.prod(shape[1:]))).reshape((1, *shape[1:]))
        for g in spec.groups_of(key):
            if g.name in perms:
                for axis in g.axes:
                    if axis.key == key and axis.dim % len(shape) != 0:
                        index = axis.permute(index, np.asarray(perms[g.name]))
        flat = index.reshape(-1)
        out[key] = np.asarray(gram)[np.ix_(flat, flat)]
    return out


def diagonal_fisher(
    model: nn.Module, X: np.ndarray, y: np.ndarray, *, batch_size: int = 256, device: str | torch.device | None = None
) -> Params:
    """The empirical diagonal Fisher of ``model`` on ``(X, y)``: the mean over samples of the squared gradient of each
    sample's log-likelihood of its label (classification: integer labels, the log-softmax of the output; regression:
    float targets, a unit-variance Gaussian). Runs in eval mode; one entry per parameter (float64)."""
    if len(X) != len(y) or len(X) == 0:
        raise InputError("y", f"one label per input ({len(X)}), at least one", len(y))
    dev = resolve_device(device)
    dtype = param_dtype(model)
    classify = np.asarray(y).dtype.kind in "iub"
    data = batches(X, batch_size, dtype, dev)
    with evaluating(model, dev):
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}

        def loglik(p: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(model, (p, buffers), (x.unsqueeze(0),))
            if classify:
                return torch.log_softmax(out, dim=-1).reshape(-1).gather(0, target.reshape(1))[0]
            return -0.5 * ((out.reshape(-1) - target.reshape(-1)) ** 2).sum()

        grad = torch.func.grad(loglik)
        per_sample: Callable[..., dict[str, torch.Tensor]] = torch.func.vmap(grad, in_dims=(None, 0, 0))
        if getattr(model, "masks_padding", False) and bool(np.any(np.asarray(X) < 0)):
            # padded texts: transformers builds the attention mask with data-dependent branches vmap cannot trace,
            # so each sample's gradient is taken on its own (same numbers, a loop)
            def looped(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> dict[str, torch.Tensor]:
                grads = [grad(p, x, t) for x, t in zip(xb, yb)]
                return {k: torch.stack([g[k] for g in grads]) for k in p}

            per_sample = looped

        total = {k: torch.zeros(v.shape, dtype=torch.float64, device=dev) for k, v in params.items()}
        labels = np.asarray(y)
        for lo, xb in zip(range(0, len(X), batch_size), data):
            yb = torch.as_tensor(labels[lo : lo + batch_size], dtype=torch.long if classify else dtype, device=dev)
            for k, g in per_sample(params, xb, yb).items():
                total[k] += (g.to(torch.float64) ** 2).sum(0)
    return {k: (v / len(X)).cpu().numpy() for k, v in total.items()}


def _conv_padding(conv: nn.Conv2d) -> tuple[int, int] | None:
    if conv.padding_mode != "zeros":
        return None
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0)
        return None
    return (int(conv.padding[0]), int(conv.padding[1]))


def input_grams(
    model: nn.Module, X: np.ndarray, *, batch_size: int = 256, device: str | torch.device | None = None
) -> tuple[dict[str, np.ndarray], int]:
    """The Gram matrices of the inputs of every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` on ``X`` (eval mode).

    Keys are the layers' weight keys (``"<module>.weight"``). A Linear's inputs are its input rows (every leading
    position); a Conv2d's are its unfolded patches, ``C_in * kh * kw`` wide, one per output position. Grouped
    convolutions and convolutions with non-zero padding modes or ``"same"`` padding are left out (RegMean averages
    them). Returns the Grams (float64 sums) and the number of samples."""
    dev = resolve_device(device)
    data = batches(X, batch_size, param_dtype(model), dev)
    sums: dict[str, torch.Tensor] = {}
    handles = []

    def hook_for(name: str, layer: nn.Module) -> Callable[[nn.Module, tuple, torch.Tensor], None]:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            x = inputs[0]
            if isinstance(layer, nn.Linear):
                rows = x.reshape(-1, x.shape[-1])
            else:
                conv = layer
                assert isinstance(conv, nn.Conv2d)
                pad = _conv_padding(conv)
                rows = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=pad, stride=conv.stride)  # type: ignore[arg-type]
                rows = rows.transpose(1, 2).reshape(-1, rows.shape[1])
            rows = rows.to(torch.float64)
            gram = rows.T @ rows
            sums[name] = sums[name] + gram if name in sums else gram

        return hook

    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear) or (isinstance(layer, nn.Conv2d) and layer.groups == 1 and _conv_padding(layer) is not None):
            handles.append(layer.register_forward_hook(hook_for(f"{name}.weight" if name else "weight", layer)))
    with evaluating(model, dev, handles), torch.no_grad():
        for xb in data:
            model(xb)
    return {k: v.cpu().numpy() for k, v in sums.items()}, len(X)
