"""The one shape of a tensor-by-tensor merge: what ``rayfuse fuse`` calls for each tensor name of a set of checkpoints.

A merge receives one tensor name's values from every model (float32, or float64 where the checkpoint holds float64),
the base's value when the merge takes a base, each model's own parameters and the global ones (mergekit's
spellings), and returns the merged tensor. It may overwrite the tensors it is given (each is a fresh copy read for it),
never keeps them, and holds at its peak about ``peak(models)`` tensors of that size (the runner's memory budget reads
it). A merge that draws random numbers uses the generators it is given, one per fine-tuned model, seeded from the
run's seed, the model's position and the tensor's name, so the result does not depend on the order threads take the
tensors in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["TensorMerge", "MergeFn"]

# (base or None, fine-tuned models' tensors, each model's parameters, the global parameters, one generator per model)
MergeFn = Callable[
    [torch.Tensor | None, Sequence[torch.Tensor], Sequence[Mapping[str, float]], Mapping[str, float | bool], Sequence[torch.Generator]],
    torch.Tensor,
]


@dataclass(frozen=True)
class TensorMerge:
    """One registered tensor-by-tensor merge.

    ``per_model`` and ``globals`` name the parameters it reads and their defaults (``None``: required); ``base``
    whether it needs ``base_model:`` ("required"), may take one ("optional") or takes none ("none"); ``exact`` whether
    it is deterministic (no random drop), so its output can be compared to its reference tensor for tensor;
    ``spectral`` whether 2-D tensors are merged through their singular value decomposition; ``reference`` the paper and
    the code it follows."""

    name: str
    fn: MergeFn
    summary: str
    reference: str
    per_model: Mapping[str, float | None] = field(default_factory=dict)
    globals: Mapping[str, float | bool | None] = field(default_factory=dict)
    base: str = "required"
    exact: bool = True
    spectral: bool = False
    peak: Callable[[int], float] = lambda models: models + 2.0
