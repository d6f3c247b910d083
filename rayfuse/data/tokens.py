"""``tokens``: a procedural token-sequence classification task (seeded, numpy only), the data of a Hugging Face
sequence classifier (``model.name: hf:<folder>``).

Each row is ``length`` token ids in ``0..vocab - 1`` (stored exactly as float32, as every dataset's inputs are).
Tokens ``1..n_classes`` are *markers*, one a class; every other id is filler. Each position is a marker with
probability ``marker_rate`` (the marker drawn uniformly), filler otherwise (uniform over the filler ids); the label is
the marker that occurs most often in the row. Rows where two markers tie for the most are redrawn, so the label is a
function of the row: a model that counts the markers classifies every row right. Token 0 never occurs (kept free for
a padding id).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rayfuse.data.datasets import Dataset, register_dataset
from rayfuse.errors import InputError
from rayfuse.memory import check_fits_memory

__all__ = ["token_sequences", "MAX_VOCAB"]

#: The largest ``vocab``: token ids are stored in the dataset's float32 inputs, exact for integers up to 2^24.
MAX_VOCAB = 2**24
#: The least share of rows with a marker (a row without one is redrawn).
MIN_MARKED = 0.01
#: Rows drawn for each row kept before the options are refused (rows with tied markers are redrawn).
MAX_DRAWS_PER_ROW = 200


def token_sequences(
    *, n_samples: int = 2000, length: int = 16, vocab: int = 32, n_classes: int = 2, marker_rate: float = 0.4, random_state: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(X, y)``: ``n_samples`` rows of token ids ``(n_samples, length)`` (int64) and their labels (see the module)."""
    for key, value, low in (
        ("n_samples", n_samples, 10),
        ("length", length, 2),
        ("n_classes", n_classes, 2),
        ("random_state", random_state, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InputError(f"data.options.{key}", f"an integer >= {low}", value)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < n_classes + 2:
        raise InputError("data.options.vocab", f"an integer >= n_classes + 2 ({n_classes + 2}: token 0, the markers and a filler)", vocab)
    if vocab > MAX_VOCAB:
        raise InputError(
            "data.options.vocab",
            f"an integer <= {MAX_VOCAB} (2^24: a dataset's inputs are float32, exact for integers up to 2^24)",
            vocab,
            "ids above it would be stored as other ids",
        )
    if isinstance(marker_rate, bool) or not isinstance(marker_rate, (int, float)) or not 0 < marker_rate <= 1:
        raise InputError("data.options.marker_rate", "a probability in (0, 1]", marker_rate)
    # a row without a marker is redrawn: below this rate most rows are, and the generator would draw for ever
    lowest = 1 - (1 - MIN_MARKED) ** (1 / length)
    if marker_rate < lowest:
        raise InputError(
            "data.options.marker_rate",
            f"a rate that puts a marker in at least {MIN_MARKED:.0%} of the rows of length {length} (>= {lowest:.3g})",
            marker_rate,
        )
    # the rows, their float32 copy (the Dataset's inputs) and a draw's temporaries: about 40 bytes a token
    check_fits_memory("data.options.n_samples", n_samples, 40.0 * n_samples * length, f"{n_samples:,} rows of {length} tokens")
    rng = np.random.default_rng(random_state)
    rows: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    kept = drawn = 0
    while kept < n_samples:
        if drawn > MAX_DRAWS_PER_ROW * n_samples:  # ties between markers discard almost every row (many classes, long rows)
            raise InputError(
                "data.options.marker_rate",
                f"a rate at which a row's most frequent marker is unique in at least 1 of {MAX_DRAWS_PER_ROW} rows "
                f"(n_classes {n_classes}, length {length})",
                marker_rate,
            )
        batch = min(max(2 * (n_samples - kept), 64), 2**20 // length + 64)
        drawn += batch
        marker = rng.random((batch, length)) < marker_rate
        X = np.where(
            marker,
            rng.integers(1, n_classes + 1, size=(batch, length)),
            rng.integers(n_classes + 1, vocab, size=(batch, length)),
        )
        counts = np.stack([(X == c + 1).sum(axis=1) for c in range(n_classes)], axis=1)
        top = counts.max(axis=1)
        unique = (counts == top[:, None]).sum(axis=1) == 1
        X, y = X[unique], counts[unique].argmax(axis=1)
        take = min(len(y), n_samples - kept)
        rows.append(X[:take])
        labels.append(y[:take])
        kept += take
    return np.concatenate(rows).astype(np.int64), np.concatenate(labels).astype(np.int64)


@register_dataset(
    "tokens",
    source="generator",
    description="token-id rows for a Hugging Face sequence classifier (numpy only): the label is the most frequent "
    "marker token; data.options: n_samples, length, vocab, n_classes, marker_rate, random_state",
)
def _load_tokens(
    *,
    n_samples: int = 2000,
    length: int = 16,
    vocab: int = 32,
    n_classes: int = 2,
    marker_rate: float = 0.4,
    random_state: int = 0,
    **_: Any,
) -> Dataset:
    X, y = token_sequences(
        n_samples=n_samples, length=length, vocab=vocab, n_classes=n_classes, marker_rate=marker_rate, random_state=random_state
    )
    return Dataset(
        "tokens",
        X.astype(np.float32),
        y,
        n_classes,
        tuple(f"marker{c + 1}" for c in range(n_classes)),
        stored_dtype="int64",
    )
