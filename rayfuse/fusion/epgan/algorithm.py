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
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from rayfuse.errors import InputError, NonFiniteError, key_error
from rayfuse.fusion import references
from rayfuse.fusion.epgan.ep import gaussian_product
from rayfuse.fusion.epgan.nets import GANSettings, GANTrainer
from rayfuse.method import (
    ClientContext,
    ClientRounds,
    KeptState,
    Method,
    MethodCase,
    MethodParams,
    MethodResult,
    MethodTags,
    RunSetup,
    ServerContext,
    Update,
    client_step,
    register_method,
)
from rayfuse.seeding import derive_seed
from rayfuse.updates.aggregate import weighted_average

__all__ = [
    "EPGAN",
    "EPGANOracle",
    "EPGANParams",
    "EPGANOracleParams",
    "train_gan",
    "combine_factors",
    "grid_points",
    "mixture_density",
    "density_mse",
    "score_toy",
]


# -----------------------------------------------------------------------------------------------------------------
# Parameters


class EPGANParams(MethodParams):
    backbone: Literal["wgan", "probgan", "ep-bgan", "ep-probgan"] = Field(
        "ep-probgan", description="wgan / probgan: the FedAvg baselines; ep-bgan, ep-probgan: with the EP prior"
    )
    components: int = Field(1, ge=1, le=64, description="J, EP-prior mixture components (J > 1: Mixture-EP-ProbGAN)")
    num_generators: int = Field(4, ge=1, le=64, description="generator samples N (Bayesian backbones)")
    num_discriminators: int = Field(4, ge=1, le=64, description="discriminator samples M (Bayesian backbones)")
    latent_dim: int = Field(2, ge=1, description="z dimension (UNRECOVERABLE for the toy set; PROPOSED 2)")
    hidden: int = Field(32, ge=2, description="hidden width of G and D (toy: 32)")
    out_activation: Literal["none", "sigmoid"] = Field("none", description="generator output: none (toy) or sigmoid (images in [0, 1])")
    lr_g: float = Field(2e-4, gt=0, description="Adam learning rate of the generator(s) (betas 0.5, 0.999)")
    lr_d: float = Field(1e-4, gt=0, description="Adam learning rate of the discriminator(s) (betas 0.5, 0.999)")
    batch_size: int = Field(128, ge=2, description="minibatch size of GAN training (a last batch under 2 samples is skipped)")
    d_steps: int = Field(1, ge=1, description="critic updates per generator update")
    gp_weight: float = Field(10.0, ge=0, description="WGAN-GP penalty weight")
    noise_weight: float = Field(3e-2, ge=0, description="SGHMC noise-loss weight (Bayesian backbones)")
    sghmc_alpha: float = Field(0.01, gt=0, description="SGHMC alpha: noise std sqrt(2 alpha)")
    hist_weight: float = Field(1.0, ge=0, description="weight of the discriminator-history (PSA) term")
    hist_every: int = Field(10, ge=1, description="iterations between discriminator-history updates")
    lambda_ep: float = Field(1e-3, ge=0, description="weight of the EP-prior term in the generator loss")
    f_weight: float = Field(
        1.0,
        ge=0,
        description="weight of f's objective in the critic loss (its objective is UNRECOVERABLE; 0: f stays at its initialisation)",
    )
    prior_var: float = Field(1.0, gt=0, description="variance of the initial global EP prior")
    component_spread: float = Field(0.05, ge=0, description="std of the seeded offsets of components j > 0 at initialisation")
    damping: float = Field(0.5, gt=0, le=1, description="damping rho of the EP factor update (natural parameters)")
    site: Literal["paper", "ep"] = Field(
        "paper",
        description="paper: clients upload the tilted Gaussian (Algorithm 2); "
        "ep: they upload tilted / cavity, the server multiplies in the initial prior once",
    )
    warmup_epochs: int = Field(50, ge=0, description="local epochs before the first aggregation")
    rounds: int = Field(10, ge=1, le=100_000, description="FedAvg turns after the warm-up")
    local_epochs: int = Field(20, ge=0, description="local epochs per turn")
    beta: float = Field(0.5, ge=0, le=1, description="historical interpolation after each local epoch (1: off)")
    grid: int = Field(100, ge=10, le=1000, description="grid points per axis of the D-MSE map")
    eval_samples: int = Field(10_000, ge=100, description="generator samples for the sample scores")

    @model_validator(mode="after")
    def _components_need_ep(self) -> EPGANParams:
        if self.components > 1 and not self.backbone.startswith("ep-"):
            raise key_error(
                "components", f"1 for backbone {self.backbone!r} (mixture components need an EP backbone), got {self.components}"
            )
        return self

    def settings(self, data_dim: int) -> GANSettings:
        return GANSettings(
            backbone=self.backbone,
            data_dim=data_dim,
            latent_dim=self.latent_dim,
            hidden=self.hidden,
            num_generators=self.num_generators,
            num_discriminators=self.num_discriminators,
            components=self.components,
            out_activation=self.out_activation,
            lr_g=self.lr_g,
            lr_d=self.lr_d,
            batch_size=self.batch_size,
            d_steps=self.d_steps,
            gp_weight=self.gp_weight,
            noise_weight=self.noise_weight,
            sghmc_alpha=self.sghmc_alpha,
            hist_weight=self.hist_weight,
            hist_every=self.hist_every,
            lambda_ep=self.lambda_ep,
            f_weight=self.f_weight,
        )


class EPGANOracleParams(EPGANParams):
    epochs: int = Field(200, ge=1, description="epochs on the pooled data (the paper's centralised runs: 200)")


# -----------------------------------------------------------------------------------------------------------------
# Client side


def _flat(X: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(X.reshape(len(X), -1), dtype=np.float32)


STATE = "epgan-state"  # the kind of client state (:class:`rayfuse.client.ClientStateStore`) EP-GAN clients keep
#: each client's GAN training state, kept by the client across turns (and in its own storage with ``run.model_cache``)
KEPT_GAN = KeptState(STATE, "GAN state", unit="turn", key="epgan/{name}")


@client_step("epgan.train")
def train_gan(
    ctx: ClientContext,
    broadcast: dict[str, Any],
    *,
    label: str,
    round: int,
    settings: dict[str, Any],
    epochs: int,
    beta: float,
    damping: float,
    site: str,
    state_turn: int | None = None,
    store: str | None = None,
) -> Update:
    """One turn of a client (Algorithm 2, lines 5-8): EP step, local GAN training, upload.

    The client's GAN (optimiser states, random generator, iteration counter, EP site) lives in ``ctx.state`` between
    turns and never travels: the update carries the parameters (``G/*``, ``D/*``, ``pi/logits``) and, on EP backbones,
    the factor (``ep_mean/*``, ``ep_var/*``), nothing else. The discriminator history (PSA) is a buffer of D: it travels
    with D's parameters and is averaged. ``broadcast``: ``params`` and, once initialised, the global EP prior
    ``ep_mean`` / ``ep_var`` (arrays with a leading component axis).

    ``state_turn``: the turn the server's checkpoint says this client's GAN state belongs to (its last turn that came
    back; ``None``: none yet, a fresh trainer from the shared initialisation's seed). With ``store`` (and
    ``run.model_cache`` on the client) the client also writes its state to its own storage after the turn, and reads it
    back when memory does not hold that turn (a resumed run's or a restarted actor's client; :data:`KEPT_GAN`).
    """

    def fresh() -> GANTrainer:
        return GANTrainer(GANSettings(**settings), seed=ctx.step_seed(label, "gan"), device=ctx.device)

    def load(saved: dict[str, np.ndarray]) -> GANTrainer:
        trainer = fresh()
        _load_gan_state(trainer, saved)
        return trainer

    trainer = KEPT_GAN.take(ctx, label, state_turn, store, fresh=fresh, load=load)
    KEPT_GAN.hold(ctx, label, trainer)  # until this turn is done: a half-trained trainer is no turn's state
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
    KEPT_GAN.keep(ctx, label, trainer, round, store, previous=state_turn, arrays=_gan_state)
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


def _prefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays under ``prefix``, the prefix removed (copies: broadcasts and loaded checkpoints may be read-only)."""
    return {k[len(prefix) :]: np.array(v) for k, v in arrays.items() if k.startswith(prefix)}


# -----------------------------------------------------------------------------------------------------------------
# Server math


def combine_factors(
    factors: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
    prior: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
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


def score_toy(
    critic: np.ndarray, samples: np.ndarray, truth: np.ndarray, centres: np.ndarray, variances: np.ndarray, *, grid: int, limit: float = 5.0
) -> dict[str, float]:
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
    is trained on ImageNet); no method sees it. With ``data.silos`` no process holds a whole dataset: the instrument
    trains on the server's own data instead, ``data.public`` if given, else ``data.test`` (the set the scores are
    computed against anyway).
    """

    def __init__(self, server: ServerContext, params: EPGANParams) -> None:
        import torch

        from rayfuse.models import train_model
        from rayfuse.models.registry import MLP

        X, y, self.shape, self.num_classes = self._instrument_data(server)
        self.samples = min(params.eval_samples, 2000)
        self.seed = derive_seed(server.seed, "epgan-eval")  # the same instrument and noise for every method of a run
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.classifier = MLP(int(np.prod(self.shape)), [128], self.num_classes)
        train_model(self.classifier, X, y, epochs=40, batch_size=64, lr=1e-3, seed=self.seed)
        self.classifier.eval()
        self.real, real_proba = self._features(_flat(server.data.test.X))
        share = np.bincount(real_proba.argmax(1), minlength=self.num_classes) / len(real_proba)
        self._reference = {"is": inception_score(real_proba), "classes": float((share >= 0.05).sum())}

    @staticmethod
    def _instrument_data(server: ServerContext) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], int]:
        """The classifier's training data, the input shape and the class count: the whole dataset on a simulation; with
        ``data.silos``, the server's public sample if it has one, else its test set (:meth:`EPGAN.check` refuses a
        silo run with no ``data.test``)."""
        if server.data.data_cfg.is_silos:
            own = server.data.public if len(server.data.public) else server.data.test
            return own.X, own.y, tuple(server.data.input_shape), server.data.num_classes
        from rayfuse.data.roles import load_dataset_from_config

        dataset = load_dataset_from_config(server.data.data_cfg)
        return dataset.X, dataset.y, dataset.input_shape, dataset.num_classes

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
    if server.data.data_cfg.dataset != "gaussians4" and len(server.data.input_shape) == 3:
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
        data = server.data.data_cfg
        if data.dataset == "gaussians4" and int(np.prod(server.data.input_shape)) == 2:
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
    means = {k[len("ep_mean/") :]: v for k, v in params.items() if k.startswith("ep_mean/")}
    variances = {k[len("ep_var/") :]: v for k, v in params.items() if k.startswith("ep_var/")}
    return model, ((means, variances) if means else None)


def initial_ep_prior(
    trainer: GANTrainer, components: int, prior_var: float, spread: float, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
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


def _positive_ep_variances(client: int, update: Update) -> str | None:
    """EP-GAN's own check of a client update (besides NaN / Inf, keys, shapes, metrics): EP variances must be > 0."""
    bad = next((k for k, v in update.params.items() if k.startswith("ep_var/") and not (v > 0).all()), None)
    return None if bad is None else f"{bad}: non-positive EP variances"


@dataclass
class EPGANState:
    """EP-GAN's server state between turns, all of it in the turn checkpoint (nothing of any client's).

    ``params``: the global G and D (every ProbGAN sample, D's PSA history buffers and the mixture logits included);
    ``ep_mean`` / ``ep_var``: the global EP prior (every component), ``ep0_*`` the initial one (site mode "ep"
    multiplies it in each turn); the maps for the report, the last losses, the rejection count; ``state_turns``: per
    client, the turn its GAN state (kept by the client, :data:`KEPT_GAN`) belongs to.
    """

    params: dict[str, np.ndarray]
    ep_mean: dict[str, np.ndarray] | None = None
    ep_var: dict[str, np.ndarray] | None = None
    ep0_mean: dict[str, np.ndarray] | None = None
    ep0_var: dict[str, np.ndarray] | None = None
    maps: dict[str, Any] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    rejected: int = 0
    state_turns: ClientRounds = field(default_factory=KEPT_GAN.rounds)

    def reference(self, uses_ep: bool) -> dict[str, np.ndarray]:
        """The layout every client update must match: the global model and, once initialised, the EP factor's."""
        reference = dict(self.params)
        if self.ep_mean is not None and self.ep_var is not None and uses_ep:
            reference.update({f"ep_mean/{k}": v for k, v in self.ep_mean.items()})
            reference.update({f"ep_var/{k}": v for k, v in self.ep_var.items()})
        return reference


#: the GAN methods' tiny runs (their ``test_case``, rayfuse.testing): four Gaussian modes, one per client
_TINY_DATA: dict[str, Any] = {
    "data": {"dataset": "gaussians4", "options": {"n_per_mode": 60}, "val_size": 0.0},
    "partition": {"method": "labels", "num_clients": 4, "groups": [[0], [1], [2], [3]]},
}
_TINY_GAN: dict[str, Any] = {"warmup_epochs": 1, "rounds": 2, "local_epochs": 1, "batch_size": 32, "grid": 20, "eval_samples": 200}


@register_method
class EPGAN(Method[EPGANParams, EPGANState]):
    name = "epgan"
    tags = MethodTags(
        fuses="posteriors",  # the generators' and discriminators' EP posteriors (product of Gaussians)
        federated_evaluation=False,  # generative scores (FD / IS / D-MSE) against the server's test set: evaluation central only
        multi_round=True,  # a checkpoint after the warm-up (turn 0) and after each turn; --resume continues after the last
        public_labels=True,  # with data.silos its image-score classifier trains on data.public's labels (if given)
        # public_sample stays false: a simulation's public sample is never read (the scores' classifier trains on the
        # whole dataset), so none is drawn for it
    )
    test_case = MethodCase(_TINY_GAN, _TINY_DATA, step="epgan.train", fused=None, client_state=True)
    Params = EPGANParams
    summary = "EP-GAN: federated (Bayesian) GANs, FedAvg of G and D plus a product-of-Gaussians EP prior (Wu et al. 2022)"
    reference = references.EPGAN

    @classmethod
    def check(cls, params: EPGANParams, setup: RunSetup) -> None:
        """With ``data.silos``, a server test set (``data.test``): EP-GAN scores its generator centrally against it, and
        its evaluation classifier (image data) trains on ``data.public``, else on ``data.test``."""
        if setup.data.is_silos and setup.data.test is None:
            raise InputError(
                "data.test",
                "the server's test set with data.silos (EP-GAN scores its generator centrally against it, "
                "evaluation: central; its image-score classifier trains on data.public, else on data.test)",
                "none given",
                "give data.test: {dataset: npz, path: ...} and evaluation: central",
            )

    def run(self, server: ServerContext) -> MethodResult:
        # Each client's GAN state (Adam moments of G and D, its random generator, its iteration counter -- the PSA
        # schedule -- and its EP site) stays on the client (KEPT_GAN): gradient statistics of private data never travel.
        # Re-initialising it every turn instead would change the method (Adam restarts) for every run.
        # Randomness: the server draws only at turn 0 (the initial prior's offsets, server.rng("ep-init")); each client
        # draws from its trainer's generator, seeded once per client (ctx.step_seed(label, "gan")) and carried across
        # turns as part of its state rather than re-derived from the turn number: re-seeding per turn would change
        # every uninterrupted run's numbers (docs/methods/epgan.md's results).
        p = self.params
        settings = p.settings(int(np.prod(server.data.input_shape)))
        fed = server.federation
        scorer = make_scorer(server, p)
        model = GANTrainer(settings, seed=server.step_seed("init"), device=server.models.device)  # the shared initialisation
        show = {0, 1, (p.rounds + 1) // 2, p.rounds}

        def score(turn: int) -> dict[str, float]:
            metrics = scorer(model)
            snap = scorer.snapshot(model) if turn in show else None
            if snap is not None:
                state.maps[str(turn)] = snap
            return metrics

        rounds = server.rounds(EPGANState(model.get_params()), first=0, last=p.rounds, evaluate=score, unit="turn")
        state = rounds.state
        if rounds.resumed:
            model.set_params(state.params)
        step_args = dict(
            label=server.label, settings=asdict(settings), beta=p.beta, damping=p.damping, site=p.site, store=state.state_turns.store
        )
        for turn in rounds:  # turn 0: the warm-up; turns 1..rounds: Algorithm 2
            broadcast = fed.put({"params": state.params, "ep_mean": state.ep_mean, "ep_var": state.ep_var})
            epochs = p.warmup_epochs if turn == 0 else p.local_epochs
            gathered = fed.gather(
                [
                    call
                    for client in fed.client_ids
                    for call in fed.map(
                        train_gan,
                        broadcast,
                        clients=[client],
                        round=turn,
                        epochs=epochs,
                        state_turn=state.state_turns.get(client),
                        **step_args,
                    )
                ]
            )
            state.state_turns.moved(gathered.results, turn)  # accepted or not, its GAN state moved on to this turn
            updates = self.accept(server, gathered, state.reference(settings.uses_ep))
            state.rejected += len(gathered.results) - len(updates)
            weights = [u.num_examples for u in updates.values()]
            parts = [_split(u.params) for u in updates.values()]
            state.params = weighted_average([part[0] for part in parts], weights)  # Algorithm 2, line 9
            model.set_params(state.params)
            if settings.uses_ep:
                if state.ep_mean is None:  # after the warm-up: the global EP prior starts at the averaged generator
                    state.ep_mean, state.ep_var = initial_ep_prior(
                        model, p.components, p.prior_var, p.component_spread, server.rng("ep-init")
                    )
                    state.ep0_mean, state.ep0_var = state.ep_mean, state.ep_var
                else:  # Algorithm 2, line 10 (corrected variance)
                    state.ep_mean, state.ep_var = combine_factors(
                        [part[1] for part in parts if part[1] is not None],
                        (state.ep0_mean, state.ep0_var) if p.site == "ep" else None,  # type: ignore[arg-type]
                    )
            row = {
                "clients": float(len(updates)),
                "d_loss": float(np.average([u.metrics["d_loss"] for u in updates.values()], weights=weights)),
                "g_loss": float(np.average([u.metrics["g_loss"] for u in updates.values()], weights=weights)),
                "client_seconds": float(np.mean([u.metrics["train_seconds"] for u in updates.values()])),
            }
            state.losses = {"d_loss": row["d_loss"], "g_loss": row["g_loss"]}
            if state.ep_var is not None:
                # by sorted key: a resumed run's prior comes from stored states, keyed in another order than a fresh one's
                row["ep_var_mean"] = float(np.mean([state.ep_var[k].mean() for k in sorted(state.ep_var)]))
            del broadcast, gathered
            rounds.log(row)
        metrics = rounds.metrics or dict(state.losses)  # no toy scores for this dataset: the last losses
        final = dict(state.params)
        if state.ep_mean is not None and state.ep_var is not None:
            final.update({f"ep_mean/{k}": v.astype(np.float32) for k, v in state.ep_mean.items()})
            final.update({f"ep_var/{k}": v.astype(np.float32) for k, v in state.ep_var.items()})
        return MethodResult(
            metrics,
            final,
            info={
                "rounds": p.rounds,
                "backbone": p.backbone,
                "components": p.components,
                "rejected_updates": state.rejected,
                "maps": state.maps,
                "truth": scorer.truth_snapshot(),
                "real_data_scores": scorer.reference(),
            },
        )

    @staticmethod
    def accept(server: ServerContext, gathered: Any, reference: dict[str, np.ndarray]) -> dict[int, Update]:
        """The update pipeline's validation, ``server.updates.accept`` (NaN / Inf, keys, shapes, metrics) plus: EP variances must be > 0."""
        return server.updates.accept(gathered, reference, check=_positive_ep_variances)


@dataclass
class EPGANOracleState:
    """The oracle's round state: the trainer's parameters, what it carries between blocks besides them
    (:func:`_gan_state`: Adam moments, random generator, iteration counter, EP site) and the last block's losses."""

    params: dict[str, np.ndarray]
    gan: dict[str, np.ndarray] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)


@register_method
class EPGANOracle(Method[EPGANOracleParams, "EPGANOracleState"]):
    name = "epgan-oracle"
    tags = MethodTags(
        fuses="nothing",
        needs_dataset=True,  # reads the whole dataset (data.dataset): not with data.silos
        federated_evaluation=False,  # generative scores (FD / IS / D-MSE) against the server's test set: evaluation central only
        oracle=True,
    )
    # the oracle trains on the pooled data on the server, a checkpoint per block of local_epochs epochs: interrupted at
    # its second block's log, after block 1's checkpoint
    test_case = MethodCase({**_TINY_GAN, "epochs": 3}, _TINY_DATA, call=2, fused=None, checkpoints=True)
    aliases = ("epgan-centralized",)
    Params = EPGANOracleParams
    summary = "ORACLE: the EP-GAN backbone trained on all clients' data pooled (the paper's centralised column)"
    reference = references.EPGAN
    # A checkpoint after each block of local_epochs epochs (the round loop, its rounds numbered by epochs done);
    # ``--resume`` continues after the last one (the loop resumes whatever its tags say). It is not tagged multi_round:
    # that would make it an ASHA target in a sweep, with a budget that defaults to ``rounds`` turns, and the oracle
    # counts epochs, not turns.

    def run(self, server: ServerContext) -> MethodResult:
        p = self.params
        data = server.data.pooled_train()
        X = _flat(data.X)
        settings = p.settings(X.shape[1])
        scorer = make_scorer(server, p)
        trainer = GANTrainer(settings, seed=server.step_seed("init"), device=server.models.device)
        chunk = max(p.local_epochs, 1)
        # Rounds are epochs done, one every ``chunk`` (and the last); each block's losses go in the row, its scores are
        # the loop's evaluation (the progress line shows the scores alone, as before: the losses are quiet).
        rounds = server.rounds(
            EPGANOracleState(trainer.get_params()),
            last=p.epochs,
            evaluate=lambda done: scorer(trainer),
            unit="epoch",
            quiet=("d_loss", "g_loss"),
            step=chunk,
        )
        state = rounds.state
        if rounds.resumed:
            # Everything the trainer carries between blocks: its parameters, Adam moments, random generator, iteration
            # counter and EP site (its own factor, which is also the global prior here). Its EP prior is not: each
            # block's EP step recomputes it before training. The oracle trains on the server, with every client's data
            # pooled (an upper reference, not a federated method), so its training state is the server's own and is
            # kept in its round state, unlike a federated EP-GAN client's (which stays on the client, see EPGAN.run).
            trainer.set_params(state.params)
            _load_gan_state(trainer, state.gan)
        done = rounds.start - 1  # epochs trained so far (a resumed run: the checkpoint's)
        for epoch in rounds:
            if settings.uses_ep and done > 0:
                # One "client" holding everything: the global prior is its own factor (a product of one factor). As in
                # the federation, the prior starts at the generator after the first chunk of epochs (the warm-up).
                if trainer.site is None:
                    ep = initial_ep_prior(trainer, p.components, p.prior_var, p.component_spread, server.rng("ep-init"))
                    trainer.update_ep(X, *ep, damping=p.damping, site_mode="paper")
                else:
                    trainer.update_ep(X, *trainer.site, damping=p.damping, site_mode="paper")
            stats = trainer.train(X, epoch - done)
            done = epoch
            state.params, state.gan = trainer.get_params(), _gan_state(trainer)
            state.losses = {"d_loss": stats["d_loss"], "g_loss": stats["g_loss"]}
            rounds.log(dict(state.losses))
        metrics = rounds.metrics or dict(state.losses)
        snap = scorer.snapshot(trainer)
        return MethodResult(
            metrics,
            trainer.get_params(),
            info={
                "note": "trained on all clients' data pooled: infeasible in a federation, an upper reference",
                "backbone": p.backbone,
                "epochs": p.epochs,
                "num_examples": len(X),
                "maps": {"oracle": snap} if snap else {},
                "truth": scorer.truth_snapshot(),
                "real_data_scores": scorer.reference(),
            },
        )
