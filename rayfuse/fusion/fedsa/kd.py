"""FedSA building blocks: hidden representations, saliency maps, transferability, selection, the translator, feature
distillation, task adaptation and the duplicate-counting average [1].

Pure functions on torch modules and numpy arrays; the method and its client steps are in :mod:`rayfuse.fusion.fedsa.algorithm`.

**Saliency (eq. 1).** For probe image ``x_j`` and the layer-``k`` representation ``r^k`` of model ``n``::

    a^k_{n,j} = | d r^k / d x_j |                                   (kind='grad', the paper)

``r^k`` is a tensor; its gradient is taken of the sum of its units (the attribution of the whole layer; the paper does
not say how the Jacobian is reduced, and the sum is one backward pass per batch). The authors' code uses Grad-CAM at
the last convolutional map instead (kind='gradcam'): ``cam = ReLU(sum_c mean_hw(dy_c*/dF_c) F_c)`` for the model's own
predicted class ``c*``, min-max normalised, quantised to 256 levels and resized to the input [KAMAL :
kamal/utils/saliency_map.py ``GradCam``].

**Transferability (eq. 2-3).** ``d(M_n, M_T) = M / sim_n`` and ``Q_n = 1 / d``. ``similarity='per_image'`` (the code,
[KAMAL : kamal/utils/model_select.py ``AttributeMap.get_Similarity``]) is ``sim_n = sum_j (0.5 + 0.5 cos(a_T,j,
a_n,j))``; ``'mean_map'`` (the paper) is ``cos(A_n, A_T)`` of the maps averaged over the probe set, where
``d = M / cos`` makes ``Q = cos / M``. Then ``p = softmax(Q)`` (eq. 3). Because ``Q`` of different teachers differ by
hundredths, eq. 3 alone gives nearly uniform probabilities; the code min-max normalises ``q`` to [0, 1] first
(``normalize=True``, the default; ``False`` is the paper's formula as written).

[1] D. Xie, R. Yu, G. Fang, J. Song, Z. Feng, X. Wang, L. Sun, M. Song. Federated Selective Aggregation for Knowledge
    Amalgamation. arXiv:2207.13309 (2022). Choices between paper and code: ``docs/methods/fedsa.md``.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from rayfuse.errors import InputError
from rayfuse.models.training import make_optimizer, train_model
from rayfuse.symmetry import build_node_graph, read_output_module, read_structure
from rayfuse.updates.aggregate import normalize_weights, weighted_average

__all__ = [
    "hidden_representation",
    "features_and_logits",
    "representation_shape",
    "compute_saliency",
    "compute_transferability",
    "selection_probabilities",
    "select_teachers",
    "draw_weights",
    "Translator",
    "build_translator",
    "distill_features",
    "find_head",
    "adapt_to_target",
    "average_students",
    "SELECTIONS",
    "WEIGHTINGS",
]

SELECTIONS = ("saliency", "random", "fixed", "top_k", "least_k", "all")
WEIGHTINGS = ("uniform", "positive", "negative")


# -----------------------------------------------------------------------------------------------------------------
# Representations


class _Representation(NamedTuple):
    """A model's representation node and the graphs computing it (alone, and with the logits)."""

    shape: tuple[int, ...]  # one sample's
    alone: torch.fx.GraphModule
    with_logits: torch.fx.GraphModule


_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], _Representation]] = weakref.WeakKeyDictionary()
_GRAPHS_LOCK = threading.Lock()


def _representation(model: nn.Module, sample_shape: tuple[int, ...]) -> _Representation:
    """Where ``model``'s representation is, read from its graph once per model and input shape (kept while the model
    lives): the last feature map before global pooling / flatten, else the features its output layer reads."""
    with _GRAPHS_LOCK:
        found = _GRAPHS.get(model, {}).get(sample_shape)
    if found is not None:
        return found
    try:
        structure = read_structure(model, torch.zeros((2, *sample_shape)), spec=False)
    except InputError as exc:
        raise exc.at("model.name") if exc.path in ("architecture", "input") else exc from None
    if not structure.hidden:
        raise InputError(
            "model.name", "a model with a hidden representation for FedSA (a layer before its output layer)", type(model).__name__
        )
    node = structure.representation_node
    found = _Representation(
        tuple(structure.shapes[node][1:]),
        build_node_graph(structure, [node]),
        build_node_graph(structure, [node, structure.output_layer.node]),
    )
    with _GRAPHS_LOCK:
        _GRAPHS.setdefault(model, {})[sample_shape] = found
    return found


def features_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The representation FedSA distils and attributes (``r^k``: the last feature map before global pooling or
    flatten, found in the model's graph, or the penultimate vector its output layer reads when it has no map) and the
    logits, from one forward pass of the model's graph (gradients flow through both)."""
    rep, logits = _representation(model, tuple(x.shape[1:])).with_logits(x)
    return rep, logits


def hidden_representation(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``r^k`` of eq. 1 and the feature the translator matches (eq. 4): the graph up to the representation."""
    (rep,) = _representation(model, tuple(x.shape[1:])).alone(x)
    return rep


def representation_shape(model: nn.Module, input_shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of one sample's representation (``(C, H, W)`` or ``(D,)``), read from the model's graph."""
    return _representation(model, tuple(int(d) for d in input_shape)).shape


# -----------------------------------------------------------------------------------------------------------------
# Saliency and transferability (eq. 1-3)


def compute_saliency(
    model: nn.Module, X: np.ndarray, *, kind: Literal["grad", "gradcam"] = "grad", batch_size: int = 256, device: str = "cpu"
) -> np.ndarray:
    """One saliency map per probe image, flattened: float32 ``(n, prod(input_shape))`` (gradcam: ``(n, H * W)``).

    ``grad``: ``|d sum(r^k) / d x_j|`` (eq. 1 of [1]); ``gradcam``: Grad-CAM of the predicted class at the last feature
    map, min-max normalised per image, quantised to uint8 levels and resized to the input (the authors' code).
    """
    model.to(device)
    was_training = model.training
    model.eval()  # per-image maps: no batch statistics coupling the images
    out = []
    for start in range(0, len(X), batch_size):
        x = torch.tensor(np.asarray(X[start : start + batch_size]), dtype=torch.float32, device=device).requires_grad_(True)
        if kind == "grad":
            rep = hidden_representation(model, x)
            (grad,) = torch.autograd.grad(rep.sum(), x)
            maps = grad.abs().flatten(1)
        elif kind == "gradcam":
            fmap, logits = features_and_logits(model, x)
            if fmap.dim() != 4:
                raise InputError(
                    "saliency",
                    "a model with a convolutional feature map for Grad-CAM (or saliency: grad)",
                    f"a representation of shape {tuple(fmap.shape[1:])}",
                )
            score = logits.gather(1, logits.argmax(1, keepdim=True)).sum()  # the model's own predicted class
            (dfmap,) = torch.autograd.grad(score, fmap)
            cam = F.relu((dfmap.mean(dim=(2, 3), keepdim=True) * fmap).sum(dim=1, keepdim=True))
            low = cam.amin(dim=(2, 3), keepdim=True)
            span = cam.amax(dim=(2, 3), keepdim=True) - low
            cam = torch.where(span > 0, (cam - low) / span.clamp_min(1e-12), torch.zeros_like(cam))
            cam = torch.floor(cam * 255.0) / 255.0  # the code's uint8 image
            # cv2.resize(INTER_AREA) in the code; bilinear here (INTER_AREA upsampling is bilinear-like)
            cam = F.interpolate(cam, size=tuple(X.shape[-2:]), mode="bilinear", align_corners=False)
            maps = cam.flatten(1)
        else:
            raise InputError("saliency", "grad or gradcam", kind)
        out.append(maps.detach().cpu().numpy().astype(np.float32))
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, int(np.prod(X.shape[1:]))), np.float32)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity; 0 where either row is all zeros."""
    num = np.sum(a * b, axis=-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.divide(num, den, out=np.zeros_like(num, dtype=np.float64), where=den > 0)


def compute_transferability(
    target_maps: np.ndarray, teacher_maps: Sequence[np.ndarray], *, similarity: Literal["per_image", "mean_map"] = "per_image"
) -> tuple[np.ndarray, np.ndarray]:
    """Saliency similarity ``sim_n / M`` in [0, 1] and transferability ``Q_n = 1 / d(M_n, M_T)`` (eq. 2 of [1]).

    ``per_image`` (code): ``sim_n = sum_j (0.5 + 0.5 cos(a_T,j, a_n,j))``, ``d = M / sim_n``, so ``Q_n = sim_n / M``.
    ``mean_map`` (paper): ``d = M / cos(A_n, A_T)`` with ``A = mean_j a_j``, so ``Q_n = cos / M``; the similarity
    returned is the cosine itself.
    """
    target = np.asarray(target_maps, dtype=np.float64)
    M = len(target)
    if M == 0:
        raise InputError("data.public_size", "a non-empty probe (target) set for the saliency maps", 0)
    sims, Q = [], []
    for maps in teacher_maps:
        maps = np.asarray(maps, dtype=np.float64)
        if maps.shape != target.shape:
            raise ValueError(f"teacher saliency maps of shape {maps.shape}, expected {target.shape}")
        if similarity == "per_image":
            s = float(np.sum(0.5 + 0.5 * _cosine(target, maps)))
            sims.append(s / M)
            Q.append(s / M)  # 1 / d with d = M / s
        elif similarity == "mean_map":
            c = float(_cosine(target.mean(0), maps.mean(0)))
            sims.append(c)
            Q.append(c / M)  # 1 / d with d = M / cos (eq. 2 as written)
        else:
            raise InputError("similarity", "per_image or mean_map", similarity)
    return np.asarray(sims), np.asarray(Q)


def selection_probabilities(Q: np.ndarray, *, normalize: bool = True, temperature: float = 1.0) -> np.ndarray:
    """``p_n = exp(q_n / tau) / sum_b exp(q_b / tau)`` (eq. 3 of [1]; ``tau = 1`` in the paper).

    With ``normalize`` (the authors' code) ``q = (Q - min Q) / (max Q - min Q)`` first (all equal: uniform).
    """
    q = np.asarray(Q, dtype=np.float64)
    if normalize:
        span = q.max() - q.min()
        q = (q - q.min()) / span if span > 0 else np.zeros_like(q)
    z = q / temperature
    z = np.exp(z - z.max())
    return z / z.sum()


def select_teachers(strategy: str, probabilities: np.ndarray, Q: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """Teacher indices drawn for one selection period (a teacher may appear several times).

    ``saliency`` (FedSA, and ``fixed`` at its one selection): ``k`` draws **with replacement** from ``p``;
    ``random``: ``k`` uniform draws with replacement; ``top_k`` / ``least_k``: the ``k`` largest / smallest ``Q``
    (Table 2 of [1]); ``all``: every teacher once (FedAvg+).
    """
    N = len(probabilities)
    if strategy in ("saliency", "fixed"):
        return [int(i) for i in rng.choice(N, size=k, replace=True, p=probabilities)]
    if strategy == "random":
        return [int(i) for i in rng.choice(N, size=k, replace=True)]
    if strategy == "top_k":
        return [int(i) for i in np.argsort(-np.asarray(Q), kind="stable")[:k]]
    if strategy == "least_k":
        return [int(i) for i in np.argsort(np.asarray(Q), kind="stable")[:k]]
    if strategy == "all":
        return list(range(N))
    raise InputError("selection", f"one of {SELECTIONS}", strategy)


def draw_weights(draws: Sequence[int], probabilities: np.ndarray, weighting: str) -> list[float]:
    """Aggregation weight of each draw, summing to 1.

    ``uniform``: ``1 / K`` per draw (eq. 5 of [1]; a teacher drawn twice counts twice); ``positive``: proportional to
    the teacher's selection probability ``p_n``; ``negative``: proportional to ``1 / p_n`` (Table 2's "positive /
    negative weighted": the paper does not give the formulas; ``p`` is the similarity score it samples with).
    """
    p = np.asarray([probabilities[i] for i in draws], dtype=np.float64)
    if weighting == "uniform":
        return normalize_weights(None, len(draws))
    if weighting == "positive":
        return normalize_weights(p.tolist(), len(draws))
    if weighting == "negative":
        return normalize_weights((1.0 / np.maximum(p, 1e-300)).tolist(), len(draws))
    raise InputError("weighting", f"one of {WEIGHTINGS}", weighting)


# -----------------------------------------------------------------------------------------------------------------
# Translator and feature distillation (eq. 4)


def _block(kind: str, n_in: int, n_out: int) -> list[nn.Module]:
    if kind == "map":
        return [nn.Conv2d(n_in, n_out, kernel_size=1), nn.BatchNorm2d(n_out), nn.LeakyReLU(0.1)]
    return [nn.Linear(n_in, n_out), nn.BatchNorm1d(n_out), nn.LeakyReLU(0.1)]


class Translator(nn.Module):
    """Maps a student representation onto a teacher's [KAMAL : kamal/vision/models/paraphraser.py ``translator``].

    Feature maps: ``Conv1x1(Cs, Cs)-BN-LReLU(0.1) -> Conv1x1(Cs, k Ct)-BN-LReLU -> Conv1x1(k Ct, k Ct)-BN-LReLU`` with
    ``k = 1`` (``ft_k`` in the code), after average-pooling the student map down to the teacher's spatial size when it
    is an integer multiple of it. Vectors: the same three blocks with linear layers (a student map feeding a teacher
    vector is global-average-pooled first).
    """

    def __init__(self, student_shape: Sequence[int], teacher_shape: Sequence[int]) -> None:
        super().__init__()
        self.student_shape = tuple(int(d) for d in student_shape)
        self.teacher_shape = tuple(int(d) for d in teacher_shape)
        kind = "map" if len(self.teacher_shape) == 3 else "vector"
        self.kind = kind
        c_s, c_t = self.student_shape[0], self.teacher_shape[0]
        self.blocks = nn.Sequential(*_block(kind, c_s, c_s), *_block(kind, c_s, c_t), *_block(kind, c_t, c_t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "map":
            if tuple(x.shape[2:]) != self.teacher_shape[1:]:
                x = F.adaptive_avg_pool2d(x, (self.teacher_shape[1], self.teacher_shape[2]))
        elif x.dim() == 4:
            x = x.mean(dim=(2, 3))
        return self.blocks(x)


def build_translator(
    student_shape: Sequence[int], teacher_shape: Sequence[int], *, path: str = "student", seed: int | None = None
) -> Translator:
    """A :class:`Translator`, or an :class:`InputError` (naming ``path``) when no translator can bridge the shapes.

    Bridgeable: map -> map with the student's height and width integer multiples of the teacher's; vector -> vector;
    map -> vector. A vector cannot be turned into a teacher's spatial map, nor can a smaller map be blown up.
    """
    s, t = tuple(student_shape), tuple(teacher_shape)
    ok = (
        (len(s) == 1 and len(t) == 1)
        or (len(s) == 3 and len(t) == 1)
        or (len(s) == 3 and len(t) == 3 and t[1] > 0 and t[2] > 0 and s[1] % t[1] == 0 and s[2] % t[2] == 0)
    )
    if not ok:
        raise InputError(
            path,
            "a student representation a translator can map onto the teacher's (map -> map with the "
            "student's height / width multiples of the teacher's, vector -> vector, or map -> vector)",
            f"student {s}, teacher {t}",
        )
    if seed is None:
        return Translator(s, t)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Translator(s, t)


def distill_features(
    student: nn.Module,
    translator: Translator,
    X: np.ndarray,
    teacher_features: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: str = "adam",
    weight_decay: float = 0.0,
    seed: int = 0,
    device: str = "cpu",
) -> float:
    """Feature KD of a teacher into ``student`` on the teacher's unlabelled data (eq. 4 of [1]), in place.

    Minimises ``MSE(translator(r_s(x)), r_t(x))`` over the student and its translator: the FitNets ``Hint`` loss of the
    code (a mean), which is eq. 4's ``1/2 ||F_p - F_s||^2`` up to a constant factor. The student's head gets no
    gradient. Returns the mean loss of the last epoch.
    """
    student.to(device)
    translator.to(device)
    X_t = torch.as_tensor(np.ascontiguousarray(X), device=device)
    target = teacher_features.to(device)
    n = len(X_t)
    if n == 0 or epochs <= 0:
        return float("nan")
    head = find_head(student)
    head_ids = {id(p) for p in head.parameters()}
    params = [p for p in student.parameters() if id(p) not in head_ids] + list(translator.parameters())
    opt = make_optimizer(params, optimizer=optimizer, lr=lr, weight_decay=weight_decay)
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    last = float("nan")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        student.train()
        translator.train()
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator).to(device)
            total, seen = 0.0, 0
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                if idx.numel() < 2:
                    continue  # BatchNorm cannot train on a batch of one
                loss = F.mse_loss(translator(hidden_representation(student, X_t[idx])), target[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * idx.numel()
                seen += idx.numel()
            last = total / max(seen, 1)
    student.eval()
    translator.eval()
    return last


# -----------------------------------------------------------------------------------------------------------------
# Task adaptation and aggregation (eq. 5)


def find_head(model: nn.Module) -> nn.Linear:
    """The classifier (the "decoder" of [1]): the output layer of the model's graph, a Linear."""
    try:
        _, head = read_output_module(model)
    except InputError as exc:
        raise exc.at("model.name") if exc.path == "architecture" else exc from None
    if not isinstance(head, nn.Linear):
        raise InputError("model.name", "a model with a linear classifier", type(model).__name__)
    return head


def _head_inputs(model: nn.Module, head: nn.Linear, X: np.ndarray, *, batch_size: int = 1024, device: str = "cpu") -> np.ndarray:
    """What ``head`` reads for each input (eval mode, no gradients): the frozen features of head-only adaptation."""
    captured: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, inputs: captured.append(inputs[0].detach().cpu()))
    was_training = model.training
    model.to(device)
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(X), batch_size):
                model(torch.as_tensor(np.ascontiguousarray(X[start : start + batch_size]), device=device))
    finally:
        handle.remove()
        model.train(was_training)
    return torch.cat(captured).numpy() if captured else np.zeros((0, head.in_features), np.float32)


def adapt_to_target(
    model: nn.Module,
    X: np.ndarray,
    y: np.ndarray,
    *,
    mode: Literal["head", "whole"],
    epochs: int,
    lr: float,
    batch_size: int,
    weight_decay: float = 0.0,
    reset_head: bool = True,
    seed: int = 0,
    device: str = "cpu",
) -> nn.Module:
    """Target task adaptation on the labelled target set; returns an adapted copy of ``model``.

    ``head`` (the paper): only the decoder (the last linear layer) is trained, on the features of the frozen network
    (eval mode: BatchNorm statistics stay as distilled); ``whole`` (the code): every parameter. ``reset_head`` starts
    from a new head, as the code does.
    """
    model = copy.deepcopy(model)
    head = find_head(model)
    if reset_head:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            head.reset_parameters()
    if mode == "head":
        feats = _head_inputs(model, head, X, device=device)
        train_model(
            head,
            feats,
            y,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            optimizer="adam",
            weight_decay=weight_decay,
            seed=seed,
            device=device,
        )
    elif mode == "whole":
        train_model(
            model, X, y, epochs=epochs, batch_size=batch_size, lr=lr, optimizer="adam", weight_decay=weight_decay, seed=seed, device=device
        )
    else:
        raise InputError("adapt", "head or whole", mode)
    model.eval()
    return model


def average_students(students: Sequence[dict[str, np.ndarray]], weights: Sequence[float] | None = None) -> dict[str, np.ndarray]:
    """``theta_{t+1} = sum_i w_i theta^t_i`` over the full state dict, BatchNorm statistics included (eq. 5 of [1]).

    One entry per *draw*: a teacher drawn twice contributes two students, each with its own weight (``1 / K``).
    """
    return weighted_average(list(students), None if weights is None else list(weights))
