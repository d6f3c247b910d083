"""``fedref``: FedAvg with a server-side Bayesian fine-tuning step towards a reference model (Yoon & Choi,
"FedRef: Communication-Efficient Bayesian Fine Tuning with Reference Model", arXiv 2506.23210 v2).

Clients train exactly as in FedAvg (no proximal term) and return their parameters, sample counts and local loss
``F_k``. The server keeps a queue of the last ``p`` FedAvg aggregates ``theta1`` and forms the reference model as
their uniform mean (eq. 13-14)::

    theta2_r = (1/p) sum_{i=1..p} theta1_{r+1-i}          (the queue includes this round's aggregate)

The first reference is formed in round ``p + 1`` (from the aggregates of rounds ``2..p+1``, as the authors' server
does). From round ``p + 2`` on (rounds ``1..p+1`` are plain FedAvg) the server fine-tunes this round's aggregate once along eq. 12::

    L_ref = sum_k W_k F_k + lambda ||theta1 - theta1_0||^2 + lambda ||theta2 - theta2_0||^2

where ``theta1_0`` and ``theta2_0`` are the previous round's aggregate (before fine-tuning) and reference. Two forms:

* ``update: code`` (default, what produced the paper's numbers [FEDREF @ 737c333 : server/FedRefServer.py
  ``BayesianTransferLearning``]): ``W <- theta1 - lr (c_loss + lambda |D1| + lambda |D2|)`` elementwise, with
  ``D1 = theta1 - theta1_0``, ``D2 = theta2 - theta2_0`` and the scalar ``c_loss = (sum_k F_k^r - sum_k
  F_k^{r-1}) / K``. It is a heuristic, not a gradient: the |.| terms always push parameters down.
* ``update: grad`` (PROPOSED, docs/methods/fedref.md): one gradient step on eq. 12 with respect to ``theta1``, given
  that ``theta2`` depends on ``theta1`` through the ``1/p`` term; the loss term is constant (reported scalars):
  ``W <- theta1 - lr [2 lambda D1 + (2 lambda / p) D2]``. With ``lambda = 0`` this is FedAvg exactly.

The queue and ``theta1_0`` hold *pre*-fine-tuning aggregates; only the fine-tuned model is broadcast (as the code
does). Clients pay nothing extra: the default ``client_loss: running`` is the mean loss of the last local epoch,
computed while training; ``client_loss: eval`` reproduces the authors' clients, which evaluate the trained model on
their training data once more (one extra forward pass per round).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from pydantic import Field

from rayfuse.errors import NonFiniteError
from rayfuse.fusion import references
from rayfuse.fusion.fedavg.algorithm import FedAvg, FedAvgParams, FedAvgState
from rayfuse.method import MethodCase, ServerContext, Update, register_method

__all__ = ["FedRef", "FedRefParams", "FedRefState", "reference_model", "fedref_step"]


class FedRefParams(FedAvgParams):
    p: int = Field(5, ge=1, le=10_000, description="aggregates kept for the reference model (paper: 3-5; MNIST: 5)")
    lam: float = Field(0.01, ge=0, description="lambda of eq. 12 (MNIST: 0.01)")
    server_lr: float | None = Field(
        None, gt=0, description="step size of the fine-tuning step (default: the clients' lr, as in the authors' code)"
    )
    update: Literal["code", "grad"] = Field("code", description="code: the authors' elementwise |.| step; grad: a gradient step on eq. 12")
    client_loss: Literal["running", "eval"] = Field(
        "running",
        description="F_k: running = mean loss of the last local epoch (free); eval = a forward pass after training (authors' code)",
    )


def reference_model(queue: list[dict[str, np.ndarray]] | deque[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Eq. 13-14: the uniform mean of the stored aggregates (float64 accumulation, the aggregates' dtypes)."""
    n = len(queue)
    first = queue[0]
    out = {}
    for key, ref in first.items():
        acc = np.zeros(ref.shape, np.float64)
        for q in queue:
            acc += q[key]
        out[key] = (acc / n).astype(ref.dtype) if ref.dtype.kind == "f" else first[key].copy()
    return out


def fedref_step(
    form: str,
    theta1: dict[str, np.ndarray],
    theta1_prev: dict[str, np.ndarray],
    theta2: dict[str, np.ndarray],
    theta2_prev: dict[str, np.ndarray],
    *,
    c_loss: float,
    lam: float,
    lr: float,
    p: int,
) -> dict[str, np.ndarray]:
    """The fine-tuning step of eq. 12 applied to this round's aggregate ``theta1`` (see the module docstring)."""
    if form not in ("code", "grad"):
        raise ValueError(f"unknown FedRef update form {form!r}")
    out = {}
    for key, t1 in theta1.items():
        if t1.dtype.kind != "f":
            out[key] = t1
            continue
        d1 = np.subtract(t1, theta1_prev[key], dtype=t1.dtype)  # in place from here: two scratch arrays per tensor
        d2 = np.subtract(theta2[key], theta2_prev[key], dtype=t1.dtype)
        if form == "code":  # c_loss + lam |D1| + lam |D2|
            np.abs(d1, out=d1)
            np.abs(d2, out=d2)
            d1 += d2
            d1 *= lam
            d1 += c_loss
        else:  # 2 lam D1 + (2 lam / p) D2
            d1 *= 2.0 * lam
            d2 *= 2.0 * lam / p
            d1 += d2
        d1 *= lr
        out[key] = np.subtract(t1, d1, out=d1)
    return out


@dataclass
class FedRefState(FedAvgState):
    """FedRef's round state: the global model; the queue of the last ``p`` aggregates (oldest first, pre-fine-tuning;
    its newest entry is the previous round's aggregate ``theta1_0``) and its float64 running sum (a resumed run continues
    the same float sums); the previous reference ``theta2_0`` (``None`` before the first), the previous mean client loss
    and the number of aggregates formed so far."""

    queue: list[dict[str, np.ndarray]] = field(default_factory=list)
    queue_sum: dict[str, np.ndarray] = field(default_factory=dict)
    theta2_prev: dict[str, np.ndarray] | None = None
    loss_prev: float = float("nan")
    seen: int = 0


@register_method
class FedRef(FedAvg[FedRefParams, FedRefState]):
    name = "fedref"
    Params = FedRefParams
    summary = "FedAvg plus a server-side Bayesian fine-tuning step towards the mean of the last p aggregates (Yoon & Choi 2025)"
    reference = references.FEDREF
    # its server step reads each client's loss: neither DP-FedAvg's noise nor secure aggregation's sum covers it
    tags = replace(FedAvg.tags, no_dp="its server step reads each client's training loss, which DP-FedAvg does not noise", sums=False)
    test_case = MethodCase({"rounds": 3, "local_epochs": 1, "p": 1}, step="fedavg.fit")

    def __init__(self, params: FedRefParams | None = None, label: str | None = None) -> None:
        super().__init__(params, label)
        self.fine_tuned = False  # this round's, for round_metrics (not state: each round sets it)

    def initial_state(self, params: dict[str, np.ndarray]) -> FedRefState:
        return FedRefState(params)

    def client_args(self) -> dict[str, object]:
        return {"eval_loss": True} if self.params.client_loss == "eval" else {}

    def server_update(
        self, server: ServerContext, state: FedRefState, averaged: dict[str, np.ndarray], updates: dict[int, Update], round: int
    ) -> dict[str, np.ndarray]:
        p = self.params
        metric = "eval_loss" if p.client_loss == "eval" else "train_loss"
        losses = np.array([u.metrics.get(metric, np.nan) for u in updates.values()], dtype=np.float64)
        if not np.isfinite(losses).all():  # the update pipeline rejects non-finite metrics; a missing one lands here
            raise NonFiniteError(f"{self.label}: round {round}: clients reported no finite {metric!r} (FedRef needs each client's loss)")
        # The code's c_loss = sum_k (w_k / K) (sum F^r - sum F^{r-1}) = (sum F^r - sum F^{r-1}) / K when the same K
        # clients report in both rounds. With client sampling or drops the sums cover different sets, so compare the
        # means: identical in the code's setting, unbiased otherwise.
        loss = float(losses.mean())
        theta1 = averaged
        theta1_prev = state.queue[-1] if state.queue else None
        self._push(state, theta1)
        state.seen += 1
        # The authors' server forms the first reference in round p + 1 (from rounds 2..p+1) and fine-tunes from p + 2.
        theta2 = self._reference(state) if state.seen > p.p else None
        self.fine_tuned = False
        new = theta1
        if theta2 is not None and state.theta2_prev is not None and theta1_prev is not None:  # round > p + 1
            lr = p.server_lr or p.lr or server.models.train_cfg.lr
            new = fedref_step(
                p.update, theta1, theta1_prev, theta2, state.theta2_prev, c_loss=loss - state.loss_prev, lam=p.lam, lr=lr, p=p.p
            )
            bad = [k for k, a in new.items() if not np.isfinite(a).all()]
            if bad:
                raise NonFiniteError(f"{self.label}: the fine-tuning step of round {round} produced non-finite values in {bad[0]!r}")
            self.fine_tuned = True
        state.theta2_prev, state.loss_prev = theta2, loss
        return new

    def _push(self, state: FedRefState, theta1: dict[str, np.ndarray]) -> None:
        """Append to the queue, keeping the running sum: add the new aggregate, subtract the one that falls out."""
        if not state.queue_sum:
            state.queue_sum = {k: np.zeros(a.shape, np.float64) for k, a in theta1.items() if a.dtype.kind == "f"}
        if len(state.queue) == self.params.p:
            for key, acc in state.queue_sum.items():
                acc -= state.queue[0][key]
            del state.queue[0]
        for key, acc in state.queue_sum.items():
            acc += theta1[key]
        state.queue.append(theta1)

    def _reference(self, state: FedRefState) -> dict[str, np.ndarray]:
        """Eq. 13-14 from the running sum (equal to :func:`reference_model` of the queue up to float64 rounding)."""
        n = len(state.queue)
        newest = state.queue[-1]
        return {k: (state.queue_sum[k] / n).astype(a.dtype) if k in state.queue_sum else a for k, a in newest.items()}

    def round_metrics(self) -> dict[str, float]:
        return {"fine_tuned": float(self.fine_tuned)}
