"""Deterministic seeds.

Seeds are derived from the run seed and a tuple of tags (client id, method, round...) with
``numpy.random.SeedSequence``; never from ``hash(str)``, which Python salts per process. The same tags give the same
seed in every process, so a resumed run, a restarted actor and an in-process test all draw the same numbers.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["derive_seed", "make_rng"]


def _tag_to_int(tag: object) -> int:
    if isinstance(tag, (int, np.integer)) and not isinstance(tag, bool):
        return int(tag) & 0xFFFFFFFF
    return zlib.crc32(str(tag).encode("utf-8"))


def derive_seed(seed: int, *tags: object) -> int:
    """Return a 32-bit seed determined by ``seed`` and ``tags`` (stable across processes and platforms)."""
    sequence = np.random.SeedSequence(entropy=int(seed), spawn_key=tuple(_tag_to_int(t) for t in tags))
    return int(sequence.generate_state(1, dtype=np.uint32)[0])


def make_rng(seed: int, *tags: object) -> np.random.Generator:
    """A ``numpy.random.Generator`` seeded with :func:`derive_seed`."""
    return np.random.default_rng(derive_seed(seed, *tags))
