"""The one-shot DP upload: each client clips and noises its local model's parameters before they leave it.

``dp: {clip_norm, noise_multiplier | target_epsilon, delta}`` on a one-shot method (``average``). The client computes
its upload ``u`` (the difference to the shared initialisation with ``train.shared_init``, else the parameters
themselves), scales it to L2 norm at most ``C = clip_norm`` and adds ``N(0, (z C)^2)`` to every coordinate
(:func:`rayfuse.models.privacy.clip_and_noise`): one release of the Gaussian mechanism with sensitivity ``C``. The
noise is drawn on the client, so the guarantee needs no trusted server. The privacy unit is the client's whole
dataset, under add/remove (Opacus' accountants' neighbouring relation): with or without a client, its clipped upload
moves the released vector by at most ``C``. The client reports the epsilon of that one release at ``delta``, by
Opacus' accountant with sample rate 1 and one step (:func:`rayfuse.updates.accountant.compute_epsilon`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from rayfuse.errors import InputError
from rayfuse.method import ClientContext, Gathered, MethodParams, RunSetup, ServerContext, Update, client_step
from rayfuse.updates.accountant import UnreachableEpsilon, compute_epsilon, noise_multiplier_for, require_one_noise

# the smallest BatchNorm running variance a noised upload keeps (BatchNorm's own eps is 1e-5)
VARIANCE_FLOOR = 1e-5

__all__ = ["UploadDP", "check_upload_dp", "dp_upload", "gather_dp_uploads"]


class UploadDP(MethodParams):
    """A one-shot method's ``dp`` key: the clipped and noised upload of each client's parameters."""

    #: the mechanism in the words of a refusal (``rayfuse.method.dp_options``)
    mechanism: ClassVar[str] = "upload DP (each client clips and noises its upload)"
    clip_norm: float = Field(gt=0, description="C: the upload's L2 norm bound (all parameter arrays together)")
    # z > 0, as central DP-FedAvg has it: z = 0 releases the clipped upload in the clear (epsilon infinite), which the
    # update checks refuse as a non-finite epsilon only after every client trained; refused here, before anything runs
    noise_multiplier: float | None = Field(
        None,
        gt=0,
        description="z > 0: noise standard deviation z C on every coordinate (or "
        "target_epsilon); for clipping without noise use aggregator.clip_norm instead of dp",
    )
    target_epsilon: float | None = Field(
        None, gt=0, description="the epsilon of the one release: Opacus picks z for it (or noise_multiplier)"
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee; below 1 / the number of clients")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus' accountant that converts z into epsilon")

    @model_validator(mode="after")
    def _one_noise(self) -> UploadDP:
        require_one_noise(self.noise_multiplier, self.target_epsilon)
        return self


def check_upload_dp(dp: UploadDP | None, setup: RunSetup) -> None:
    """Refuse a ``dp`` upload whose delta is not below one over the number of clients (the privacy unit is one
    client's data), or whose ``target_epsilon`` no noise multiplier reaches in its one release (the bounded search of
    :func:`rayfuse.updates.accountant.noise_multiplier_for`, run here before any client trains; the clients' own search then
    finds the same noise)."""
    if dp is None:
        return
    if dp.delta >= 1.0 / setup.num_clients:
        raise InputError(
            "dp.delta",
            f"less than 1 / {setup.num_clients} (the number of clients: the privacy unit of the upload is one client's data)",
            dp.delta,
        )
    if dp.target_epsilon is not None:
        try:
            noise_multiplier_for(dp.target_epsilon, dp.delta, 1.0, 1, dp.accountant)
        except UnreachableEpsilon as exc:
            raise InputError(
                "dp.target_epsilon",
                f"an epsilon a noise multiplier reaches in the one release: {exc}",
                dp.target_epsilon,
                "or give noise_multiplier",
            ) from None


@client_step("dp.upload")
def dp_upload(
    ctx: ClientContext,
    *,
    label: str,
    clip_norm: float,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float,
    accountant: str,
) -> Update:
    """This client's local model, clipped and noised on the client (:func:`rayfuse.models.privacy.clip_and_noise`);
    reports only the epsilon and noise multiplier of the release, never the norm before clipping."""
    from rayfuse.models import get_params
    from rayfuse.models.privacy import clip_and_noise

    params = get_params(ctx.local_model())
    reference: dict[str, Any] | None = get_params(ctx.build_model(seed=ctx.init_seed)) if ctx.train_cfg.shared_init else None
    z = (
        float(noise_multiplier)
        if noise_multiplier is not None
        else noise_multiplier_for(float(target_epsilon or 0.0), delta, 1.0, 1, accountant)
    )
    rng = np.random.default_rng(ctx.step_seed(label, "dp-upload"))
    noised, _ = clip_and_noise(params, reference, clip_norm=clip_norm, noise_multiplier=z, rng=rng)
    # BatchNorm's running variances are noised like every float tensor; a negative one would make the model NaN.
    # Clamping them is post-processing of the release, which costs no privacy.
    noised = {k: np.maximum(v, np.asarray(VARIANCE_FLOOR, dtype=v.dtype)) if k.endswith("running_var") else v for k, v in noised.items()}
    epsilon = compute_epsilon(z, 1.0, 1, delta, accountant)  # one release, on all of the client's data
    return Update(noised, ctx.num_examples, {"dp_epsilon": epsilon, "dp_noise_multiplier": z})


def gather_dp_uploads(server: ServerContext, dp: UploadDP) -> tuple[Gathered[Update], dict[str, Any]]:
    """Every client's clipped and noised upload (:func:`dp_upload`: the raw local models never leave the clients), and
    what the results record of it: each client's epsilon, delta, C, the accountant, the largest noise multiplier and
    what the upload is relative to."""
    uploads = server.federation.run(
        dp_upload,
        label=server.label,
        clip_norm=dp.clip_norm,
        noise_multiplier=dp.noise_multiplier,
        target_epsilon=dp.target_epsilon,
        delta=dp.delta,
        accountant=dp.accountant,
    )
    epsilon = {str(c): float(u.metrics["dp_epsilon"]) for c, u in sorted(uploads.results.items())}
    info = {
        "epsilon": epsilon,
        "delta": dp.delta,
        "clip_norm": dp.clip_norm,
        "accountant": dp.accountant,
        "noise_multiplier": max(float(u.metrics["dp_noise_multiplier"]) for u in uploads.results.values()),
        "relative_to": "shared init" if server.models.train_cfg.shared_init else "zero",
    }
    return uploads, info
