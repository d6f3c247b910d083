"""``epgan``: EP-GAN, federated Bayesian GANs with an expectation-propagation prior (Wu, Huang, Wang, Wang, Xu,
"Unsupervised Federated Learning with Expectation-Propagation Prior GAN", ICLR 2022 submission, withdrawn; no public
code) [1], and its baselines on the same engine.

Algorithm 2 of [1] with the toy experiment's schedule (App. F.2.3)::

    turn 0 (warm-up): every client trains its GAN for warmup_epochs from the shared initialisation
    server: theta_G, theta_D <- sum_k (n_k / n) theta_{G,k}, ...      (FedAvg; the paper's "1/n_k" is a typo)
            EP prior initialised at the averaged generator: m_j = theta_G (+ a small seeded spread for j > 0),
            s_j = prior_var
    turns t = 1..rounds: broadcast (theta_G, theta_D, m, s); every client
        1. EP step (EP backbones): cavity = global / own factor, tilted moments of sigma(f_bar_j theta) x cavity
           (Theorem 4.1 with the corrected S2, rayfuse.fusion.epgan.ep), damped factor update          (line 5)
        2. local_epochs of GAN training (Algorithm 1: Adam + SGHMC noise loss; + lambda_ep L_ep), each epoch followed
           by the historical interpolation theta <- beta theta + (1 - beta) theta_global       (line 6, App. F.2.3)
        3. uploads theta_G, theta_D and its factor (m_k, s_k)                                  (line 8)
    server: FedAvg of G and D; product of the factors (precision sum; the paper writes the precision where the variance
            belongs: corrected, see rayfuse.fusion.epgan.ep.gaussian_product)                        (lines 9-10)

The backbone is a parameter: ``wgan`` and ``probgan`` with FedAvg are the paper's baselines (no EP), ``ep-bgan``,
``ep-probgan`` and, with ``components: J > 1``, Mixture-EP-ProbGAN (:mod:`rayfuse.fusion.epgan.nets`).
``epgan-oracle`` trains the same backbone on every client's data pooled (the paper's "centralised" column).

A client update with NaN / Inf anywhere (parameters, EP moments, losses), the wrong keys or shapes, or a non-positive
EP variance is rejected and recorded (``update_rejected`` event), never averaged in.

Scores (the toy set ``gaussians4``): D-MSE (App. F.2.2, eq. 48) between the min-max normalised critic map and the
min-max normalised true mixture density on a 100 x 100 grid over [-5, 5]^2 (docs/methods/epgan.md, PROPOSED: a grid
rather than 10,000 random points, and min-max scaling because a WGAN critic is unbounded; ``d_mse_raw`` without the
scaling); and, on 10,000 generator samples, ``g_dmse`` (the same MSE for the normalised sample histogram on 50 x 50
bins), ``modes`` (centres holding >= 5 % of the samples within 3 standard deviations) and ``high_quality`` (the
fraction of samples within 3 standard deviations of some centre).

[1] [EPGAN] (docs/references.md); docs/methods/epgan.md (corrected formulas, proposals where the paper is silent).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from rayfuse.errors import NonFiniteError, RunFailure
from rayfuse.fusion import references
from rayfuse.fusion.aggregate import weighted_average
from rayfuse.fusion.epgan.ep import gaussian_product
from rayfuse.fusion.epgan.nets import GANSettings, GANTrainer
from rayfuse.method import ClientContext, Gathered, Method, MethodParams, MethodResult, ServerContext, Update, client_step, register_method
from rayfuse.seeding import derive_seed

__all__ = ["EPGAN", "EPGANOracle", "EPGANParams", "EPGANOracleParams", "train_gan", "combine_factors", "grid_points",
           "mixture_density", "density_mse", "score_toy"]


# -----------------------------------------------------------------------------------------------------------------
# Parameters


class EPGANParams(MethodParams):
    backbone: Literal["wgan", "probgan", "ep-bgan", "ep-probgan"] = Field(
        "ep-probgan", description="wgan / probgan: the FedAvg baselines; ep-bgan, ep-probgan: with the EP prior")
    components: int = Field(1, ge=1, le=64, description="J, EP-prior mixture components (J > 1: Mixture-EP-ProbGAN)")
    num_generators: int = Field(4, ge=1, le=64, description="generator samples N (Bayesian backbones)")
    num_discriminators: int = Field(4, ge=1, le=64, description="discriminator samples M (Bayesian backbones)")
    latent_dim: int = Field(2, ge=1, description="z dimension (UNRECOVERABLE for the toy set; PROPOSED 2)")
    hidden: int = Field(32, ge=2, description="hidden width of G and D (toy: 32)")
    out_activation: Literal["none", "sigmoid"] = Field("none", description="generator output: none (toy) or sigmoid (images in [0, 1])")
    lr_g: float = Field(2e-4, gt=0)
    lr_d: float = Field(1e-4, gt=0)
    batch_size: int = Field(128, ge=2)
    d_steps: int = Field(1, ge=1, description="critic updates per generator update")
    gp_weight: float = Field(10.0, ge=0, description="WGAN-GP penalty weight")
    noise_weight: float = Field(3e-2, ge=0, description="SGHMC noise-loss weight (Bayesian backbones)")
    sghmc_alpha: float = Field(0.01, gt=0, description="SGHMC alpha: noise std sqrt(2 alpha)")
    hist_weight: float = Field(1.0, ge=0, description="weight of the discriminator-history (PSA) term")
    hist_every: int = Field(10, ge=1, description="iterations between discriminator-history updates")
    lambda_ep: float = Field(1e-3, ge=0, description="weight of the EP-prior term in the generator loss")
    f_weight: float = Field(
        1.0, ge=0, description="weight of f's objective in the critic loss (its objective is UNRECOVERABLE; 0: f stays at its initialisation)")
    prior_var: float = Field(1.0, gt=0, description="variance of the initial global EP prior")
    component_spread: float = Field(0.05, ge=0, description="std of the seeded offsets of components j > 0 at initialisation")
    damping: float = Field(0.5, gt=0, le=1, description="damping rho of the EP factor update (natural parameters)")
    site: Literal["paper", "ep"] = Field("paper", description="paper: clients upload the tilted Gaussian (Algorithm 2); "
                                         "ep: they upload tilted / cavity, the server multiplies in the initial prior once")
    warmup_epochs: int = Field(50, ge=0, description="local epochs before the first aggregation")
    rounds: int = Field(10, ge=1, le=100_000, description="FedAvg turns after the warm-up")
    local_epochs: int = Field(20, ge=0, description="local epochs per turn")
    beta: float = Field(0.5, ge=0, le=1, description="historical interpolation after each local epoch (1: off)")
    grid: int = Field(100, ge=10, le=1000, description="grid points per axis of the D-MSE map")
    eval_samples: int = Field(10_000, ge=100, description="generator samples for the sample scores")

    @model_validator(mode="after")
    def _components_need_ep(self) -> EPGANParams:
        if self.components > 1 and not self.backbone.startswith("ep-"):
            raise ValueError(f"@components@ 1 for backbone {self.backbone!r} (mixture components need an EP backbone), got {self.components}")
        return self

    def settings(self, data_dim: int) -> GANSettings:
        return GANSettings(
            backbone=self.backbone, data_dim=data_dim, latent_dim=self.latent_dim, hidden=self.hidden,
            num_generators=self.num_generators, num_discriminators=self.num_discriminators, components=self.components,
            out_activation=self.out_activation, lr_g=self.lr_g, lr_d=self.lr_d, batch_size=self.batch_size,
            d_steps=self.d_steps, gp_weight=self.gp_weight, noise_weight=self.noise_weight, sghmc_alpha=self.sghmc_alpha,
            hist_weight=self.hist_weight, hist_every=self.hist_every, lambda_ep=self.lambda_ep, f_weight=self.f_weight)


class EPGANOracleParams(EPGANParams):
    epochs: int = Field(200, ge=1, description="epochs on the pooled data (the paper's centralised runs: 200)")


# -----------------------------------------------------------------------------------------------------------------
# Client side


def _flat(X: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(X.reshape(len(X), -1), dtype=np.float32)


STATE = "epgan-state"  # the kind of client state (:class:`rayfuse.client.ClientStateStore`) EP-GAN clients keep


@client_step("epgan.train")
def train_gan(ctx: ClientContext, broadcast: dict[str, Any], *, label: str, round: int, settings: dict[str, Any],
              epochs: int, beta: float, damping: float, site: str, state_turn: int | None = None,
              store: str | None = None) -> Update:
    """One turn of a client (Algorithm 2, lines 5-8): EP step, local GAN training, upload.

    The client's GAN (optimiser states, random generator, iteration counter, EP site) lives in ``ctx.state`` between
    turns and never travels: the update carries the parameters (``G/*``, ``D/*``, ``pi/logits``) and, on EP backbones,
    the factor (``ep_mean/*``, ``ep_var/*``), nothing else. The discriminator history (PSA) is a buffer of D: it travels
    with D's parameters and is averaged. ``broadcast``: ``params`` and, once initialised, the global EP prior
    ``ep_mean`` / ``ep_var`` (arrays with a leading component axis).

    ``state_turn``: the turn the server's checkpoint says this client's GAN state belongs to (its last turn that came
    back; ``None``: none yet, a fresh trainer). With ``store`` (and ``run.model_cache`` on the client) the client also
    writes its state to its own storage after the turn (:func:`_held_trainer` reads it back when memory does not hold
    that turn: a resumed run's or a restarted actor's client).
    """
    key = f"epgan/{label}"
    trainer = _held_trainer(ctx, label, GANSettings(**settings), state_turn, store)
    ctx.state[key] = trainer
    ctx.state[key + "/turn"] = None  # until this turn is done: a half-trained trainer is no turn's state
    X = _flat(ctx.train.X)
    params = broadcast["params"]
    trainer.set_params(params)  # Algorithm 2, line 11: the local copies are overwritten by the broadcast
    upload: dict[str, np.ndarray] = {}
    metrics: dict[str, float] = {}
    ep_mean, ep_var = broadcast.get("ep_mean"), broadcast.get("ep_var")
    if trainer.settings.uses_ep and ep_mean is not None:
        started = time.perf_counter()
        assert ep_var is not None  # the server broadcasts ep_mean and ep_var together
        means, variances, f_bar = trainer.update_ep(X, ep_mean, ep_var, damping=damping, site_mode=site)
        upload.update({f"ep_mean/{k}": v for k, v in means.items()})
        upload.update({f"ep_var/{k}": v for k, v in variances.items()})
        metrics["ep_seconds"] = time.perf_counter() - started
        metrics["f_bar"] = float(np.mean(f_bar))
    # Turn 0 is the warm-up: there is no global model to interpolate towards yet.
    stats = trainer.train(X, epochs, interpolate_to=params if round > 0 else None, beta=beta)
    metrics.update(stats)
    ctx.state[key + "/turn"] = (store, round)
    if store:
        ctx.state_store(STATE, store).save(label, round, _gan_state(trainer), keep=state_turn)
    return Update({**trainer.get_params(), **upload}, ctx.num_examples, metrics)


def _gan_state(trainer: GANTrainer) -> dict[str, np.ndarray]:
    """What a client keeps of its GAN between turns besides the parameters the broadcast overwrites: ``state/*``
    (:meth:`GANTrainer.training_state`: Adam moments, random generator, iteration counter) and, from the first EP turn
    on, its EP site (``site_mean/*``, ``site_var/*``, which its next cavity divides out). Its EP prior is not needed:
    the next turn's EP step sets it afresh before any training."""
    state = {f"state/{k}": v for k, v in trainer.training_state().items()}
    if trainer.site is not None:
        state.update({f"site_mean/{k}": v for k, v in trainer.site[0].items()})
        state.update({f"site_var/{k}": v for k, v in trainer.site[1].items()})
    return state


def _load_gan_state(trainer: GANTrainer, saved: dict[str, np.ndarray]) -> None:
    """Restore what :func:`_gan_state` returned."""
    trainer.load_training_state(_prefixed(saved, "state/"))
    site_mean, site_var = _prefixed(saved, "site_mean/"), _prefixed(saved, "site_var/")
    if site_mean:
        trainer.site = (site_mean, site_var)


def _held_trainer(ctx: ClientContext, label: str, settings: GANSettings, state_turn: int | None,
                  store: str | None) -> GANTrainer:
    """The GAN this turn starts from: the one of ``state_turn`` (see :func:`train_gan`), from memory, else from the
    client's own storage; a fresh one (the shared initialisation's seed) when ``state_turn`` is ``None``.

    Without storage (no ``store`` or no ``run.model_cache``) a client keeps only what its actor holds: that (whichever
    turn it is of), or a fresh trainer for a restarted actor.
    """
    def fresh() -> GANTrainer:
        return GANTrainer(settings, seed=ctx.step_seed(label, "gan"), device=ctx.device)

    key = f"epgan/{label}"
    held: GANTrainer | None = ctx.state.get(key)
    if state_turn is None:
        return fresh()
    if held is not None and ctx.state.get(key + "/turn") == (store, state_turn):
        return held
    kept = ctx.state_store(STATE, store) if store else None
    if kept is None or kept.folder is None:
        return held if held is not None else fresh()
    if not kept.has(label, state_turn):
        raise FileNotFoundError(f"client {ctx.client_id}: no GAN state of {label!r} after turn {state_turn} in {kept.folder}")
    trainer = fresh()
    _load_gan_state(trainer, kept.load(label, state_turn) or {})
    return trainer


def _prefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays under ``prefix``, the prefix removed (copies: broadcasts and loaded checkpoints may be read-only)."""
    return {k[len(prefix):]: np.array(v) for k, v in arrays.items() if k.startswith(prefix)}


# -----------------------------------------------------------------------------------------------------------------
# Server math


def combine_factors(factors: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
                    prior: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Algorithm 2, line 10 (corrected): the product of the clients' Gaussian factors, key by key, elementwise.

    ``s = 1 / sum_k (1 / s_k)``, ``m = s sum_k m_k / s_k``. With ``prior`` (site mode ``ep``) the initial prior is one
    more factor, so that the global prior is ``p_0 prod_k q_k``.
    """
    everything = list(factors) + ([prior] if prior is not None else [])
    means, variances = {}, {}
    for key in everything[0][0]:
        means[key], variances[key] = gaussian_product([f[0][key] for f in everything], [f[1][key] for f in everything])
    return means, variances


def grid_points(n: int = 100, limit: float = 5.0) -> np.ndarray:
    """``n x n`` points on ``[-limit, limit]^2``, row-major with x fastest (row = y), shape ``(n * n, 2)``."""
    axis = np.linspace(-limit, limit, n)
    xx, yy = np.meshgrid(axis, axis)
    return np.stack([xx.ravel(), yy.ravel()], axis=1)


def mixture_density(points: np.ndarray, centres: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """Equal-weight isotropic Gaussian mixture density at ``points`` (App. F.2.2's ground-truth map ``f_P``)."""
    sq = ((points[:, None, :] - centres[None, :, :]) ** 2).sum(-1)
    dim = points.shape[1]
    dens = np.exp(-0.5 * sq / variances[None, :]) / (2 * np.pi * variances[None, :]) ** (dim / 2)
    return dens.mean(1)


def _minmax(a: np.ndarray) -> np.ndarray:
    span = float(a.max() - a.min())
    return (a - a.min()) / span if span > 0 else np.zeros_like(a)


def density_mse(f_p: np.ndarray, f_q: np.ndarray, *, normalise: bool = True) -> float:
    """Eq. 48, ``(1/N) sum_x (f_P(x) - f_Q(x))^2``; with ``normalise`` both maps are min-max scaled to [0, 1] first."""
    if normalise:
        f_p, f_q = _minmax(f_p), _minmax(f_q)
    return float(np.mean((f_p - f_q) ** 2))


def score_toy(critic: np.ndarray, samples: np.ndarray, truth: np.ndarray, centres: np.ndarray, variances: np.ndarray, *,
              grid: int, limit: float = 5.0) -> dict[str, float]:
    """The toy scores of one model: ``critic`` on :func:`grid_points`, ``truth`` the mixture density there."""
    metrics = {"d_mse": density_mse(truth, critic), "d_mse_raw": density_mse(truth, critic, normalise=False)}
    finite = np.isfinite(samples).all(axis=1)
    samples = samples[finite]
    bins = 50
    hist, _, _ = np.histogram2d(samples[:, 1], samples[:, 0], bins=bins, range=[[-limit, limit], [-limit, limit]])
    centres_1d = -limit + (np.arange(bins) + 0.5) * (2 * limit / bins)
    bx, by = np.meshgrid(centres_1d, centres_1d)
    coarse_truth = mixture_density(np.stack([bx.ravel(), by.ravel()], 1), centres, variances)
    metrics["g_dmse"] = density_mse(coarse_truth, hist.ravel())
    dist = np.sqrt(((samples[:, None, :] - centres[None]) ** 2).sum(-1)) / np.sqrt(variances)[None]  # in standard deviations
    near = dist <= 3.0
    share = near.sum(0) / max(len(samples), 1)
    metrics["modes"] = float((share >= 0.05).sum())
    metrics["high_quality"] = float(near.any(1).mean()) if len(samples) else 0.0
    metrics["nonfinite_samples"] = float((~finite).sum())
    return metrics


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """``||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2))`` between Gaussians fitted to two feature sets (FID's
    formula, Heusel et al. 2017)."""
    from scipy import linalg

    mu_a, mu_b = a.mean(0), b.mean(0)
    # + 1e-6 I: ReLU features have dead units, whose zero variance makes the product singular (as pytorch-fid does)
    offset = 1e-6 * np.eye(a.shape[1])
    cov_a, cov_b = np.cov(a, rowvar=False) + offset, np.cov(b, rowvar=False) + offset
    root, _ = linalg.sqrtm(cov_a @ cov_b, disp=False)
    root = np.real(root)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2.0 * root))


def inception_score(proba: np.ndarray, eps: float = 1e-12) -> float:
    """``exp(E_x KL(p(y|x) || p(y)))`` (Salimans et al. 2016) for class probabilities ``(n, C)``."""
    marginal = proba.mean(0, keepdims=True)
    kl = (proba * (np.log(proba + eps) - np.log(marginal + eps))).sum(1)
    return float(np.exp(kl.mean()))


class _ImageScorer:
    """Inception-style scores of generated images with a classifier trained on the dataset (issue 7: a digits
    classifier stands in for Inception): ``fd`` (Frechet distance of its penultimate features, generated vs the global
    test set), ``is`` (Inception score of its predictions) and ``classes`` (classes predicted for >= 5 % of the
    samples, the image analogue of modes covered).

    The classifier is an evaluation instrument outside the federation, trained once on the whole dataset (as Inception
    is trained on ImageNet); no method sees it.
    """

    def __init__(self, server: ServerContext, params: EPGANParams) -> None:
        import torch

        from rayfuse.data.roles import load_dataset_from_config
        from rayfuse.models import train_model
        from rayfuse.models.registry import MLP

        dataset = load_dataset_from_config(server.data_cfg)
        self.shape = dataset.input_shape
        self.samples = min(params.eval_samples, 2000)
        self.seed = derive_seed(server.seed, "epgan-eval")  # the same instrument and noise for every method of a run
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.classifier = MLP(int(np.prod(self.shape)), [128], dataset.num_classes)
        train_model(self.classifier, dataset.X, dataset.y, epochs=40, batch_size=64, lr=1e-3, seed=self.seed)
        self.classifier.eval()
        self.num_classes = dataset.num_classes
        self.real, real_proba = self._features(_flat(server.test.X))
        share = np.bincount(real_proba.argmax(1), minlength=self.num_classes) / len(real_proba)
        self._reference = {"is": inception_score(real_proba), "classes": float((share >= 0.05).sum())}

    def _features(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.no_grad():
            x = torch.as_tensor(np.ascontiguousarray(X, dtype=np.float32))
            feats = self.classifier.features(x)
            proba = torch.softmax(self.classifier.layers[-1](feats), dim=1)
        return feats.double().numpy(), proba.double().numpy()

    def __call__(self, trainer: GANTrainer) -> dict[str, float]:
        images = trainer.sample(self.samples, seed=self.seed)
        if not np.isfinite(images).all():
            raise NonFiniteError("epgan: the fused generator produced non-finite images")
        feats, proba = self._features(images)
        share = np.bincount(proba.argmax(1), minlength=self.num_classes) / len(proba)
        return {"fd": frechet_distance(feats, self.real), "is": inception_score(proba), "classes": float((share >= 0.05).sum())}

    def reference(self) -> dict[str, float]:
        """``is`` and ``classes`` of the real test images (the best a generator can do; their ``fd`` is 0)."""
        return dict(self._reference)

    def snapshot(self, trainer: GANTrainer) -> dict[str, Any] | None:
        images = trainer.sample(16, seed=self.seed).reshape((16,) + self.shape[-2:] if len(self.shape) == 3 else (16, -1))
        return {"images": np.round(images, 3).tolist()}

    def truth_snapshot(self) -> dict[str, Any] | None:
        return None


def make_scorer(server: ServerContext, params: EPGANParams) -> _Scorer | _ImageScorer:
    """Toy scores for ``gaussians4``; image scores for image datasets; otherwise only losses are logged."""
    if server.data_cfg.dataset != "gaussians4" and len(server.input_shape) == 3:
        return _ImageScorer(server, params)
    return _Scorer(server, params)


class _Scorer:
    """Scores a model on the toy set, when the run's dataset is ``gaussians4`` (else only losses are logged)."""

    MAP_SIZE = 50  # resolution of the maps kept in results.json for the density-map figure

    def __init__(self, server: ServerContext, params: EPGANParams) -> None:
        self.grid = params.grid
        self.samples = params.eval_samples
        self.seed = derive_seed(server.seed, "epgan-eval")  # the same instrument and noise for every method of a run
        self.truth = None
        data = server.data_cfg
        if data.dataset == "gaussians4" and int(np.prod(server.input_shape)) == 2:
            from rayfuse.data.datasets import gaussians4_mixture

            options = {k: v for k, v in data.options.items() if k in ("var_low", "var_high", "random_state")}
            self.centres, self.variances = gaussians4_mixture(**options)
            self.points = grid_points(self.grid)
            self.truth = mixture_density(self.points, self.centres, self.variances)
            self.map_points = grid_points(self.MAP_SIZE)

    def __call__(self, trainer: GANTrainer) -> dict[str, float]:
        if self.truth is None:
            return {}
        critic = trainer.critic_map(self.points)
        if not np.isfinite(critic).all():
            raise NonFiniteError("epgan: the fused discriminator's output is not finite")
        return score_toy(critic, trainer.sample(self.samples, seed=self.seed), self.truth, self.centres, self.variances, grid=self.grid)

    def snapshot(self, trainer: GANTrainer) -> dict[str, Any] | None:
        """A small picture of the model for the report: the normalised critic map and 500 generator samples."""
        if self.truth is None:
            return None
        critic = _minmax(trainer.critic_map(self.map_points)).reshape(self.MAP_SIZE, self.MAP_SIZE)
        return {"critic": np.round(critic, 4).tolist(), "samples": np.round(trainer.sample(500, seed=self.seed), 3).tolist()}

    def reference(self) -> dict[str, float]:
        return {}

    def truth_snapshot(self) -> dict[str, Any] | None:
        if self.truth is None:
            return None
        dens = _minmax(mixture_density(self.map_points, self.centres, self.variances)).reshape(self.MAP_SIZE, self.MAP_SIZE)
        return {"density": np.round(dens, 4).tolist(), "centres": self.centres.tolist(), "variances": self.variances.tolist()}


# -----------------------------------------------------------------------------------------------------------------
# The federated method


def _split(params: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None]:
    model = {k: v for k, v in params.items() if not k.startswith("ep_")}
    means = {k[len("ep_mean/"):]: v for k, v in params.items() if k.startswith("ep_mean/")}
    variances = {k[len("ep_var/"):]: v for k, v in params.items() if k.startswith("ep_var/")}
    return model, ((means, variances) if means else None)


def initial_ep_prior(trainer: GANTrainer, components: int, prior_var: float, spread: float,
                     rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The global EP prior at the first aggregation (Algorithm 2, line 2): centred at the averaged generator.

    Where to centre it is not in the paper (UNRECOVERABLE); the averaged warm-up generator is the model the federated
    turns start from. Components ``j > 0`` get seeded offsets ``N(0, spread^2)`` so that the mixture is not J copies of
    one Gaussian. Variances ``prior_var``.
    """
    centre = trainer.prior_from_generator()
    means, variances = {}, {}
    for name, value in centre.items():
        offsets = rng.normal(0.0, spread, size=(components,) + value.shape)
        offsets[0] = 0.0
        means[name] = value[None] + offsets
        variances[name] = np.full((components,) + value.shape, float(prior_var))
    return means, variances


# -----------------------------------------------------------------------------------------------------------------
# Turn checkpoints (``rayfuse run --resume``)


def _checkpoint_state(ep: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None,
                      initial_prior: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None) -> dict[str, np.ndarray]:
    """The arrays of a turn checkpoint besides the global model: ``ep_mean/*``, ``ep_var/*`` (the global EP prior)
    and ``ep0_mean/*``, ``ep0_var/*`` (the initial prior). Nothing of any client's: each keeps its own GAN state."""
    state: dict[str, np.ndarray] = {}
    for tag, prior in (("ep", ep), ("ep0", initial_prior)):
        if prior is not None:
            state.update({f"{tag}_mean/{k}": v for k, v in prior[0].items()})
            state.update({f"{tag}_var/{k}": v for k, v in prior[1].items()})
    return state


def _prior_from(state: dict[str, np.ndarray], tag: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    means, variances = _prefixed(state, f"{tag}_mean/"), _prefixed(state, f"{tag}_var/")
    return (means, variances) if means else None


@register_method
class EPGAN(Method):
    name = "epgan"
    Params = EPGANParams
    params: EPGANParams
    summary = "EP-GAN: federated (Bayesian) GANs, FedAvg of G and D plus a product-of-Gaussians EP prior (Wu et al. 2022)"
    reference = references.EPGAN
    # A checkpoint after the warm-up (turn 0) and after each turn; ``--resume`` continues after the last one.
    multi_round = True

    def run(self, server: ServerContext) -> MethodResult:
        p: EPGANParams = self.params
        data_dim = int(np.prod(server.input_shape))
        settings = p.settings(data_dim)
        fed = server.federation
        scorer = make_scorer(server, p)
        model = GANTrainer(settings, seed=server.step_seed("init"), device=server.device)  # the shared initialisation
        step_args = dict(label=server.label, settings=asdict(settings), beta=p.beta, damping=p.damping, site=p.site)
        show = {0, 1, (p.rounds + 1) // 2, p.rounds}
        # The server's state between turns, all of it in the turn checkpoint: the global G and D (every ProbGAN sample,
        # D's PSA history buffers and the mixture logits included), the global EP prior (every component), the initial
        # prior (site mode "ep" multiplies it in each turn), the per-turn records (metrics history through server.log,
        # the maps for the report), the rejection count and the last losses, and per client the turn its GAN state
        # belongs to (state_turns) with the id of the store the clients keep it in.
        # Each client's GAN state (Adam moments of G and D, its random generator, its iteration counter -- the PSA
        # schedule -- and its EP site) stays on the client: gradient statistics of private data never travel. With
        # run.model_cache each client writes it to its own storage after each turn (train_gan), so that --resume can
        # continue mid-method (see _resume). Re-initialising it every turn instead would change the method (Adam
        # restarts) for every run.
        # Randomness: the server draws only at turn 0 (the initial prior's offsets, server.rng("ep-init")); each client
        # draws from its trainer's generator, seeded once per client (ctx.step_seed(label, "gan")) and carried across
        # turns as part of its state rather than re-derived from the turn number: re-seeding per turn would change
        # every uninterrupted run's numbers (docs/methods/epgan.md's results).
        checkpoint = self._resume(server)
        store = uuid.uuid4().hex if server.model_cache else None
        state_turns: dict[int, int] = {}  # per client: its last turn that came back (what its stored state is of)
        if checkpoint is None:
            start = 0
            global_params = model.get_params()
            ep: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
            initial_prior: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
            maps: dict[str, Any] = {}
            metrics: dict[str, float] = {}
            losses: dict[str, float] = {}
            rejected = 0
        else:
            start = checkpoint.round + 1
            global_params = dict(checkpoint.params)
            ep, initial_prior = _prior_from(checkpoint.state, "ep"), _prior_from(checkpoint.state, "ep0")
            meta = checkpoint.meta
            maps, metrics = dict(meta.get("maps", {})), dict(meta.get("metrics", {}))
            losses, rejected = dict(meta.get("losses", {})), int(meta.get("rejected", 0))
            store = meta.get("store") or store
            state_turns = {int(c): int(t) for c, t in meta.get("state_turns", [])}
            model.set_params(global_params)
        for turn in range(start, p.rounds + 1):
            broadcast = fed.put({"params": global_params, "ep_mean": None if ep is None else ep[0],
                                 "ep_var": None if ep is None else ep[1]})
            epochs = p.warmup_epochs if turn == 0 else p.local_epochs
            gathered = fed.gather([call for client in fed.client_ids for call in fed.map(
                train_gan, broadcast, clients=[client], round=turn, epochs=epochs, state_turn=state_turns.get(client),
                store=store, **step_args)])
            # Every client that came back (its update accepted or not) has moved its GAN state on to this turn.
            state_turns.update({int(client): turn for client in gathered.results})
            reference = dict(global_params)
            if ep is not None and settings.uses_ep:
                reference.update({f"ep_mean/{k}": v for k, v in ep[0].items()})
                reference.update({f"ep_var/{k}": v for k, v in ep[1].items()})
            updates = self.accept(server, gathered, reference)
            rejected += len(gathered.results) - len(updates)
            weights = [u.num_examples for u in updates.values()]
            parts = [_split(u.params) for u in updates.values()]
            global_params = weighted_average([part[0] for part in parts], weights)  # Algorithm 2, line 9
            model.set_params(global_params)
            if settings.uses_ep:
                if ep is None:  # after the warm-up: the global EP prior starts at the averaged generator
                    ep = initial_ep_prior(model, p.components, p.prior_var, p.component_spread, server.rng("ep-init"))
                    initial_prior = ep
                else:  # Algorithm 2, line 10 (corrected variance)
                    ep = combine_factors([part[1] for part in parts if part[1] is not None],
                                         initial_prior if p.site == "ep" else None)
            row = {
                "clients": float(len(updates)),
                "d_loss": float(np.average([u.metrics["d_loss"] for u in updates.values()], weights=weights)),
                "g_loss": float(np.average([u.metrics["g_loss"] for u in updates.values()], weights=weights)),
                "client_seconds": float(np.mean([u.metrics["train_seconds"] for u in updates.values()])),
            }
            losses = {"d_loss": row["d_loss"], "g_loss": row["g_loss"]}
            if ep is not None:
                # by sorted key: a resumed run's prior comes from stored states, keyed in another order than a fresh one's
                row["ep_var_mean"] = float(np.mean([ep[1][k].mean() for k in sorted(ep[1])]))
            metrics = scorer(model)
            row.update(metrics)
            server.log(turn, row)
            server.progress(f"turn {turn}/{p.rounds}", round=turn, rounds=p.rounds, clients=len(updates),
                            metrics={k: round(v, 4) for k, v in row.items()})
            if turn in show:
                snap = scorer.snapshot(model)
                if snap is not None:
                    maps[str(turn)] = snap
            del broadcast, gathered
            server.save_checkpoint(turn, global_params, _checkpoint_state(ep, initial_prior), {
                "metrics": metrics, "losses": losses, "maps": maps, "rejected": rejected, "store": store,
                "state_turns": sorted([int(c), int(t)] for c, t in state_turns.items())})
        if store is not None:
            server.forget_client_state(STATE, store)  # the method is done: the clients may delete their GAN states
        if not metrics:  # no toy scores for this dataset: report the last losses
            metrics = dict(losses)
        final = dict(global_params)
        if ep is not None:
            final.update({f"ep_mean/{k}": v.astype(np.float32) for k, v in ep[0].items()})
            final.update({f"ep_var/{k}": v.astype(np.float32) for k, v in ep[1].items()})
        return MethodResult(metrics, final, info={
            "rounds": p.rounds, "backbone": p.backbone, "components": p.components, "rejected_updates": rejected,
            "maps": maps, "truth": scorer.truth_snapshot(), "real_data_scores": scorer.reference()})

    # -- resume ----------------------------------------------------------------------------------------------------

    def _resume(self, server: ServerContext) -> Any:
        """The turn checkpoint to continue from on ``--resume``, or ``None`` (a fresh start from turn 0).

        Each client's GAN state lives on its client, across turns: a resumed run can continue mid-method only when the
        clients kept theirs (``run.model_cache``, storage the clients own) and still hold the turn the checkpoint
        names. Otherwise the method starts again from turn 0 (a ``warning`` event says why): the same result, later.
        A checkpoint of the last turn needs no client state (nothing is trained again).
        """
        if not server.resume:
            return None
        saved = server.checkpoint.load()
        if saved is None:
            return None
        if saved.round < self.params.rounds:
            store, turns = saved.meta.get("store"), {int(c): int(t) for c, t in saved.meta.get("state_turns", [])}
            problem = None
            if not server.model_cache or not store:
                problem = ("the clients' GAN training state (Adam moments, random generators, EP sites) stays on the "
                           "clients, which keep it across runs only with run.model_cache")
            else:
                missing = server.clients_missing_state(STATE, store, turns)
                if missing:
                    problem = f"clients {missing} no longer hold their GAN state"
                    server.forget_client_state(STATE, store)  # the others' are of no use now
            if problem is not None:
                server.events.emit("warning", f"restarting from turn 0: {problem}", method=server.label)
                return None
        checkpoint = server.resume_checkpoint()
        if checkpoint is not None and checkpoint.round < self.params.rounds:
            continuing = sorted(int(c) for c, _ in checkpoint.meta.get("state_turns", []))
            server.events.emit("info", f"{len(continuing)} clients continue from the GAN state they kept themselves",
                               method=server.label, round=checkpoint.round, clients=continuing)
        return checkpoint

    @staticmethod
    def accept(server: ServerContext, gathered: Gathered[Any], reference: dict[str, np.ndarray]) -> dict[int, Update]:
        """:meth:`ServerContext.accept_updates` (NaN / Inf, keys, shapes, metrics) plus: EP variances must be > 0."""
        updates = server.accept_updates(gathered, reference)
        kept = {}
        for client, update in updates.items():
            bad = next((k for k, v in update.params.items() if k.startswith("ep_var/") and not (v > 0).all()), None)
            if bad is None:
                kept[client] = update
            else:
                server.events.emit("update_rejected", f"{bad}: non-positive EP variances", method=server.label, client=client)
        need = max(min(server.federation.policy.min_clients, len(gathered.results) + len(gathered.failures)), 1)
        if len(kept) < need:
            raise RunFailure(f"{server.label}: {len(kept)} valid client updates, need {need}; see the update_rejected events")
        return kept


@register_method
class EPGANOracle(Method):
    name = "epgan-oracle"
    aliases = ("epgan-centralized",)
    Params = EPGANOracleParams
    params: EPGANOracleParams
    summary = "ORACLE: the EP-GAN backbone trained on all clients' data pooled (the paper's centralised column)"
    reference = references.EPGAN
    oracle = True
    # A checkpoint after each block of local_epochs epochs (the loop's unit); ``--resume`` continues after the last one
    # (through ServerContext.resume_checkpoint, which does not look at multi_round). multi_round stays False: its other
    # effect is to make the method an ASHA target in a sweep, with a budget that defaults to ``rounds`` turns, and the
    # oracle counts epochs, not turns (its progress events carry no round).

    def run(self, server: ServerContext) -> MethodResult:
        p: EPGANOracleParams = self.params
        data = server.pooled_train()
        X = _flat(data.X)
        settings = p.settings(X.shape[1])
        scorer = make_scorer(server, p)
        trainer = GANTrainer(settings, seed=server.step_seed("init"), device=server.device)
        chunk = max(p.local_epochs, 1)
        done = 0
        metrics: dict[str, float] = {}
        losses: dict[str, float] = {}
        checkpoint = server.resume_checkpoint()
        if checkpoint is not None:
            # Everything the trainer carries between blocks: its parameters, Adam moments, random generator, iteration
            # counter and EP site (its own factor, which is also the global prior here). Its EP prior is not: each
            # block's EP step recomputes it before training. The oracle trains on the server, with every client's data
            # pooled (an upper reference, not a federated method), so its training state is the server's own and is
            # kept in its checkpoint, unlike a federated EP-GAN client's (which stays on the client, see EPGAN.run).
            done = checkpoint.round
            trainer.set_params(checkpoint.params)
            _load_gan_state(trainer, checkpoint.state)
            metrics, losses = dict(checkpoint.meta.get("metrics", {})), dict(checkpoint.meta.get("losses", {}))
        while done < p.epochs:
            epochs = min(chunk, p.epochs - done)
            if settings.uses_ep and done > 0:
                # One "client" holding everything: the global prior is its own factor (a product of one factor). As in
                # the federation, the prior starts at the generator after the first chunk of epochs (the warm-up).
                if trainer.site is None:
                    ep = initial_ep_prior(trainer, p.components, p.prior_var, p.component_spread, server.rng("ep-init"))
                    trainer.update_ep(X, *ep, damping=p.damping, site_mode="paper")
                else:
                    trainer.update_ep(X, *trainer.site, damping=p.damping, site_mode="paper")
            stats = trainer.train(X, epochs)
            done += epochs
            losses = {"d_loss": stats["d_loss"], "g_loss": stats["g_loss"]}
            metrics = scorer(trainer)
            server.log(done, {**losses, **metrics})
            server.progress(f"epoch {done}/{p.epochs}", metrics={k: round(v, 4) for k, v in metrics.items()})
            server.save_checkpoint(done, trainer.get_params(), _gan_state(trainer), {"metrics": metrics, "losses": losses})
        if not metrics:
            metrics = dict(losses)
        snap = scorer.snapshot(trainer)
        return MethodResult(metrics, trainer.get_params(), info={
            "note": "trained on all clients' data pooled: infeasible in a federation, an upper reference",
            "backbone": p.backbone, "epochs": p.epochs, "num_examples": len(X), "maps": {"oracle": snap} if snap else {},
            "truth": scorer.truth_snapshot(), "real_data_scores": scorer.reference()})
