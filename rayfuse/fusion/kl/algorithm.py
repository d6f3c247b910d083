"""``kl``: Model Fusion with Kullback-Leibler Divergence (Claici, Yurochkin, Ghosh, Solomon, ICML 2020) [1].

Every client summarises its data by a mean-field posterior whose factors are in one exponential family; the server
fuses the factors of all clients into global components by minimising the summed ``KL(global || local)`` of matched
pairs plus a group-sparsity penalty that lets the number of global components ``G`` be inferred (eq. 9). The
algorithms are in :mod:`rayfuse.fusion.kl.fusion` (pure numpy / scipy); the families in :mod:`rayfuse.expfam`.

Applications (``application``):

* ``gmm`` (section 5.1): clients fit local variational GMMs (client step ``kl.gmm_posterior``, in their own actors)
  and return Normal-Wishart posteriors; the server fuses them and reports the Hausdorff distance of the fused means to
  the generator's true means and the relative model-size error ``|G_hat - G| / G`` (:mod:`rayfuse.fusion.kl.gmm`).
* ``bnn`` (section 5.4, Table 2): clients train mean-field Gaussian Bayesian MLPs; their hidden neurons are fused as
  diagonal Gaussians; Monte-Carlo accuracy, log-likelihood and entropy of the fused and local BNNs
  (:mod:`rayfuse.fusion.kl.bnn`).
* ``topics`` (section 5.3): clients fit LDA; topics are fused as Dirichlets; held-out document completion, also for
  the homogeneous (parametric) variant with ``homogeneous: true`` (:mod:`rayfuse.fusion.kl.topics`).

The per-dataset assignment solves of each sweep fan out through the federation's ``parallel_map`` (batched Ray tasks
on the coordinator's cluster; threads in-process) when the sweep carries enough work (``executor: auto``), else
through a thread pool in the coordinator.

[1] S. Claici, M. Yurochkin, S. Ghosh, J. Solomon. Model Fusion with Kullback-Leibler Divergence. ICML 2020.
Defaults: the paper's (lambda = 0.1 relative to the KL costs' standard deviation) and ``docs/methods/kl.md``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
from pydantic import Field

from rayfuse.errors import InputError
from rayfuse.expfam import Dirichlet
from rayfuse.fusion import references
from rayfuse.fusion.kl.bnn import corrupt, fuse_output_bias, network_of, neurons_of, predictive, predictive_metrics, train_bnn
from rayfuse.fusion.kl.fusion import fuse_heterogeneous, fuse_homogeneous
from rayfuse.fusion.kl.gmm import (
    TINY_GMM_DATA,
    TINY_GMM_SILOS,
    GMMPosteriorParams,
    check_gmm_dataset,
    check_local_components,
    check_silo_components,
    gather_gmm_posteriors,
    gmm_metrics,
)
from rayfuse.fusion.kl.topics import completion_log_likelihood, fit_lda_posterior, split_documents, topic_hausdorff
from rayfuse.matching import Executor, serial_map, thread_map
from rayfuse.method import Method, MethodCase, MethodResult, MethodTags, RunSetup, ServerContext, register_method
from rayfuse.seeding import make_rng

__all__ = ["KLFusion", "KLParams", "choose_executor"]

# Below this much assignment work per sweep (sum_j L_j (G + L_j)^2, about ns of LSA), Ray tasks cost more than they save.
PARALLEL_WORK = 5e7


class KLParams(GMMPosteriorParams):
    application: Literal["gmm", "bnn", "topics"] = Field(
        "gmm",
        description="what the clients' posteriors are: gmm = local variational GMMs (Normal-Wishart); bnn = Bayesian MLP "
        "neurons (diagonal Gaussians); topics = LDA topics (Dirichlet)",
    )
    homogeneous: bool = Field(
        False, description="topics: the parametric variant (eq. 3): every client fits n_components topics, fused by permutation"
    )
    lam: float = Field(0.1, ge=0, description="lambda of eq. 9, relative to the standard deviation of the KL costs (paper: 0.1)")
    solver: Literal["exact", "relaxed"] = Field(
        "exact", description="exact: per-dataset augmented Hungarian (binary); relaxed: the convex P-step (Frank-Wolfe)"
    )
    max_iter: int | None = Field(None, ge=1, description="sweeps (exact, default 20) or P/theta alternations (relaxed, default 10)")
    n_init_components: int | None = Field(
        None, ge=1, description="G_init of the KL-k-means++ initialisation (default min(sum L_j, 2 max L_j))"
    )
    fw_iterations: int = Field(100, ge=1, description="relaxed: Frank-Wolfe iterations per P-step")
    reg_weights: Literal["code", "uniform"] = Field(
        "code",
        description="relaxed: group weights sqrt(max(0, rank + 1 - Lmax)) (reference code; default) or uniform (paper; degenerate, see kl_fusion)",
    )
    hidden: int = Field(150, ge=1, description="bnn: hidden units of each client's Bayesian MLP (paper: 150)")
    bnn_epochs: int = Field(100, ge=1, description="bnn: Bayes-by-backprop epochs")
    bnn_lr: float = Field(1e-3, gt=0, description="bnn: Adam learning rate (docs/methods/kl.md: 1e-3)")
    prior_sd: float = Field(1.0, gt=0, description="bnn: N(0, prior_sd^2) prior on every weight")
    mc_samples: int = Field(100, ge=1, description="bnn: Monte-Carlo weight samples of the predictive (paper: 100)")
    executor: Literal["auto", "federation", "threads", "serial"] = Field(
        "auto",
        description="where the per-dataset solves run: federation = Ray tasks on Ray (threads in-process); auto = federation for large sweeps",
    )


def choose_executor(server: ServerContext, kind: str, sizes: list[int], n_globals: int) -> tuple[Executor, str]:
    """The executor of the per-dataset solves and its name."""
    if kind == "auto":
        work = sum(L * (n_globals + L) ** 2 for L in sizes)
        kind = "federation" if work >= PARALLEL_WORK else "threads"
    if kind == "federation":
        return server.federation.parallel_map, "federation"
    return (thread_map, "threads") if kind == "threads" else (serial_map, "serial")


@register_method
class KLFusion(Method[KLParams, None]):
    name = "kl"
    tags = MethodTags(
        fuses="posteriors",
        federated_evaluation=False,  # scores on the server's test set and the true parameters (BNN, topics, GMM): central only
    )
    test_case = MethodCase(
        {"n_init": 1, "vi_max_iter": 20}, TINY_GMM_DATA, step="kl.gmm_posterior", fused=None, variants={"silos": TINY_GMM_SILOS}
    )
    aliases = ("kl_fusion",)
    Params = KLParams
    summary = "KL-fusion: fuse clients' exponential-family posteriors, number of global components inferred (Claici et al. 2020)"
    reference = references.KLF

    def _fuse(self, server: ServerContext, posteriors: list) -> tuple[Any, str, float]:
        p = self.params
        sizes = [len(q) for q in posteriors]
        g_init = p.n_init_components or min(sum(sizes), 2 * max(sizes))
        executor, executor_name = choose_executor(server, p.executor, sizes, g_init)
        server.progress(f"kl: fusing {sum(sizes)} local components from {len(posteriors)} clients ({p.solver} solver, {executor_name})")
        started = time.perf_counter()
        result = fuse_heterogeneous(
            posteriors,
            lam=p.lam,
            solver=p.solver,
            max_iter=p.max_iter,
            n_init_components=p.n_init_components,
            executor=executor,
            random_state=server.step_seed("fuse") % (2**31),
            fw_iterations=p.fw_iterations,
            reg_weights=p.reg_weights,
        )
        return result, executor_name, time.perf_counter() - started

    @classmethod
    def check(cls, params: KLParams, setup: RunSetup) -> None:
        """The dataset the application needs, the number of local components, and ``n_init_components`` against the
        largest local count where the config fixes it. With ``data.silos`` (no generator, so no true parameters) gmm and
        topics fuse any data with a fixed ``n_components`` and report the metrics that need no truth."""
        from rayfuse.data.datasets import DATASETS

        p = params
        if p.application == "gmm":
            check_gmm_dataset(setup, cls.name)
            check_silo_components(p, setup)
            check_local_components(p, setup)
        elif p.application == "topics":
            check_silo_components(p, setup)
            if not setup.data.is_silos and DATASETS.canonical(setup.data.dataset) != "kl_lda":
                raise InputError("data.dataset", "kl_lda (application topics needs the synthetic corpus' true topics)", setup.data.dataset)
            if p.homogeneous and p.n_components == "true":
                raise InputError("n_components", "a number of topics every client fits (homogeneous fusion)", "true")
        local = p.hidden if p.application == "bnn" else None if p.n_components == "true" else int(p.n_components)
        if (
            p.n_init_components is not None
            and local is not None
            and p.n_init_components < local
            and not (p.application == "topics" and p.homogeneous)
        ):
            raise InputError(
                "n_init_components", f"at least the largest local count ({local}) so every dataset can be assigned", p.n_init_components
            )

    def run(self, server: ServerContext) -> MethodResult:
        run = {"gmm": self._run_gmm, "bnn": self._run_bnn, "topics": self._run_topics}[self.params.application]
        return run(server)

    def _run_gmm(self, server: ServerContext) -> MethodResult:
        p = self.params
        server.progress("kl: clients fit their local variational GMMs")
        started = time.perf_counter()
        posteriors, raw = gather_gmm_posteriors(server, p)
        local_seconds = max(r["seconds"] for r in raw.values())
        sizes = [len(q) for q in posteriors]
        result, executor_name, fuse_seconds = self._fuse(server, posteriors)
        metrics = gmm_metrics(server, result.globals.means())
        metrics["fuse_seconds"] = fuse_seconds
        for step, value in enumerate(result.objective):
            server.log(step, {"objective": value})
        server.log(len(result.objective), metrics)
        info = {
            "clients": list(raw),
            "local_components": sizes,
            "global_components": result.num_globals,
            **({} if server.data.data_cfg.is_silos else {"true_components": int(len(server.data.dataset_meta["global_means"]))}),
            "lam_effective": result.lam,
            "counts": np.asarray(result.counts).round(4).tolist(),
            "means": result.globals.means().tolist(),
            "executor": executor_name,
            "local_fit_seconds_max": round(local_seconds, 3),
            "total_seconds": round(time.perf_counter() - started, 3),
            **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.info.items()},
        }
        return MethodResult(metrics, info=info)

    def _run_bnn(self, server: ServerContext) -> MethodResult:
        p = self.params
        server.progress(f"kl: clients train Bayesian MLPs ({p.hidden} hidden units, Bayes by backprop)")
        started = time.perf_counter()
        gathered = server.updates.run_cached(train_bnn, hidden=p.hidden, epochs=p.bnn_epochs, lr=p.bnn_lr, prior_sd=p.prior_sd)
        # NaN / non-positive variances / wrong shapes (InputError): rejected, never fused
        kept = server.updates.accept_replies(
            gathered, lambda client, r: (neurons_of(r["bnn"], where=f"client {client} posterior"), r["bnn"]), what="client posteriors"
        )
        neurons = [n for n, _ in kept.values()]
        bnns = {client: bnn for client, (_, bnn) in kept.items()}
        d_in = int(np.prod(server.data.input_shape))
        if any(b["w1_mu"].shape[1] != d_in for b in bnns.values()):
            raise InputError("model", f"Bayesian MLPs with {d_in} inputs on every client", [b["w1_mu"].shape for b in bnns.values()])
        result, executor_name, fuse_seconds = self._fuse(server, neurons)
        b2_mu, b2_var = fuse_output_bias(list(bnns.values()))
        fused = network_of(result.globals, b2_mu, b2_var, d_in)
        test = server.data.test
        rng = server.rng("mc")
        ood = corrupt(test.X, make_rng(server.seed, "kl-bnn-ood"))  # the same OOD set for every method of a run

        def evaluate(bnn: dict) -> dict[str, float]:
            metrics = predictive_metrics(predictive(bnn, test.X, p.mc_samples, rng), test.y)
            metrics["ood_entropy"] = predictive_metrics(predictive(bnn, ood, p.mc_samples, rng))["entropy"]
            return metrics

        server.progress(f"kl: evaluating the fused BNN ({result.num_globals} units) and the local BNNs, {p.mc_samples} MC samples")
        metrics = evaluate(fused)
        metrics.update(hidden_units=float(result.num_globals), fuse_seconds=fuse_seconds)
        local = {client: evaluate(b) for client, b in bnns.items()}
        for client, m in local.items():
            server.log(0, m, client=client)
        for name in ("accuracy", "log_likelihood", "entropy", "ood_entropy"):
            values = [m[name] for m in local.values()]
            metrics[f"local_{name}_mean"], metrics[f"local_{name}_max"] = float(np.mean(values)), float(np.max(values))
        server.log(1, metrics)
        info = {
            "clients": list(bnns),
            "global_units": result.num_globals,
            "local_units": [len(n) for n in neurons],
            "concatenated_units": int(sum(len(n) for n in neurons)),
            "lam_effective": result.lam,
            "executor": executor_name,
            "local": {str(c): {k: round(v, 4) for k, v in m.items()} for c, m in local.items()},
            "local_train_seconds_max": round(max(r["seconds"] for r in gathered.results.values()), 3),
            "class_counts": {str(c): gathered.results[c]["class_counts"] for c in bnns},
            "total_seconds": round(time.perf_counter() - started, 3),
            **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.info.items()},
        }
        params = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in fused.items()}
        return MethodResult(metrics, params=params, info=info)

    def _run_topics(self, server: ServerContext) -> MethodResult:
        p = self.params
        # a silo run has no generator: no true topics, and a fixed n_components (check_silo_components)
        meta = None if server.data.data_cfg.is_silos else server.data.dataset_meta
        k: dict[int, int] | int
        if p.n_components == "true":
            assert meta is not None
            k = {c: int(meta["local_counts"][c]) for c in server.federation.client_ids}
        else:
            k = int(p.n_components)
        server.progress("kl: clients fit LDA on their documents")
        started = time.perf_counter()
        gathered = server.updates.run_cached(fit_lda_posterior, k, max_iter=p.vi_max_iter)
        locals_ = server.updates.accept_replies(
            gathered, lambda client, r: Dirichlet(r["alpha"], where=f"client {client} posterior"), what="client posteriors"
        )
        posteriors = list(locals_.values())
        if p.homogeneous:
            fuse_started = time.perf_counter()
            result = fuse_homogeneous(posteriors, max_iter=p.max_iter or 20)
            executor_name, fuse_seconds = "threads", time.perf_counter() - fuse_started
        else:
            result, executor_name, fuse_seconds = self._fuse(server, posteriors)
        test = server.data.test
        # the same split for every method of a run (not per label), so their completion scores compare
        seen, held = split_documents(test.X.reshape(len(test), -1), make_rng(server.seed, "kl-topics-completion"))
        fused_topics = result.globals.means()
        if meta is None:  # silos: held-out completion on the server's test documents, no truth to compare with
            truth = None
            metrics = {
                "completion_ll": completion_log_likelihood(fused_topics, seen, held),
                "num_components": float(result.num_globals),
                "fuse_seconds": fuse_seconds,
            }
        else:
            used = sorted({t for subset in meta["subsets"] for t in subset})  # topics no client writes about are not recoverable
            truth = np.asarray(meta["topics"])[used]
            metrics = {
                "completion_ll": completion_log_likelihood(fused_topics, seen, held),
                "topic_hausdorff": topic_hausdorff(fused_topics, truth),
                "num_components": float(result.num_globals),
                "size_error": abs(result.num_globals - len(truth)) / len(truth),
                "fuse_seconds": fuse_seconds,
            }
        local_ll = {c: completion_log_likelihood(q.means(), seen, held) for c, q in locals_.items()}
        metrics["local_completion_ll_mean"] = float(np.mean(list(local_ll.values())))
        metrics["local_completion_ll_max"] = float(np.max(list(local_ll.values())))
        if meta is not None:  # all generating topics: upper reference
            metrics["truth_completion_ll"] = completion_log_likelihood(np.asarray(meta["topics"]), seen, held)
        server.log(1, metrics)
        info = {
            "clients": list(locals_),
            "local_topics": [len(q) for q in posteriors],
            "global_topics": result.num_globals,
            **({} if truth is None else {"true_topics": int(len(truth))}),
            "local_completion_ll": {str(c): round(v, 4) for c, v in local_ll.items()},
            "executor": executor_name,
            "homogeneous": p.homogeneous,
            "total_seconds": round(time.perf_counter() - started, 3),
            **{k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in result.info.items()},
        }
        return MethodResult(metrics, info=info)
