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
from typing import Any

import torch

__all__ = ["TensorMerge", "MergeFn", "StreamFn", "Loader"]

# (base or None, fine-tuned models' tensors, each model's parameters, the global parameters, one generator per model:
# a data-aware merge gets each model's statistic tensor there instead)
MergeFn = Callable[
    [torch.Tensor | None, Sequence[torch.Tensor], Sequence[Mapping[str, float]], Mapping[str, float | bool], Sequence[Any]],
    torch.Tensor,
]
# a loader gives one model's tensor as a fresh tensor of the compute dtype that the merge may overwrite
Loader = Callable[[], torch.Tensor]
# the same merge reading each model's tensor from its loader when it needs it (base's loader or None first): merges that
# hold a fixed number of tensors whatever the number of models
StreamFn = Callable[
    [Loader | None, Sequence[Loader], Sequence[Mapping[str, float]], Mapping[str, float | bool], Sequence[Any]],
    torch.Tensor,
]


@dataclass(frozen=True)
class TensorMerge:
    """One registered tensor-by-tensor merge.

    ``per_model`` and ``globals`` name the parameters it reads and their defaults (``None``: required); ``base``
    whether it needs ``base_model:`` ("required"), may take one ("optional") or takes none ("none"); ``exact`` whether
    it is deterministic (no random drop), so its output can be compared to its reference tensor for tensor;
    ``spectral`` whether 2-D tensors are merged through their singular value decomposition; ``reference`` the paper and
    the code it follows. ``stream``: the same merge from loaders (:data:`StreamFn`), which the runner calls instead of
    ``fn`` where given; ``models``: how many fine-tuned models it takes (at least, at most: ``None`` for no bound);
    ``statistics``: the statistic each model's ``statistics:`` file holds ("fisher" or "gram") for the data-aware
    merges, which the runner hands them instead of generators; ``choices``: the values a parameter that is not a number
    may take; ``aliases``: other names it answers to; ``check``: a rule between its parameters, run on every tensor's
    values before anything is written."""

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
    stream: StreamFn | None = None
    models: tuple[int, int | None] = (1, None)
    statistics: str | None = None
    choices: Mapping[str, tuple[object, ...]] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    # a rule between parameters no single bound says, on one tensor's values: (key, expected, got) when broken
    check: Callable[[Sequence[Mapping[str, float]], Mapping[str, float | bool]], tuple[str, str, object] | None] | None = None

    def merge(
        self,
        base: Loader | None,
        tuned: Sequence[Loader],
        per_model: Sequence[Mapping[str, float]],
        globals_: Mapping[str, float | bool],
        generators: Sequence[Any],
    ) -> torch.Tensor:
        """One tensor's merge from its loaders: ``stream`` where the merge has one, else ``fn`` on the loaded tensors."""
        if self.stream is not None:
            return self.stream(base, tuned, per_model, globals_, generators)
        return self.fn(base() if base is not None else None, [load() for load in tuned], per_model, globals_, generators)
