"""Partitioners: split a labelled pool across clients.

Names follow flwr-datasets and the FedMA / PFNM family:

* ``iid`` (alias ``homo``): a random permutation split into near-equal parts.
* ``dirichlet`` (alias ``hetero-dir``): for each class ``k``, client proportions ``p ~ Dir_J(alpha)``; with the PFNM
  balancing rule a client already holding ``>= N/J`` samples gets no more; the whole draw is repeated until every
  client holds at least ``min_size`` samples [PFNM : experiment.py ``partition_data``].
* ``labels``: explicit label groups (GEMS' ``{0,1},{2,3},...``); a label held by several clients is split evenly
  among them.
* ``pathological``: ``classes_per_client`` classes per client, the first ``i mod C`` and the rest drawn at random
  (flwr-datasets' ``first-deterministic`` mode); each class is split evenly among its holders.
* ``shards``: sort by label, cut into ``num_clients * shards_per_client`` shards, deal them out at random
  (McMahan et al. 2017).
* ``subsets``: each client draws its own random subset of the pool, a fraction drawn uniformly from
  ``subset_fraction = [low, high]``; subsets of different clients **overlap** (FedRef's MNIST setting: each of 10
  clients takes ``random_split(train, [i, 1 - i])`` with ``i`` in 40-90 % [FEDREF @ 737c333]).

Each partitioner takes the label array of the pool, the number of clients and a ``numpy.random.Generator`` and returns
one sorted ``int64`` index array per client. Indices never repeat across clients, except with the partitioners in
``OVERLAPPING``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from rayfuse.errors import InputError
from rayfuse.registry import Registry

__all__ = ["PARTITIONERS", "OVERLAPPING", "partition", "class_counts"]

Partitioner = Callable[..., list[np.ndarray]]
PARTITIONERS: Registry[Partitioner] = Registry("partitioner")


def _finish(parts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def partition_iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(len(labels))
    return _finish(np.array_split(order, num_clients))


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.5,
    balance: bool = True,
    min_size: int = 10,
    max_attempts: int = 1000,
) -> list[np.ndarray]:
    """PFNM's ``hetero-dir`` split (Yurochkin et al. 2019), with the balancing rule optional."""
    n = len(labels)
    classes = np.unique(labels)
    if min_size * num_clients > n:
        raise InputError("partition.min_size", f"at most pool size / num_clients ({n // num_clients})", min_size)
    for _ in range(max_attempts):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for k in classes:
            idx_k = np.flatnonzero(labels == k)
            rng.shuffle(idx_k)
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            if balance:
                # PFNM balancing rule: a client that already holds >= N/J samples receives no more of this class.
                open_ = np.array([len(p) < n / num_clients for p in parts])
                masked = proportions * open_
                if masked.sum() > 0:
                    proportions = masked
                elif open_.any():
                    # Every open client's share underflowed to 0 (alpha << 1); PFNM would divide by zero. The draw
                    # restricted to the open clients is then, in the limit, the whole class on one open client.
                    proportions = np.zeros(num_clients)
                    proportions[rng.choice(np.flatnonzero(open_))] = 1.0
                # else every client is full (PFNM divides by zero): keep the raw draw
            # Departure from PFNM's code, which normalises the proportions and then truncates cumsum * n: the
            # normalised cumsum can end at 1 - 1e-16 before a closed (zero-proportion) last client, whose chunk then
            # gets a sample. Dividing by the last partial sum makes trailing zeros cut at exactly len(idx_k).
            cumulative = np.cumsum(proportions)
            cuts = (cumulative / cumulative[-1] * len(idx_k)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(idx_k, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return _finish(parts)
    raise InputError(
        "partition.min_size",
        f"a size every client reaches within {max_attempts} Dirichlet draws",
        min_size,
        "raise partition.alpha or lower partition.min_size",
    )


def partition_labels(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, groups: Sequence[Sequence[int]]
) -> list[np.ndarray]:
    """Explicit label groups; a label shared by several clients is split evenly among them."""
    if len(groups) != num_clients:
        raise InputError("partition.groups", f"one label list per client ({num_clients})", len(groups))
    present = set(np.unique(labels).tolist())
    num_classes = int(labels.max()) + 1 if len(labels) else 0
    for i, group in enumerate(groups):
        for j, label in enumerate(group):
            if not 0 <= int(label) < num_classes:
                raise InputError(f"partition.groups[{i}][{j}]", f"a label in 0..{num_classes - 1}", label)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for label in sorted(present):
        holders = [i for i, group in enumerate(groups) if label in set(int(g) for g in group)]
        if not holders:
            continue  # unassigned: recorded in the data plan
        idx = rng.permutation(np.flatnonzero(labels == label))
        for holder, chunk in zip(holders, np.array_split(idx, len(holders))):
            parts[holder].extend(chunk.tolist())
    return _finish(parts)


def partition_pathological(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, classes_per_client: int = 2
) -> list[np.ndarray]:
    classes = np.unique(labels)
    num_classes = len(classes)
    if classes_per_client > num_classes:
        raise InputError("partition.classes_per_client", f"at most the number of classes ({num_classes})", classes_per_client)
    groups = []
    for i in range(num_clients):
        first = classes[i % num_classes]
        rest = rng.choice(classes[classes != first], size=classes_per_client - 1, replace=False)
        groups.append([int(first), *(int(c) for c in rest)])
    return partition_labels(labels, num_clients, rng, groups=groups)


def partition_shards(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, shards_per_client: int = 2, shard_size: int | None = None
) -> list[np.ndarray]:
    total = num_clients * shards_per_client
    size = shard_size or len(labels) // total
    if size < 1 or size * total > len(labels):
        raise InputError(
            "partition.shard_size" if shard_size else "partition.shards_per_client",
            f"shards that fit in the pool ({len(labels)} samples for {total} shards)",
            shard_size or shards_per_client,
        )
    order = rng.permutation(len(labels))
    order = order[np.argsort(labels[order], kind="stable")]  # by label, ties in random order
    shard_ids = rng.permutation(total)
    parts = [np.concatenate([order[s * size : (s + 1) * size] for s in shard_ids[c::num_clients]]) for c in range(num_clients)]
    return _finish(parts)


def partition_subsets(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, subset_fraction: Sequence[float] = (0.4, 0.9)
) -> list[np.ndarray]:
    """Independent random subsets, one per client, each of ``round(f * n)`` samples with ``f ~ U[low, high]``.

    The authors' code draws ``i = randint(4, 9) / 10`` (tenths); a continuous uniform over the same range is used here
    so that ``subset_fraction`` can be any interval. Subsets overlap across clients (never within one).
    """
    low, high = (float(f) for f in subset_fraction)
    n = len(labels)
    parts = []
    for _ in range(num_clients):
        size = max(1, int(round(rng.uniform(low, high) * n)))
        parts.append(rng.choice(n, size=size, replace=False))
    return _finish(parts)


PARTITIONERS.register("iid", partition_iid, aliases=("homo",))
PARTITIONERS.register("dirichlet", partition_dirichlet, aliases=("hetero-dir",))
PARTITIONERS.register("labels", partition_labels)
PARTITIONERS.register("pathological", partition_pathological)
PARTITIONERS.register("shards", partition_shards)
PARTITIONERS.register("subsets", partition_subsets)

OVERLAPPING = frozenset({"subsets"})  # partitioners whose clients may share samples


def partition(labels: np.ndarray, num_clients: int, method: str, *, seed: int | np.random.Generator, **params: object) -> list[np.ndarray]:
    """Split ``labels``' indices among ``num_clients`` with partitioner ``method``.

    Parameters
    ----------
    labels : ndarray of int, shape (n,)
    num_clients : int
    method : str
        A registered partitioner name or alias.
    seed : int or numpy Generator
        The same seed gives the same split.
    **params
        The partitioner's parameters (``alpha``, ``groups``...).

    Returns
    -------
    list of ndarray
        One sorted index array per client.
    """
    labels = np.asarray(labels)
    if num_clients > len(labels):
        raise InputError("partition.num_clients", f"at most the pool size ({len(labels)})", num_clients)
    fn = PARTITIONERS.get(method, path="partition.method")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    parts = fn(labels, num_clients, rng, **params)
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise InputError(
            "partition", "every client to receive samples", f"client {empty[0]} got none", "use fewer clients or another partitioner"
        )
    return parts


def class_counts(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Counts per client and class, shape ``(num_clients, num_classes)``."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts]) if parts else np.zeros((0, num_classes), int)
