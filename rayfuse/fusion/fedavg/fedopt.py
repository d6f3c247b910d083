"""``fedadagrad``, ``fedadam``, ``fedyogi``: adaptive server optimizers (Reddi et al. 2021, "Adaptive Federated
Optimization"; FedRef's eq. 4-6).

The clients run FedAvg's local training unchanged. The server treats the round's pseudo-gradient, the (weighted)
average of the clients' models minus the broadcast model, ``Delta_t = avg_k(w_t^k) - x_t``, as a gradient step
direction and applies an adaptive step to it, elementwise::

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t                               (FedAdagrad: beta1 = 0, so m_t = Delta_t)
    FedAdagrad: v_t = v_{t-1} + Delta_t^2                                                                    (eq. 4)
    FedAdam:    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                                                  (eq. 5)
    FedYogi:    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)                              (eq. 6)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

``m`` and ``v`` start at 0 and ``initial_accumulator`` respectively (Flower: 0 for all three; Reddi et al.'s
Algorithm 2 asks ``v_{-1} >= tau^2``). FedAdam with ``bias_correction`` scales ``eta`` by
``sqrt(1 - beta2^t) / (1 - beta1^t)`` with ``t`` the number of server steps taken (Kingma & Ba; Flower's FedAdam does
the same with ``t = round + 1``). The moments are fields of the typed round state (:class:`FedOptState`), checkpointed each round, so ``--resume``
continues exactly.

Defaults are those of the FedRef authors' comparison [FEDREF HEAD : main.py]: eta = 1e-2, beta1 = 0.9,
beta2 = 0.99, tau = 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import numpy as np
from pydantic import Field, model_validator

from rayfuse.errors import NonFiniteError, key_error
from rayfuse.fusion import references
from rayfuse.fusion.fedavg.algorithm import FedAvg, FedAvgParams, FedAvgState
from rayfuse.method import ServerContext, Update, register_method

__all__ = ["FedOpt", "FedAdagrad", "FedAdam", "FedYogi", "FedOptParams", "FedOptState", "FedAdagradParams", "fedopt_step"]


class FedOptParams(FedAvgParams):
    eta: float = Field(1e-2, gt=0, description="server learning rate")
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay (momentum of the pseudo-gradient)")
    beta2: float = Field(0.99, gt=0, lt=1, description="second-moment decay (FedAdam, FedYogi)")
    tau: float = Field(1e-4, gt=0, description="adaptivity: added to sqrt(v_t) in the denominator")
    initial_accumulator: float = Field(0.0, ge=0, description="v_{-1} (Flower: 0; Reddi et al.: >= tau^2)")
    bias_correction: bool = Field(False, description="FedAdam: Adam's bias-corrected step size")


class FedAdagradParams(FedOptParams):
    beta1: float = Field(0.0, ge=0, lt=1, description="first-moment decay (eq. 4 and Flower: 0, the step uses Delta_t)")

    @model_validator(mode="after")
    def _no_bias_correction(self) -> FedAdagradParams:
        if self.bias_correction:
            raise key_error("bias_correction", "false (Adam's bias correction has no meaning for FedAdagrad), got true")
        return self


def fedopt_step(
    rule: str,
    x: dict[str, np.ndarray],
    delta: dict[str, np.ndarray],
    m: dict[str, np.ndarray],
    v: dict[str, np.ndarray],
    *,
    eta: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> dict[str, np.ndarray]:
    """One adaptive server step, in place on ``m`` and ``v``; returns the new model (``x``'s dtypes).

    Parameters
    ----------
    rule : {"adagrad", "adam", "yogi"}
    x : dict of ndarray
        The current global model ``x_t``.
    delta : dict of ndarray
        The pseudo-gradient ``Delta_t``; consumed (used as scratch space).
    m, v : dict of ndarray
        First and second moments (float arrays of ``x``'s shapes), updated in place.
    eta, beta1, beta2, tau : float
        Step size (already bias-corrected when asked), decays and adaptivity.
    """
    if rule not in ("adagrad", "adam", "yogi"):
        raise ValueError(f"unknown FedOpt rule {rule!r}")
    out = {}
    for key, x_k in x.items():
        d = delta[key]
        if x_k.dtype.kind != "f":  # integer buffers (BatchNorm counters) follow the average
            out[key] = (x_k + d).astype(x_k.dtype)
            continue
        m_k, v_k = m[key], v[key]
        # In-place arithmetic, two scratch arrays: the step costs a few passes over the model, not a dozen allocations.
        m_k *= beta1
        m_k += (1.0 - beta1) * d
        np.multiply(d, d, out=d)  # d now holds Delta_t^2
        if rule == "adagrad":
            v_k += d
        elif rule == "adam":
            v_k *= beta2
            d *= 1.0 - beta2
            v_k += d
        else:  # yogi: v -= (1 - beta2) Delta^2 sign(v - Delta^2)
            sign = np.sign(v_k - d)
            d *= 1.0 - beta2
            d *= sign
            v_k -= d
        step = np.sqrt(v_k)
        step += tau
        np.divide(m_k, step, out=step)
        step *= eta
        step += x_k
        out[key] = step.astype(x_k.dtype, copy=False)
    return out


@dataclass
class FedOptState(FedAvgState):
    """FedOpt's round state: the global model, the moments ``m`` and ``v`` (float keys only, in the parameters'
    dtypes; empty before the first step) and the number of server steps taken (FedAdam's bias correction)."""

    m: dict[str, np.ndarray] = field(default_factory=dict)
    v: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0


OP = TypeVar("OP", bound=FedOptParams)


class FedOpt(FedAvg[OP, FedOptState]):
    """FedAvg's clients with an adaptive server step on the pseudo-gradient; subclasses name the rule."""

    Params = FedOptParams
    rule: ClassVar[str] = ""

    def initial_state(self, params: dict[str, np.ndarray]) -> FedOptState:
        return FedOptState(params)

    def server_update(
        self, server: ServerContext, state: FedOptState, averaged: dict[str, np.ndarray], updates: dict[int, Update], round: int
    ) -> dict[str, np.ndarray]:
        p = self.params
        global_params = state.params
        if not state.m:  # moments in the parameters' float dtype (as Flower keeps them)
            state.m = {k: np.zeros_like(a) for k, a in global_params.items() if a.dtype.kind == "f"}
            state.v = {k: np.full_like(a, p.initial_accumulator) for k, a in global_params.items() if a.dtype.kind == "f"}
        delta = {k: averaged[k] - global_params[k] for k in global_params}
        state.steps += 1
        eta = p.eta
        if p.bias_correction:
            eta = eta * np.sqrt(1.0 - p.beta2**state.steps) / (1.0 - p.beta1**state.steps)
        new = fedopt_step(self.rule, global_params, delta, state.m, state.v, eta=eta, beta1=p.beta1, beta2=p.beta2, tau=p.tau)
        bad = [k for k, a in new.items() if not np.isfinite(a).all()]
        if bad:
            raise NonFiniteError(
                f"{self.label}: the server step of round {round} produced non-finite values in {bad[0]!r} "
                f"(try a smaller eta or a larger tau)"
            )
        return new


@register_method
class FedAdagrad(FedOpt[FedAdagradParams]):
    name = "fedadagrad"
    Params = FedAdagradParams
    rule = "adagrad"
    summary = "FedAvg clients, Adagrad server step on the pseudo-gradient (Reddi et al. 2021)"
    reference = references.FEDOPT


@register_method
class FedAdam(FedOpt[FedOptParams]):
    name = "fedadam"
    rule = "adam"
    summary = "FedAvg clients, Adam server step on the pseudo-gradient (Reddi et al. 2021)"
    reference = references.FEDOPT


@register_method
class FedYogi(FedOpt[FedOptParams]):
    name = "fedyogi"
    rule = "yogi"
    summary = "FedAvg clients, Yogi server step on the pseudo-gradient (Reddi et al. 2021)"
    reference = references.FEDOPT
