"""The teachers of a distillation: the clients' models, evaluated together, and how their outputs are combined.

:class:`Teachers` holds K models. Models of one architecture (the same class and the same ``state_dict`` layout) form a
group, and a group is evaluated in one batched call: the members' parameters and buffers stacked
(``torch.func.stack_module_state``) and one ``functional_call`` vmapped over them, instead of a Python loop over models.
Groups of other architectures (heterogeneous clients) are evaluated one call per group. ``batched=False`` evaluates
every model in a loop (the reference the speed benchmark measures against; on the CPU the loop can be the faster of
the two for convolutional models, where grouped convolutions are slower than separate ones: measured in
``benchmarks/distill/speed.py``).

The ensemble (:func:`combine_teachers`) is the weighted average of the members' logits, as FedDF averages them [FEDDF],
with per-class weights ``w[k, c]`` (:func:`teacher_weights`): uniform, by each client's sample count, or by each
client's share of class ``c`` (a client that never saw a class has no say on it; the way FedDF's and Co-Boosting's
weighted ensembles are built from the clients' label counts).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Teachers",
    "teacher_weights",
    "combine_teachers",
    "ensemble_term",
    "ensemble_of_sum",
    "distillation_loss",
    "prior_gap",
    "choose_target",
    "class_holders",
    "flat_temperature",
    "mean_entropy",
    "PRIOR_MARGIN",
    "MAX_ENTROPY",
    "MIN_HOLDERS",
    "MIN_CLIENTS",
    "WEIGHTINGS",
    "COMBINES",
]

WEIGHTINGS = ("uniform", "samples", "classes")
COMBINES = ("logits", "probabilities", "geometric", "energy")
_EPS = 1e-3  # class-count smoothing: a class no client holds gets uniform weights, not 0 / 0
_FLOOR = 1e-12  # the weighted probabilities' floor before their log (combine: probabilities)
# combine: auto's check (choose_target): the plain mean replaces the default only when its top-1 classes are nearer the
# pooled class frequencies by more than this (total variation; 3 of 300 public inputs). Chosen on the probe cells in
# docs/methods/distill.md: at 0 near-ties switch, and lose as often as they gain
PRIOR_MARGIN = 0.01
# ... and only where classes are shared (class_holders): where each class has about one owner, the class weights give
# the owner's say, and the plain mean's top-1 is decided by margins a student does not learn (label-disjoint cells in
# docs/methods/distill.md). Halfway between one holder a class and two
MIN_HOLDERS = 1.5
# ... and only with many clients, where the failure it corrects arises (each client holds a few dozen examples of a few
# classes): with a few strong clients the plain mean is a mixture of a few peaked opinions, and distilled it lost up to
# 0.08 where its labels were the more accurate (the MNIST-1D newcomer's mixed sites, K = 6; docs/methods/distill.md)
MIN_CLIENTS = 10
# ... and where it runs, the target is sharpened until its mean entropy on the public inputs is at most this share of
# log C (flat_temperature): with many clients of a few dozen examples each, the ensemble is near uniform (0.97 of log C
# at K = 50), its classes differ by a few hundredths of probability, and at temperature 1 a student learns the flat
# part and not the order (the probe cells in docs/methods/distill.md). Above every measured cell under 10 clients
# (0.67 at most)
MAX_ENTROPY = 0.75
_MIN_TEMPERATURE = 0.05  # flat_temperature's floor: below it the target is its top-1 class


def teacher_weights(kind: Literal["uniform", "samples", "classes"], class_counts: np.ndarray) -> np.ndarray:
    """Per-class teacher weights ``w[k, c]`` (each column sums to 1).

    Parameters
    ----------
    kind : {"uniform", "samples", "classes"}
        ``uniform``: ``1 / K``; ``samples``: ``n_k / n`` (each client's share of all training samples); ``classes``:
        ``(n_kc + eps) / sum_j (n_jc + eps)``, each client's share of class ``c``.
    class_counts : ndarray of shape (K, C)
        Each teacher's training samples per class.

    Returns
    -------
    ndarray of shape (K, C), float32

    Examples
    --------
    >>> teacher_weights("classes", np.array([[10, 0], [10, 30]])).round(3).tolist()
    [[0.5, 0.0], [0.5, 1.0]]
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    num_teachers, num_classes = counts.shape
    if kind == "uniform":
        weights = np.full((num_teachers, num_classes), 1.0 / num_teachers)
    elif kind == "samples":
        sizes = counts.sum(axis=1)
        share = sizes / sizes.sum() if sizes.sum() > 0 else np.full(num_teachers, 1.0 / num_teachers)
        weights = np.repeat(share[:, None], num_classes, axis=1)
    elif kind == "classes":
        smoothed = counts + _EPS
        weights = smoothed / smoothed.sum(axis=0, keepdims=True)
    else:
        raise ValueError(f"teacher weighting: expected one of {WEIGHTINGS}, got {kind!r}")
    return weights.astype(np.float32)


def writable(a: Any) -> np.ndarray:
    """``a`` as a C-contiguous array that may be written: a read-only array (from Ray's object store) is copied, never
    written through; a writable one is copied only where it is not contiguous."""
    a = np.asarray(a)
    return np.ascontiguousarray(a) if a.flags.writeable else np.array(a, order="C")


def combine_teachers(member_logits: torch.Tensor, weights: torch.Tensor, how: str = "logits") -> torch.Tensor:
    """The ensemble's logits from the members' ``(K, N, C)`` logits and per-class weights ``(K, C)``.

    .. math::

        \\bar z_c(x) = \\sum_k w_{kc} z_{kc}(x) \\quad (\\text{logits}), \\qquad
        \\bar z_c(x) = \\log \\sum_k w_{kc}\\, \\mathrm{softmax}(z_k(x))_c \\quad (\\text{probabilities}),

        \\bar z_c(x) = \\sum_k w_{kc} \\log \\mathrm{softmax}(z_k(x))_c \\quad (\\text{geometric}),

        \\bar z_c(x) = \\sum_k w_{kc} \\big(\\log \\mathrm{softmax}(z_k(x))_c + \\hat E_k(x)\\big) \\quad (\\text{energy}),
        \\quad \\hat E_k(x) = \\frac{E_k(x) - \\mathrm{mean}_X E_k}{\\mathrm{std}_X E_k}, \\; E_k = \\log \\sum_c e^{z_{kc}}

    ``geometric`` is the members' weighted geometric mean of probabilities (a product of experts): like ``logits`` a
    sum the members' terms make, but of log-probabilities, so a member whose logits are on a larger scale (another
    architecture, a more confident training) does not outweigh the rest. ``energy`` adds back what normalising
    discards, how familiar each member finds the input: its energy ``E_k`` (the log-sum-exp of its logits, higher on
    inputs like its training data), standardised over the ``N`` inputs combined (a bank, a held-out set), so that it is
    on one scale for every member. Returns ``(N, C)``.
    """
    w = weights.to(member_logits.dtype)[:, None, :]
    if how == "logits":
        return (w * member_logits).sum(0)
    if how == "geometric":
        return (w * torch.log_softmax(member_logits, dim=2)).sum(0)
    if how == "energy":
        return (w * _energy_log_probabilities(member_logits)).sum(0)
    if how == "probabilities":
        return torch.log((w * torch.softmax(member_logits, dim=2)).sum(0).clamp_min(_FLOOR))
    raise ValueError(f"combine: expected one of {COMBINES}, got {how!r}")


def _energy_log_probabilities(member_logits: torch.Tensor) -> torch.Tensor:
    """Each member's log-probabilities plus its standardised energy over the inputs (``combine: energy``): ``(K, N,
    C)`` from ``(K, N, C)`` logits (a member whose energy is constant over the inputs adds 0)."""
    energy = torch.logsumexp(member_logits, dim=2)
    spread = energy.std(1, unbiased=False, keepdim=True)
    standard = (energy - energy.mean(1, keepdim=True)) / spread.clamp_min(1e-6)
    return torch.log_softmax(member_logits, dim=2) + standard[:, :, None]


def prior_gap(logits: torch.Tensor | np.ndarray, prior: np.ndarray) -> float:
    """How far an ensemble's top-1 classes on some inputs are from the class frequencies ``prior`` ``(C,)``: the total
    variation ``0.5 * sum_c |h_c - p_c|`` between the histogram ``h`` of the argmax of ``logits`` ``(N, C)`` and ``p``
    (normalised). 0: the inputs are labelled in the proportions of ``prior``; 1: only in classes it gives no mass.

    Examples
    --------
    >>> prior_gap(np.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [1.0, 0.0]]), np.array([1.0, 1.0]))
    0.25
    """
    top = torch.as_tensor(logits).argmax(-1).reshape(-1).cpu().numpy()
    p = np.asarray(prior, dtype=np.float64)
    h = np.bincount(top, minlength=len(p)) / max(1, len(top))
    return round(float(0.5 * np.abs(h - p / p.sum()).sum()), 6)


def mean_entropy(logits: torch.Tensor | np.ndarray, temperature: float = 1.0) -> float:
    """The mean entropy of the softmax of ``logits / temperature`` ``(N, C)`` over its rows, as a share of ``log C``
    (0: one-hot; 1: uniform).

    Examples
    --------
    >>> mean_entropy(torch.zeros(2, 4))
    1.0
    """
    z = torch.as_tensor(logits, dtype=torch.float64)
    p = torch.softmax(z.reshape(-1, z.shape[-1]) / float(temperature), dim=1)
    return float(-(p * torch.log(p.clamp_min(_FLOOR))).sum(1).mean() / np.log(max(2, z.shape[-1])))


def flat_temperature(logits: torch.Tensor | np.ndarray, max_entropy: float = MAX_ENTROPY) -> float:
    """The temperature ``T <= 1`` at which the softmax of ``logits / T`` ``(N, C)`` has a mean entropy of at most
    ``max_entropy`` times ``log C`` (:func:`mean_entropy`): 1 where it has at temperature 1, else the largest such
    ``T`` found by bisection on ``log T`` (the entropy falls as ``T`` does), rounded down to 3 decimals, floored at 0.05.

    Examples
    --------
    >>> flat_temperature(torch.tensor([[4.0, 0.0], [0.0, 4.0]]))
    1.0
    >>> T = flat_temperature(torch.tensor([[0.2, 0.0, 0.0], [0.0, 0.1, 0.0]]))
    >>> 0.05 < T < 0.2
    True
    """
    if np.shape(logits)[-1] < 2 or mean_entropy(logits) <= max_entropy:
        return 1.0
    low, high = _MIN_TEMPERATURE, 1.0
    if mean_entropy(logits, low) > max_entropy:
        return low
    for _ in range(40):
        mid = float(np.sqrt(low * high))
        low, high = (mid, high) if mean_entropy(logits, mid) <= max_entropy else (low, mid)
    return float(np.floor(low * 1000) / 1000)


def class_holders(class_counts: np.ndarray) -> float:
    """How many clients hold each class, on average over the classes: the effective number ``1 / sum_k w_kc^2`` of
    each class's shares ``w_kc`` (:func:`teacher_weights`'s ``classes``). 1: every class has one owner
    (label-disjoint); K: every client holds an equal share of every class.

    Examples
    --------
    >>> class_holders(np.array([[10, 0], [0, 10]]))
    1.0
    >>> class_holders(np.array([[10, 5], [10, 5]]))
    2.0
    """
    w = teacher_weights("classes", class_counts).astype(np.float64)
    return round(float((1.0 / np.square(w).sum(axis=0)).mean()), 3)


def choose_target(
    ensembles: dict[str, torch.Tensor], prior: np.ndarray, default: str, margin: float = PRIOR_MARGIN
) -> tuple[str, dict[str, float]]:
    """Which of the candidate ``ensembles`` (name: logits ``(N, C)`` on the same unlabeled inputs) to distil:
    ``default``, unless another's top-1 classes are nearer the class frequencies ``prior`` (:func:`prior_gap`) by more
    than ``margin``, then the nearest. Returns the name and every candidate's gap.

    ``combine: auto``'s check on public inputs, drawn like the clients' data pooled: with many clients of a few
    classes each, the class-weighted ensemble can name each client's few classes everywhere (each holds a large
    share of them), and its labels on the public inputs then stray from the pooled class counts the server already
    holds; the plain mean of the teachers' probabilities does not (docs/methods/distill.md gives the measured cells).

    Examples
    --------
    >>> skewed, plain = torch.tensor([[1.0, 0.0]] * 4), torch.tensor([[1.0, 0.0], [0.0, 1.0]] * 2)
    >>> choose_target({"energy": skewed, "plain": plain}, np.array([5, 5]), "energy")
    ('plain', {'energy': 0.5, 'plain': 0.0})
    """
    gaps = {name: prior_gap(z, prior) for name, z in ensembles.items()}
    nearest = min(gaps, key=lambda name: gaps[name])
    return (nearest if gaps[nearest] < gaps[default] - margin else default), gaps


def ensemble_term(logits: np.ndarray, weights: np.ndarray, how: str = "logits") -> np.ndarray:
    """One member's term of :func:`combine_teachers`'s sum, float64: ``w_c z_c`` (``logits``), ``w_c softmax(z)_c``
    (``probabilities``), ``w_c log softmax(z)_c`` (``geometric``) or that plus the member's standardised energy
    (``energy``, over the rows of ``logits``: the pass's inputs), over the last axis of ``logits`` with the member's
    per-class ``weights`` ``(C,)``. The members' terms summed (secure aggregation sums them) give the ensemble through
    :func:`ensemble_of_sum`."""
    z = np.asarray(logits, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if how == "logits":
        return w * z
    if how in ("geometric", "energy"):  # energy: standardised over this member's rows (the pass's inputs)
        rows = torch.as_tensor(z.reshape(-1, z.shape[-1]))
        terms = _energy_log_probabilities(rows[None])[0] if how == "energy" else torch.log_softmax(rows, dim=1)
        return w * terms.numpy().reshape(z.shape)
    if how == "probabilities":
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return w * (e / e.sum(axis=-1, keepdims=True))
    raise ValueError(f"combine: expected one of {COMBINES}, got {how!r}")


def ensemble_of_sum(total: np.ndarray, how: str = "logits") -> np.ndarray:
    """The ensemble's logits (float32) from the sum of the members' :func:`ensemble_term`: what
    :func:`combine_teachers` gives from their logits."""
    total = np.asarray(total, dtype=np.float64)
    if how in ("logits", "geometric", "energy"):
        return total.astype(np.float32)
    if how == "probabilities":
        return np.log(np.maximum(total, _FLOOR)).astype(np.float32)
    raise ValueError(f"combine: expected one of {COMBINES}, got {how!r}")


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, reduction: Literal["mean", "none"] = "mean"
) -> torch.Tensor:
    """Hinton's distillation loss ``T^2 KL(softmax(t / T) || softmax(s / T))`` (mean over the batch, or per sample)."""
    T = float(temperature)
    per_sample = F.kl_div(
        F.log_softmax(student_logits / T, dim=1), F.log_softmax(teacher_logits / T, dim=1), reduction="none", log_target=True
    ).sum(1) * (T * T)
    return per_sample.mean() if reduction == "mean" else per_sample


def _layout(model: nn.Module) -> tuple[object, ...]:
    return (type(model), tuple((k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()))


def _batchnorm_gap(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """DeepInversion's feature-statistic loss of one BatchNorm layer: ``||mu(x) - mu_run||_2 + ||var(x) - var_run||_2``
    over the layer's input batch (Yin et al. 2020, eq. 4; the form DENSE's code uses)."""
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dims)
    var = x.var(dims, unbiased=False)
    assert module.running_mean is not None and module.running_var is not None  # tracked statistics (the caller's filter)
    return torch.linalg.vector_norm(mean - module.running_mean) + torch.linalg.vector_norm(var - module.running_var)


class _Group:
    """Teachers of one architecture: their indices, and either the stacked state (batched) or the models (loop).

    Each tracked BatchNorm records its statistic gap while :meth:`forward` asks for it: through a hook on the stacked
    template (batched; the template is this group's own), or through hooks held on the models for that call only (the
    models may be a client's own, which must not keep hooks of ours)."""

    def __init__(self, index: list[int], models: list[nn.Module], batched: bool) -> None:
        self.index = index
        self.models = models
        # a model that masks padded token rows (rayfuse.models.hf) cannot run under vmap: transformers' attention-mask
        # code branches on the data; its group runs in the loop
        self.batched = batched and len(models) > 1 and not getattr(models[0], "masks_padding", False)
        self._recording = False
        self._collected: list[torch.Tensor] = []
        if self.batched:
            from torch.func import stack_module_state

            self.params, self.buffers = stack_module_state(models)
            self.template = copy.deepcopy(models[0]).to("meta")
            for module in _norms(self.template):
                module.register_forward_hook(self._collect)
        self.has_batchnorm = bool(_norms(models[0]))

    def _collect(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if self._recording:
            assert isinstance(module, nn.modules.batchnorm._BatchNorm)
            self._collected.append(_batchnorm_gap(module, inputs[0]))

    def _run(self, call: Any, with_bn: bool, model: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._recording, self._collected = with_bn and self.has_batchnorm, []
        hooks = [m.register_forward_hook(self._collect) for m in _norms(model)] if (model is not None and self._recording) else []
        try:
            out = call()
        finally:
            self._recording = False
            for hook in hooks:
                hook.remove()
        gap = torch.stack(self._collected).sum() if self._collected else out.new_zeros(())
        self._collected = []
        return out, gap

    def forward(self, x: torch.Tensor, with_bn: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(len(index), N, C)`` logits and each member's summed BatchNorm gap ``(len(index),)`` (zeros unless
        ``with_bn``)."""
        if self.batched:
            from torch.func import functional_call, vmap

            def one(
                params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], inputs: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
                return self._run(lambda: functional_call(self.template, (params, buffers), (inputs,)), with_bn)

            return vmap(one, in_dims=(0, 0, None))(self.params, self.buffers, x)
        pairs = [self._run(lambda model=model: model(x), with_bn, model) for model in self.models]
        return torch.stack([out for out, _ in pairs]), torch.stack([gap for _, gap in pairs])


def _norms(model: nn.Module | None) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``model`` that keep running statistics."""
    if model is None:
        return []
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.running_mean is not None
    ]


class Teachers:
    """K teacher models, evaluated together (in eval mode).

    Parameters
    ----------
    models : sequence of nn.Module
        The teachers, used as given, in eval mode.
    batched : bool
        Evaluate each architecture's members in one vmapped call, or in a loop over models.
    device : str
    chunk_size : int
        Inputs per call when predicting without gradients (bounds the memory of a large transfer bank).
    freeze : bool
        Turn off ``requires_grad`` on the models' parameters (models the caller owns: gradients then flow to the inputs
        only). ``False`` leaves a model that is not the caller's to change as it is (a client's local model).
    """

    def __init__(
        self, models: Sequence[nn.Module], *, batched: bool = True, device: str = "cpu", chunk_size: int = 256, freeze: bool = True
    ) -> None:
        if not models:
            raise ValueError("at least one teacher")
        self.device = device
        self.chunk_size = int(chunk_size)
        layouts: dict[tuple[object, ...], list[int]] = {}
        prepared = []
        for i, model in enumerate(models):
            model = model.to(device).eval()
            if freeze:
                for p in model.parameters():
                    p.requires_grad_(False)
            prepared.append(model)
            layouts.setdefault(_layout(model), []).append(i)
        self.num_teachers = len(prepared)
        self.groups = [_Group(index, [prepared[i] for i in index], batched) for index in layouts.values()]
        self.has_batchnorm = any(group.has_batchnorm for group in self.groups)

    def forward(self, x: torch.Tensor, *, with_bn: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Every teacher's logits ``(K, N, C)`` on ``x`` and each teacher's summed BatchNorm statistic gap ``(K,)``
        (zeros unless ``with_bn``); differentiable with respect to ``x``."""
        x = x.to(self.device)
        if len(self.groups) == 1:
            return self.groups[0].forward(x, with_bn)
        parts = [(group.index, *group.forward(x, with_bn)) for group in self.groups]
        num_classes = parts[0][1].shape[-1]
        logits = x.new_empty((self.num_teachers, x.shape[0], num_classes))
        gaps = x.new_empty((self.num_teachers,))
        for index, out, gap in parts:
            logits[index] = out
            gaps[index] = gap
        return logits, gaps

    @torch.no_grad()
    def predict(self, X: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Every teacher's logits ``(K, N, C)`` on ``X``, in chunks of ``chunk_size`` inputs."""
        if isinstance(X, np.ndarray):
            X = writable(X)
        X_t = torch.as_tensor(X, device=self.device)
        chunks = [self.forward(X_t[start : start + self.chunk_size])[0] for start in range(0, max(len(X_t), 1), self.chunk_size)]
        return torch.cat(chunks, dim=1)
