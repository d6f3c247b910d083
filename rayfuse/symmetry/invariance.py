"""The invariance check: a permutation spec is tested on the model it describes, not taken on trust.

For every group of a :class:`~rayfuse.symmetry.spec.PermutationSpec`, random permutations (seeded) are applied to the
model's tensors with the spec's own :meth:`~rayfuse.symmetry.spec.PermutationSpec.apply_torch`, and the model is run
on the example batch; a group whose permutation changes the output (beyond round-off, relative to the output's scale)
fails. Then every group that passed is permuted at once, and the first group whose addition changes the output fails
too, until the joint permutation passes.

The check runs on a copy of the model (the model itself is left as it was): in float64 for models of up to a million
parameters whose forward allows it (round-off far below any real change), else in float32 (a tolerance of ``1e-4`` of
the output's scale: float64 convolutions run several times slower on CPU); in eval mode; with its parameters perturbed
(seeded) so that initial values that happen to be symmetric (zero biases, unit LayerNorm weights, a layer scale of
``1e-6``, BatchNorm's zero means and unit variances) cannot hide a wrong permutation. A floating example batch gets
seeded noise added (a zero batch alone would exercise the biases only), or is used as it is where the model refuses
the noised one (it reads the values as ids); other examples (token ids) are used as they are.

:func:`derive_spec <rayfuse.symmetry.trace.derive_spec>` fixes the groups that fail, with the reason
:data:`INVARIANCE_REASON`; a user's explicit spec is refused instead (:func:`check_spec`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from rayfuse.errors import InputError
from rayfuse.symmetry.spec import FixedAxis, PermutationSpec

__all__ = ["INVARIANCE_REASON", "invariance_failures", "apply_invariance", "check_spec"]

INVARIANCE_REASON = "failed the invariance check"

_DRAWS = 1  # random permutations per group, then one of all groups at once (a wrong group moves the output under almost any)
_FLOAT64_PARAMETERS = 1_000_000
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}  # of the output's
# scale: round-off of reordered sums at that precision


class _LowestPrecision(torch.overrides.TorchFunctionMode):
    """The least precise floating dtype any torch function returns during a forward: a model run in float64 may cast
    parts of itself down (Hugging Face's RMSNorm computes in float32), and its round-off is then float32's."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype: torch.dtype | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.is_floating_point() and (self.dtype is None or _TOLERANCE.get(t.dtype, 0.0) > _TOLERANCE.get(self.dtype, 0.0)):
                self.dtype = t.dtype
        return out


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a model's output, in a fixed order (tuples, lists, dicts and dict-like outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for key in value:
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class _Runner:
    """A perturbed copy of the model, the batches, and the output to compare with."""

    def __init__(self, model: nn.Module, example: torch.Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model, self.batches, self.dtype = self._prepare(model, example, gen)
        self.live = self.model.state_dict(keep_vars=True)  # the copy's own tensors, written in place
        self.state = {k: v.detach().clone() for k, v in self.live.items()}
        self.base = self.outputs()
        scale = max((float(t.abs().max()) for t in self.base if t.is_floating_point() and t.numel() and t.isfinite().all()), default=0.0)
        precision = _LowestPrecision()
        with precision:
            again = self.outputs()
        lowest = self.dtype
        if precision.dtype is not None and _TOLERANCE.get(precision.dtype, 0.0) > _TOLERANCE.get(lowest, 0.0):
            lowest = precision.dtype
        self.scale = max(scale, 1e-12)
        self.tolerance = _TOLERANCE.get(lowest, 1e-4) * self.scale
        self.deterministic = self.change(again) <= self.tolerance

    @staticmethod
    def _prepare(model: nn.Module, example: torch.Tensor, gen: torch.Generator) -> tuple[nn.Module, list[torch.Tensor], torch.dtype]:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        batch = example.to(device)
        candidates = [batch]
        if example.is_floating_point():  # noised first; as given where the model reads the values as ids or indices
            candidates.insert(0, batch + torch.randn(example.shape, generator=gen).to(device=device, dtype=example.dtype))
        last: Exception | None = None
        small = sum(p.numel() for p in model.parameters()) <= _FLOAT64_PARAMETERS
        for dtype in (torch.float64, torch.float32) if small else (torch.float32,):
            for candidate in candidates:
                clone = copy.deepcopy(model).eval()
                _perturb(clone, gen)
                if dtype == torch.float64:
                    clone = clone.double()
                xs = [candidate.to(dtype) if candidate.is_floating_point() else candidate]
                try:
                    with torch.no_grad():
                        for x in xs:
                            clone(x)
                except Exception as exc:  # a forward that needs float32 (constants it makes itself), or ids: try the next
                    last = exc
                    continue
                return clone, xs, dtype
        message = (str(last).strip().splitlines() or [""])[0][:160]
        raise InputError(
            "input", "an example batch the model accepts", f"shape {tuple(example.shape)}", f"{type(last).__name__}: {message}"
        )

    def outputs(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [t.detach() for x in self.batches for t in _tensors(self.model(x))]

    def change(self, outputs: list[torch.Tensor]) -> float:
        """The largest difference from the unpermuted output (``inf`` where shapes or non-finite values differ)."""
        if len(outputs) != len(self.base):
            return math.inf
        worst = 0.0
        for a, b in zip(self.base, outputs):
            if a.shape != b.shape or a.dtype != b.dtype:
                return math.inf
            if not a.is_floating_point():
                if not torch.equal(a, b):
                    return math.inf
                continue
            if not torch.equal(a.isfinite(), b.isfinite()) or not torch.equal(a[~a.isfinite()], b[~b.isfinite()]):
                return math.inf
            finite = a.isfinite()
            if finite.any():
                worst = max(worst, float((a[finite] - b[finite]).abs().max()))
        return worst

    def permuted(self, spec: PermutationSpec, perms: Mapping[str, np.ndarray]) -> float:
        """The change of the output with ``perms`` applied by the spec's own :meth:`PermutationSpec.apply_torch`."""
        permuted = spec.apply_torch(self.state, perms)
        touched = [k for k in permuted if permuted[k] is not self.state[k]]
        try:
            with torch.no_grad():
                for k in touched:  # tied names share one tensor: each writes the same permuted values
                    self.live[k].copy_(permuted[k])
            return self.change(self.outputs())
        finally:
            with torch.no_grad():
                for k in touched:
                    self.live[k].copy_(self.state[k])


def _perturb(model: nn.Module, gen: torch.Generator) -> None:
    """Seeded noise on every floating parameter (scaled to its values) and buffer (positive buffers stay positive)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel():
                p.add_(torch.randn(p.shape, generator=gen).to(p) * (0.1 * float(p.abs().mean()) + 0.05))
        for b in model.buffers():
            if b.is_floating_point() and b.numel() and b.isfinite().all():
                noise = torch.randn(b.shape, generator=gen).to(b)
                if bool((b > 0).all()):
                    b.mul_(torch.exp(0.2 * noise))
                else:
                    b.add_(noise * (0.1 * float(b.abs().mean()) + 0.05))


def _draw(rng: np.random.Generator, size: int) -> np.ndarray:
    perm = rng.permutation(size)
    for _ in range(16):  # two units: one permutation in two is the identity
        if not np.array_equal(perm, np.arange(size)):
            break
        perm = rng.permutation(size)
    return perm


def invariance_failures(model: nn.Module, spec: PermutationSpec, example: torch.Tensor, *, seed: int = 0) -> dict[str, str]:
    """The groups of ``spec`` whose random permutations change ``model``'s output on ``example``, each with the reason
    (see the module docstring). Every group fails when the model's output is not deterministic (nothing to compare)."""
    if not spec.groups:
        return {}
    runner = _Runner(model, example, seed)
    if not runner.deterministic:
        return {g.name: f"{INVARIANCE_REASON} (the model's output differs between two runs: nothing to compare with)" for g in spec.groups}
    rng = np.random.default_rng(seed)
    failures: dict[str, str] = {}

    def fail(name: str, change: float) -> None:
        scale = runner.scale
        failures[name] = (
            f"{INVARIANCE_REASON} (a random permutation of its {spec.group(name).size} units changed the output by "
            f"{change / scale:.2g} of its scale)"
        )

    for g in spec.groups:
        for _ in range(_DRAWS):
            change = runner.permuted(spec, {g.name: _draw(rng, g.size)})
            if change > runner.tolerance:
                fail(g.name, change)
                break
    passing = [g for g in spec.groups if g.name not in failures]
    joint = {g.name: _draw(rng, g.size) for g in passing}
    while joint and runner.permuted(spec, joint) > runner.tolerance:
        names = list(joint)
        for k in range(1, len(names) + 1):  # the first group whose addition changes the output
            change = runner.permuted(spec, {n: joint[n] for n in names[:k]})
            if change > runner.tolerance:
                fail(names[k - 1], change)
                del joint[names[k - 1]]
                break
        else:  # cannot happen (the whole set failed): fail them all rather than loop
            for n in names:
                fail(n, math.inf)
            joint = {}
    return failures


def apply_invariance(spec: PermutationSpec, failures: Mapping[str, str]) -> PermutationSpec:
    """``spec`` with the failing groups moved to its fixed axes, with their reasons."""
    if not failures:
        return spec
    fixed = list(spec.fixed)
    for g in spec.groups:
        if g.name in failures:
            fixed.extend(FixedAxis(a.key, a.dim, f"{g.name}: {failures[g.name]}") for a in g.axes)
    return PermutationSpec(tuple(g for g in spec.groups if g.name not in failures), tuple(fixed), spec.notes)


def check_spec(model: nn.Module, spec: PermutationSpec, example: torch.Tensor | None, *, where: str = "spec") -> PermutationSpec:
    """A user's explicit ``spec`` checked against ``model``: its groups permute disjoint units of each axis, and (given
    an example batch) every group passes the invariance check. One line naming the first group that does not."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    spec.check(shapes, where=where)
    spec.check_disjoint(shapes, where=where)
    if example is not None:
        failures = invariance_failures(model, spec, example)
        for g in spec.groups:
            if g.name in failures:
                raise InputError(f"{where}.{g.name}", "a group whose permutations leave the model's output unchanged", failures[g.name])
    return spec
