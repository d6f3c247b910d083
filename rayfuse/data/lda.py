"""A synthetic LDA corpus where each group (client) writes about a subset of the topics (KL-fusion section 5.3 offline).

PROPOSED in place of 20 Newsgroups (a download; ``docs/methods/kl.md``, "Topics")::

    beta_k  ~ Dir(eta 1_V),                     k = 1..K global topics
    group j uses topics S_j, |S_j| ~ U{min_topics..max_topics} drawn without replacement
    theta_d ~ Dir(alpha 1_{S_j});  n_d ~ Poisson(doc_length);  words ~ Mult(n_d, theta_d beta)

``X`` is the document-word count matrix (float32), the label is the group; partition with ``labels`` so client ``j``
holds group ``j``'s documents. The test split is ``test_docs`` documents over *all* topics (Dir(alpha 1_K)), for the
held-out document-completion log-likelihood. ``Dataset.meta`` holds the true topics and each group's topic set.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rayfuse.data.datasets import Dataset, register_dataset
from rayfuse.errors import InputError

__all__ = ["generate_lda_groups"]


def generate_lda_groups(
    *,
    num_topics: int = 20,
    vocabulary: int = 500,
    num_groups: int = 5,
    docs: int = 300,
    test_docs: int = 200,
    doc_length: int = 80,
    min_topics: int = 5,
    max_topics: int = 10,
    eta: float = 0.05,
    alpha: float = 0.5,
    seed: int = 0,
) -> dict[str, Any]:
    for key, value, low in (
        ("num_topics", num_topics, 2),
        ("vocabulary", vocabulary, 2),
        ("num_groups", num_groups, 1),
        ("docs", docs, 1),
        ("test_docs", test_docs, 0),
        ("doc_length", doc_length, 1),
        ("min_topics", min_topics, 1),
        ("seed", seed, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InputError(f"data.options.{key}", f"an integer >= {low}", value)
    if not min_topics <= max_topics <= num_topics:
        raise InputError("data.options.max_topics", f"min_topics ({min_topics}) <= max_topics <= num_topics ({num_topics})", max_topics)
    for key, number in (("eta", eta), ("alpha", alpha)):
        if not isinstance(number, (int, float)) or isinstance(number, bool) or not number > 0:
            raise InputError(f"data.options.{key}", "a number > 0", number)
    rng = np.random.default_rng(seed)
    topics = rng.dirichlet(np.full(vocabulary, eta), size=num_topics)

    def write(n: int, subset: np.ndarray) -> np.ndarray:
        theta = rng.dirichlet(np.full(len(subset), alpha), size=n)
        lengths = np.maximum(rng.poisson(doc_length, size=n), 2)
        word_p = theta @ topics[subset]
        return np.stack([rng.multinomial(m, p / p.sum()) for m, p in zip(lengths, word_p)]).astype(np.float32)

    subsets = [
        np.sort(rng.choice(num_topics, size=int(rng.integers(min_topics, max_topics + 1)), replace=False)) for _ in range(num_groups)
    ]
    groups = [write(docs, s) for s in subsets]
    test = write(test_docs, np.arange(num_topics)) if test_docs else np.zeros((0, vocabulary), np.float32)
    return {"groups": groups, "test": test, "topics": topics, "subsets": [s.tolist() for s in subsets]}


@register_dataset(
    "kl_lda",
    description="synthetic LDA corpus, each group (label) on a subset of topics; data.options: num_topics, vocabulary, "
    "num_groups, docs, test_docs, doc_length, min_topics, max_topics, eta, alpha, seed",
    source="generator",
)
def _load_kl_lda(
    *,
    num_topics: int = 20,
    vocabulary: int = 500,
    num_groups: int = 5,
    docs: int = 300,
    test_docs: int = 200,
    doc_length: int = 80,
    min_topics: int = 5,
    max_topics: int = 10,
    eta: float = 0.05,
    alpha: float = 0.5,
    seed: int = 0,
    **_: Any,
) -> Dataset:
    out = generate_lda_groups(
        num_topics=num_topics,
        vocabulary=vocabulary,
        num_groups=num_groups,
        docs=docs,
        test_docs=test_docs,
        doc_length=doc_length,
        min_topics=min_topics,
        max_topics=max_topics,
        eta=eta,
        alpha=alpha,
        seed=seed,
    )
    X = np.concatenate(out["groups"])
    y = np.repeat(np.arange(num_groups), docs).astype(np.int64)
    X_test = y_test = None
    if test_docs:
        X_test, y_test = out["test"], (np.arange(test_docs) % num_groups).astype(np.int64)
    meta = {"kind": "lda", "topics": out["topics"], "subsets": out["subsets"], "local_counts": [len(s) for s in out["subsets"]]}
    return Dataset("kl_lda", X, y, max(num_groups, 2), tuple(f"group{j}" for j in range(max(num_groups, 2))), X_test, y_test, meta=meta)
