"""The GAN backbones of EP-GAN (Wu et al., "Unsupervised Federated Learning with Expectation-Propagation Prior GAN",
ICLR 2022 submission; ``docs/methods/epgan.md``), small MLPs that train fast on a CPU.

One trainer, :class:`GANTrainer`, covers the paper's five backbones through :class:`GANSettings`:

==========================  =========  ==================  ===========  ===========  ===============
backbone                    samples    SGHMC noise loss    D history    EP prior     components J
==========================  =========  ==================  ===========  ===========  ===============
``wgan`` (WGAN-GP)          1 G, 1 D   no                  no           no           -
``probgan``                 N G, M D   yes                 yes (PSA)    no           -
``ep-bgan``                 N G, M D   yes                 no           yes          1
``ep-probgan``              N G, M D   yes                 yes (PSA)    yes          1
Mixture-EP-ProbGAN          N G, M D   yes                 yes (PSA)    yes          J > 1
==========================  =========  ==================  ===========  ===========  ===============

* **Parameter sharing** (App. F.2.3): the ``N`` generator samples have their own first layer and share the last two;
  the ``M`` discriminator samples share the first two layers and have their own last layer (one output each, averaged,
  as ProbGAN's ``D(x).mean(-1)``). A batch of ``z`` is split into ``N`` chunks, one per generator sample.
* **SGHMC** (Algorithm 1) as ProbGAN implements it: Adam on the loss plus a random linear "noise loss"
  ``sum_p p * n, n ~ N(0, 2 alpha)`` weighted 3e-2 ([PROBGAN : train_utils.py ``noise_loss``]).
* **PSA** (eq. 47, App. E.3; [PROBGAN : train.py]): the running average of the discriminator's last layer, updated every 10 iterations
  (``w_hist <- (1 - 1/n) w_hist + w / n``; no gradient), and the generator loss adds ``phi3(D_hist(G(z)))``.
* **EP prior** (eq. 45, corrected sign): ``L_ep = sum_n sum_i (m_i - theta_{n,i})^2 / (2 s_i)`` over every generator
  parameter ``i`` of each sample ``n``; with ``J`` components (eq. 46)
  ``L_ep = -log sum_j pi_j exp(-E_j)`` computed with ``logsumexp``, ``pi = gumbel_softmax(logits, tau=1)``.
  The generator loss is ``L_gan + lambda_ep L_ep``.
* **Likelihood network f** (eq. 5): the discriminator's shared first two layers plus an independent linear output
  layer with ``J`` outputs. Its objective is not in the paper (UNRECOVERABLE); docs/methods/epgan.md's proposal is used:
  maximise ``sum_j log sigma(f_j(x) mean(m_j))`` on real data, jointly with the discriminator.

Objective: WGAN-GP everywhere (the toy experiment's objective, App. F.2.3), ``lambda_gp = 10``:
``L_D = -D(x) + D(G(z)) + 10 (||grad D(x_hat)|| - 1)^2``, ``L_G = -D(G(z))``.

Parameters leave the trainer as ``dict[str, numpy.ndarray]`` with keys ``G/<name>`` and ``D/<name>`` (parameters and
BatchNorm buffers, what FedAvg averages). The EP prior covers the generator's *parameters* (not its buffers); a
per-sample tensor (the first layer, shape ``(N, ...)``) has a prior of shape ``(...)`` shared by the ``N`` samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rayfuse.fusion.epgan.ep import cavity, site_update, tilted_moments

__all__ = ["BACKBONES", "GANSettings", "Generator", "Discriminator", "GANTrainer", "ep_energy", "noise_loss", "gradient_penalty"]

BACKBONES = ("wgan", "probgan", "ep-bgan", "ep-probgan")


@dataclass(frozen=True)
class GANSettings:
    """Everything that defines one backbone and its local training (the method parameters, validated upstream)."""

    backbone: str = "ep-probgan"
    data_dim: int = 2
    latent_dim: int = 2
    hidden: int = 32
    num_generators: int = 4
    num_discriminators: int = 4
    components: int = 1
    out_activation: str = "none"  # "sigmoid" for images in [0, 1]
    lr_g: float = 2e-4
    lr_d: float = 1e-4
    batch_size: int = 128
    d_steps: int = 1
    gp_weight: float = 10.0
    noise_weight: float = 3e-2
    sghmc_alpha: float = 0.01
    hist_weight: float = 1.0
    hist_every: int = 10
    lambda_ep: float = 1e-3
    f_weight: float = 1.0

    @property
    def bayesian(self) -> bool:
        return self.backbone != "wgan"

    @property
    def uses_ep(self) -> bool:
        return self.backbone.startswith("ep-")

    @property
    def uses_history(self) -> bool:
        return self.backbone in ("probgan", "ep-probgan")

    @property
    def n_gen(self) -> int:
        return self.num_generators if self.bayesian else 1

    @property
    def n_disc(self) -> int:
        return self.num_discriminators if self.bayesian else 1


class Generator(nn.Module):
    """``N`` MLP generators ``z -> hidden -> hidden -> data`` sharing their last two layers (BatchNorm, ReLU)."""

    def __init__(self, latent_dim: int, hidden: int, out_dim: int, num_samples: int = 1, out_activation: str = "none") -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(latent_dim)  # nn.Linear's default initialisation, per sample
        self.first_weight = nn.Parameter(torch.empty(num_samples, hidden, latent_dim).uniform_(-bound, bound))
        self.first_bias = nn.Parameter(torch.empty(num_samples, hidden).uniform_(-bound, bound))
        self.bn1 = nn.BatchNorm1d(hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.bn2 = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, out_dim)
        self.num_samples = num_samples
        self.out_activation = out_activation

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` ``(B, latent)`` split into ``N`` consecutive chunks, chunk ``n`` through generator sample ``n``."""
        chunks = z.tensor_split(self.num_samples)
        h = torch.cat([F.linear(c, self.first_weight[n], self.first_bias[n]) for n, c in enumerate(chunks)])
        h = F.relu(self.bn1(h))
        h = F.relu(self.bn2(self.mid(h)))
        x = self.out(h)
        return torch.sigmoid(x) if self.out_activation == "sigmoid" else x


class Discriminator(nn.Module):
    """``M`` critics sharing ``x -> hidden (BatchNorm, ReLU) -> hidden (ReLU)``, one linear output each, averaged.

    ``hist_weight`` / ``hist_bias`` hold ProbGAN's running average of the last layer (PSA; buffers, no gradient).
    ``f_head`` is EP-GAN's likelihood network's own output layer (``J`` outputs) on the shared features.
    """

    hist_weight: torch.Tensor  # buffers (register_buffer): declared so the checker knows they are tensors
    hist_bias: torch.Tensor
    hist_count: torch.Tensor

    def __init__(self, in_dim: int, hidden: int, num_samples: int = 1, components: int = 0) -> None:
        super().__init__()
        self.l1 = nn.Linear(in_dim, hidden)
        self.bn1 = nn.BatchNorm1d(hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_samples)
        self.f_head = nn.Linear(hidden, components) if components else None
        self.register_buffer("hist_weight", self.head.weight.detach().clone())
        self.register_buffer("hist_bias", self.head.bias.detach().clone())
        self.register_buffer("hist_count", torch.ones((), dtype=torch.float32))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.l2(F.relu(self.bn1(self.l1(x.flatten(1))))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).mean(-1)

    def history(self, x: torch.Tensor) -> torch.Tensor:
        """The critic with the historical average of the last layer (eq. 47's sum over past discriminators)."""
        return F.linear(self.features(x), self.hist_weight, self.hist_bias).mean(-1)

    @torch.no_grad()
    def update_history(self) -> None:
        self.hist_count += 1.0
        rate = 1.0 / self.hist_count
        # torch takes a 0-dim tensor as alpha; its stub admits only Python numbers
        self.hist_weight.mul_(1.0 - rate).add_(self.head.weight, alpha=rate)  # type: ignore[arg-type]
        self.hist_bias.mul_(1.0 - rate).add_(self.head.bias, alpha=rate)  # type: ignore[arg-type]

    def likelihood_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``f(x)``, shape ``(B, J)`` (eq. 5)."""
        if self.f_head is None:
            raise RuntimeError("this discriminator has no likelihood head (not an EP backbone)")
        return self.f_head(self.features(x))


def noise_loss(params: Iterable[torch.Tensor], std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """ProbGAN's SGHMC noise: ``sum_p sum(p * n)``, ``n ~ N(0, std^2)`` drawn afresh (``train_utils.noise_loss``)."""
    total = torch.zeros(())
    for p in params:
        total = total + (p * (torch.randn(p.shape, generator=generator) * std).to(p.device)).sum()
    return total


def gradient_penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """WGAN-GP: ``E (||grad_x D(x_hat)||_2 - 1)^2`` on random interpolates ``x_hat`` (Gulrajani et al. 2017)."""
    eps = torch.rand((real.shape[0],) + (1,) * (real.dim() - 1), generator=generator).to(real.device)
    mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
    return ((grad.flatten(1).norm(dim=1) - 1.0) ** 2).mean()


def ep_energy(
    named: Mapping[str, torch.Tensor],
    means: dict[str, torch.Tensor],
    half_precisions: dict[str, torch.Tensor],
    num_samples: int,
    per_sample: set[str],
) -> torch.Tensor:
    """``E_j = sum_n sum_i (m_{j,i} - theta_{n,i})^2 / (2 s_{j,i})`` for each component ``j``, shape ``(J,)``.

    ``means[name]`` / ``half_precisions[name]`` (``1 / (2 s)``) have a leading component axis ``J``. A per-sample
    tensor (leading axis ``N``) contributes each sample's own values; a shared tensor is part of every sample and so
    counts ``N`` times (eq. 45 sums over the ``N`` samples of the whole generator).
    """
    energy = None
    for name, theta in named.items():
        m, hp = means[name], half_precisions[name]
        if name in per_sample:
            term = ((theta.unsqueeze(0) - m.unsqueeze(1)) ** 2 * hp.unsqueeze(1)).flatten(1).sum(1)
        else:
            term = num_samples * ((theta.unsqueeze(0) - m) ** 2 * hp).flatten(1).sum(1)
        energy = term if energy is None else energy + term
    assert energy is not None
    return energy


class GANTrainer:
    """One client's GAN (or the oracle's): models, optimisers, the discriminator history and the client's EP factor.

    Parameters
    ----------
    settings : GANSettings
    seed : int
        Seeds the initialisation (give every client the same seed for a shared initialisation) and the training noise.
    device : str
    """

    def __init__(self, settings: GANSettings, seed: int, device: str = "cpu") -> None:
        self.settings = s = settings
        self.device = device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.G = Generator(s.latent_dim, s.hidden, s.data_dim, s.n_gen, s.out_activation)
            self.D = Discriminator(s.data_dim, s.hidden, s.n_disc, s.components if s.uses_ep else 0)
            # Mixture weights pi = gumbel_softmax(logits): learnable logits of size J (PROPOSED, docs/methods/epgan.md).
            self.logits = nn.Parameter(torch.zeros(s.components, device=device))
        self.G.to(device)
        self.D.to(device)
        g_params = list(self.G.parameters()) + ([self.logits] if s.uses_ep and s.components > 1 else [])
        self.opt_g = torch.optim.Adam(g_params, lr=s.lr_g, betas=(0.5, 0.999))
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=s.lr_d, betas=(0.5, 0.999))
        self.rng = torch.Generator().manual_seed(seed + 1)
        self.iterations = 0
        # EP state: the client's local EP prior (the Gaussian used in L_ep) and its site (what it uploads).
        self.prior: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
        self.site: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
        self._prior_torch: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._mbar: torch.Tensor | None = None

    # -- parameters ------------------------------------------------------------------------------------------------

    def get_params(self) -> dict[str, np.ndarray]:
        out = {f"G/{k}": v.detach().cpu().numpy().copy(order="C") for k, v in self.G.state_dict().items()}
        out.update({f"D/{k}": v.detach().cpu().numpy().copy(order="C") for k, v in self.D.state_dict().items()})
        if self.settings.uses_ep and self.settings.components > 1:
            out["pi/logits"] = self.logits.detach().cpu().numpy().copy()
        return out

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        for prefix, module in (("G/", self.G), ("D/", self.D)):
            state = {k[len(prefix) :]: torch.as_tensor(np.array(v)) for k, v in params.items() if k.startswith(prefix)}
            module.load_state_dict(state)
        if "pi/logits" in params:
            with torch.no_grad():
                self.logits.copy_(torch.as_tensor(np.array(params["pi/logits"])))

    @torch.no_grad()
    def interpolate(self, params: dict[str, np.ndarray], beta: float) -> None:
        """App. F.2.3's historical parameter interpolation: ``theta <- beta theta + (1 - beta) theta_global``."""
        for prefix, module in (("G/", self.G), ("D/", self.D)):
            for name, tensor in module.state_dict().items():
                if tensor.dtype.is_floating_point:
                    target = torch.as_tensor(np.array(params[prefix + name]), device=tensor.device)
                    tensor.mul_(beta).add_(target, alpha=1.0 - beta)

    def prior_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the EP prior's tensors (without the component axis): the generator's parameters."""
        return {name: tuple(p.shape[1:]) if name in self.per_sample else tuple(p.shape) for name, p in self.G.named_parameters()}

    @property
    def per_sample(self) -> set[str]:
        return {"first_weight", "first_bias"}

    def prior_from_generator(self) -> dict[str, np.ndarray]:
        """The generator's parameters in the prior's shapes (per-sample tensors averaged over the samples)."""
        out = {}
        for name, p in self.G.named_parameters():
            value = p.detach().cpu().double().numpy()
            out[name] = value.mean(0) if name in self.per_sample else value
        return out

    # -- EP ------------------------------------------------------------------------------------------------------

    def set_prior(self, means: dict[str, np.ndarray], variances: dict[str, np.ndarray]) -> None:
        """The Gaussian (mixture) the generator is regularised towards (arrays with a leading component axis)."""
        self.prior = (means, variances)
        self._prior_torch = (
            {k: torch.as_tensor(v, dtype=torch.float32, device=self.device) for k, v in means.items()},
            {k: torch.as_tensor(0.5 / v, dtype=torch.float32, device=self.device) for k, v in variances.items()},
        )
        # mean(m_j) over every prior element: the scalar f's objective multiplies f_j(x) with
        size = sum(v[0].size for v in means.values())
        self._mbar = torch.as_tensor(
            sum(v.reshape(v.shape[0], -1).sum(1) for v in means.values()) / size, dtype=torch.float32, device=self.device
        )

    @torch.no_grad()
    def likelihood_scalars(self, X: np.ndarray, max_items: int = 512) -> np.ndarray:
        """``f_bar_j``: the mean of ``f_j(x)`` over (up to ``max_items`` of) the client's data (docs/methods/epgan.md,
        PROPOSED: one EP update per round with the minibatch mean of f)."""
        self.D.eval()
        idx = torch.randperm(len(X), generator=self.rng)[:max_items].numpy()
        f = self.D.likelihood_logits(torch.as_tensor(X[idx], device=self.device)).mean(0)
        self.D.train()
        return f.double().cpu().numpy()

    def update_ep(
        self,
        X: np.ndarray,
        global_means: dict[str, np.ndarray],
        global_vars: dict[str, np.ndarray],
        *,
        damping: float,
        site_mode: str = "paper",
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
        """One EP step of client ``k`` for every component (Algorithm 2, line 5; Theorem 4.1 with the corrected S2).

        Cavity ``q_{-k} = q_global / q_k`` (natural parameters; the global prior where that is improper); tilted
        moments ``N(S1, S2 - S1^2)`` of ``sigma(f_bar_j theta) q_{-k}(theta)`` elementwise; damped update of the
        client's factor. ``site_mode``:

        * ``paper``: the client's factor is the (damped) tilted Gaussian itself, what Algorithm 2 uploads;
        * ``ep``: the client's factor is the EP site ``tilted / cavity`` (damped), so that the server's product of
          the sites (times the initial prior) is the EP approximation without counting the cavity K times.

        The generator is then regularised towards the tilted Gaussian (the client's updated EP prior). Returns the
        uploaded factor (means, variances) and ``f_bar``.
        """
        f_bar = self.likelihood_scalars(X)
        site_m, site_v = self.site if self.site is not None else (None, None)
        new_site_m, new_site_v, prior_m, prior_v = {}, {}, {}, {}
        for name in global_means:
            gm, gv = global_means[name], global_vars[name]
            old_m = None if site_m is None else site_m[name]
            old_v = None if site_v is None else site_v[name]
            cav_m, cav_v = cavity(gm, gv, old_m, old_v)
            f = f_bar.reshape((-1,) + (1,) * (gm.ndim - 1))  # component j's scalar f_j for its slice
            t_m, t_v = tilted_moments(f, cav_m, cav_v)
            if site_mode == "ep":
                lam = np.maximum(1.0 / t_v - 1.0 / cav_v, 1e-12)  # the sigmoid is log-concave: lam >= 0 up to the Lemma's error
                eta = t_m / t_v - cav_m / cav_v
                s_m, s_v = eta / lam, 1.0 / lam
            else:
                s_m, s_v = t_m, t_v
            new_site_m[name], new_site_v[name] = site_update(old_m, old_v, s_m, s_v, damping=damping)
            prior_m[name], prior_v[name] = t_m, t_v
        self.site = (new_site_m, new_site_v)
        self.set_prior(prior_m, prior_v)
        return new_site_m, new_site_v, f_bar

    def ep_loss(self) -> torch.Tensor:
        """``L_ep`` (eq. 45; eq. 46 with J > 1, through logsumexp)."""
        assert self._prior_torch is not None
        means, half_prec = self._prior_torch
        named = dict(self.G.named_parameters())
        energy = ep_energy(named, means, half_prec, self.G.num_samples, self.per_sample)
        if energy.shape[0] == 1:
            return energy[0]
        log_pi = torch.log(self.mixture_weights() + 1e-20)
        return -torch.logsumexp(log_pi - energy, dim=0)

    def mixture_weights(self) -> torch.Tensor:
        """``pi = gumbel_softmax(logits, tau=1)``, soft, as ``F.gumbel_softmax`` computes it but with the Gumbel noise
        drawn from this trainer's own generator: ``F.gumbel_softmax`` draws from torch's global generator, whose state
        depends on what else ran in the process (other clients of an in-process run, a restarted actor), so runs with
        ``components > 1`` were not reproducible and could not be resumed exactly."""
        gumbels = -torch.empty(self.logits.shape).exponential_(generator=self.rng).log().to(self.logits.device)
        return torch.softmax(self.logits + gumbels, dim=-1)  # tau = 1

    # -- state kept between turns (for resuming a run) -----------------------------------------------------------

    def training_state(self) -> dict[str, np.ndarray]:
        """What this trainer carries from one turn to the next besides its parameters (which the broadcast
        overwrites) and its EP site (which it uploads): the Adam moments and step counts of G and D, the state of its
        random generator (minibatch order, z, gradient-penalty mixing, SGHMC noise, Gumbel noise, f's subsample) and
        its iteration counter (when the PSA history is next updated). Copies: the live tensors keep changing.

        The EP prior the generator is pulled to is not part of it: every turn sets it afresh (:meth:`update_ep`)
        before training.
        """
        out = {"rng": self.rng.get_state().numpy().copy(), "iterations": np.asarray(self.iterations, dtype=np.int64)}
        for name, opt in (("opt_g", self.opt_g), ("opt_d", self.opt_d)):
            for index, slots in opt.state_dict()["state"].items():
                for slot, value in slots.items():
                    out[f"{name}/{index}/{slot}"] = value.detach().cpu().numpy().copy()
        return out

    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`training_state` returned (on a trainer built with the same settings)."""
        self.rng.set_state(torch.as_tensor(np.array(state["rng"], dtype=np.uint8)))
        self.iterations = int(state["iterations"])
        for name, opt in (("opt_g", self.opt_g), ("opt_d", self.opt_d)):
            slots: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in state.items():
                owner, _, rest = key.partition("/")
                if owner == name:
                    index, slot = rest.split("/", 1)
                    slots.setdefault(int(index), {})[slot] = torch.as_tensor(np.array(value))
            # load_state_dict moves the moments to the parameters' device and dtype ("step" stays a CPU scalar)
            opt.load_state_dict({"state": slots, "param_groups": opt.state_dict()["param_groups"]})

    # -- training ----------------------------------------------------------------------------------------------

    def _z(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.settings.latent_dim, generator=self.rng).to(self.device)

    def train_step(self, real: torch.Tensor) -> tuple[float, float]:
        """One iteration: ``d_steps`` critic updates, one generator update (Algorithm 1 with L = 1)."""
        s = self.settings
        noise_std = math.sqrt(2.0 * s.sghmc_alpha)
        n = real.shape[0]
        for _ in range(s.d_steps):
            with torch.no_grad():
                fake = self.G(self._z(n))
            d_real, d_fake = self.D(torch.cat([real, fake])).split([n, n])
            d_loss = -d_real.mean() + d_fake.mean() + s.gp_weight * gradient_penalty(self.D, real, fake, self.rng)
            if s.bayesian and s.noise_weight:
                d_loss = d_loss + s.noise_weight * noise_loss(self.D.parameters(), noise_std, self.rng)
            if s.uses_ep and self.prior is not None:
                assert self._mbar is not None  # set_prior sets prior and _mbar together
                # f's objective (UNRECOVERABLE; PROPOSED, docs/methods/epgan.md): max sum_j log sigma(f_j(x) mean(m_j))
                d_loss = d_loss - s.f_weight * F.logsigmoid(self.D.likelihood_logits(real) * self._mbar).sum(1).mean()
            self.opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            self.opt_d.step()
        fake = self.G(self._z(n))
        # The critic sees real and fake in one batch, here and above: its BatchNorm (after the first layer, App. F.2.3)
        # normalises a fake-only batch by the fakes' own mean, which hides where the fakes sit, and the generator never
        # moves towards the data (measured: a WGAN-GP on one Gaussian at (3, 3) stays at the origin for 100 epochs).
        features = self.D.features(torch.cat([real, fake]))[n:]
        g_loss = -self.D.head(features).mean(-1).mean()
        total = g_loss
        if s.uses_history and s.hist_weight:
            total = total - s.hist_weight * F.linear(features, self.D.hist_weight, self.D.hist_bias).mean(-1).mean()
        if s.bayesian and s.noise_weight:
            total = total + s.noise_weight * noise_loss(self.G.parameters(), noise_std, self.rng)
        if s.uses_ep and self.prior is not None and s.lambda_ep:
            total = total + s.lambda_ep * self.ep_loss()
        self.opt_g.zero_grad(set_to_none=True)
        total.backward()
        self.opt_g.step()
        self.iterations += 1
        if s.uses_history and self.iterations % s.hist_every == 0:
            self.D.update_history()
        return float(d_loss.detach()), float(g_loss.detach())

    def train_epoch(self, X: np.ndarray) -> tuple[float, float]:
        """One pass over ``X`` in shuffled minibatches (a last batch smaller than 2 samples is skipped: BatchNorm)."""
        self.G.train()
        self.D.train()
        order = torch.randperm(len(X), generator=self.rng).numpy()
        data = torch.as_tensor(X, device=self.device)
        d_sum = g_sum = 0.0
        steps = 0
        for start in range(0, len(order), self.settings.batch_size):
            idx = order[start : start + self.settings.batch_size]
            if len(idx) < 2:
                continue
            d, g = self.train_step(data[idx])
            d_sum, g_sum, steps = d_sum + d, g_sum + g, steps + 1
        return d_sum / max(steps, 1), g_sum / max(steps, 1)

    def train(
        self, X: np.ndarray, epochs: int, *, interpolate_to: dict[str, np.ndarray] | None = None, beta: float = 0.5
    ) -> dict[str, float]:
        """``epochs`` local epochs; with ``interpolate_to`` the historical interpolation after each epoch."""
        started = time.perf_counter()
        d = g = float("nan")
        for _ in range(epochs):
            d, g = self.train_epoch(X)
            if interpolate_to is not None and beta < 1.0:
                self.interpolate(interpolate_to, beta)
        return {"d_loss": d, "g_loss": g, "train_seconds": time.perf_counter() - started, "epochs": float(epochs)}

    # -- evaluation ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def critic_map(self, points: np.ndarray) -> np.ndarray:
        self.D.eval()
        out = self.D(torch.as_tensor(points, dtype=torch.float32, device=self.device)).double().cpu().numpy()
        self.D.train()
        return out

    @torch.no_grad()
    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        self.G.eval()
        z = torch.randn(n, self.settings.latent_dim, generator=torch.Generator().manual_seed(seed)).to(self.device)
        out = self.G(z).double().cpu().numpy()
        self.G.train()
        return out
