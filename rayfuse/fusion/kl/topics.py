"""KL-fusion's topic-model application (Claici et al. 2020, section 5.3) on the synthetic ``kl_lda`` corpus.

Each client fits scikit-learn's ``LatentDirichletAllocation`` (batch variational Bayes) to its own documents; its
topics' variational posteriors ``Dir(lambda_k)`` (``components_``) are what it returns. The server fuses them with
the Dirichlet KL and the alpha-average barycenter (``rayfuse.expfam.Dirichlet``). Evaluation is document completion:
for each test document, half of its words (a random half of the tokens) is observed, the topic proportions are
inferred from it with the topics fixed at their posterior means (EM folding-in), and the mean log-likelihood per
held-out token of the other half is reported (``completion_ll``; higher is better). The paper holds out 10 % of
each document; with ~80-word synthetic documents half is used so each test document has enough held-out tokens.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

from rayfuse.method import ClientContext, client_step

__all__ = ["fit_lda_posterior", "split_documents", "completion_log_likelihood", "topic_hausdorff"]


@client_step("kl.lda_posterior")
def fit_lda_posterior(
    ctx: ClientContext, n_components: dict[int, int] | int, *, max_iter: int = 50, topic_word_prior: float | None = None
) -> dict[str, Any]:
    """Fit LDA on this client's documents; return the topics' Dirichlet parameters (cached per settings)."""
    from sklearn.decomposition import LatentDirichletAllocation

    k = int(n_components[ctx.client_id] if isinstance(n_components, dict) else n_components)
    key = ("kl.lda_posterior", k, max_iter, topic_word_prior)
    if key not in ctx.state:
        started = time.perf_counter()
        X = np.asarray(ctx.train.X, dtype=np.float64).reshape(len(ctx.train), -1)
        model = LatentDirichletAllocation(
            n_components=k,
            learning_method="batch",
            max_iter=max_iter,
            topic_word_prior=topic_word_prior,
            random_state=ctx.step_seed("lda") % (2**31),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(X)
        ctx.state[key] = {
            "alpha": np.asarray(model.components_, dtype=np.float64),
            "num_examples": len(X),
            "seconds": time.perf_counter() - started,
        }
    return dict(ctx.state[key])


def split_documents(X: np.ndarray, rng: np.random.Generator, observed: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Split each document's tokens at random into (observed, held-out) count matrices."""
    X = np.asarray(X, dtype=np.int64)
    seen = rng.binomial(X, observed)
    return seen.astype(np.float64), (X - seen).astype(np.float64)


def completion_log_likelihood(
    topics: np.ndarray, seen: np.ndarray, held: np.ndarray, *, iterations: int = 100, smoothing: float = 1e-3
) -> float:
    """Mean log p(held-out token) under ``theta_d . topics`` with ``theta_d`` folded in from the observed tokens by EM
    (``topics`` fixed, rows on the simplex); ``smoothing`` keeps unseen words finite."""
    beta = (topics + smoothing / topics.shape[1]) / (1 + smoothing)
    theta = np.full((len(seen), len(beta)), 1.0 / len(beta))
    for _ in range(iterations):
        ratio = seen / np.maximum(theta @ beta, 1e-300)
        theta *= ratio @ beta.T
        theta += 1e-12
        theta /= theta.sum(1, keepdims=True)
    p = np.maximum(theta @ beta, 1e-300)
    return float((held * np.log(p)).sum() / max(held.sum(), 1.0))


def topic_hausdorff(estimated: np.ndarray, truth: np.ndarray) -> float:
    """Hausdorff distance between two topic sets under the Hellinger distance."""
    h = np.sqrt(np.maximum(0.0, 1 - np.sqrt(estimated) @ np.sqrt(truth).T))
    return float(max(h.min(1).max(), h.min(0).max()))
