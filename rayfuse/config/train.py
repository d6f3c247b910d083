"""The ``train`` section: each client's local training (and the pooled oracle's), with local DP-SGD (``train.dp``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rayfuse.config.base import StrictModel
from rayfuse.updates.accountant import require_one_noise

__all__ = ["DPSGDConfig", "TrainConfig"]


class DPSGDConfig(StrictModel):
    """``train.dp``: each client trains its local model with DP-SGD (Opacus: per-example gradient clipping to
    ``max_grad_norm``, Gaussian noise of standard deviation ``noise_multiplier * max_grad_norm`` on each batch's sum,
    Poisson sampling of batches at rate ``batch_size / n``). The privacy unit is one example of the client's data; the
    client reports the epsilon it spent at ``delta`` (:mod:`rayfuse.models.privacy`)."""

    # > 0: without noise the accountant's epsilon is infinite and every local model was rejected after training
    noise_multiplier: float | None = Field(
        None, gt=0, description="the noise's standard deviation over max_grad_norm, > 0 (or give target_epsilon)"
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="the epsilon each client may spend: Opacus picks the noise multiplier "
        "for it from the client's sample rate and steps (or give noise_multiplier)",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="per-example gradient clipping norm C")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee; below 1 / (smallest client's train size)")
    accountant: Literal["rdp", "prv"] = Field(
        "rdp", description="Opacus' privacy accountant: rdp (Renyi DP) or prv (privacy random variables)"
    )

    @model_validator(mode="after")
    def _one_noise(self) -> DPSGDConfig:
        require_one_noise(self.noise_multiplier, self.target_epsilon)
        return self


class TrainConfig(StrictModel):
    """Local training of each client's model (and of the pooled oracle)."""

    epochs: int = Field(20, ge=0, le=100_000, description="epochs of local training (0: the local model stays at its initialisation)")
    batch_size: int = Field(32, ge=1, description="minibatch size (with dp: the expected size of a Poisson-sampled batch)")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="adam or sgd (with momentum)")
    lr: float = Field(5e-3, gt=0, description="learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd momentum")
    weight_decay: float = Field(0.0, ge=0, description="the optimiser's weight decay (an L2 penalty added to the gradient)")
    shared_init: bool = Field(
        False,
        description="all clients start from one seeded initialisation (default: each its own, as "
        "models trained apart do; aligned fusion is for that case)",
    )
    dp: DPSGDConfig | None = Field(
        None,
        description="local DP-SGD (Opacus) for each client's local model: {noise_multiplier | "
        "target_epsilon, max_grad_norm, delta, accountant}; null: no DP",
    )
