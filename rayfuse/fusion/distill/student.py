"""The distillation loops: a student trained to match the teachers' ensemble on public or synthetic transfer inputs.

Both loops are written against a teacher *source*, so the same code serves the three ways of reaching the teachers:

* :class:`~rayfuse.fusion.distill.teachers.Teachers` (the server holds the teachers' parameters, or ``rayfuse fuse``
  reads checkpoints): exact gradients through the teachers;
* the clients themselves (``teachers: clients``, parameters never leave): one call per client per pass, which returns
  the client's logits on the pass's inputs (``predict``); for the generator, two calls per generator step: the
  client's logits on the step's inputs (``predict``), then the input gradient of the client's logits against the
  server's cotangent for them plus its BatchNorm term (``vjp``, :func:`teacher_vjp`): the exact gradient, as through
  the teachers. A source with only ``signal`` (secure aggregation's, which sees only sums) is asked once per round for
  each client's own term of the objective (:func:`teacher_signal`).

**Public transfer** (FedDF [FEDDF]). Each of ``epochs`` passes draws a bank of ``steps / epochs * batch_size``
augmented inputs (:func:`~rayfuse.fusion.distill.transfer.augment_bank`), has the teachers predict on it once, and
trains the student one step per batch of it:

.. math::

    \\min_\\theta \\; \\mathbb{E}_{x \\in \\text{bank}} \\; T^2\\, \\mathrm{KL}\\big(\\sigma(\\bar z(x) / T) \\,\\|\\,
    \\sigma(s_\\theta(x) / T)\\big), \\qquad \\bar z_c(x) = \\sum_k w_{kc}\\, z_{kc}(x)

with Adam and a cosine learning-rate schedule over ``steps``.

**Synthetic transfer** (DENSE [DENSE], with Co-Boosting's options [COBOOST]). In rounds (``steps / student_steps`` of
them, spread over ``epochs`` epochs), the generator ``G`` takes ``generator_steps`` steps on

.. math::

    L_G = \\lambda_{ce}\\, \\frac1B \\sum_i (1 - p_{y_i}(x_i))^{h}\\, \\mathrm{CE}(\\bar z(x_i), y_i)
        + \\lambda_{bn} \\frac1K \\sum_k \\sum_l \\big(\\|\\mu_l(x) - \\mu_{kl}\\|_2 + \\|\\sigma^2_l(x) - \\sigma^2_{kl}\\|_2\\big)
        - \\lambda_{adv}\\, \\frac1B \\sum_i \\mathbb{1}[\\arg\\max s(x_i) \\ne \\arg\\max \\bar z(x_i)]\\,
          \\mathrm{KL}\\big(\\sigma(\\bar z(x_i)/3) \\,\\|\\, \\sigma(s(x_i)/3)\\big)

with ``x_i = G(z_i)``, labels ``y_i`` drawn from the clients' pooled label frequencies, ``p`` the ensemble's
probabilities, ``h`` Co-Boosting's hardness (0: DENSE's plain cross-entropy), ``mu_kl, sigma_kl`` teacher ``k``'s
BatchNorm running statistics at layer ``l`` (DeepInversion's prior [DEEPINV]) and the adversarial term pushing ``G``
to inputs where student and ensemble disagree (DENSE's mask, as the issue of record and Co-Boosting's copy of DENSE
write it). Every generated batch joins a bank with the teachers' logits on it; the student then takes
``student_steps`` distillation steps on batches drawn from the whole bank. With ``reweight`` (Co-Boosting), each
epoch the members' weights take signed-gradient steps on the cross-entropy of the weighted ensemble over the bank.

With the clients as teachers (``predict`` and ``vjp``) each generator step is exact in two calls: the clients' logits
``z_k`` on the step's inputs; the server, holding them, differentiates its part of ``L_G`` (the cross-entropy of the
combined logits and the adversarial term) with respect to each ``z_k``, and client ``k`` returns
``d/dx [<z_k(x), c_k> + lambda_bn / K * BN_k(x)]`` for its cotangent ``c_k``; the chain rule through the generator
then gives the gradient the exact path takes. That is ``2 * generator_steps`` calls per round. A source that can only
sum the clients' replies (secure aggregation: no client's logits may be seen alone) keeps one call per round: client
``k`` returns ``d/dx [lambda_ce * mean_i w_{k y_i} (1 - p_{k y_i})^h CE(z_k(x_i), y_i) + lambda_bn / K * BN_k(x)]`` on
the round's batches, so the cross-entropy term is the weighted sum of the members' cross-entropies instead of the
cross-entropy of their weighted sum, the generator's steps within a round use gradients taken at the inputs the round
began with, and the adversarial term is computed with the teachers' logits held fixed: the three places where that mode
departs from DENSE.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rayfuse.fusion.distill.teachers import (
    MIN_CLIENTS,
    MIN_HOLDERS,
    choose_target,
    class_holders,
    combine_teachers,
    distillation_loss,
    flat_temperature,
    mean_entropy,
    teacher_weights,
)
from rayfuse.fusion.distill.transfer import Generator, SyntheticBank, augment_bank, drop_tokens, mix_texts

__all__ = [
    "DistillSettings",
    "ExactTeachers",
    "SignalTeachers",
    "distill_public",
    "distill_synthetic",
    "teacher_signal",
    "teacher_vjp",
    "GradientTeachers",
    "agreement",
    "check_target",
    "auto_target",
    "fidelity",
    "held_out",
    "refine_student",
    "scaled_weights",
]

Log = Callable[[int, dict[str, float]], None]


@dataclass(frozen=True)
class DistillSettings:
    """How a student is distilled (the ``distill`` method's parameters, less the run's choices of teachers and start)."""

    steps: int = 2000
    epochs: int = 10
    batch_size: int = 64
    lr: float = 3e-3
    temperature: float = 4.0
    combine: str = "logits"
    shift: int = 1
    mixup: float = 0.5
    scale: float = 0.0  # public: each input's amplitude times U(1 - scale, 1 + scale)
    noise: float = 0.0  # public: Gaussian noise of this many standard deviations of each input element
    word_dropout: float = 0.0  # token-id rows (texts): each real token dropped with this probability (drop_tokens)
    text_mixup: float = 0.0  # token-id rows (texts): this share of a bank's texts mixed with a second in word-embedding space
    holdout: float = 0.0  # public: this share of the inputs held out to score the student's fidelity each pass (0: off)
    patience: int = 0  # holdout: stop after this many passes without a better fidelity (0: run every pass)
    synthetic_batch: int = 128
    generator_steps: int = 5
    student_steps: int = 20
    generator_lr: float = 1e-3
    latent_dim: int = 256
    generator_width: int = 32
    ce_weight: float = 1.0
    bn_weight: float = 1.0
    adversarial_weight: float = 1.0
    hardness: float = 0.0
    reweight: bool = False
    reweight_lr: float = 0.01
    bank_samples: int = 20000
    seed: int = 0


class ExactTeachers(Protocol):
    """Teachers the server can differentiate through (:class:`~rayfuse.fusion.distill.teachers.Teachers`)."""

    num_teachers: int

    def predict(self, X: torch.Tensor) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor, *, with_bn: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...


class SignalTeachers(Protocol):
    """Teachers reached only through their predictions (the clients, ``teachers: clients``)."""

    num_teachers: int

    def predict(self, X: torch.Tensor) -> torch.Tensor: ...

    def signal(
        self, X: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, settings: DistillSettings
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Member logits ``(K, G, B, C)`` on the batches ``X`` ``(G, B, ...)`` and the summed input gradient of the members'
        generator terms ``(G, B, ...)`` (:func:`teacher_signal` per member)."""
        ...


class GradientTeachers(Protocol):
    """Teachers reached through their predictions and input gradients (the clients, ``teachers: clients``): the
    generator's exact gradient in two calls per step."""

    num_teachers: int

    def predict(self, X: torch.Tensor) -> torch.Tensor: ...

    def vjp(self, X: torch.Tensor, cotangents: torch.Tensor, settings: DistillSettings) -> tuple[torch.Tensor, float]:
        """The summed input gradients ``(B, ...)`` at ``X`` ``(B, ...)`` of each member's logits against its cotangent
        ``(K, B, C)`` plus its BatchNorm term, and the members' BatchNorm terms summed (:func:`teacher_vjp`)."""
        ...


def agreement(student: nn.Module, X: torch.Tensor, target: torch.Tensor, limit: int = 1024) -> float:
    """The fraction of (at most ``limit``) inputs where the student's and the ensemble's top classes agree."""
    was = student.training
    student.eval()
    with torch.no_grad():
        n = min(limit, X.shape[0])
        agree = float((student(X[:n]).argmax(1) == target[:n].argmax(1)).float().mean())
    student.train(was)
    return agree


def check_target(
    ensemble_of: Callable[[str, np.ndarray], torch.Tensor],
    weights: np.ndarray,
    class_counts: np.ndarray,
    settings: DistillSettings,
    temperature: float | None = None,
) -> tuple[DistillSettings, np.ndarray, dict[str, Any]]:
    """``combine: auto``'s check of the target on the public inputs: the ensemble of ``settings.combine`` with the
    teacher ``weights`` ``(K, C)`` (the default: the energy ensemble, per-class weights), or the plain mean of the
    teachers' probabilities (uniform weights), whichever :func:`~rayfuse.fusion.distill.teachers.choose_target` picks
    against the clients' pooled class counts (``class_counts`` ``(K, C)`` summed). With fewer than ``MIN_CLIENTS``
    teachers, or where the classes are not shared (fewer than ``MIN_HOLDERS`` effective holders a class,
    :func:`~rayfuse.fusion.distill.teachers.class_holders`), nothing is checked. ``ensemble_of(combine, weights)``
    gives an ensemble's logits on the public inputs, unaugmented. Where the check runs and ``temperature`` is None
    (unset), the target it keeps is sharpened where it is flat: the temperature of
    :func:`~rayfuse.fusion.distill.teachers.flat_temperature` (1 unless its mean entropy there is above
    ``MAX_ENTROPY`` of ``log C``); a ``temperature`` set is the mean's too. Returns the settings and weights to distil
    with and the record of the check (``info.target``)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    holders = class_holders(counts)
    kept = {"chosen": settings.combine, "combine": settings.combine, "temperature": settings.temperature}
    kept.update(clients=len(counts), class_holders=holders)
    if len(counts) < MIN_CLIENTS or holders < MIN_HOLDERS:  # a few clients, or each class one client's: nothing asked
        return settings, weights, kept
    uniform = teacher_weights("uniform", counts)
    candidates = {"default": ensemble_of(settings.combine, weights), "mean": ensemble_of("probabilities", uniform)}
    chosen, gaps = choose_target(candidates, counts.sum(0), "default")
    gap = {
        "prior_gap": {settings.combine: gaps["default"], "mean of probabilities": gaps["mean"]},
        "top2_margin": {settings.combine: _top2_margin(candidates["default"]), "mean of probabilities": _top2_margin(candidates["mean"])},
    }
    picked, w, record = settings, weights, {**kept, **gap}
    if chosen != "default":
        picked, w = replace(settings, combine="probabilities", temperature=1.0 if temperature is None else float(temperature)), uniform
        record.update(chosen="mean of probabilities", combine="probabilities", weighting="uniform")
    if temperature is None:  # unset: the target sharpened where it is flat (teachers.MAX_ENTROPY)
        picked = replace(picked, temperature=flat_temperature(candidates[chosen]))
        record["entropy"] = round(mean_entropy(candidates[chosen]), 4)
    record["temperature"] = picked.temperature
    return picked, w, record


def _top2_margin(logits: torch.Tensor) -> float:
    """The mean gap between an ensemble's two largest probabilities (temperature 1) over its inputs."""
    top = torch.softmax(torch.as_tensor(logits).float(), dim=-1).topk(2, dim=-1).values
    return round(float((top[..., 0] - top[..., 1]).mean()), 4)


def auto_target(
    teachers: ExactTeachers | GradientTeachers | SignalTeachers,
    X: np.ndarray,
    weights: np.ndarray,
    class_counts: np.ndarray,
    settings: DistillSettings,
    temperature: float | None = None,
    *,
    device: str = "cpu",
) -> tuple[DistillSettings, np.ndarray, dict[str, Any]]:
    """:func:`check_target` with teachers whose ``predict`` gives each member's logits (``(K, N, C)``: the uploaded
    models, or the clients' predictions; one call more per client where the check is made), on the public inputs
    ``X`` as they are."""
    members: list[torch.Tensor] = []

    def ensemble_of(how: str, w: np.ndarray) -> torch.Tensor:
        if not members:  # once, and only where the check asks
            members.append(teachers.predict(torch.as_tensor(np.ascontiguousarray(X), dtype=torch.float32, device=device)).to(device))
        return combine_teachers(members[0], torch.as_tensor(w, dtype=torch.float32, device=device), how)

    return check_target(ensemble_of, weights, class_counts, settings, temperature)


def held_out(n: int, share: float) -> int:
    """How many of ``n`` transfer inputs ``holdout: share`` holds out: ``round(share * n)``, at least one. Callers refuse
    a share that leaves fewer than 2 to train on (``n - held_out(n, share) < 2``) before anything trains."""
    return max(1, round(share * n))


def fidelity(student: nn.Module, X: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """The student's fidelity to the ensemble on the inputs ``X`` (the ensemble's logits ``target``): the fraction of
    inputs where their top classes agree, and the mean ``KL(ensemble || student)`` of their softmaxes (temperature 1)."""
    was = student.training
    student.eval()
    with torch.no_grad():
        logits = student(X)
        agree = float((logits.argmax(1) == target.argmax(1)).float().mean())
        kl = float(distillation_loss(logits, target, 1.0))
    student.train(was)
    return agree, kl


def refine_student(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    public: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    anchor: float,
    seed: int,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """A client's turn of the few-round mode: ``model`` (the broadcast student) trained in place on the client's own
    ``(X, y)`` for ``epochs`` epochs of Adam at ``lr``, each step's cross-entropy on ``batch_size`` of its samples plus
    ``anchor`` times the ``KL(start || model)`` (temperature 1) on as many of the public inputs ``public``, against
    the student it started from. The anchor keeps what the student knows of the classes the client lacks, which a
    client trained on its own labels alone forgets: a label-skewed client then sharpens the student on its own classes
    without unlearning the others (measured: docs/methods/distill.md). Returns ``train_loss`` (the last epoch's mean
    cross-entropy), ``anchor_kl`` (its mean anchor term) and ``seconds``."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(int(seed))
    torch.manual_seed(int(seed))  # dropout inside the model
    model.to(device).eval()
    X, y, public = X.to(device), y.to(device), public.to(device)
    with torch.no_grad():  # the start's log-probabilities on the public inputs: the anchor's target
        target = torch.cat([F.log_softmax(model(public[i : i + 1024]), -1) for i in range(0, len(public), 1024)])
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    n, ce_sum, kl_sum, batches = len(y), 0.0, 0.0, 0
    for _ in range(max(int(epochs), 0)):
        order = torch.randperm(n, generator=generator).to(device)
        ce_sum, kl_sum, batches = 0.0, 0.0, 0
        for i in range(0, n, batch_size):
            index = order[i : i + batch_size]
            loss = F.cross_entropy(model(X[index]), y[index])
            ce = float(loss.detach())
            kl = 0.0
            if anchor > 0:
                pick = torch.randint(0, len(public), (len(index),), generator=generator).to(device)
                term = F.kl_div(F.log_softmax(model(public[pick]), -1), target[pick], log_target=True, reduction="batchmean")
                loss = loss + anchor * term
                kl = float(term.detach())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ce_sum, kl_sum, batches = ce_sum + ce, kl_sum + kl, batches + 1
    model.eval()
    train_loss = ce_sum / max(batches, 1)
    _check_finite(train_loss, "refinement loss")
    return {"train_loss": train_loss, "anchor_kl": kl_sum / max(batches, 1), "seconds": time.perf_counter() - started}


def _optimizer(student: nn.Module, settings: DistillSettings) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=settings.lr)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, settings.steps))


def _student_step(
    student: nn.Module, opt: torch.optim.Optimizer, sched: Any, x: torch.Tensor, target: torch.Tensor, temperature: float
) -> float:
    loss = distillation_loss(student(x), target, temperature)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _check_finite(value: float, what: str) -> None:
    if not math.isfinite(value):
        raise FloatingPointError(f"distillation diverged: the {what} is {value}; lower lr / generator_lr")


def distill_public(
    student: nn.Module,
    teachers: ExactTeachers | GradientTeachers | SignalTeachers,
    X: np.ndarray,
    weights: np.ndarray,
    settings: DistillSettings,
    *,
    device: str = "cpu",
    log: Log | None = None,
) -> list[dict[str, float]]:
    """Train ``student`` in place on augmented banks of the unlabeled inputs ``X`` ``(N, *input_shape)`` to match the
    teachers' ensemble (per-class ``weights`` ``(K, C)``). Returns one row per epoch (one bank, one teacher call):
    ``loss`` (mean distillation loss of the epoch), ``agreement`` (student and ensemble top-1 on the epoch's bank),
    ``seconds``.

    With ``settings.holdout`` a seeded share of ``X`` (at least one input, at least two left to train on) is held out,
    unaugmented, and the teachers predict on it once (one call more per teacher). Before training and after every pass
    the student's :func:`fidelity` on it is scored (rows' ``holdout_agreement`` and ``holdout_kl``; the start is row
    ``epoch`` 0); the student that is returned is the best one scored (the highest agreement, then the lowest KL; the
    rows' ``chosen`` marks it), so the number of steps is chosen on inputs the student never trained on. With
    ``settings.patience`` the passes stop once that many in a row were no better."""
    generator = torch.Generator().manual_seed(int(settings.seed))
    torch.manual_seed(int(settings.seed))  # dropout inside the student
    X_t = torch.as_tensor(np.ascontiguousarray(X), dtype=torch.float32, device=device)
    W = torch.as_tensor(weights, dtype=torch.float32, device=device)
    student.to(device).train()
    held: tuple[torch.Tensor, torch.Tensor] | None = None
    if settings.holdout > 0:
        n_held = min(held_out(X_t.shape[0], settings.holdout), X_t.shape[0] - 2)
        if n_held < 1:
            raise ValueError(f"holdout: at least 3 transfer inputs needed to hold one out, got {X_t.shape[0]}")
        order = torch.randperm(X_t.shape[0], generator=generator).to(device)
        held_X, X_t = X_t[order[:n_held]], X_t[order[n_held:]]
        held = held_X, combine_teachers(teachers.predict(held_X).to(device), W, settings.combine)
    opt, sched = _optimizer(student, settings)
    per_pass = math.ceil(settings.steps / settings.epochs)
    # token-id rows (texts: a model that masks their -1 padding) are drawn as they are: a mix of two texts' ids is no
    # text; their mixup (text_mixup, the text fuse's) pairs the texts for the models to mix in word-embedding space
    tokens = getattr(student, "masks_padding", False)
    mixup = 0.0 if tokens else settings.mixup
    scale, noise = (0.0, 0.0) if tokens else (settings.scale, settings.noise)  # token ids are not amplitudes
    history: list[dict[str, float]] = []
    best: tuple[float, float, int, dict[str, torch.Tensor]] | None = None

    def score(epoch: int, row: dict[str, float]) -> bool:
        """Score the student on the held-out inputs; keep it when it is the best so far (returns whether it is)."""
        nonlocal best
        assert held is not None
        agree, kl = fidelity(student, *held)
        row.update(holdout_agreement=agree, holdout_kl=kl)
        if best is None or agree > best[0] or (agree == best[0] and kl < best[1]):
            best = (agree, kl, epoch, {k: v.detach().clone() for k, v in student.state_dict().items()})
            return True
        return False

    if held is not None:
        start_row: dict[str, float] = {"epoch": 0.0}
        score(0, start_row)
        history.append(start_row)
    done, stale = 0, 0
    started = time.perf_counter()
    for epoch in range(1, settings.epochs + 1):
        bank = augment_bank(
            X_t, per_pass * settings.batch_size, shift=settings.shift, mixup=mixup, generator=generator, scale=scale, noise=noise
        )
        if tokens:
            bank = drop_tokens(bank, settings.word_dropout, generator)
            bank = mix_texts(bank, X_t, settings.text_mixup, generator)  # mixup in word-embedding space
        target = combine_teachers(teachers.predict(bank).to(device), W, settings.combine)
        order = torch.randperm(bank.shape[0], generator=generator).to(device)
        losses = []
        for start in range(0, bank.shape[0], settings.batch_size):
            if done >= settings.steps:
                break
            idx = order[start : start + settings.batch_size]
            if idx.numel() < 2:
                continue  # BatchNorm cannot train on a batch of one
            losses.append(_student_step(student, opt, sched, bank[idx], target[idx], settings.temperature))
            done += 1
        row = {
            "epoch": float(epoch),
            "loss": float(np.mean(losses)) if losses else 0.0,
            "agreement": agreement(student, bank, target),
            "seconds": time.perf_counter() - started,
        }
        _check_finite(row["loss"], "student's loss")
        if held is not None:
            stale = 0 if score(epoch, row) else stale + 1
        history.append(row)
        if log is not None:
            log(epoch, row)
        if held is not None and settings.patience and stale >= settings.patience:
            break
    if best is not None:
        student.load_state_dict(best[3])
        for row in history:
            row["chosen"] = float(row["epoch"] == best[2])
    student.eval()
    return history


def _adversarial(student_logits: torch.Tensor, ensemble_logits: torch.Tensor) -> torch.Tensor:
    """DENSE's adversarial term: minus the student-ensemble divergence (T = 3) where their top classes differ."""
    mask = (student_logits.argmax(1) != ensemble_logits.argmax(1)).to(student_logits.dtype)
    return -(distillation_loss(student_logits, ensemble_logits, 3.0, reduction="none") / 9.0 * mask).mean()


def _hard_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, hardness: float, class_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy, each sample weighted by ``(1 - p_y)^hardness`` (Co-Boosting's hard-sample weighting; 0: plain)
    and, given ``class_weights`` ``(C,)``, by its label's weight; the mean over the batch."""
    ce = F.cross_entropy(logits, labels, reduction="none")
    if hardness > 0:
        p = torch.softmax(logits, dim=1).gather(1, labels[:, None])[:, 0].detach()
        ce = (1 - p).pow(hardness) * ce
    if class_weights is not None:
        ce = class_weights[labels] * ce
    return ce.mean()


def teacher_signal(
    model: nn.Module, X: torch.Tensor, labels: torch.Tensor, class_weights: torch.Tensor, *, num_teachers: int, settings: DistillSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher's reply to the generator (run by the client that holds the model): its logits ``(G, B, C)`` on the
    batches ``X`` ``(G, B, ...)`` and the gradient ``(G, B, ...)``, per batch, of

    ``lambda_ce * mean_i w[y_i] (1 - p_{y_i})^h CE(z(x_i), y_i) + lambda_bn / K * BN(x)``

    with respect to the inputs (``class_weights``: this teacher's ``w[k, :]``; ``BN``: its BatchNorm statistic gap)."""
    from rayfuse.fusion.distill.teachers import Teachers

    teacher = Teachers([model], batched=False, freeze=False)  # the client's own model: gradients go to the inputs only
    logits, grads = [], []
    for x_batch, y_batch in zip(X, labels):
        x = x_batch.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            member, gap = teacher.forward(x, with_bn=settings.bn_weight > 0)
            z = member[0]
            loss = (
                settings.ce_weight * _hard_cross_entropy(z, y_batch, settings.hardness, class_weights)
                + settings.bn_weight / num_teachers * gap[0]
            )
            (grad,) = torch.autograd.grad(loss, x)
        logits.append(z.detach())
        grads.append(grad.detach())
    return torch.stack(logits), torch.stack(grads)


def teacher_vjp(
    model: nn.Module, X: torch.Tensor, cotangent: torch.Tensor, *, num_teachers: int, settings: DistillSettings
) -> tuple[torch.Tensor, float]:
    """One teacher's input gradient for the generator (run by the client that holds the model): the gradient at the
    inputs ``X`` ``(B, ...)`` of ``sum_i <z(x_i), c_i> + lambda_bn / K * BN(x)`` for the server's cotangent ``c``
    ``(B, C)`` on its logits, and the value of its BatchNorm term ``lambda_bn / K * BN(x)``."""
    from rayfuse.fusion.distill.teachers import Teachers

    teacher = Teachers([model], batched=False, freeze=False)  # the client's own model: gradients go to the inputs only
    x = X.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        member, gap = teacher.forward(x, with_bn=settings.bn_weight > 0)
        bn = settings.bn_weight / num_teachers * gap[0]
        (grad,) = torch.autograd.grad((member[0] * cotangent.to(member.dtype)).sum() + bn, x)
    return grad.detach(), float(bn.detach())


def _generator_round(
    gen: Generator,
    opt_g: torch.optim.Optimizer,
    student: nn.Module,
    teachers: ExactTeachers | GradientTeachers | SignalTeachers,
    bank: SyntheticBank,
    W: torch.Tensor,
    prior: torch.Tensor,
    generator: torch.Generator,
    settings: DistillSettings,
    device: str,
) -> list[float]:
    """``generator_steps`` steps of the generator against the ensemble (per-class weights ``W``); every batch it
    generates joins ``bank`` with the teachers' logits on it. Returns the generator's losses."""
    B, G = settings.synthetic_batch, settings.generator_steps
    student.eval()
    gen.train()
    z = torch.randn((G, B, settings.latent_dim), generator=generator).to(device)
    y = torch.multinomial(prior, G * B, replacement=True, generator=generator).view(G, B).to(device)
    losses = []
    if hasattr(teachers, "forward"):  # exact: through the teachers
        for j in range(G):
            x = gen(z[j])
            member, gaps = teachers.forward(x, with_bn=settings.bn_weight > 0)
            t = combine_teachers(member, W, settings.combine)
            loss = settings.ce_weight * _hard_cross_entropy(t, y[j], settings.hardness) + settings.bn_weight * gaps.mean()
            if settings.adversarial_weight > 0:
                loss = loss + settings.adversarial_weight * _adversarial(student(x), t)
            opt_g.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(gen.parameters(), 10.0)
            opt_g.step()
            losses.append(float(loss.detach()))
            bank.add(x.detach(), member.detach(), y[j])
        return losses
    if hasattr(teachers, "vjp"):  # the clients, exact in two calls a step: their logits, then their input gradients
        for j in range(G):
            x = gen(z[j])
            member = teachers.predict(x.detach()).to(device)
            held = member.clone().requires_grad_(True)
            t = combine_teachers(held, W, settings.combine)
            loss = settings.ce_weight * _hard_cross_entropy(t, y[j], settings.hardness)
            if settings.adversarial_weight > 0:
                loss = loss + settings.adversarial_weight * _adversarial(student(x), t)
            (cotangents,) = torch.autograd.grad(loss, held, retain_graph=True)
            grad, bn = teachers.vjp(x.detach(), cotangents.detach(), settings)
            opt_g.zero_grad(set_to_none=True)
            (loss + (x * grad.to(device)).sum()).backward()  # the server's part through the student, the clients' chained
            nn.utils.clip_grad_norm_(gen.parameters(), 10.0)
            opt_g.step()
            losses.append(float(loss.detach()) + bn)
            bank.add(x.detach(), member.detach(), y[j])
        return losses
    with torch.no_grad():  # the clients: one call for the round's batches, at the inputs the round starts from
        X_start = torch.stack([gen(z[j]) for j in range(G)])
    member_all, grads = teachers.signal(X_start, y, W, settings)
    member_all, grads = member_all.to(device), grads.to(device)
    for j in range(G):
        x = gen(z[j])
        loss = (x * grads[j]).sum()  # the clients' input gradient, chained through the generator
        if settings.adversarial_weight > 0:
            loss = loss + settings.adversarial_weight * _adversarial(student(x), combine_teachers(member_all[:, j], W, settings.combine))
        opt_g.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(gen.parameters(), 10.0)
        opt_g.step()
        losses.append(float(loss.detach()))
        bank.add(X_start[j], member_all[:, j], y[j])
    return losses


def _reweight(scale: torch.Tensor, bank: SyntheticBank, W: torch.Tensor, settings: DistillSettings, round_: int) -> torch.Tensor:
    """Co-Boosting's ensemble re-weighting: signed-gradient steps on the members' scales that lower the weighted
    ensemble's cross-entropy on the round's batches (one step per batch, of ``lr * 0.99^round``; scales kept in [0, 1],
    at least one positive)."""
    _, member, labels = bank.tensors()
    recent = settings.synthetic_batch * settings.generator_steps
    member, labels = member[:, -recent:], labels[-recent:]
    step = settings.reweight_lr * 0.99**round_
    for start in range(0, member.shape[1], settings.synthetic_batch):
        idx = torch.arange(start, min(start + settings.synthetic_batch, member.shape[1]))
        s = scale.detach().clone().requires_grad_(True)
        loss = F.cross_entropy(combine_teachers(member[:, idx], scaled_weights(W, s), settings.combine), labels[idx])
        (grad,) = torch.autograd.grad(loss, s)
        scale = (scale - step * grad.sign()).clamp(0.0, 1.0)
    if float(scale.max()) <= 0:
        scale = torch.ones_like(scale)
    return scale


def scaled_weights(W: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-class weights ``W`` ``(K, C)`` times the members' scales, renormalised per class (the data-free loop's
    members' weights; secure aggregation's teachers left after a dropout)."""
    scaled = W * scale[:, None]
    return scaled / scaled.sum(0, keepdim=True).clamp_min(1e-12)


def distill_synthetic(
    student: nn.Module,
    teachers: ExactTeachers | GradientTeachers | SignalTeachers,
    input_shape: Sequence[int],
    weights: np.ndarray,
    settings: DistillSettings,
    *,
    label_prior: np.ndarray | None = None,
    moments: tuple[np.ndarray, np.ndarray] | None = None,
    device: str = "cpu",
    log: Log | None = None,
) -> tuple[list[dict[str, float]], np.ndarray]:
    """Train ``student`` in place, data-free: a generator trained against the teachers' ensemble supplies the
    transfer inputs (module docstring). ``teachers`` with ``forward`` are differentiated through exactly; with ``vjp``
    they are asked for their logits and then their input gradients at every generator step (:func:`teacher_vjp`: the
    same gradient); others for their :func:`teacher_signal` once per round. Returns one row per epoch (``loss``, ``agreement`` on the
    last round's generated inputs, ``generator_loss``, ``seconds``) and the members' final scales (1 without
    ``reweight``)."""
    generator = torch.Generator().manual_seed(int(settings.seed))
    torch.manual_seed(int(settings.seed))  # dropout inside the student
    K = teachers.num_teachers
    W = torch.as_tensor(weights, dtype=torch.float32, device=device)
    C = W.shape[1]
    prior = torch.as_tensor(np.full(C, 1.0 / C) if label_prior is None else np.asarray(label_prior, np.float64), dtype=torch.float64)
    prior = prior / prior.sum()
    gen = Generator(input_shape, settings.latent_dim, settings.generator_width, moments=moments).to(device)
    with torch.random.fork_rng():
        torch.manual_seed(int(settings.seed))
        for module in gen.modules():  # DENSE's initialisation of the generator
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(module.weight, 0.0, 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    opt_g = torch.optim.Adam(gen.parameters(), lr=settings.generator_lr, betas=(0.5, 0.999))
    student.to(device)
    opt, sched = _optimizer(student, settings)
    bank = SyntheticBank(settings.bank_samples)
    scale = torch.ones(K, device=device)
    B, G = settings.synthetic_batch, settings.generator_steps
    rounds = math.ceil(settings.steps / settings.student_steps)
    per_epoch = math.ceil(rounds / settings.epochs)
    history: list[dict[str, float]] = []
    done, round_ = 0, 0
    started = time.perf_counter()
    for epoch in range(1, settings.epochs + 1):
        losses: list[float] = []
        g_losses: list[float] = []
        for _ in range(per_epoch):
            if round_ >= rounds:
                break
            round_ += 1
            W_eff = scaled_weights(W, scale)
            g_losses.extend(_generator_round(gen, opt_g, student, teachers, bank, W_eff, prior, generator, settings, device))
            if settings.reweight and round_ > 1:
                scale = _reweight(scale, bank, W, settings, round_)
                W_eff = scaled_weights(W, scale)
            X_bank, member_bank, _ = bank.tensors()
            student.train()
            for _ in range(settings.student_steps):
                if done >= settings.steps:
                    break
                idx = torch.randint(0, X_bank.shape[0], (settings.batch_size,), generator=generator).to(device)
                target = combine_teachers(member_bank[:, idx], W_eff, settings.combine)
                losses.append(_student_step(student, opt, sched, X_bank[idx], target, settings.temperature))
                done += 1
        if not losses:
            break
        X_bank, member_bank, _ = bank.tensors()
        row = {
            "epoch": float(epoch),
            "loss": float(np.mean(losses)),
            "agreement": agreement(
                student, X_bank[-B * G :], combine_teachers(member_bank[:, -B * G :], scaled_weights(W, scale), settings.combine)
            ),
            "generator_loss": float(np.mean(g_losses)),
            "seconds": time.perf_counter() - started,
        }
        _check_finite(row["loss"], "student's loss")
        _check_finite(row["generator_loss"], "generator's loss")
        history.append(row)
        if log is not None:
            log(epoch, row)
    student.eval()
    return history, scale.detach().cpu().numpy()
