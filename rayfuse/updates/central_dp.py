"""Central differential privacy for the FedAvg family: DP-FedAvg with fixed or adaptive clipping, and its accountant.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models", Algorithm 1 with
``w_k = 1``): each round every client is sampled independently with probability ``q`` (Poisson sampling, seeded per
round); each sampled client's update ``Delta_k = w_k - w_t`` is clipped to L2 norm ``C`` over all its float tensors
as one vector; the server adds Gaussian noise ``N(0, (z C)^2)`` to each coordinate of the sum of the clipped updates
and divides by the *expected* number of clients ``q N``::

    w_{t+1} = w_t + (sum_k clip(Delta_k, C) + N(0, (z C)^2 I)) / (q N)

The denominator is fixed, not the number of clients that came: the count of participants depends on who is in the
data set (removing a client changes it), so dividing by it would need its own noise and sensitivity analysis; with
``q N`` the only data-dependent quantity released is the noised sum, whose sensitivity to adding or removing one
client is ``C``. The estimate is unbiased (its expectation is the mean clipped update).

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping", Algorithm 1): each
sampled client also reports the bit ``b_k = [||Delta_k|| <= C]``; the server noises their sum with ``N(0,
sigma_b^2)``, forms ``b_bar = (sum_k b_k + noise) / (q N)`` and moves the clip norm geometrically toward the
``gamma`` quantile of the update norms, ``C <- C exp(-eta_C (b_bar - gamma))``. Releasing the count costs privacy
too, so the updates' noise multiplier is raised to ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (the paper's
Theorem 1): the two releases together are exactly as private as one Gaussian mechanism with multiplier ``z``, which
is what the accountant is given. It needs ``2 sigma_b > z``.

The privacy spent after ``t`` rounds is the sampled Gaussian mechanism composed ``t`` times, at noise multiplier
``z`` and sampling rate ``q``, computed by Opacus' accountants (RDP, Mironov 2017 / Mironov et al. 2019; PRV,
Gopi et al. 2021). The unit of privacy is a client (user-level DP): the guarantee covers everything one client
contributes, across all rounds.

Integer tensors (BatchNorm's ``num_batches_tracked``) are counters, not learned: they keep the global model's values
(a client's counter would leak how many batches it ran).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from rayfuse.errors import InputError
from rayfuse.method import MethodParams
from rayfuse.updates.accountant import compute_epsilon, noise_multiplier_for, require_one_noise

__all__ = [
    "AdaptiveClipSettings",
    "CentralDPSettings",
    "DPPlan",
    "DPRound",
    "find_noise_multiplier",
    "count_affordable_rounds",
    "compute_update_noise_multiplier",
    "plan_dp",
    "check_dp",
    "sample_poisson",
    "clip_and_sum",
    "apply_dp_round",
    "noise_dp_round",
    "update_clip_norm",
    "describe_plan",
]

Params = dict[str, np.ndarray]


class AdaptiveClipSettings(MethodParams):
    """Adaptive clipping (Andrew et al. 2021): the clip norm follows a quantile of the update norms."""

    target_quantile: float = Field(0.5, gt=0, lt=1, description="gamma: the fraction of updates left unclipped (paper: 0.5)")
    lr: float = Field(0.2, gt=0, description="eta_C: the geometric step of the clip norm (paper: 0.2)")
    count_stddev: float | None = Field(
        None, gt=0, description="sigma_b: the noise on the count of unclipped updates (default: q N / 20, the paper's choice)"
    )


class CentralDPSettings(MethodParams):
    """Central DP-FedAvg (the ``dp`` key of the FedAvg family): client sampling, clipping, Gaussian noise on the sum."""

    #: the mechanism in the words of a refusal (``rayfuse.method.dp_options``)
    mechanism: ClassVar[str] = "central DP-FedAvg"
    noise_multiplier: float | None = Field(None, gt=0, description="z: the noise's standard deviation is z C (give this or target_epsilon)")
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="the epsilon to spend over the planned rounds: the noise multiplier is found for it (give this or noise_multiplier)",
    )
    clip_norm: float = Field(gt=0, description="C: each client's update is clipped to this L2 norm (adaptive: the initial C)")
    adaptive: AdaptiveClipSettings | None = Field(None, description="adaptive clipping (Andrew et al. 2021); null: fixed C")
    sample_rate: float = Field(gt=0, le=1, description="q: each client takes part in a round with this probability (Poisson)")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta epsilon is reported at (must be below 1 / number of clients)")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus' accountant: rdp (Renyi DP) or prv (privacy random variables)")
    stop_at_epsilon: float | None = Field(
        None, gt=0, description="stop before the round that would spend more than this epsilon (null: run every round)"
    )

    @model_validator(mode="after")
    def _one_noise(self) -> CentralDPSettings:
        require_one_noise(self.noise_multiplier, self.target_epsilon)
        return self


# ---------------------------------------------------------------------------------------------------------------
# The accountant (Opacus)


def find_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp") -> float:
    """The noise multiplier that spends ``target_epsilon`` at ``delta`` in ``steps`` rounds
    (:func:`rayfuse.updates.accountant.noise_multiplier_for`). Raises :class:`InputError` at ``dp.target_epsilon`` when no
    noise up to Opacus' limit reaches it."""
    try:
        return noise_multiplier_for(target_epsilon, delta, sample_rate, steps, accountant)
    except ValueError as exc:  # rayfuse.updates.accountant.UnreachableEpsilon: too small, too large, or not finite
        too_small = str(exc).startswith("at least")
        raise InputError(
            "dp.target_epsilon",
            f"an epsilon some noise multiplier reaches in {steps} rounds ({exc})",
            target_epsilon,
            "raise target_epsilon or plan fewer rounds" if too_small else "or give noise_multiplier",
        ) from None


def count_affordable_rounds(
    noise_multiplier: float, sample_rate: float, delta: float, budget: float, rounds: int, accountant: str = "rdp"
) -> int:
    """The most rounds, up to ``rounds``, whose epsilon stays within ``budget`` (epsilon grows with the rounds: a
    binary search)."""
    if compute_epsilon(noise_multiplier, sample_rate, rounds, delta, accountant) <= budget:
        return rounds
    low, high = 0, rounds  # eps(low) <= budget < eps(high)
    while high - low > 1:
        mid = (low + high) // 2
        if compute_epsilon(noise_multiplier, sample_rate, mid, delta, accountant) <= budget:
            low = mid
        else:
            high = mid
    return low


def compute_update_noise_multiplier(noise_multiplier: float, count_stddev: float | None) -> float:
    """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, Theorem 1); ``z`` itself without adaptive clipping."""
    if count_stddev is None:
        return float(noise_multiplier)
    rest = noise_multiplier**-2 - (2.0 * count_stddev) ** -2
    if rest <= 0:
        raise ValueError(f"adaptive clipping needs 2 count_stddev > noise_multiplier, got {count_stddev} and {noise_multiplier}")
    return float(rest**-0.5)


# ---------------------------------------------------------------------------------------------------------------
# The plan, checked before any client trains


@dataclass(frozen=True)
class DPPlan:
    """What a DP-FedAvg run will do: ``noise_multiplier`` (``z``, accounted), ``update_noise_multiplier``
    (``z_Delta``, applied to the sum), ``count_stddev`` (``sigma_b``, adaptive only), ``expected_clients`` (``q N``),
    ``rounds`` (the rounds run: fewer than planned when ``stop_at_epsilon`` stops the run) and ``epsilon`` (after them)."""

    noise_multiplier: float
    update_noise_multiplier: float
    count_stddev: float | None
    expected_clients: float
    planned_rounds: int
    rounds: int
    epsilon: float
    next_epsilon: float | None  # the epsilon one more round would have reached (when the run stops early)


def check_dp(settings: CentralDPSettings, num_clients: int, where: str = "dp") -> None:
    """Refuse DP settings the run cannot honour: ``delta >= 1 / N`` (with client-level DP a delta that large allows
    publishing one client's data outright) and adaptive clipping whose count noise is too small for Theorem 1."""
    if settings.delta >= 1.0 / num_clients:
        raise InputError(
            f"{where}.delta",
            f"delta < 1/n = {1.0 / num_clients:.3g} with n = {num_clients} clients (the unit of privacy is a client)",
            settings.delta,
            "e.g. 1e-5",
        )
    if settings.adaptive is not None and settings.noise_multiplier is not None:
        sigma_b = _count_stddev(settings, num_clients)
        if 2.0 * sigma_b <= settings.noise_multiplier:
            raise InputError(
                f"{where}.adaptive.count_stddev",
                f"more than noise_multiplier / 2 = {settings.noise_multiplier / 2:.4g} (z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 must exist)",
                sigma_b,
            )


def _count_stddev(settings: CentralDPSettings, num_clients: int) -> float:
    assert settings.adaptive is not None
    given = settings.adaptive.count_stddev
    return float(given) if given is not None else settings.sample_rate * num_clients / 20.0


def plan_dp(settings: CentralDPSettings, num_clients: int, rounds: int, where: str = "dp") -> DPPlan:
    """Check ``settings`` (:func:`check_dp`), find the noise multiplier (``target_epsilon``) and the rounds the run
    can afford (``stop_at_epsilon``). Raises :class:`InputError` naming ``where.<key>``."""
    check_dp(settings, num_clients, where)
    q, delta, acc = settings.sample_rate, settings.delta, settings.accountant
    try:
        z = (
            settings.noise_multiplier
            if settings.noise_multiplier is not None
            else find_noise_multiplier(settings.target_epsilon or 0.0, delta, q, rounds, acc)
        )
    except InputError as exc:
        raise exc.at(f"{where}.target_epsilon") from None
    sigma_b = _count_stddev(settings, num_clients) if settings.adaptive is not None else None
    if sigma_b is not None and 2.0 * sigma_b <= z:
        raise InputError(
            f"{where}.adaptive.count_stddev",
            f"more than noise_multiplier / 2 = {z / 2:.4g} (the noise multiplier "
            "found for target_epsilon; z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 must exist)",
            sigma_b,
        )
    run = rounds
    if settings.stop_at_epsilon is not None:
        run = count_affordable_rounds(z, q, delta, settings.stop_at_epsilon, rounds, acc)
        if run == 0:
            first = compute_epsilon(z, q, 1, delta, acc)
            raise InputError(
                f"{where}.stop_at_epsilon",
                f"at least the epsilon of one round ({first:.4g} at delta {delta:g})",
                settings.stop_at_epsilon,
                "raise it, or add noise",
            )
    next_eps = compute_epsilon(z, q, run + 1, delta, acc) if run < rounds else None
    return DPPlan(
        noise_multiplier=float(z),
        update_noise_multiplier=compute_update_noise_multiplier(z, sigma_b),
        count_stddev=sigma_b,
        expected_clients=q * num_clients,
        planned_rounds=rounds,
        rounds=run,
        epsilon=compute_epsilon(z, q, run, delta, acc),
        next_epsilon=next_eps,
    )


# ---------------------------------------------------------------------------------------------------------------
# One round


def sample_poisson(rng: np.random.Generator, client_ids: Sequence[int], sample_rate: float) -> list[int]:
    """Each client independently with probability ``sample_rate`` (possibly none), in id order."""
    ids = [int(c) for c in client_ids]
    taken = rng.random(len(ids)) < sample_rate
    return [c for c, t in zip(ids, taken) if t]


def clipped_update(
    model: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], clip_norm: float
) -> tuple[dict[str, np.ndarray], float]:
    """One client's clipped update ``min(1, C / ||Delta||) Delta`` (float64, the float tensors of ``reference``) and
    its norm before clipping: what :func:`clip_and_sum` adds up, and what a client encodes for a secure sum."""
    keys = [k for k, v in reference.items() if np.asarray(v).dtype.kind == "f"]
    deltas = {k: np.asarray(model[k], dtype=np.float64) - np.asarray(reference[k], dtype=np.float64) for k in keys}
    norm = math.sqrt(sum(float(np.vdot(d, d)) for d in deltas.values()))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {k: scale * d for k, d in deltas.items()}, norm


def clip_and_sum(
    models: Sequence[Mapping[str, np.ndarray]], reference: Mapping[str, np.ndarray], clip_norm: float
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The sum of the clipped updates ``sum_k min(1, C / ||Delta_k||) Delta_k`` (float64, the float tensors of
    ``reference``) and each update's norm before clipping.

    Parameters
    ----------
    models : list of dict of ndarray
        The clients' models.
    reference : dict of ndarray
        The global model ``w_t`` they started from.
    clip_norm : float
        ``C > 0``.
    """
    keys = [k for k, v in reference.items() if np.asarray(v).dtype.kind == "f"]
    total = {k: np.zeros(np.asarray(reference[k]).shape, dtype=np.float64) for k in keys}
    norms = np.zeros(len(models))
    for i, model in enumerate(models):
        clipped, norms[i] = clipped_update(model, reference, clip_norm)
        for k in keys:
            total[k] += clipped[k]
    return total, norms


@dataclass
class DPRound:
    """One DP-FedAvg round's outcome: the new global model, the clip norm for the next round and what is logged."""

    params: Params
    clip_norm: float
    metrics: dict[str, float]


def update_clip_norm(clip_norm: float, unclipped: float, count_noise: float, expected: float, quantile: float, lr: float) -> float:
    """Andrew et al.'s geometric update: ``C exp(-eta_C (b_bar - gamma))`` with ``b_bar = (unclipped + noise) / (q N)``."""
    b_bar = (unclipped + count_noise) / expected
    return float(clip_norm * math.exp(-lr * (b_bar - quantile)))


def apply_dp_round(
    models: Sequence[Mapping[str, np.ndarray]],
    reference: Mapping[str, np.ndarray],
    settings: CentralDPSettings,
    plan: DPPlan,
    clip_norm: float,
    rng: np.random.Generator,
) -> DPRound:
    """``w_t + (sum_k clip(Delta_k, C) + N(0, (z_Delta C)^2)) / (q N)`` and, with adaptive clipping, the next ``C``.

    ``models`` may be empty (no client sampled, or none came back): the noise is added all the same, as the accountant
    assumes. The metrics are ``dp_clip_norm`` (the ``C`` of this round) and, adaptive, ``dp_unclipped_fraction``
    (the noised ``b_bar``): nothing un-noised about the clients.
    """
    total, norms = clip_and_sum(models, reference, clip_norm)
    return noise_dp_round(total, int(np.sum(norms <= clip_norm)), reference, settings, plan, clip_norm, rng)


def noise_dp_round(
    total: Mapping[str, np.ndarray],
    unclipped: int,
    reference: Mapping[str, np.ndarray],
    settings: CentralDPSettings,
    plan: DPPlan,
    clip_norm: float,
    rng: np.random.Generator,
    *,
    noised: bool = False,
) -> DPRound:
    """:func:`apply_dp_round` from the clipped updates' sum already formed (``total``: float64, the float tensors of
    ``reference``; a streaming round folds it reply by reply) and the number of updates within ``C``
    (``unclipped``): the same noise, drawn in the same order from ``rng``. ``noised``: the sum already carries the
    noise (distributed DP: the clients added it under secure aggregation), so none is drawn for it here."""
    std = 0.0 if noised else plan.update_noise_multiplier * clip_norm
    out: Params = {}
    for key, g in reference.items():
        g = np.asarray(g)
        if key not in total:
            out[key] = g.copy()
            continue
        noisy = total[key] + rng.normal(0.0, std, size=total[key].shape)
        out[key] = (g.astype(np.float64) + noisy / plan.expected_clients).astype(g.dtype, copy=False)
    metrics = {"dp_clip_norm": float(clip_norm)}
    next_clip = clip_norm
    adaptive = settings.adaptive
    if adaptive is not None:
        assert plan.count_stddev is not None
        noise = float(rng.normal(0.0, plan.count_stddev))
        metrics["dp_unclipped_fraction"] = (float(unclipped) + noise) / plan.expected_clients
        next_clip = update_clip_norm(clip_norm, float(unclipped), noise, plan.expected_clients, adaptive.target_quantile, adaptive.lr)
    return DPRound(out, next_clip, metrics)


def describe_plan(settings: CentralDPSettings, plan: DPPlan) -> dict[str, Any]:
    """The ``dp`` record of ``results.json`` (``info.dp``)."""
    record: dict[str, Any] = {
        "epsilon": plan.epsilon,
        "delta": settings.delta,
        "accountant": settings.accountant,
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": settings.sample_rate,
        "expected_clients": plan.expected_clients,
        "rounds": plan.rounds,
        "planned_rounds": plan.planned_rounds,
        "clipping": "adaptive" if settings.adaptive else "fixed",
    }
    if settings.adaptive is not None:
        record["update_noise_multiplier"] = plan.update_noise_multiplier
        record["count_stddev"] = plan.count_stddev
    if plan.rounds < plan.planned_rounds:
        record["stopped"] = (
            f"stopped after round {plan.rounds} of {plan.planned_rounds}: round {plan.rounds + 1} would spend "
            f"epsilon {plan.next_epsilon:.4g} > stop_at_epsilon {settings.stop_at_epsilon:g}"
        )
    return record
