"""Streaming aggregation: a round's sum-decomposable rule folded reply by reply, never holding the K updates.

The rules that are a sum of per-client terms, ``mean`` (weighted or not), ``mean`` with ``clip_norm`` and central
DP-FedAvg's clipped-and-noised sum, are computed as a running sum: each reply is validated exactly as the gathered
path validates it (:func:`update_problem`), clipped where the rule clips, added with its weight, and dropped. The
coordinator then holds the running sum and the reply in hand, about 2 x the model beside the global model it
broadcast, whatever the number of clients.

The same fold runs where the clients are (``federation.aggregation: per_actor``): :class:`RoundFold` is the
:class:`rayfuse.federation.Reducer` an actor hosting several clients runs over their replies, and it sends one
:class:`PartialSum` (the weighted sum, its total weight, each client's count and metrics, never its parameters)
instead of k updates; the coordinator folds partial sums into the same running sum. On a cluster
(``federation.aggregation: per_node``) an aggregator on each node folds that node's partial sums once more
(:class:`NodeFold`), so one partial sum per node crosses the network.

Nothing here imports Ray.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from scipy.linalg.blas import get_blas_funcs

from rayfuse.memory import LARGE_MODEL_BYTES, return_freed_memory
from rayfuse.method import Folded, Update

__all__ = ["Fold", "NodeFold", "PartialSum", "RoundFold", "RunningSum", "nonfinite", "partial_problem", "update_problem", "SMALL_TENSOR"]

Params = dict[str, np.ndarray]

#: Tensors with fewer elements than this are summed in float64 (their memory is negligible); larger float tensors in
#: their own dtype (float16/bfloat16-like: float32), as the gathered kernel (:func:`rayfuse.updates.aggregate.weighted_sum`)
#: sums them: sequential ``axpy`` in float32. So the running sum of a float32 model costs 1 x the model, not 2 x (float64
#: would double it and break the 2-3 x bound), and it differs from the gathered path's sum only by the order of the
#: additions (arrival order instead of client order) and one final scaling: a few float32 ulps times K at most
#: (``tests/updates/test_streaming.py`` bounds it). In float64, a float32 value times an integer weight (a sample count)
#: is exact, and so are the sums of such terms while their exponents span fewer than 53 bits, so the small tensors'
#: sums do not depend on the order the replies arrive in; the large tensors' float32 sums do, in the last bits, on Ray
#: (``federation.streaming: false`` gathers and sums in client order, bit for bit reproducible).
SMALL_TENSOR = 1 << 16


def update_problem(
    update: Any, planned: int | Callable[[], int], reference: Mapping[str, np.ndarray], *, check_finite: bool = True
) -> str | None:
    """Why ``update`` is not a valid reply (the update pipeline's stage 1), or ``None``: an :class:`Update` whose
    count is the client's ``planned`` training-set size (or a callable giving it, asked only for an update with a
    positive count: a reply that is no update is refused without looking the client up in the plan), with
    ``reference``'s keys, shapes and dtypes, finite values (``check_finite``) and finite metrics."""
    from rayfuse.models import check_params

    if not isinstance(update, Update):
        return f"expected an Update, got {type(update).__name__}"
    if not isinstance(update.num_examples, (int, np.integer)) or update.num_examples <= 0:
        return f"num_examples must be a positive integer, got {update.num_examples!r}"
    if callable(planned):
        planned = planned()
    if update.num_examples != planned:
        return f"num_examples {update.num_examples} is not the client's {planned} training examples of the partition plan"
    reason = check_params(update.params, reference, check_finite=False)
    if reason is None and check_finite:
        reason = nonfinite(update.params)
    if reason is None and not all(np.isfinite(v) for v in update.metrics.values()):
        reason = "non-finite metric values " + str({k: v for k, v in update.metrics.items() if not np.isfinite(v)})
    return reason


def nonfinite(params: Mapping[str, Any]) -> str | None:
    """``"<key>: NaN or Inf values"`` for the first tensor of ``params`` holding one, else ``None``. A float32/float64
    tensor is screened with one BLAS dot product of it with itself (finite when every value is; no temporary array,
    a fraction of ``np.isfinite``'s time: a streamed round screens every reply, not only the average); only a
    non-finite product (a NaN/Inf, or squares that overflow) is checked value by value."""
    for key, value in params.items():
        array = np.asarray(value)
        if array.dtype.kind not in "fc":
            continue
        if array.dtype in (np.float32, np.float64) and array.flags.c_contiguous:
            flat = array.reshape(-1)
            if np.isfinite(np.dot(flat, flat)):
                continue
        if not np.isfinite(array).all():
            return f"{key}: NaN or Inf values"
    return None


@dataclass
class PartialSum:
    """The folded replies of the clients one process hosts: ``total`` (the weighted sum of their models, or central
    DP's sum of clipped updates in float64), its total ``weight``, each client's ``(num_examples, metrics)`` and each
    rejected client's reason; ``unclipped``: central DP, how many updates were within the clip norm (adaptive
    clipping's count, which the coordinator noises)."""

    total: Params
    weight: float
    clients: dict[int, tuple[int, dict[str, float]]]
    rejected: dict[int, str] = field(default_factory=dict)
    unclipped: int = 0


class RunningSum:
    """``sum_k w_k x_k`` folded one model at a time (``kind="mean"``), or central DP's ``sum_k clip(x_k - g, C)`` in
    float64 with the count of updates within ``C`` (``kind="dp"``).

    ``mean`` with ``clip_norm`` clips each model against ``reference`` first, exactly as
    :func:`rayfuse.updates.robust.clip_updates` does on the gathered path."""

    def __init__(self, reference: Mapping[str, np.ndarray], kind: Literal["mean", "dp"], clip_norm: float | None) -> None:
        self.reference = reference
        self.kind = kind
        self.clip_norm = clip_norm
        self.total: Params = {}
        self.weight = 0.0
        self.unclipped = 0
        if sum(np.asarray(v).nbytes for v in reference.values()) >= LARGE_MODEL_BYTES:
            return_freed_memory()  # the folded replies and the round's temporaries, freed, leave the resident set

    def _acc_dtype(self, value: np.ndarray) -> np.dtype:
        if self.kind == "dp" or value.dtype.kind != "f" or value.size < SMALL_TENSOR:
            return np.dtype(np.float64)  # small tensors and integer buffers: float64 (negligible memory)
        return value.dtype if value.dtype in (np.float32, np.float64) else np.dtype(np.float32)

    def _add(self, key: str, value: np.ndarray, weight: float) -> None:
        acc = self.total.get(key)
        if acc is None:
            acc = np.empty(value.shape, dtype=self._acc_dtype(value))
            # in the sum's dtype: a float32 product would round the first reply's term differently from the others'
            np.multiply(value.astype(acc.dtype, copy=False), weight, out=acc)
            self.total[key] = acc
            return
        flat = acc.reshape(-1)
        x = np.ravel(value)
        if acc.dtype in (np.float32, np.float64):
            # one fused BLAS pass, in place (acc is contiguous), as the gathered kernel adds each input
            get_blas_funcs("axpy", dtype=acc.dtype)(x if x.dtype == acc.dtype else x.astype(acc.dtype), flat, a=weight)
        else:
            flat += weight * x

    def add(self, params: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one validated model (clipped first where the rule clips)."""
        if self.kind == "dp":
            self._add_dp(params)
            return
        if self.clip_norm is not None:
            from rayfuse.updates.robust import clip_updates

            params = clip_updates([params], self.reference, self.clip_norm)[0]
        for key, value in params.items():
            self._add(key, np.asarray(value), float(weight))
        self.weight += float(weight)

    def _add_dp(self, params: Mapping[str, np.ndarray]) -> None:
        # clip_and_sum's arithmetic for one model, one tensor at a time (no full float64 copy of the update)
        assert self.clip_norm is not None
        keys = [k for k, v in self.reference.items() if np.asarray(v).dtype.kind == "f"]
        squared = 0.0
        for k in keys:
            d = np.asarray(params[k], dtype=np.float64) - np.asarray(self.reference[k], dtype=np.float64)
            squared += float(np.vdot(d, d))
        norm = math.sqrt(squared)
        scale = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        for k in keys:
            d = np.asarray(params[k], dtype=np.float64) - np.asarray(self.reference[k], dtype=np.float64)
            d *= scale
            if k in self.total:
                self.total[k] += d
            else:
                self.total[k] = d
        self.unclipped += int(norm <= self.clip_norm)
        self.weight += 1.0

    def add_partial(self, partial: PartialSum) -> None:
        """Fold another process's :class:`PartialSum` (its weights already applied)."""
        for key, value in partial.total.items():
            self._add(key, np.asarray(value), 1.0)
        self.weight += float(partial.weight)
        self.unclipped += int(partial.unclipped)

    def dp_total(self) -> Params:
        """Central DP: the clipped updates' sum (zeros when nothing was folded: the round is noise alone)."""
        return {
            k: self.total[k] if k in self.total else np.zeros(np.asarray(v).shape, dtype=np.float64)
            for k, v in self.reference.items()
            if np.asarray(v).dtype.kind == "f"
        }

    def mean(self) -> Params:
        """The weighted mean ``sum_k w_k x_k / sum_k w_k`` in the reference's dtypes (integer buffers rounded, as
        :func:`rayfuse.updates.aggregate.weighted_average` rounds them). Consumes the running sum (scaled in place)."""
        if self.weight <= 0:
            raise ValueError("nothing to average")
        out: Params = {}
        inverse = 1.0 / self.weight
        for key, ref in self.reference.items():
            acc = self.total.pop(key)
            dtype = np.asarray(ref).dtype
            acc *= inverse
            out[key] = acc if acc.dtype == dtype else (np.rint(acc) if dtype.kind != "f" else acc).astype(dtype)
        return out


def partial_problem(
    partial: Any, reference: Mapping[str, np.ndarray], planned: Mapping[int, int], *, weighted: bool, kind: str
) -> str | None:
    """Why a :class:`PartialSum` from a process cannot be folded, or ``None``: its clients' counts against the
    partition plan and the weight they add up to, finite metrics, and its total's keys, shapes and finite values."""
    if not isinstance(partial, PartialSum):
        return f"expected a partial sum, got {type(partial).__name__}"
    for client, (count, metrics) in partial.clients.items():
        if count != planned.get(client):
            return (
                f"client {client}: num_examples {count} is not the client's {planned.get(client)} training examples of the partition plan"
            )
        if not all(np.isfinite(v) for v in metrics.values()):
            return f"client {client}: non-finite metric values"
    expected = float(sum(n for n, _ in partial.clients.values())) if weighted and kind == "mean" else float(len(partial.clients))
    if not math.isclose(partial.weight, expected):
        return f"partial sum weight {partial.weight} is not its clients' {expected}"
    layout = {k: np.asarray(v).shape for k, v in reference.items() if kind == "mean" or np.asarray(v).dtype.kind == "f"}
    if set(partial.total) != set(layout):
        return f"partial sum keys {sorted(partial.total)[:3]}... are not the model's"
    for key, shape in layout.items():
        value = np.asarray(partial.total[key])
        if value.shape != shape:
            return f"partial sum {key}: shape {value.shape}, expected {shape}"
    problem = nonfinite(partial.total)
    return None if problem is None else f"partial sum {problem}"


@dataclass(frozen=True)
class RoundFold:
    """The round's fold as a :class:`rayfuse.federation.Reducer`: run where several clients are hosted, it validates
    each client's reply as the coordinator would (:func:`update_problem`, against the broadcast model, the call's
    positional argument ``reference_arg``), clips it where the rule clips, and folds it; it returns one
    :class:`PartialSum`. ``kind``: ``mean`` (weights: sample counts if ``weighted``, else 1) or ``dp`` (each update
    clipped to ``clip_norm``, weight 1; the noise is added once, by the coordinator)."""

    kind: Literal["mean", "dp"]
    weighted: bool
    planned: Mapping[int, int]
    clip_norm: float | None
    reference_arg: int = 0

    def weight(self, update: Update) -> float:
        return float(update.num_examples) if self.weighted and self.kind == "mean" else 1.0

    def reduce(self, replies: Any) -> PartialSum:
        return Fold(self, partials=False).over(replies)  # a client's own reply is an Update: it speaks for no other


class Fold:
    """The one fold of a round's replies, wherever it runs (an actor hosting several clients, a node's aggregator, the
    coordinator): each :class:`Update` validated (:func:`update_problem`) and added to one :class:`RunningSum` with
    its weight, or recorded as rejected with its reason; with ``partials``, a :class:`PartialSum` from a process is
    checked (:func:`partial_problem`: a bad one rejects its clients) and added whole, and a
    :class:`~rayfuse.method.Folded` marker (a client whose contribution travels in another's partial sum) is skipped.
    Each value is dropped once added: the fold holds the running sum and the reply in hand, never the round."""

    def __init__(self, spec: RoundFold, *, partials: bool) -> None:
        self.spec = spec
        self.partials = partials
        self.sum: RunningSum | None = None
        self.clients: dict[int, tuple[int, dict[str, float]]] = {}
        self.rejected: dict[int, str] = {}  # in the order the rejections were found

    def _sum(self, reference: Mapping[str, np.ndarray]) -> RunningSum:
        if self.sum is None:
            self.sum = RunningSum(reference, self.spec.kind, self.spec.clip_norm)
        return self.sum

    def add(self, client: int, value: Any, reference: Mapping[str, np.ndarray]) -> None:
        spec = self.spec
        if self.partials and isinstance(value, PartialSum):
            self.rejected.update(value.rejected)
            if not value.clients:
                return
            problem = partial_problem(value, reference, spec.planned, weighted=spec.weighted, kind=spec.kind)
            if problem is not None:
                self.rejected.update({c: problem for c in sorted(value.clients)})
                return
            self._sum(reference).add_partial(value)
            self.clients.update(value.clients)
        elif self.partials and isinstance(value, Folded):
            return  # its contribution is in its process's partial sum
        else:
            reason = update_problem(value, int(spec.planned.get(client, -1)), reference)
            if reason is not None:
                self.rejected[client] = reason
                return
            self._sum(reference).add(value.params, spec.weight(value))
            self.clients[client] = (int(value.num_examples), {k: float(v) for k, v in value.metrics.items()})

    def over(self, replies: Any) -> PartialSum:
        """A :class:`rayfuse.federation.Reducer`'s replies ``(client, value, args)`` folded, each against the broadcast
        model among its call's arguments (``reference_arg``), and dropped once added: :meth:`partial`."""
        for client, value, args in replies:
            self.add(client, value, args[self.spec.reference_arg])
            del value
        return self.partial()

    def partial(self) -> PartialSum:
        """What was folded, as one :class:`PartialSum` (empty when nothing valid arrived)."""
        if self.sum is None:
            return PartialSum({}, 0.0, {}, dict(self.rejected))
        return PartialSum(self.sum.total, self.sum.weight, dict(self.clients), dict(self.rejected), self.sum.unclipped)


@dataclass(frozen=True)
class NodeFold:
    """``federation.aggregation: per_node``: the :class:`rayfuse.federation.Reducer` that folds the replies of every
    process on one node (each a :class:`PartialSum` from :class:`RoundFold`, or a single client's reply) into one
    :class:`PartialSum`, with the same :class:`Fold`: one partial sum per node crosses the network to the coordinator.
    ``fold``: the round's per-process fold (its kind, weights, clip norm, plan and the position of the broadcast model
    among the call's arguments)."""

    fold: RoundFold

    def reduce(self, replies: Any) -> PartialSum:
        return Fold(self.fold, partials=True).over(replies)
