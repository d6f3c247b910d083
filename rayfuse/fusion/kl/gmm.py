"""KL-fusion's GMM application (Claici et al. 2020, section 5.1): local variational posteriors, metrics, baselines.

Clients hold one group of the ``kl_gmm`` dataset each (:mod:`rayfuse.data.gmm`). In the client step
:func:`fit_gmm_posterior` a client fits scikit-learn's ``BayesianGaussianMixture`` to its own points (as the reference
driver does: full covariances, ``n_init = 16``, a Dirichlet-distribution weight prior, ``n_components`` = the true
local count) and returns the Normal-Wishart posteriors of its components, never its points. The fit is cached in the
client, so every method of a run (``kl``, ``spahm``, ``dp_cluster``) fuses the same posteriors.

Metrics (``docs/methods/kl.md``): ``hausdorff`` between the estimated and true global means [KLF : ``min_match``], and
``size_error`` ``|G_hat - G| / G`` (PROPOSED there: the paper's y-axis is relative but undefined). Baselines:
``gmm_oracle`` (VI on the pooled data with the true ``G``; an oracle), ``dp_cluster`` (a Dirichlet-process
``BayesianGaussianMixture`` on the pooled local *means*, components with weight > 1e-2 kept; PROPOSED) and ``spahm``
(:mod:`rayfuse.fusion.kl.spahm`, on the local means).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import Field, field_validator

from rayfuse.errors import InputError, RunFailure
from rayfuse.expfam import NormalWishart, normal_wishart_from_sklearn
from rayfuse.fusion import references
from rayfuse.fusion.kl.fusion import hausdorff
from rayfuse.method import (
    ClientContext,
    Method,
    MethodCase,
    MethodParams,
    MethodResult,
    MethodTags,
    RunSetup,
    ServerContext,
    client_step,
    register_method,
)

__all__ = [
    "fit_gmm_posterior",
    "GMMPosteriorParams",
    "gather_gmm_posteriors",
    "gmm_truth",
    "gmm_metrics",
    "GMMOracle",
    "DPCluster",
    "GMMMethod",
    "check_gmm_dataset",
    "check_silo_components",
    "check_local_components",
]


@client_step("kl.gmm_posterior")
def fit_gmm_posterior(
    ctx: ClientContext,
    n_components: dict[int, int] | int,
    *,
    n_init: int = 16,
    max_iter: int = 100,
    covariance_type: str = "full",
    weight_prior: str = "dirichlet_distribution",
) -> dict[str, Any]:
    """Fit local VI (``BayesianGaussianMixture``) on this client's points; return its Normal-Wishart posteriors."""
    from sklearn.mixture import BayesianGaussianMixture

    k = int(n_components[ctx.client_id] if isinstance(n_components, dict) else n_components)
    key = ("kl.gmm_posterior", k, n_init, max_iter, covariance_type, weight_prior)
    if key not in ctx.state:
        X = np.asarray(ctx.train.X, dtype=np.float64).reshape(len(ctx.train), -1)
        if len(X) < k:
            raise RunFailure(f"client {ctx.client_id}: {len(X)} points for {k} mixture components")
        started = time.perf_counter()
        model = BayesianGaussianMixture(
            n_components=k,
            covariance_type=covariance_type,
            n_init=n_init,
            max_iter=max_iter,
            weight_concentration_prior_type=weight_prior,
            random_state=ctx.step_seed("bgmm") % (2**31),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ConvergenceWarning on some restarts: the best restart is kept
            model.fit(X)
        nw = normal_wishart_from_sklearn(model, where=f"client {ctx.client_id} posterior")
        ctx.state[key] = {
            "mean": nw.mean,
            "kappa": nw.kappa,
            "nu": nw.nu,
            "W": nw.W,
            "weights": np.asarray(model.weights_),
            "num_examples": len(X),
            "seconds": time.perf_counter() - started,
            "converged": bool(model.converged_),
        }
    return dict(ctx.state[key])


class GMMPosteriorParams(MethodParams):
    """How the clients fit their local posteriors (the same values in every GMM method share one fit per client)."""

    n_components: int | Literal["true"] = Field(
        "true", description="local mixture components: 'true' = each group's true atom count (the paper), or a number"
    )
    n_init: int = Field(16, ge=1, description="BayesianGaussianMixture restarts (reference driver: 16)")
    vi_max_iter: int = Field(100, ge=1, description="BayesianGaussianMixture iterations")

    @field_validator("n_components")
    @classmethod
    def _at_least_one(cls, value: int | str) -> int | str:
        if not isinstance(value, str) and value < 1:  # the one string the field admits is "true"
            raise ValueError("a number of components >= 1 or 'true'")
        return value


def check_gmm_dataset(setup: RunSetup, method: str) -> None:
    """Refuse a dataset other than ``kl_gmm`` (``method`` needs the generator's true atoms for its metrics). A silo run
    (``data.silos``) has no generator: any points are fused, and scored without the truth (:func:`gmm_metrics`)."""
    from rayfuse.data.datasets import DATASETS

    if setup.data.is_silos:
        return
    if DATASETS.canonical(setup.data.dataset) != "kl_gmm":
        raise InputError("data.dataset", f"kl_gmm (method {method} needs the generator's true atoms)", setup.data.dataset)


def check_silo_components(params: GMMPosteriorParams, setup: RunSetup) -> None:
    """Refuse ``n_components: true`` with ``data.silos``: it is each client's count in the synthetic generator (``kl_gmm``,
    ``kl_lda``), and a silo run has no generator."""
    if setup.data.is_silos and params.n_components == "true":
        raise InputError(
            "n_components",
            "a number of local components with data.silos ('true' is each client's count in the "
            "synthetic generator, kl_gmm / kl_lda; silos have none)",
            "true",
            "e.g. n_components: 3",
        )


def check_local_components(params: GMMPosteriorParams, setup: RunSetup) -> None:
    """Refuse a fixed number of local components larger than a client's training split (its points)."""
    if params.n_components != "true" and setup.train_sizes and params.n_components > min(setup.train_sizes):
        raise InputError(
            "n_components", f"at most the smallest client's number of training points ({min(setup.train_sizes)})", params.n_components
        )


GP = TypeVar("GP", bound=GMMPosteriorParams)

#: the GMM methods' tiny runs (their ``test_case``, rayfuse.testing): four well-separated groups, one per client, and a
#: quick variational fit; on silo data (rayfuse.testing's three silos of 3 classes) 3 components
TINY_GMM_DATA: dict[str, Any] = {
    "data": {"dataset": "kl_gmm", "options": {"separation": 30.0, "local_sd": 0.1, "points": 60, "num_groups": 4}, "val_size": 0},
    "partition": {"method": "labels", "num_clients": 4, "groups": [[0], [1], [2], [3]]},
}
TINY_GMM_FIT: dict[str, Any] = {"n_components": 4, "n_init": 1, "vi_max_iter": 20}
TINY_GMM_SILOS: dict[str, Any] = {"n_components": 3, "n_init": 1, "vi_max_iter": 20}


class GMMMethod(Method[GP, None]):
    """A method on the ``kl_gmm`` dataset whose clients fit local GMM posteriors: checks both before the run."""

    tags = MethodTags(
        fuses="posteriors",
        federated_evaluation=False,  # scores against the dataset's true GMM atoms: evaluation central only
    )
    test_case = MethodCase(TINY_GMM_FIT, TINY_GMM_DATA, step="kl.gmm_posterior", fused=None, variants={"silos": TINY_GMM_SILOS})

    @classmethod
    def check(cls, params: GP, setup: RunSetup) -> None:
        check_gmm_dataset(setup, cls.name)
        check_silo_components(params, setup)
        check_local_components(params, setup)


def gmm_truth(server: ServerContext, path: str) -> dict[str, Any]:
    meta = server.data.dataset_meta
    if meta.get("kind") != "gmm":
        raise InputError("data.dataset", f"kl_gmm (method {path.split('.')[-1]} needs the generator's true atoms)", server.method)
    return meta


def gather_gmm_posteriors(server: ServerContext, params: GMMPosteriorParams) -> tuple[list[NormalWishart], dict[int, dict[str, Any]]]:
    """Every client's local Normal-Wishart posteriors (validated), by client id."""
    meta = None if server.data.data_cfg.is_silos else gmm_truth(server, f"methods.{server.label}")  # a silo run has no generator
    if params.n_components == "true":
        assert meta is not None  # n_components: true is refused with data.silos (check_silo_components)
        counts = meta["local_counts"]
        n_components: dict[int, int] | int = {c: int(counts[c]) for c in server.federation.client_ids}
    else:
        n_components = int(params.n_components)
    gathered = server.updates.run_cached(fit_gmm_posterior, n_components, n_init=params.n_init, max_iter=params.vi_max_iter)
    # NaN / non-positive variances / wrong shapes (InputError): rejected, never fused
    kept = server.updates.accept_replies(
        gathered,
        lambda client, r: (NormalWishart(r["mean"], r["kappa"], r["nu"], r["W"], where=f"client {client} posterior"), r),
        what="client posteriors",
    )
    return [q for q, _ in kept.values()], {client: r for client, (_, r) in kept.items()}


def gmm_metrics(server: ServerContext, means: np.ndarray) -> dict[str, float]:
    """``hausdorff`` and ``size_error`` against the generator's true means, and ``num_components``; a silo run
    (``data.silos``: no generator, no truth) reports ``num_components`` only."""
    if server.data.data_cfg.is_silos:
        if not np.isfinite(means).all():
            raise RunFailure(f"{server.label}: non-finite estimated means")
        return {"num_components": float(len(means))}
    truth = np.asarray(server.data.dataset_meta["global_means"])
    G = len(truth)
    if not np.isfinite(means).all():
        raise RunFailure(f"{server.label}: non-finite estimated means")
    return {"hausdorff": hausdorff(means, truth), "size_error": abs(len(means) - G) / G, "num_components": float(len(means))}


@register_method
class GMMOracle(Method[GMMPosteriorParams, None]):
    name = "gmm_oracle"
    tags = MethodTags(
        fuses="nothing",
        needs_dataset=True,  # reads the whole dataset (data.dataset): not with data.silos
        federated_evaluation=False,  # scores against the dataset's true GMM atoms: evaluation central only
        oracle=True,
    )
    test_case = MethodCase(TINY_GMM_FIT, TINY_GMM_DATA, fused=None)
    aliases = ("vi_oracle",)
    Params = GMMPosteriorParams
    summary = "ORACLE: variational GMM on every client's points pooled, with the true number of components (KL-fusion's VI-oracle)"
    reference = references.KLF

    @classmethod
    def check(cls, params: GMMPosteriorParams, setup: RunSetup) -> None:
        check_gmm_dataset(setup, cls.name)  # the oracle fits the true number of components, not n_components

    def run(self, server: ServerContext) -> MethodResult:
        from sklearn.mixture import BayesianGaussianMixture

        meta = gmm_truth(server, f"methods.{self.label}")
        data = server.data.pooled_train()
        G = len(meta["global_means"])
        model = BayesianGaussianMixture(
            n_components=G,
            covariance_type="full",
            n_init=self.params.n_init,
            max_iter=self.params.vi_max_iter,
            weight_concentration_prior_type="dirichlet_distribution",
            random_state=server.step_seed("bgmm") % (2**31),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(np.asarray(data.X, dtype=np.float64).reshape(len(data), -1))
        metrics = gmm_metrics(server, model.means_)
        server.log(0, metrics)
        return MethodResult(
            metrics, info={"note": "VI on the pooled data with the true G: infeasible in a federation", "means": model.means_.tolist()}
        )


class DPClusterParams(GMMPosteriorParams):
    min_weight: float = Field(1e-2, ge=0, lt=1, description="keep DP components with a larger weight")


@register_method
class DPCluster(GMMMethod[DPClusterParams]):
    name = "dp_cluster"
    Params = DPClusterParams
    summary = "Dirichlet-process mixture on the pooled local posterior means (KL-fusion's DP-cluster baseline)"
    reference = references.KLF

    def run(self, server: ServerContext) -> MethodResult:
        from sklearn.mixture import BayesianGaussianMixture

        posteriors, _ = gather_gmm_posteriors(server, self.params)
        X = np.concatenate([p.means() for p in posteriors])
        model = BayesianGaussianMixture(
            n_components=len(X),
            covariance_type="full",
            weight_concentration_prior_type="dirichlet_process",
            n_init=1,
            max_iter=500,
            random_state=server.step_seed("dp") % (2**31),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(X)
        means = model.means_[model.weights_ > self.params.min_weight]
        metrics = gmm_metrics(server, means)
        server.log(0, metrics)
        return MethodResult(metrics, info={"means": means.tolist(), "local_components": int(len(X))})
