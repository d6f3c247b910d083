"""Training and prediction loops (plain PyTorch, seeded, device-aware).

Data sets here are small enough to live as tensors on the device, so mini-batches are index slices of one tensor,
not a ``DataLoader``: no worker processes, no per-batch collation, and the shuffling order comes from a seeded
``torch.Generator``. Dropout draws from the global torch RNG, which :func:`train_model` forks and seeds so that a
call is reproducible without disturbing the caller's RNG state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfuse.devices import to_device
from rayfuse.memory import LARGE_MODEL_BYTES, return_freed_memory

__all__ = ["TrainStats", "train_model", "predict_proba", "compute_loss", "make_optimizer", "STEP_IN_BACKWARD_BYTES"]

#: Models whose trainable parameters take at least this many bytes (:data:`rayfuse.memory.LARGE_MODEL_BYTES`) are trained with each parameter's optimizer step
#: taken inside the backward pass, as soon as its gradient is complete, and the gradient freed at once
#: (:class:`_StepInBackward`): the gradients never exist all at once, so training holds the model and about one
#: tensor's gradient instead of 2 x the model. The update is the same (per-parameter SGD and Adam are elementwise);
#: below this size the one optimizer is kept, its one ``step`` call per batch being cheaper for many small tensors.
STEP_IN_BACKWARD_BYTES = LARGE_MODEL_BYTES


@dataclass(frozen=True)
class TrainStats:
    loss: float  # mean data loss over the last epoch (no proximal term); the full-data loss when epochs == 0
    steps: int
    examples: int
    seconds: float


def make_optimizer(params, *, optimizer: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {optimizer!r}")


class _StepInBackward:
    """An optimizer per parameter, stepped by a hook when that parameter's gradient has been accumulated in the
    backward pass (``register_post_accumulate_grad_hook``), which then frees the gradient. Autograd runs a leaf's
    accumulation once per backward, after every use of the parameter has contributed its gradient, so each parameter
    is stepped with its complete gradient, as one optimizer's ``step`` after ``backward`` would; SGD (with momentum and
    weight decay) and Adam act on each parameter alone, so the per-parameter optimizers take the same steps. Its
    ``zero_grad`` and ``step`` do nothing: the hooks did both. :meth:`remove` takes the hooks off."""

    def __init__(self, params: list[nn.Parameter], **options: object) -> None:
        self.optimizers = {p: make_optimizer([p], **options) for p in params}  # type: ignore[arg-type]
        self.handles = [p.register_post_accumulate_grad_hook(self._step) for p in params]

    def _step(self, param: torch.Tensor) -> None:
        optimizer = self.optimizers[param]  # type: ignore[index]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each gradient was freed by its hook."""

    def step(self) -> None:
        """Nothing: each parameter was stepped by its hook."""

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def train_model(
    model: nn.Module,
    X: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: Literal["adam", "sgd"] = "adam",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    proximal_mu: float = 0.0,
    early_stop_patience: int = 0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    step_in_backward: bool | None = None,
) -> TrainStats:
    """Minimise the cross-entropy of ``model`` on ``(X, y)`` in place (arrays, or tensors: those on ``device`` already are
    used as they are, not copied).

    With ``proximal_mu > 0`` the FedProx objective (Li et al. 2020, eq. 2) is minimised instead::

        F_k(w) + (mu / 2) * ||w - w_t||^2

    where ``w_t`` are the model's parameters when the call starts (the broadcast global model).

    With ``early_stop_patience = p > 0`` training stops once the epoch's training accuracy (measured on the fly, in
    training mode, as Keras's ``EarlyStopping(monitor='acc', mode='max', patience=p)`` sees it) has not risen above
    its best for ``p`` epochs in a row.

    ``step_in_backward`` (default: whether the trainable parameters take at least :data:`STEP_IN_BACKWARD_BYTES`)
    steps each parameter inside the backward pass and frees its gradient there, so a large model never holds all its
    gradients at once; the trained parameters are the same.
    """
    started = time.perf_counter()
    model.to(device)
    X_t, y_t = to_device(X, device), to_device(y, device)  # tensors already there (ClientContext.device_split) stay as they are
    n = int(y_t.shape[0])
    if epochs <= 0 or n == 0:
        return TrainStats(compute_loss(model, X_t, y_t, device=device) if n else 0.0, 0, 0, time.perf_counter() - started)
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else None
    options: dict[str, Any] = dict(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if step_in_backward is None:
        step_in_backward = sum(p.numel() * p.element_size() for p in params) >= STEP_IN_BACKWARD_BYTES
    if step_in_backward:
        return_freed_memory()  # the steps' activations and gradients, freed, leave the resident set
    opt: torch.optim.Optimizer | _StepInBackward = (
        _StepInBackward(params, **options) if step_in_backward else make_optimizer(params, **options)
    )
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    skip_single = _has_batchnorm(model)
    steps = 0
    epoch_loss = 0.0
    best_acc, stale, epochs_done = -1.0, 0, 0
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(seed))
            model.train()
            for _ in range(epochs):
                order = torch.randperm(n, generator=generator).to(device)
                total, seen, correct = 0.0, 0, 0
                for start in range(0, n, batch_size):
                    idx = order[start : start + batch_size]
                    if skip_single and idx.numel() == 1:
                        continue  # BatchNorm cannot train on a batch of one
                    logits = model(X_t[idx])
                    loss = F.cross_entropy(logits, y_t[idx])
                    objective = loss
                    if anchor is not None:
                        objective = loss + 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
                    opt.zero_grad(set_to_none=True)
                    objective.backward()
                    opt.step()
                    steps += 1
                    total += float(loss.detach()) * idx.numel()
                    seen += idx.numel()
                    if early_stop_patience:
                        correct += int((logits.detach().argmax(1) == y_t[idx]).sum())
                epoch_loss = total / max(seen, 1)
                epochs_done += 1
                if early_stop_patience:
                    acc = correct / max(seen, 1)
                    best_acc, stale = (acc, 0) if acc > best_acc else (best_acc, stale + 1)
                    if stale >= early_stop_patience:
                        break
    finally:  # the hooks never outlive the call, whatever happened in it
        if isinstance(opt, _StepInBackward):
            opt.remove()
    opt.zero_grad(set_to_none=True)  # the gradients (one more copy of the model) go before the caller copies it out
    del opt, anchor
    model.eval()
    return TrainStats(epoch_loss, steps, n * epochs_done, time.perf_counter() - started)


@torch.no_grad()
def predict_proba(
    model: nn.Module, X: np.ndarray | torch.Tensor, *, batch_size: int = 4096, device: str | torch.device = "cpu"
) -> np.ndarray:
    """Class probabilities, float64 ``(n, num_classes)``, computed in eval mode."""
    model.to(device)
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, max(len(X), 1), batch_size):  # an empty X still yields shape (0, num_classes)
        batch = to_device(X[start : start + batch_size], device)
        out.append(torch.softmax(model(batch).double(), dim=1).cpu().numpy())
    model.train(was_training)
    return np.concatenate(out)


@torch.no_grad()
def compute_loss(
    model: nn.Module,
    X: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    batch_size: int = 4096,
    device: str | torch.device = "cpu",
) -> float:
    """Mean cross-entropy of ``model`` on ``(X, y)`` in eval mode."""
    model.to(device)
    model.eval()
    total = 0.0
    for start in range(0, len(X), batch_size):
        xb = to_device(X[start : start + batch_size], device)
        yb = to_device(y[start : start + batch_size], device)
        total += float(F.cross_entropy(model(xb), yb, reduction="sum"))
    return total / max(len(X), 1)
