"""Differential privacy on the client: DP-SGD local training and the clipped, noised upload of parameters.

Every privacy number here comes from Opacus (its ``PrivacyEngine`` and accountants); nothing is derived by hand.

- :func:`train_model_dp`: DP-SGD (Abadi et al. 2016) through Opacus' ``PrivacyEngine``: per-example gradients clipped
  to ``max_grad_norm``, Gaussian noise of standard deviation ``noise_multiplier * max_grad_norm`` added to each batch's
  sum, batches drawn by Poisson sampling at rate ``batch_size / n``. The privacy unit is one training example. Returns
  the epsilon the accountant gives for the steps taken.
- :func:`clip_and_noise`: one release of the Gaussian mechanism on a parameter vector (the one-shot DP upload): the
  vector is scaled to L2 norm at most ``C`` and ``N(0, (z C)^2)`` is added to every coordinate; its epsilon is the
  accountant's for sample rate 1 and one step (:func:`rayfuse.updates.accountant.compute_epsilon`). The privacy unit is the client's whole
  dataset (its upload is one release).
- :func:`find_dp_unsupported`: the first module of a model Opacus cannot train privately (BatchNorm, stock
  ``MultiheadAttention``), by Opacus' own ``ModuleValidator``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfuse.models.training import TrainStats, make_optimizer

__all__ = ["train_model_dp", "clip_and_noise", "find_dp_unsupported", "dp_sgd_noise_multiplier"]


def dp_sgd_noise_multiplier(target_epsilon: float, delta: float, batches: int, epochs: int, accountant: str = "rdp") -> float:
    """The noise multiplier with which DP-SGD spends ``target_epsilon`` at ``delta`` over ``epochs`` of ``batches``
    Poisson batches: Opacus' ``make_private_with_epsilon`` (sample rate ``1 / batches``, ``int(epochs / rate)`` steps)
    through the bounded search of :func:`rayfuse.updates.accountant.noise_multiplier_for`. Raises
    :class:`rayfuse.updates.accountant.UnreachableEpsilon` for a target that search cannot reach."""
    from rayfuse.updates.accountant import noise_multiplier_for

    sample_rate = 1 / batches
    return noise_multiplier_for(float(target_epsilon), float(delta), sample_rate, int(epochs / sample_rate), accountant)


def find_dp_unsupported(model: nn.Module) -> tuple[str, str] | None:
    """The first submodule of ``model`` that Opacus cannot train with DP-SGD, as ``(name, class name)``; ``None`` when
    Opacus' ``ModuleValidator`` accepts the whole model."""
    from opacus.validators import ModuleValidator

    if not ModuleValidator.validate(model, strict=False):
        return None
    for name, module in model.named_modules():
        own = ModuleValidator.VALIDATORS.get(type(module))
        if own is not None and own(module):
            return name or "(the model)", type(module).__name__
    return "(the model)", type(model).__name__  # Opacus refuses it, but no single module's validator does


def clip_and_noise(
    params: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray] | None,
    *,
    clip_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
) -> tuple[dict[str, np.ndarray], float]:
    """The Gaussian mechanism on a model's parameters: ``ref + clip(params - ref, C) + N(0, (z C)^2 I)``.

    The difference to ``reference`` (all zeros when ``None``) over every floating-point array together is scaled to
    L2 norm at most ``clip_norm`` (``C``), then every coordinate receives independent Gaussian noise of standard
    deviation ``noise_multiplier * clip_norm``. Integer arrays (counters) are sent as they are. Returns the noised
    parameters and the norm of the difference before clipping.
    """
    keys = [k for k, v in params.items() if np.asarray(v).dtype.kind == "f"]
    diffs = {
        k: np.asarray(params[k], dtype=np.float64) - (0.0 if reference is None else np.asarray(reference[k], dtype=np.float64))
        for k in keys
    }
    norm = float(np.sqrt(sum(float(np.sum(d * d)) for d in diffs.values())))
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    std = noise_multiplier * clip_norm
    out: dict[str, np.ndarray] = {}
    for k, v in params.items():
        if k not in diffs:
            out[k] = np.array(v, copy=True)
            continue
        base = 0.0 if reference is None else np.asarray(reference[k], dtype=np.float64)
        noised = base + diffs[k] * factor + (rng.normal(0.0, std, size=diffs[k].shape) if std > 0 else 0.0)
        out[k] = np.asarray(noised, dtype=np.asarray(v).dtype)
    return out, norm


def train_model_dp(
    model: nn.Module,
    X: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "adam",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    max_grad_norm: float = 1.0,
    delta: float = 1e-5,
    accountant: str = "rdp",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[TrainStats, dict[str, float]]:
    """Train ``model`` in place on ``(X, y)`` with DP-SGD through Opacus' ``PrivacyEngine``.

    Batches are drawn by Poisson sampling (each example joins each batch with probability ``q = batch_size / n``;
    ``ceil(n / batch_size)`` batches an epoch), per-example gradients are clipped to ``max_grad_norm`` and Gaussian
    noise of standard deviation ``noise_multiplier * max_grad_norm`` is added to their sum. With ``target_epsilon``
    Opacus picks the noise multiplier that spends it over ``epochs``. The sampling and the noise draw from generators
    seeded by ``seed`` (Opacus' ``secure_mode`` is off: reproducible runs, not a cryptographic noise source).

    Returns
    -------
    stats : TrainStats
    privacy : dict
        ``dp_epsilon`` (what the accountant gives at ``delta`` for the steps taken), ``dp_delta``,
        ``dp_noise_multiplier``, ``dp_sample_rate`` and ``dp_steps``.
    """
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    started = time.perf_counter()
    model.to(device)
    n = int(len(y))
    if epochs <= 0 or n == 0:
        return TrainStats(0.0, 0, 0, time.perf_counter() - started), {
            "dp_epsilon": 0.0,
            "dp_delta": delta,
            "dp_noise_multiplier": float(noise_multiplier or 0.0),
            "dp_sample_rate": 0.0,
            "dp_steps": 0.0,
        }
    X_t = torch.as_tensor(np.ascontiguousarray(X), device=device)
    y_t = torch.as_tensor(np.ascontiguousarray(y), device=device)
    sampling = torch.Generator(device="cpu").manual_seed(int(seed))
    noise = torch.Generator(device=torch.device(device)).manual_seed(int(seed) + 1)
    loader = DataLoader(TensorDataset(X_t, y_t), batch_size=batch_size, generator=sampling)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay)
    with warnings.catch_warnings():  # Opacus warns that secure_mode is off (chosen: seeded runs); torch that inputs need no grad
        warnings.filterwarnings("ignore", message=r"(Secure RNG turned off|Full backward hook is firing|Optimal order is the)")
        engine = PrivacyEngine(accountant=accountant, secure_mode=False)
        common = {
            "module": model,
            "optimizer": opt,
            "data_loader": loader,
            "max_grad_norm": max_grad_norm,
            "poisson_sampling": True,
            "noise_generator": noise,
            "wrap_model": False,
        }
        if target_epsilon is not None:
            # Opacus' make_private_with_epsilon, with its unbounded noise search replaced by rayfuse's bounded one (the
            # same noise for every target Opacus reaches: sample rate 1 / batches, int(epochs / rate) steps, as Opacus)
            noise_multiplier = dp_sgd_noise_multiplier(target_epsilon, delta, len(loader), epochs, accountant)
        hooks, dp_opt, dp_loader = engine.make_private(noise_multiplier=float(noise_multiplier or 0.0), **common)
        steps, epoch_loss = 0, 0.0
        devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(int(seed))
                model.train()
                for _ in range(epochs):
                    total, seen = 0.0, 0
                    for xb, yb in dp_loader:
                        dp_opt.zero_grad(set_to_none=True)
                        logits = model(xb)
                        # an empty Poisson batch still takes its (noise-only) step: the accountant counts every step
                        loss = F.cross_entropy(logits, yb) if len(yb) else logits.sum() * 0.0
                        loss.backward()
                        dp_opt.step()
                        steps += 1
                        total += float(loss.detach()) * len(yb)
                        seen += len(yb)
                    epoch_loss = total / max(seen, 1)
        finally:
            hooks.cleanup()
            for p in model.parameters():
                for attr in ("grad_sample", "_forward_counter", "summed_grad"):
                    if hasattr(p, attr):
                        delattr(p, attr)
                p.grad = None
        privacy_epsilon = float(engine.get_epsilon(delta))
    model.eval()
    privacy = {
        "dp_epsilon": privacy_epsilon,
        "dp_delta": float(delta),
        "dp_noise_multiplier": float(dp_opt.noise_multiplier),
        "dp_sample_rate": float(1.0 / len(loader)),
        "dp_steps": float(steps),
    }
    return TrainStats(epoch_loss, steps, n * epochs, time.perf_counter() - started), privacy
