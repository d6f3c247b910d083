"""Secure aggregation over the engine: a round's sum computed with SecAgg+ (:mod:`rayfuse.updates.secagg`), so the
server learns the sum of the cohort's uploads and nothing else about any one client (``federation.secure_aggregation``).

A secure round is four calls on the cohort through the federation (its failure policy, retries and timeouts apply to
each): ``secagg.setup`` (each client makes its key pairs; the server sends ids and the graph seed),
``secagg.share_keys`` (each client secret-shares its self-mask seed and mask key to its neighbours, encrypted for
them), ``secagg.masked`` (each client runs the method's own step, e.g. ``fedavg.fit``, validates and encodes its
update, masks it and sends the masked vector and its count) and ``secagg.unmask`` (the survivors send the shares that
remove the masks). Each stage's message is one broadcast object in which every client finds its own part (the public
keys; the shares, encrypted for their receiver). A client that fails a stage is left out of the rest of the round
(``on_client_failure: drop``); its pairwise masks are removed with its neighbours' shares when it dropped after sharing
keys; with fewer than ``reconstruction_threshold`` survivors the round fails (a :class:`~rayfuse.errors.SecAggFailure`),
and ``rayfuse run --resume`` repeats it.

What a client sends, as signed integer levels (:class:`SumEncoding`): its update's change from the broadcast model,
each entry clipped to ``[-c, c]`` and rounded to a multiple of the step ``2c / quantization_range`` (integer buffers
exactly), multiplied by its integer weight (its sample count for a weighted mean, else 1); its weight; how many of
its entries were clipped; under central DP whether its update was within the clip norm; and its metrics
(``train_loss``...) at a step of 2^-10, weighted by its count. The weights are exact integers, so the server's weighted mean is off
from the plain one by at most half a step per entry (against the clipped updates; :attr:`SumEncoding.error_bound`),
and every count it reads is exact. The server knows a client's count from the partition plan; it sends it in the clear,
and the sum's weight must equal the survivors' planned counts. It never sees one client's update or metrics: each
kept client's record carries its count and the cohort's mean metrics.

Beyond the round's model update: :func:`secure_round` takes any client step and an :class:`Encoding` of its reply
(:class:`ArraySum`: a dict of float arrays, each key with its own fixed-point step and range), so a method whose
server needs only a sum of statistics or predictions runs it the same way and reads back the sums alone. Where no
one knows the arrays' scale in advance (a Fisher, a Gram), :class:`ScaledSum` runs two sums: the power-of-two band of
each key's largest entry, then the arrays at a step set from the highest band.

Nothing here imports Ray: the engine's federation runs the steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from rayfuse.errors import InputError, SecAggFailure
from rayfuse.method import Folded, client_step
from rayfuse.updates.secagg import SecAggClient, SecAggParams, SecAggServer
from rayfuse.updates.streaming import update_problem

__all__ = [
    "ArraySum",
    "Encoding",
    "discrete_gaussian",
    "METRICS",
    "Masked",
    "MaskedFold",
    "MaskedSum",
    "ScaledSum",
    "SecureSum",
    "SumEncoding",
    "level_bits",
    "neighbourhood",
    "ring_bits",
    "secure_params",
    "secure_round",
]

Params = dict[str, np.ndarray]

#: the metrics a secure round sums (weighted by the clients' counts): the cohort's means are all the server learns
METRICS = ("train_loss", "train_seconds", "eval_seconds")
METRIC_STEP = 2.0**-10  # a metric's resolution in the sum
METRIC_LIMIT = 2.0**20  # a metric's magnitude is clipped to this (a loss or seconds are far below)
NOISE_TAIL = 12.0  # distributed DP: a client's noise is truncated at this many standard deviations (the ring's bound)
_KEEP_SESSIONS = 4  # a client keeps the state of this many recent secure rounds (a stale one is dropped)


def neighbourhood(config: Any, cohort: int) -> tuple[int, int]:
    """``(num_neighbours, reconstruction_threshold)`` for a cohort of ``cohort`` clients: ``auto`` neighbours are every
    other client up to 16 clients (plain SecAgg), else ``4 ceil(log2 N)`` (SecAgg+'s O(log N)); a configured number
    is capped at ``cohort - 1``; an ``auto`` threshold is the smallest majority of ``k + 1``, a configured one is capped
    at ``k + 1`` (a smaller cohort than the run's, a DP sample's) and otherwise kept (:class:`SecAggParams` refuses one
    below a majority)."""
    k_cfg = config.num_neighbours
    k = (cohort - 1 if cohort <= 16 else 4 * math.ceil(math.log2(cohort))) if k_cfg == "auto" else int(k_cfg)
    k = max(1, min(k, cohort - 1))
    t_cfg = config.reconstruction_threshold
    majority = (k + 1) // 2 + 1
    # a configured threshold is kept where the cohort's neighbourhood allows it (a DP sample may draw a small cohort):
    # at most k + 1 shares exist, and below a majority a server could rebuild both secrets of one client
    t = majority if t_cfg == "auto" else min(int(t_cfg), k + 1)
    return k, t


def ring_bits(cohort: int, max_level: int) -> int:
    """The ring's bits for a sum of ``cohort`` clients' levels, each at most ``max_level`` in magnitude: the sum's
    magnitude stays below ``2^(bits - 1)`` (at least 32 bits: the PRG draws 8 bytes an entry anyway)."""
    return max(32, (int(cohort) * max(int(max_level), 1)).bit_length() + 1)


def secure_params(config: Any, cohort: int, max_level: int) -> SecAggParams:
    """The :class:`SecAggParams` of one secure sum over ``cohort`` clients whose levels are at most ``max_level`` in
    magnitude (an encoding's :attr:`Encoding.max_level`); raises :class:`InputError` naming the
    ``federation.secure_aggregation`` key a setting breaks (a threshold outside the neighbourhood's majorities, a
    quantization range whose sum overflows 64 bits)."""
    k, t = neighbourhood(config, cohort)
    bits = ring_bits(cohort, max_level)
    if bits > 64:
        raise InputError(
            "federation.secure_aggregation.quantization_range",
            f"a range whose sum over {cohort} clients fits 64 bits (a client's levels reach {max_level})",
            config.quantization_range,
            hint="lower quantization_range",
        )
    return SecAggParams(
        num_clients=int(cohort),
        num_neighbours=k,
        reconstruction_threshold=t,
        clipping_range=float(config.clipping_range),
        quantization_range=int(config.quantization_range),
        modulus_bits=bits,
    )


class Encoding(Protocol):
    """How a client turns a step's reply into the signed integer levels of a secure sum (in its own process), and how
    large they can be: the contract :func:`secure_round` needs (:class:`SumEncoding` for a round's model update,
    :class:`ArraySum` for a dict of arrays). ``encode(value, args, planned)``: ``value`` the step's reply, ``args`` the
    step's positional arguments (resolved), ``planned`` the client's training-set size; it validates the reply and
    raises where it is not valid (the client then leaves the round)."""

    @property
    def max_level(self) -> int: ...

    def encode(self, value: Any, args: tuple, planned: int) -> np.ndarray: ...


@dataclass(frozen=True)
class ArraySum:
    """A reply that is a dict of float arrays, summed over the cohort: each key's entries clipped to ``[-limit,
    limit]`` and rounded to a multiple of its ``step`` (``keys``: ``(key, shape, step, limit)``; the method chooses
    each key's step and range for its quantity, logits or statistics), plus how many entries were clipped. The server
    reads the sums with :meth:`decode`, each entry within ``cohort x step / 2`` of the exact sum of the clipped values."""

    keys: tuple[tuple[str, tuple[int, ...], float, float], ...]

    @property
    def max_level(self) -> int:
        size = sum(math.prod(shape) for _, shape, _, _ in self.keys)
        return max(max(int(math.ceil(limit / step)) for _, _, step, limit in self.keys), size)

    def encode(self, value: Any, args: tuple, planned: int) -> np.ndarray:
        if not isinstance(value, Mapping) or set(value) != {k for k, _, _, _ in self.keys}:
            got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(f"secure aggregation: expected a dict of {sorted(k for k, _, _, _ in self.keys)}, got {got}")
        parts, clipped = [], 0
        for key, shape, step, limit in self.keys:
            array = np.asarray(value[key], dtype=np.float64)
            if array.shape != shape:
                raise ValueError(f"secure aggregation: {key} of shape {shape}, got {array.shape}")
            if not np.isfinite(array).all():
                raise ValueError(f"secure aggregation: non-finite values in {key}")
            clipped += int(np.count_nonzero(np.abs(array) > limit))
            parts.append(np.rint(np.clip(array, -limit, limit).ravel() / step).astype(np.int64))
        parts.append(np.asarray([clipped], dtype=np.int64))
        return np.concatenate(parts)

    def decode(self, levels: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
        """The summed arrays (float64) and how many entries the clients clipped in all."""
        out, start = {}, 0
        for key, shape, step, _ in self.keys:
            size = math.prod(shape)
            out[key] = (levels[start : start + size].astype(np.float64) * step).reshape(shape)
            start += size
        return out, int(levels[start])

    def error_bounds(self, contributors: int) -> dict[str, float]:
        """Per key, the largest gap of an entry of the decoded sum of ``contributors`` clients from the exact sum of
        their clipped values: each client's entry is rounded once, by half a step at most (float rounding aside)."""
        return {key: int(contributors) * step / 2 for key, _, step, _ in self.keys}


#: a scale pass's power-of-two bands (:class:`ScaledSum`): a largest magnitude in ``[2^(e-1), 2^e)`` is band ``e``;
#: one below ``2^(BANDS[0] - 1)`` counts as band ``BANDS[0]`` (still a bound above it), one of ``2^BANDS[1]`` or more
#: as band ``BANDS[1]`` (then clipped in the sum, and counted)
BANDS = (-256, 256)


def level_bits(cohort: int) -> int:
    """The bits of one client's levels in a sum of ``cohort`` clients that fits the 64-bit ring, its sign included
    (:func:`ring_bits` of ``cohort`` levels of ``2^bits`` is 64)."""
    return 63 - int(cohort).bit_length()


@dataclass(frozen=True)
class ScaledSum:
    """A secure sum of float arrays whose scale no one knows in advance (a Fisher, a Gram: tiny or huge), in two sums.

    1. The scale pass (:attr:`bands_encoding`): each client sends, per key, a one-hot row marking the power-of-two band
       of its largest ``|entry|`` (:meth:`bands`; a row of its own for all zeros). The server learns how many clients'
       largest entries fall in each band, per key: never which client's, nor more than a factor of 2 of any one.
    2. The sum itself (:meth:`arrays`): each key at range ``2^E``, ``E`` the highest band any client marked, so no
       entry is clipped, and step ``2^(E - level_bits(cohort))``: each client's entry is rounded to ``2^-bits`` of the
       cohort's largest (``bits`` about 60: float64's rounding of that largest entry), the sum within ``cohort x
       step / 2`` per entry (:meth:`ArraySum.error_bounds`). A key every client sent as zeros is left out: its sum is
       zero exactly (:meth:`decode` gives it so).

    ``keys``: ``(key, shape)`` in the order both passes use."""

    keys: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def bands_encoding(self) -> ArraySum:
        return ArraySum((("bands", (len(self.keys), BANDS[1] - BANDS[0] + 2), 1.0, 1.0),))

    def bands(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A client's scale-pass reply for its ``values`` (every key): row ``i`` marks key ``i``'s band (column 0: all
        zeros; column ``1 + e - BANDS[0]``: band ``e``)."""
        rows = np.zeros((len(self.keys), BANDS[1] - BANDS[0] + 2))
        for i, (key, shape) in enumerate(self.keys):
            array = np.asarray(values[key], dtype=np.float64)
            if array.shape != shape or not np.isfinite(array).all():
                raise ValueError(f"secure aggregation: {key} must be finite of shape {shape}, got {array.shape}")
            largest = float(np.max(np.abs(array))) if array.size else 0.0
            rows[i, 0 if largest == 0 else 1 + min(max(math.frexp(largest)[1], BANDS[0]), BANDS[1]) - BANDS[0]] = 1.0
        return {"bands": rows}

    def arrays(self, counts: np.ndarray, cohort: int) -> ArraySum:
        """The second sum's encoding from the scale pass's summed ``counts`` (its ``bands``), for ``cohort`` clients
        (those of the scale pass: a client outside it could exceed the ranges)."""
        bits = level_bits(cohort)
        out = []
        for (key, shape), row in zip(self.keys, np.rint(np.asarray(counts)).astype(np.int64)):
            marked = np.flatnonzero(row[1:])
            if marked.size:
                top = BANDS[0] + int(marked[-1])
                out.append((key, shape, 2.0 ** (top - bits), 2.0**top))
        return ArraySum(tuple(out))

    def decode(self, encoding: ArraySum, levels: np.ndarray | None) -> tuple[dict[str, np.ndarray], int]:
        """Every key's sum (zeros for those :meth:`arrays` left out; ``levels`` None where it left out all) and how
        many entries the clients clipped."""
        sums, clipped = encoding.decode(levels) if levels is not None else ({}, 0)
        return {key: sums.get(key, np.zeros(shape)) for key, shape in self.keys}, clipped


@dataclass(frozen=True)
class SumEncoding:
    """How a client turns its update into the levels of a secure sum, and how the server reads the sum back.

    ``kind``: ``mean`` (the change from the broadcast model, clipped to ``clip_norm`` first where the rule clips,
    weighted by the count if ``weighted``, else 1) or ``dp`` (central DP: the change clipped to the L2 norm
    ``clip_norm`` in float64, weight 1, and whether it was within it). ``keys``: the model's keys in order (central
    DP: its float tensors), with shapes and whether each holds integers (summed exactly, not quantised).
    """

    kind: Literal["mean", "dp"]
    weighted: bool
    clip_norm: float | None
    keys: tuple[tuple[str, tuple[int, ...], bool], ...]
    clipping_range: float
    quantization_range: int
    max_count: int = 1  # the cohort's largest training-set size (a weight, and the metrics' weight)
    noise_std: float = 0.0  # distributed DP: each client's discrete Gaussian noise, in levels (with_distributed_noise)

    @staticmethod
    def level_bound(quantization_range: int, max_count: int, entries: int) -> int:
        """The largest level a client sends: a weighted entry (the clipping range's level, or a metric's) times its
        count, or the count of its clipped entries."""
        level = max((int(quantization_range) + 1) // 2, int(METRIC_LIMIT / METRIC_STEP))
        return max(int(max_count) * level, int(entries))

    @property
    def max_level(self) -> int:
        return self.level_bound(self.quantization_range, self.max_count, self.entries) + math.ceil(NOISE_TAIL * self.noise_std)

    @property
    def sensitivity(self) -> float:
        """Central DP: the L2 norm of one client's encoded update at most: the clip norm plus the rounding's half step
        per float entry (``C + step sqrt(d) / 2``)."""
        assert self.clip_norm is not None
        floats = sum(math.prod(shape) for _, shape, integer in self.keys if not integer)
        return float(self.clip_norm) + self.step * math.sqrt(floats) / 2

    def with_distributed_noise(self, noise_multiplier: float, threshold: int) -> SumEncoding:
        """Distributed DP (``federation.secure_aggregation.distributed_dp``): each client adds discrete Gaussian noise of
        standard deviation ``z Delta / sqrt(t)`` (in levels), so any ``t`` survivors' sum carries at least the noise
        ``z Delta`` the accountant counts for the sum (``Delta``: :attr:`sensitivity`, with the rounding; more
        survivors add more noise, never less). The server adds none and never holds the noiseless sum."""
        std = float(noise_multiplier) * self.sensitivity / self.step / math.sqrt(int(threshold))
        return dataclasses.replace(self, noise_std=std)

    @classmethod
    def of(
        cls,
        reference: Mapping[str, np.ndarray],
        kind: Literal["mean", "dp"],
        weighted: bool,
        clip_norm: float | None,
        config: Any,
        max_count: int,
    ) -> SumEncoding:
        keys = tuple(
            (str(k), tuple(np.shape(v)), np.asarray(v).dtype.kind not in "fc")
            for k, v in reference.items()
            if kind == "mean" or np.asarray(v).dtype.kind == "f"
        )
        return cls(
            kind, weighted and kind == "mean", clip_norm, keys, float(config.clipping_range), int(config.quantization_range), int(max_count)
        )

    @property
    def step(self) -> float:
        return 2.0 * self.clipping_range / self.quantization_range

    @property
    def entries(self) -> int:
        """The model's entries (the levels hold 3 + 2 per metric more)."""
        return sum(math.prod(shape) for _, shape, _ in self.keys)

    @property
    def error_bound(self) -> float:
        """The largest gap of one entry of the decoded mean (or, central DP, of the sum per contributor) from the exact
        one over the clipped updates: half a step (each client's entry is rounded once; integer weights are exact)."""
        return self.step / 2

    def encode(self, update: Any, args: tuple, planned: int) -> np.ndarray:
        """The client's levels (int64) of its ``update`` against the broadcast model ``args[0]``. The update is
        validated first, as the server validates a reply in the clear
        (:func:`~rayfuse.updates.streaming.update_problem`); an invalid one raises and the client leaves the round."""
        reference: Mapping[str, np.ndarray] = args[0]
        reason = update_problem(update, planned, reference)
        if reason is not None:
            raise ValueError(f"secure aggregation: this client's update is not valid: {reason}")
        params: Mapping[str, np.ndarray] = update.params
        limit = (self.quantization_range + 1) // 2
        unclipped = 1
        if self.kind == "dp":  # clipped as the server clips each update in the clear (its float tensors, as self.keys)
            from rayfuse.updates.central_dp import clipped_update

            assert self.clip_norm is not None
            changes, norm = clipped_update(params, reference, self.clip_norm)
            unclipped = int(norm <= self.clip_norm)
        else:
            if self.clip_norm is not None:  # the mean's clip_norm, as the plain fold clips a model
                from rayfuse.updates.robust import clip_updates

                params = clip_updates([dict(params)], reference, self.clip_norm)[0]
            changes = {k: np.asarray(params[k], dtype=np.float64) - np.asarray(reference[k], dtype=np.float64) for k, _, _ in self.keys}
        weight = int(update.num_examples) if self.weighted else 1
        noise = np.random.default_rng() if self.noise_std > 0 else None  # the OS's entropy: the server must not know it
        parts, clipped = [], 0
        for key, _, integer in self.keys:
            d = changes[key].ravel()
            levels = np.rint(d) if integer else np.rint(np.clip(d, -self.clipping_range, self.clipping_range) / self.step)
            over = np.abs(levels) > limit if integer else np.abs(d) > self.clipping_range
            clipped += int(np.count_nonzero(over))
            part = np.clip(levels, -limit, limit).astype(np.int64) * weight
            if noise is not None and not integer:
                part += discrete_gaussian(self.noise_std, part.size, noise)
            parts.append(part)
        tail = [weight, clipped, unclipped]
        count = int(update.num_examples)  # metrics are weighted by the count whatever the model's weight (as rounds log them)
        for name in METRICS:
            value = update.metrics.get(name)
            if value is None:
                tail += [0, 0]
                continue
            level = int(np.rint(np.clip(float(value), -METRIC_LIMIT, METRIC_LIMIT) / METRIC_STEP))
            tail += [level * count, count]
        parts.append(np.asarray(tail, dtype=np.int64))
        return np.concatenate(parts)

    def decode(self, levels: np.ndarray) -> tuple[Params, dict[str, int], dict[str, float]]:
        """The sum's parts: the summed changes per key (float64; integers exact), the counts (``weight``,
        ``clipped_entries``, ``unclipped``) and the weighted mean of each metric some client reported."""
        total: Params = {}
        start = 0
        for key, shape, integer in self.keys:
            size = math.prod(shape)
            part = levels[start : start + size].astype(np.float64)
            total[key] = (part if integer else part * self.step).reshape(shape)
            start += size
        weight, clipped, unclipped = (int(v) for v in levels[start : start + 3])
        metrics: dict[str, float] = {}
        for i, name in enumerate(METRICS):
            value, present = int(levels[start + 3 + 2 * i]), int(levels[start + 4 + 2 * i])
            if present > 0:
                metrics[name] = value * METRIC_STEP / present
        return total, {"weight": weight, "clipped_entries": clipped, "unclipped": unclipped}, metrics

    def mean(self, total: Params, weight: int, reference: Mapping[str, np.ndarray]) -> Params:
        """The new model: the broadcast one plus the weighted mean change, in the reference's dtypes (integers rounded)."""
        out: Params = {}
        for key, ref in reference.items():
            ref = np.asarray(ref)
            value = ref.astype(np.float64) + total[key] / weight
            out[key] = (np.rint(value) if ref.dtype.kind not in "fc" else value).astype(ref.dtype)
        return out


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of the discrete Gaussian ``N_Z(0, sigma^2)`` (int64), truncated at ``NOISE_TAIL`` sigma (a tail of
    probability below 1e-30, so that the ring's bound holds): Canonne, Kamath and Steinke's sampler (NeurIPS 2020,
    Algorithm 3), a discrete Laplace proposal of scale ``floor(sigma) + 1`` accepted with probability
    ``exp(-(|y| - sigma^2 / t)^2 / (2 sigma^2))``, vectorised; the acceptance test runs in floating point (their exact
    sampler's integer Bernoulli trials are not reproduced), which is the one approximation."""
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # a geometric's success probability: the difference of two is discrete Laplace of scale t
    out = np.empty(0, dtype=np.int64)
    while out.size < size:
        n = 2 * (size - out.size) + 16
        y = rng.geometric(p, n).astype(np.int64) - rng.geometric(p, n).astype(np.int64)
        keep = rng.random(n) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        keep &= np.abs(y) <= NOISE_TAIL * sigma
        out = np.concatenate([out, y[keep]])
    return out[:size]


@dataclass
class Masked:
    """A client's reply to ``secagg.masked``: its masked levels and its count (known to the server from the plan)."""

    masked: np.ndarray
    num_examples: int


@dataclass
class MaskedSum:
    """The masked vectors of the clients one process (or one node) hosts, added in the ring, with their counts: each
    client's vector stays hidden by its self mask and its masks with neighbours elsewhere; the masks cancel only in
    the total the server unmasks."""

    masked: np.ndarray
    counts: dict[int, int]


@dataclass(frozen=True)
class MaskedFold:
    """The :class:`rayfuse.federation.Reducer` of a secure round's stage 3 where several clients are hosted
    (``federation.clients_per_actor > 1``, or per node): their :class:`Masked` replies (or a process's
    :class:`MaskedSum`) added in the ring of ``2^bits``, one :class:`MaskedSum` sent on."""

    bits: int

    def reduce(self, replies: Any) -> MaskedSum:
        total: np.ndarray | None = None
        counts: dict[int, int] = {}
        for client, value, _ in replies:
            if isinstance(value, Folded):
                continue  # its vector is in its process's partial sum
            if isinstance(value, Masked):
                vector, part = value.masked, {int(client): int(value.num_examples)}
            elif isinstance(value, MaskedSum):
                vector, part = value.masked, value.counts
            else:
                raise TypeError(f"secure aggregation: expected a masked vector, got {type(value).__name__}")
            if total is None:
                total = np.array(vector, dtype=np.uint64)
            else:
                total += vector
            counts.update(part)
            del value, vector
        assert total is not None, "a reducer is called with at least one reply"
        total &= np.uint64((1 << self.bits) - 1)
        return MaskedSum(total, counts)


# -- the client's side: four steps -------------------------------------------------------------------------------


def _session(ctx: Any, session: str) -> SecAggClient:
    client = ctx.secure_sessions.get(session)
    if client is None:  # a process that restarted mid-round lost its secrets: it cannot go on in this round
        raise SecAggFailure(f"secure aggregation: client {ctx.client_id} holds no state of round {session!r} (its process restarted?)")
    return client


@client_step("secagg.setup")
def secagg_setup(ctx: Any, session: str, params: SecAggParams, client_ids: Sequence[int], graph_seed: int) -> tuple[bytes, bytes]:
    """Stage 1: fresh key pairs for this round (kept in the client's process); the public keys."""
    sessions = ctx.secure_sessions
    while len(sessions) >= _KEEP_SESSIONS:  # a round that failed midway left its state: the oldest goes
        sessions.pop(next(iter(sessions)))
    client = SecAggClient(int(ctx.client_id), params)
    sessions[session] = client
    return client.stage_setup(client_ids, graph_seed)


@client_step("secagg.share_keys")
def secagg_share_keys(ctx: Any, session: str, keys: Mapping[int, Mapping[int, tuple[bytes, bytes]]]) -> dict[int, bytes]:
    """Stage 2: this client's secrets shared among its live neighbours, each share encrypted for its receiver."""
    return _session(ctx, session).stage_share_keys(keys[int(ctx.client_id)])


@client_step("secagg.masked")
def secagg_masked(
    ctx: Any,
    session: str,
    routed: Mapping[int, Mapping[int, bytes]],
    encoding: Encoding,
    step: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *args: Any,
) -> Masked:
    """Stage 3: the method's step (``step(ctx, *args, **kwargs)``: local training, predictions...), its reply
    validated and encoded (``encoding.encode``), then masked; only the masked levels and the count leave. (``args``
    come last, as the call's own positional arguments, so the transport resolves the broadcast objects among them.)"""
    client = _session(ctx, session)
    value = step(ctx, *args, **kwargs)
    levels = encoding.encode(value, args, int(ctx.num_examples))
    return Masked(client.stage_collect_masked_levels(routed.get(int(ctx.client_id), {}), levels), int(ctx.num_examples))


@client_step("secagg.unmask")
def secagg_unmask(ctx: Any, session: str, survivors: Sequence[int], dropped: Sequence[int]) -> dict[int, bytes]:
    """Stage 4: the shares that remove the survivors' self masks and the dropped clients' pairwise masks."""
    out = _session(ctx, session).stage_unmask(survivors, dropped)
    ctx.secure_sessions.pop(session, None)
    return out


# -- the server's side ---------------------------------------------------------------------------------------------


@dataclass
class SecureSum:
    """What a secure round gives the server: the sum of the survivors' levels (int64, exact; the encoding decodes
    it), the clients in the sum (with their planned counts), the clients that failed a stage (with why) and the
    SecAgg+ settings used."""

    levels: np.ndarray
    contributors: dict[int, int]
    failures: list[Any]
    params: SecAggParams


def secure_round(
    federation: Any,
    step: Callable[..., Any],
    args: Sequence[Any],
    clients: Sequence[int],
    *,
    session: str,
    encoding: Encoding,
    config: Any,
    planned: Callable[[int], int],
    step_kwargs: Mapping[str, Any] | None = None,
    partial_sums: Literal["flat", "per_actor", "per_node"] = "flat",
) -> SecureSum:
    """Run ``step(ctx, *args, **step_kwargs)`` on ``clients`` under SecAgg+ and return the sum of their encoded replies
    (``encoding``; see the module's text). ``args`` are broadcast once each (``federation.put``).
    ``partial_sums``: where the masked vectors are added before the coordinator (``per_actor``: in each process
    hosting several clients; ``per_node``: then on each node too; :class:`MaskedFold`).

    Raises
    ------
    SecAggFailure
        Fewer than ``reconstruction_threshold`` clients left at a stage, or a malformed message (naming its client).
    """
    clients = sorted(int(c) for c in clients)
    counts = {c: int(planned(c)) for c in clients}
    params = secure_params(config, len(clients), encoding.max_level)
    server = SecAggServer(params, clients)
    failures: list[Any] = []

    def run(stage_step: Callable[..., Any], *args: Any, among: Sequence[int]) -> dict[int, Any]:
        gathered = federation.run(stage_step, session, *args, clients=among)
        failures.extend(gathered.failures)
        return dict(gathered.results)

    ids, graph_seed = server.setup_message()
    keys = run(secagg_setup, params, ids, graph_seed, among=clients)
    key_msgs = server.receive_public_keys(keys)
    shares = run(secagg_share_keys, federation.put(key_msgs), among=sorted(key_msgs))
    routed = server.receive_shares(shares)
    call_args = (session, federation.put(routed), encoding, step, dict(step_kwargs or {}), *(federation.put(a) for a in args))
    if partial_sums == "flat":
        calls = federation.map(secagg_masked, *call_args, clients=sorted(routed))
    else:
        fold = MaskedFold(params.modulus_bits)
        node_fold = fold if partial_sums == "per_node" else None
        calls = federation.map_reduced(secagg_masked, *call_args, reducer=fold, node_reducer=node_fold, clients=sorted(routed))
    del call_args
    gathered = federation.gather(calls)
    del calls
    failures.extend(gathered.failures)
    parts: dict[tuple[int, ...], np.ndarray] = {}
    for client, reply in gathered.results.items():
        if isinstance(reply, Folded):
            continue
        sent = reply.counts if isinstance(reply, MaskedSum) else {client: reply.num_examples} if isinstance(reply, Masked) else None
        if sent is None or any(counts.get(c) != n for c, n in sent.items()):
            raise SecAggFailure(
                f"secure aggregation: client {client} sent {type(reply).__name__} {sent!r}, not masked vectors with the planned counts",
                client=client,
            )
        parts[tuple(sorted(sent))] = reply.masked
    del gathered
    survivors, dropped = server.receive_masked_sums(parts)
    del parts
    responses = run(secagg_unmask, survivors, dropped, among=survivors)
    levels = server.unmask_levels(responses)
    return SecureSum(levels, {c: counts[c] for c in server.survivors}, failures, params)
