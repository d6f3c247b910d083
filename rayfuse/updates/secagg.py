"""Secure aggregation: the SecAgg+ protocol core, clients and server as plain objects exchanging bytes and arrays.

The server learns the sum of the surviving clients' vectors and nothing else about any one of them. The engine ships
the messages between :class:`SecAggClient` (one per client, in the client's process) and :class:`SecAggServer`;
:func:`secure_sum` runs every stage in one process (tests, the in-process backend).

Protocol: SecAgg+ [SECAGGPLUS] (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020), staged as Flower does it
[SECAGGPLUS : framework/py/flwr/server/workflow/secure_aggregation/secaggplus_workflow.py]
[SECAGGPLUS : framework/py/flwr/client/mod/secure_aggregation/secaggplus_mod.py] (parameter names
``num_neighbours``, ``reconstruction_threshold``, ``clipping_range``, ``quantization_range``, ``max_weight`` as there):

1. setup: the server sends the client ids and a public graph seed; each client answers two X25519 public keys (one
   for pairwise masks, one for encrypting shares). Survivors: ``S0``.
2. share keys: the server sends each client its live neighbours' public keys; the client Shamir-shares its mask
   secret key and a fresh 32-byte self-mask seed ``b`` (``t`` of its neighbourhood needed), one AES-GCM ciphertext
   per neighbour under HKDF(X25519(own share key, neighbour's share key)). The server routes them. Survivors: ``S1``.
3. collect masked vectors: each client decrypts its shares, encodes its vector into Z_{2^bits}, adds PRG(b) and
   ±PRG(s_ij) for each neighbour j in ``S1`` (+ when its index is the larger), and sends it. Survivors: ``S2``.
4. unmask: the server sends ``S2`` and the dropped ``S1 \\ S2``; each live client answers its shares of ``b`` for the
   first and of the mask secret key for the second (never both for one client). The server rebuilds each secret
   from ``t`` shares, removes the self masks of ``S2`` and the dropped clients' pairwise masks, and decodes.

Where this departs from Flower: the PRG is AES-256-CTR (Flower seeds numpy's generator, not a cryptographic PRG);
the graph is the paper's Harary graph (ring offsets ±1..±k/2, plus the opposite node when k is odd) under a public
random relabelling; Shamir is over the prime field of p = 2^521 - 1 (Flower: GF(2^128) on 16-byte chunks): the
smallest Mersenne prime above 2^256, so a 32-byte secret is one field element with no chunking or encoding loss, and
reduction modulo p is cheap; quantisation rounds to nearest (Flower: stochastically), so the error bound is
deterministic; the share's sender and receiver are bound into the HKDF info, so each AES-GCM key encrypts one message
and a ciphertext routed to another client fails authentication; a rebuilt mask secret key is checked against the
public key its owner sent at setup, and surplus shares against the interpolated polynomial, naming a liar (with
exactly t shares a bad one is still caught, unattributed, with probability 1 - 2^-265: the secret rebuilt is then a
uniform field element, above 2^256 but for that chance).

Encoding and its error: each entry is clipped to ``[-c, c]`` (``c = clipping_range``) and rounded to a multiple of
``delta = 2c / quantization_range``, so one client's entry is off by at most ``delta / 2`` and the decoded sum of ``n``
contributors by at most ``n * delta / 2`` per entry (against the sum of the clipped inputs) — the result's
``error_bound``. No wrap-around: ``N * ceil(quantization_range / 2) < 2^(modulus_bits - 1)`` is checked at setup.

Weighted sums (``max_weight`` set): a client with weight ``w <= max_weight`` sends ``r * x`` and ``r`` as one more
entry, ``r = w / max_weight`` rounded to a multiple of ``2 / quantization_range`` (so ``|r * x| <= c`` and ``r`` fits
the same range). The result's ``total`` is ``sum w'_i x_i`` and ``weight`` is ``sum w'_i`` (``w'`` the rounded
weights, exact), so :meth:`SecAggResult.mean` is the weighted mean for ``w'`` within ``error_bound / weight``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from rayfuse.errors import InputError, NonFiniteError, SecAggFailure

__all__ = [
    "SecAggParams",
    "SecAggClient",
    "SecAggServer",
    "SecAggResult",
    "secure_sum",
    "flatten",
    "unflatten",
    "neighbours",
    "PRIME",
]

PRIME = 2**521 - 1  # Shamir's field: the smallest Mersenne prime above 2^256 (a 32-byte secret is one element)
_ELEM = 66  # bytes of one field element (521 bits)
_SHARE = 4 + 2 * _ELEM  # a share plaintext: the receiver's x coordinate, then the shares of b and of the mask key
_KEY = 32  # X25519 keys, self-mask seeds, AES-256 keys
_PREFIX = "federation.secure_aggregation"

Vector = np.ndarray | Mapping[str, np.ndarray]
Layout = tuple[tuple[str, tuple[int, ...]], ...]


# -- settings -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SecAggParams:
    """The public settings of one secure sum; checked when built (one-line :class:`InputError` naming the key).

    ``num_clients`` N; ``num_neighbours`` k (k = N-1: the complete graph, plain SecAgg); ``reconstruction_threshold``
    t, the shares of a client's secret needed out of its k+1 (its neighbours and itself), a majority so no server can
    rebuild both secrets of one client; entries clipped to ``[-clipping_range, clipping_range]`` and quantised to
    ``quantization_range`` levels across it, in the ring Z_{2^modulus_bits}; ``max_weight``: the largest client
    weight of a weighted sum (``None``: unweighted). Defaults are Flower's.
    """

    num_clients: int
    num_neighbours: int
    reconstruction_threshold: int
    clipping_range: float = 8.0
    quantization_range: int = 2**22
    modulus_bits: int = 32
    max_weight: float | None = None

    def __post_init__(self) -> None:
        def bad(key: str, expected: str, got: Any, hint: str = "") -> InputError:
            return InputError(f"{_PREFIX}.{key}", expected, got, hint)

        n, k, t = self.num_clients, self.num_neighbours, self.reconstruction_threshold
        for key in ("num_clients", "num_neighbours", "reconstruction_threshold", "quantization_range", "modulus_bits"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise bad(key, "an integer", value)
        if n < 2:
            raise bad("num_clients", "at least 2 clients (a sum of one is that client's vector)", n)
        if not 1 <= k < n:
            raise bad("num_neighbours", f"an integer in [1, {n - 1}] (fewer than the {n} clients)", k)
        if not (k + 1) // 2 < t <= k + 1:
            raise bad(
                "reconstruction_threshold",
                f"an integer in [{(k + 1) // 2 + 1}, {k + 1}] (a majority of num_neighbours + 1 = {k + 1})",
                t,
            )
        if not (isinstance(self.clipping_range, (int, float)) and math.isfinite(self.clipping_range)) or not (self.clipping_range > 0):
            raise bad("clipping_range", "a finite number > 0", self.clipping_range)
        if not 1 <= self.modulus_bits <= 64:
            raise bad("modulus_bits", "an integer in [1, 64] (the ring is held in uint64)", self.modulus_bits)
        if self.quantization_range < 2:
            raise bad("quantization_range", "an integer >= 2", self.quantization_range)
        if n * self.level_max >= 2 ** (self.modulus_bits - 1):
            need = (n * self.level_max).bit_length() + 1
            raise bad(
                "modulus_bits",
                f"at least {need} bits for {n} clients x quantization_range {self.quantization_range}",
                self.modulus_bits,
                hint="raise modulus_bits or lower quantization_range",
            )
        if self.max_weight is not None and not (
            isinstance(self.max_weight, (int, float)) and math.isfinite(self.max_weight) and self.max_weight > 0
        ):
            raise bad("max_weight", "a finite number > 0, or null for an unweighted sum", self.max_weight)

    @property
    def level_max(self) -> int:
        """The largest magnitude of one encoded entry (the clipping range's level)."""
        return (int(self.quantization_range) + 1) // 2

    @property
    def delta(self) -> float:
        """The quantisation step."""
        return 2.0 * float(self.clipping_range) / int(self.quantization_range)

    @property
    def ring_mask(self) -> np.uint64:
        return np.uint64((1 << int(self.modulus_bits)) - 1)


# -- vectors --------------------------------------------------------------------------------------------------------


def flatten(vector: Vector) -> tuple[np.ndarray, Layout | None]:
    """One float64 vector from a dict of arrays (keys in sorted order) or a flat array; the layout to undo it."""
    if isinstance(vector, Mapping):
        layout = tuple((str(key), tuple(np.shape(vector[key]))) for key in sorted(vector))
        parts = [np.asarray(vector[key], dtype=np.float64).ravel() for key, _ in layout]
        return (np.concatenate(parts) if parts else np.zeros(0)), layout
    return np.asarray(vector, dtype=np.float64).ravel(), None


def unflatten(flat: np.ndarray, layout: Layout | None) -> Vector:
    """The dict of arrays (or the flat array when ``layout`` is None) that :func:`flatten` made ``flat`` from."""
    if layout is None:
        return flat
    out, start = {}, 0
    for key, shape in layout:
        size = math.prod(shape)
        out[key] = flat[start : start + size].reshape(shape)
        start += size
    if start != flat.size:
        raise ValueError(f"unflatten: the layout holds {start} entries, the vector {flat.size}")
    return out


def _encode(flat: np.ndarray, params: SecAggParams, ratio: float | None) -> np.ndarray:
    """Clip, scale (by the weight ratio), round to the step and map into the ring (two's complement)."""
    clipped = np.clip(flat, -params.clipping_range, params.clipping_range)
    if ratio is not None:
        clipped = np.append(clipped * ratio, ratio * params.clipping_range)  # the ratio entry: level ratio * range / 2
    levels = np.rint(clipped / params.delta).astype(np.int64)
    return levels.view(np.uint64) & params.ring_mask


def _decode(ring: np.ndarray, params: SecAggParams) -> np.ndarray:
    shift = 64 - int(params.modulus_bits)  # sign-extend: move the ring's top bit to bit 63, shift back arithmetically
    signed = (ring << np.uint64(shift)).view(np.int64) >> np.int64(shift)
    return signed.astype(np.float64) * params.delta


# -- primitives -----------------------------------------------------------------------------------------------------


def neighbours(ids: Sequence[int], num_neighbours: int, graph_seed: int) -> dict[int, frozenset[int]]:
    """SecAgg+'s communication graph: a Harary graph over a public random relabelling of the clients.

    Ring offsets ±1..±floor(k/2), plus the opposite node when k is odd: k-regular when N*k is even, else some nodes
    have k+1 (a k-regular graph needs N*k even). k = N-1 is the complete graph.
    """
    order = sorted(ids)
    n = len(order)
    perm = np.random.default_rng(graph_seed).permutation(n)
    ring = [order[i] for i in perm]
    offsets = {d for d in range(1, num_neighbours // 2 + 1)} | {-d for d in range(1, num_neighbours // 2 + 1)}
    if num_neighbours % 2:
        offsets |= {n // 2, -(n // 2)}
    graph: dict[int, set[int]] = {cid: set() for cid in order}
    for pos, cid in enumerate(ring):
        for d in offsets:
            other = ring[(pos + d) % n]
            if other != cid:
                graph[cid].add(other)
                graph[other].add(cid)
    return {cid: frozenset(nbrs) for cid, nbrs in graph.items()}


class _Stream:
    """A reusable buffer of ``length`` 64-bit words of AES-256-CTR keystream (zero nonce: each seed keys one stream).

    A mask is added in full 64-bit words and the ring's mask applied once at the end: 2^bits divides 2^64, so the sum
    modulo 2^bits is the same, and no per-mask copy or reduction is made (the masking's cost is the keystream)."""

    def __init__(self, length: int) -> None:
        self._zeros = bytes(8 * length)
        self._buffer = bytearray(8 * length + 15)  # update_into wants room for a block more
        self._words = np.frombuffer(self._buffer, dtype="<u8", count=length)

    def draw(self, seed: bytes) -> np.ndarray:
        """The stream of ``seed`` (a view of the buffer, overwritten by the next draw)."""
        encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
        encryptor.update_into(self._zeros, self._buffer)
        encryptor.finalize()
        return self._words


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=_KEY, salt=None, info=info).derive(secret)


def _private(private: bytes | X25519PrivateKey | None) -> X25519PrivateKey:
    if private is None:
        raise SecAggFailure("secure aggregation: a client was asked for a later stage before its setup")
    return private if isinstance(private, X25519PrivateKey) else X25519PrivateKey.from_private_bytes(private)


def _mask_seed(private: bytes | X25519PrivateKey | None, public: bytes) -> bytes:
    shared = _private(private).exchange(X25519PublicKey.from_public_bytes(public))
    return _hkdf(shared, b"rayfuse-secagg pairwise mask")


def _share_key(private: bytes | X25519PrivateKey | None, public: bytes, src: int, dst: int) -> bytes:
    """The AES-GCM key of the one share message from ``src`` to ``dst`` (client indices, bound in)."""
    shared = _private(private).exchange(X25519PublicKey.from_public_bytes(public))
    return _hkdf(shared, b"rayfuse-secagg share" + struct.pack(">II", src, dst))


def _public(private: bytes) -> bytes:
    return (
        X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def _shamir_split(secret: bytes, xs: Iterable[int], threshold: int, randbytes) -> dict[int, int]:
    """Shares ``{x: f(x)}`` of the 32-byte secret: f of degree t-1 over GF(PRIME), f(0) = the secret."""
    coeffs = [int.from_bytes(secret, "big")] + [int.from_bytes(randbytes(_ELEM + 16), "big") % PRIME for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares


@functools.lru_cache(maxsize=1 << 14)
def _inverse(d: int) -> int:
    """``d^-1`` modulo PRIME; the x coordinates are client indices, so their differences repeat: cached."""
    return pow(d, -1, PRIME)


class _Polynomial:
    """The polynomial of degree ``len(points) - 1`` through ``points`` over GF(PRIME), in Newton's form: built once in
    O(t^2) (divided differences, with the cached inverses of the x differences), evaluated in O(t) (Horner)."""

    def __init__(self, points: Sequence[tuple[int, int]]) -> None:
        self.xs = [x for x, _ in points]
        c = [y % PRIME for _, y in points]
        for j in range(1, len(c)):
            for i in range(len(c) - 1, j - 1, -1):
                c[i] = (c[i] - c[i - 1]) * _inverse((self.xs[i] - self.xs[i - j]) % PRIME) % PRIME
        self.c = c

    def __call__(self, at: int) -> int:
        value = self.c[-1]
        for i in range(len(self.c) - 2, -1, -1):
            value = (value * (at - self.xs[i]) + self.c[i]) % PRIME
        return value


def _lagrange_at(points: Sequence[tuple[int, int]], at: int) -> int:
    """The value at ``at`` of the polynomial through ``points``."""
    return _Polynomial(points)(at)


def _consistent(points: Sequence[tuple[int, int]], threshold: int) -> bool:
    f = _Polynomial(points[:threshold])
    return all(f(x) == y % PRIME for x, y in points[threshold:])


def _reconstruct(points_by_holder: Mapping[int, tuple[int, int]], threshold: int, owner: int) -> bytes:
    """The secret from ``t`` shares, after checking the surplus ones lie on the same polynomial (naming a liar)."""
    holders = sorted(points_by_holder)
    points = [points_by_holder[h] for h in holders]
    if not _consistent(points, threshold):
        liar = None
        if len(points) > threshold + 1:  # leave each holder out; the one whose removal makes the rest agree lied
            for i, h in enumerate(holders):
                if _consistent(points[:i] + points[i + 1 :], threshold):
                    liar = h
                    break
        who = f"client {liar!r} sent a share" if liar is not None else "the shares"
        raise SecAggFailure(f"secure aggregation: {who} inconsistent with the others of client {owner!r}'s secret", client=liar)
    value = _lagrange_at(points[:threshold], 0)
    if value >= 1 << (8 * _KEY):
        raise SecAggFailure(f"secure aggregation: client {owner!r}'s secret rebuilt out of range (corrupt shares)")
    return value.to_bytes(_KEY, "big")


class _Drbg:
    """The client's randomness: AES-CTR over a key from ``seed`` (reproducible tests) or the OS."""

    def __init__(self, cid: int, seed: int | bytes | None) -> None:
        if seed is None:
            key = os.urandom(_KEY)
        else:
            material = seed if isinstance(seed, bytes) else str(int(seed)).encode()
            key = hashlib.sha256(b"rayfuse-secagg client\0" + material + b"\0" + str(cid).encode()).digest()
        self._enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()

    def __call__(self, size: int) -> bytes:
        return self._enc.update(bytes(size))


# -- client ---------------------------------------------------------------------------------------------------------


class SecAggClient:
    """One client's side: holds its secrets and the shares it received; every method returns bytes or arrays.

    ``seed`` makes its secrets reproducible (tests); leave it None in a run (the OS's randomness).
    """

    def __init__(self, cid: int, params: SecAggParams, seed: int | bytes | None = None) -> None:
        self.cid = cid
        self.params = params
        self._rand = _Drbg(cid, seed)
        self._ids: tuple[int, ...] = ()
        self._index: dict[int, int] = {}
        self._graph: frozenset[int] = frozenset()
        self._mask_sk = b""
        self._enc_sk = b""
        self._mask_key: X25519PrivateKey | None = None
        self._enc_key: X25519PrivateKey | None = None
        self._b = b""
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._b_shares: dict[int, int] = {}  # owner -> this client's share of the owner's self-mask seed
        self._sk_shares: dict[int, int] = {}  # owner -> this client's share of the owner's mask secret key
        self._masked_with: frozenset[int] = frozenset()

    def stage_setup(self, client_ids: Sequence[int], graph_seed: int) -> tuple[bytes, bytes]:
        """Stage 1: two fresh X25519 key pairs; returns the public keys (mask key, share-encryption key)."""
        if len(client_ids) != self.params.num_clients or self.cid not in client_ids:
            raise SecAggFailure(f"secure aggregation: client {self.cid!r} got a setup for {len(client_ids)} clients it is not among")
        self._ids = tuple(sorted(client_ids))
        self._index = {cid: i for i, cid in enumerate(self._ids)}
        self._graph = neighbours(self._ids, self.params.num_neighbours, graph_seed)[self.cid]
        self._mask_sk, self._enc_sk = self._rand(_KEY), self._rand(_KEY)
        self._mask_key, self._enc_key = _private(self._mask_sk), _private(self._enc_sk)  # parsed once, used per neighbour
        return _public(self._mask_sk), _public(self._enc_sk)

    def stage_share_keys(self, public_keys: Mapping[int, tuple[bytes, bytes]]) -> dict[int, bytes]:
        """Stage 2: Shamir-share the self-mask seed and the mask secret key; ``{neighbour: ciphertext}``.

        ``public_keys``: the live neighbours' (mask, share) public keys, this client's own included or not.
        """
        keys = {cid: pair for cid, pair in public_keys.items() if cid != self.cid}
        if not set(keys) <= self._graph:
            raise SecAggFailure(f"secure aggregation: client {self.cid!r} got keys of non-neighbours {sorted(set(keys) - self._graph)}")
        t = self.params.reconstruction_threshold
        if len(keys) + 1 < t:
            raise SecAggFailure(
                f"secure aggregation: client {self.cid!r} has {len(keys)} live neighbours, "
                f"fewer than reconstruction_threshold - 1 = {t - 1}"
            )
        flat = [k for pair in keys.values() for k in pair] + [_public(self._mask_sk), _public(self._enc_sk)]
        if any(len(k) != _KEY for k in flat) or len(set(flat)) != len(flat):
            raise SecAggFailure(f"secure aggregation: client {self.cid!r} got malformed or repeated public keys")
        self._keys = dict(keys)
        self._b = self._rand(_KEY)
        holders = [self.cid, *sorted(keys)]
        xs = [self._index[h] + 1 for h in holders]
        b_shares = _shamir_split(self._b, xs, t, self._rand)
        sk_shares = _shamir_split(self._mask_sk, xs, t, self._rand)
        me = self._index[self.cid]
        self._b_shares = {self.cid: b_shares[me + 1]}
        self._sk_shares = {self.cid: sk_shares[me + 1]}
        out = {}
        for dst in sorted(keys):
            x = self._index[dst] + 1
            plain = struct.pack(">I", x) + b_shares[x].to_bytes(_ELEM, "big") + sk_shares[x].to_bytes(_ELEM, "big")
            key = _share_key(self._enc_key, keys[dst][1], me, self._index[dst])
            nonce = self._rand(12)
            out[dst] = nonce + AESGCM(key).encrypt(nonce, plain, None)
        return out

    def stage_collect_masked(self, received_shares: Mapping[int, bytes], vector: Vector, weight: float | None = None) -> np.ndarray:
        """Stage 3: decrypt the shares received, then the masked, encoded vector (uint64, in Z_{2^bits}).

        ``vector``: a dict of arrays (flattened in sorted key order) or a flat array; ``weight`` when ``max_weight``
        is set. A share that fails to decrypt or is malformed raises :class:`SecAggFailure` naming its sender.
        """
        self._take_shares(received_shares)
        flat, _ = flatten(vector)
        if not np.all(np.isfinite(flat)):  # NaN would encode to an arbitrary ring element and spoil the sum unseen
            raise NonFiniteError(f"secure aggregation: client {self.cid!r}'s vector holds NaN or infinity")
        ratio = None
        if self.params.max_weight is not None:
            if weight is None or not (0 < weight <= self.params.max_weight):
                raise InputError(
                    f"{_PREFIX}.max_weight", f"every client weight in (0, {self.params.max_weight}]", weight, hint="raise max_weight"
                )
            half = self.params.quantization_range / 2  # the ratio's level: an integer, so the weight sum is exact
            ratio = round(weight / self.params.max_weight * half) / half
        elif weight is not None:
            raise InputError(f"{_PREFIX}.max_weight", "a number when clients send weights", None)
        return self._mask(_encode(flat, self.params, ratio))

    def stage_collect_masked_levels(self, received_shares: Mapping[int, bytes], levels: np.ndarray) -> np.ndarray:
        """Stage 3 for a vector the caller encoded itself: ``levels``, signed integers (int64) whose sum over the
        clients stays below ``2^(modulus_bits - 1)`` in magnitude (the caller's bound; the server decodes the sum with
        :meth:`SecAggServer.unmask_levels`). The engine encodes this way to weight by exact integer counts."""
        self._take_shares(received_shares)
        levels = np.asarray(levels)
        if levels.dtype != np.int64 or levels.ndim != 1:
            raise TypeError(f"secure aggregation: levels must be a 1-D int64 array, got {levels.dtype} {levels.shape}")
        return self._mask(levels.view(np.uint64) & self.params.ring_mask)

    def _take_shares(self, received_shares: Mapping[int, bytes]) -> None:
        t = self.params.reconstruction_threshold
        me = self._index[self.cid]
        for src, blob in received_shares.items():
            if src not in self._keys:
                raise SecAggFailure(f"secure aggregation: client {self.cid!r} got a share from non-neighbour {src!r}", client=src)
            try:
                key = _share_key(self._enc_key, self._keys[src][1], self._index[src], me)
                plain = AESGCM(key).decrypt(blob[:12], blob[12:], None)
            except (InvalidTag, ValueError, TypeError):
                raise SecAggFailure(
                    f"secure aggregation: client {src!r}'s share for client {self.cid!r} fails authentication", client=src
                ) from None
            if len(plain) != _SHARE or struct.unpack(">I", plain[:4])[0] != me + 1:
                raise SecAggFailure(f"secure aggregation: client {src!r}'s share for client {self.cid!r} is malformed", client=src)
            b_share = int.from_bytes(plain[4 : 4 + _ELEM], "big")
            sk_share = int.from_bytes(plain[4 + _ELEM :], "big")
            if b_share >= PRIME or sk_share >= PRIME:
                raise SecAggFailure(f"secure aggregation: client {src!r}'s share for client {self.cid!r} is out of the field", client=src)
            self._b_shares[src], self._sk_shares[src] = b_share, sk_share
        if len(received_shares) + 1 < t:
            raise SecAggFailure(
                f"secure aggregation: client {self.cid!r} got shares from {len(received_shares)} neighbours, "
                f"fewer than reconstruction_threshold - 1 = {t - 1}"
            )
        self._masked_with = frozenset(received_shares)

    def _mask(self, encoded: np.ndarray) -> np.ndarray:
        """The encoded vector plus the self mask and the pairwise masks with the neighbours whose shares arrived."""
        stream = _Stream(encoded.size)
        masked = encoded.astype(np.uint64, copy=True)
        masked += stream.draw(self._b)  # uint64 arithmetic wraps modulo 2^64; the ring's mask is applied once, at the end
        for other in sorted(self._masked_with):
            mask = stream.draw(_mask_seed(self._mask_key, self._keys[other][0]))
            if self._index[self.cid] > self._index[other]:
                masked += mask
            else:
                masked -= mask
        masked &= self.params.ring_mask
        return masked

    def stage_unmask(self, survivors: Iterable[int], dropped: Iterable[int]) -> dict[int, bytes]:
        """Stage 4: ``{owner: share}``: of the self-mask seed for each survivor, of the mask key for each dropped."""
        survivors, dropped = set(survivors), set(dropped)
        t = self.params.reconstruction_threshold
        if len(survivors) < t:  # the sum of fewer would be too close to one client's vector
            raise SecAggFailure(
                f"secure aggregation: client {self.cid!r} was asked to unmask {len(survivors)} clients, "
                f"fewer than reconstruction_threshold {t}; refused"
            )
        if survivors & dropped:
            raise SecAggFailure(
                f"secure aggregation: client {self.cid!r} was asked for both secrets of clients {sorted(survivors & dropped)}; refused"
            )
        out = {o: self._b_shares[o].to_bytes(_ELEM, "big") for o in sorted(survivors) if o in self._b_shares}
        out.update({o: self._sk_shares[o].to_bytes(_ELEM, "big") for o in sorted(dropped) if o in self._sk_shares})
        return out


# -- server ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SecAggResult:
    """The decoded sum: ``total`` (a flat array, or a dict when the inputs were), ``weight`` (the weight sum when
    ``max_weight`` is set), the clients summed, and ``error_bound``: the largest per-entry gap between ``total`` and
    the exact sum of the clipped (and weighted, with the rounded weights) inputs."""

    total: Vector
    weight: float | None
    contributors: tuple[int, ...]
    error_bound: float

    def mean(self) -> Vector:
        """The (weighted) mean; within ``error_bound / weight`` (or ``/ len(contributors)``) of the exact one."""
        denom = self.weight if self.weight is not None else float(len(self.contributors))
        if isinstance(self.total, Mapping):
            return {key: value / denom for key, value in self.total.items()}
        return self.total / denom


class SecAggServer:
    """The server's side: routes messages, tracks who survived each stage, rebuilds secrets and decodes the sum.

    Call in order: :meth:`setup_message`, :meth:`receive_public_keys`, :meth:`receive_shares`,
    :meth:`receive_masked`, :meth:`receive_unmask`. A client missing from a stage's replies dropped there.
    """

    def __init__(self, params: SecAggParams, client_ids: Sequence[int], seed: int | None = None) -> None:
        if len(set(client_ids)) != params.num_clients or len(client_ids) != params.num_clients:
            raise InputError(f"{_PREFIX}.num_clients", f"{params.num_clients} distinct client ids", len(set(client_ids)))
        self.params = params
        self.ids = tuple(sorted(client_ids))
        self._index = {cid: i for i, cid in enumerate(self.ids)}
        self.graph_seed = int(np.random.default_rng(seed).integers(2**63)) if seed is not None else int.from_bytes(os.urandom(8), "big")
        self.graph = neighbours(self.ids, params.num_neighbours, self.graph_seed)
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._s1: frozenset[int] = frozenset()
        self._s2: frozenset[int] = frozenset()
        self._routed: dict[int, frozenset[int]] = {}
        self._sum: np.ndarray | None = None

    def setup_message(self) -> tuple[tuple[int, ...], int]:
        """Stage 1's message to every client: the client ids and the public graph seed."""
        return self.ids, self.graph_seed

    def receive_public_keys(self, keys: Mapping[int, tuple[bytes, bytes]]) -> dict[int, dict[int, tuple[bytes, bytes]]]:
        """Stage 1's replies; returns stage 2's message per live client: its live neighbours' public keys."""
        for cid, pair in keys.items():
            self._known(cid)
            if len(pair) != 2 or any(not isinstance(k, bytes) or len(k) != _KEY for k in pair):
                raise SecAggFailure(f"secure aggregation: client {cid!r} sent malformed public keys", client=cid)
        self._keys = dict(keys)
        return {cid: {n: self._keys[n] for n in sorted(self.graph[cid]) if n in self._keys} for cid in sorted(self._keys)}

    def receive_shares(self, shares: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Stage 2's replies ``{src: {dst: ciphertext}}``; returns stage 3's message per client ``{src: ciphertext}``."""
        routed: dict[int, dict[int, bytes]] = {cid: {} for cid in shares}
        for src, out in shares.items():
            self._known(src)
            expected = {n for n in self.graph[src] if n in self._keys}
            if src not in self._keys or set(out) != expected:
                raise SecAggFailure(
                    f"secure aggregation: client {src!r} sent shares to {sorted(out)}, expected its live neighbours {sorted(expected)}",
                    client=src,
                )
            for dst, blob in out.items():
                if not isinstance(blob, bytes):
                    raise SecAggFailure(f"secure aggregation: client {src!r} sent a share that is not bytes", client=src)
                if dst in routed:
                    routed[dst][src] = blob
        self._s1 = frozenset(shares)
        self._routed = {dst: frozenset(srcs) for dst, srcs in routed.items()}
        return routed

    def receive_masked(self, masked: Mapping[int, np.ndarray]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Stage 3's replies; returns stage 4's message: (survivors whose vectors arrived, dropped after sharing keys)."""
        return self.receive_masked_sums({(cid,): vec for cid, vec in masked.items()})

    def receive_masked_sums(self, parts: Mapping[tuple[int, ...], np.ndarray]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Stage 3's replies, some already added up where several clients are hosted (an actor's or a node's partial
        sum of its clients' masked vectors, in the ring: their masks still hide each of them, and cancel only in the
        total): ``{clients: masked vector or sum}``; returns stage 4's message as :meth:`receive_masked` does."""
        total = None
        seen: set[int] = set()
        for clients, vec in parts.items():
            for cid in clients:
                self._known(cid)
            blame = clients[0] if len(clients) == 1 else None
            who = f"client {clients[0]!r}" if len(clients) == 1 else f"the partial sum of clients {list(clients)}"
            arr = np.asarray(vec)
            if (
                not clients
                or any(cid not in self._s1 or cid in seen for cid in clients)
                or arr.dtype != np.uint64
                or arr.ndim != 1
                or (total is not None and arr.shape != total.shape)
            ):
                raise SecAggFailure(f"secure aggregation: {who} sent a malformed masked vector", client=blame)
            if np.any(arr > self.params.ring_mask):
                raise SecAggFailure(f"secure aggregation: {who} sent a masked vector outside the ring", client=blame)
            seen.update(clients)
            if total is None:
                total = arr.copy()
            else:
                total += arr
        t = self.params.reconstruction_threshold
        if len(seen) < t:  # unmasking fewer would expose a lone client's vector (the paper's clients abort too)
            raise SecAggFailure(
                f"secure aggregation: {len(seen)} clients sent masked vectors ({sorted(seen)}), fewer than reconstruction_threshold {t}"
            )
        assert total is not None
        self._sum = total
        self._s2 = frozenset(seen)
        return tuple(sorted(self._s2)), tuple(sorted(self._s1 - self._s2))

    def receive_unmask(self, responses: Mapping[int, Mapping[int, bytes]], layout: Layout | None = None) -> SecAggResult:
        """Stage 4's replies ``{holder: {owner: share}}``; rebuilds the secrets, unmasks and decodes the sum."""
        decoded = _decode(self._unmask(responses), self.params)
        n = len(self._s2)
        bound = n * self.params.delta / 2
        weight = None
        if self.params.max_weight is not None:
            scale = self.params.max_weight / self.params.clipping_range  # the ratio entry is ratio * clipping_range
            weight = float(decoded[-1] * scale)
            decoded = decoded[:-1] * self.params.max_weight
            bound *= self.params.max_weight
        return SecAggResult(unflatten(decoded, layout), weight, tuple(sorted(self._s2)), bound)

    def unmask_levels(self, responses: Mapping[int, Mapping[int, bytes]]) -> np.ndarray:
        """Stage 4 for vectors sent with :meth:`SecAggClient.stage_collect_masked_levels`: the survivors' sum of levels
        (int64, exact), unmasked and sign-extended; the contributors are :attr:`survivors`."""
        shift = np.uint64(64 - int(self.params.modulus_bits))
        return (self._unmask(responses) << shift).view(np.int64) >> np.int64(shift)

    @property
    def survivors(self) -> tuple[int, ...]:
        """The clients whose masked vectors are in the sum (stage 3's survivors)."""
        return tuple(sorted(self._s2))

    def _unmask(self, responses: Mapping[int, Mapping[int, bytes]]) -> np.ndarray:
        """The masked sum with every self mask and every dropped client's pairwise masks removed (in the ring)."""
        assert self._sum is not None, "receive_masked first"
        t = self.params.reconstruction_threshold
        dropped = self._s1 - self._s2
        points: dict[int, dict[int, tuple[int, int]]] = {o: {} for o in self._s1}
        for holder, out in responses.items():
            self._known(holder)
            for owner, share in out.items():
                holds = owner == holder or (owner in self.graph[holder] and owner in self._routed.get(holder, ()))
                if owner not in points or not holds or holder not in self._s1:
                    raise SecAggFailure(
                        f"secure aggregation: client {holder!r} sent a share of client {owner!r} it does not hold", client=holder
                    )
                if not isinstance(share, bytes) or len(share) != _ELEM or int.from_bytes(share, "big") >= PRIME:
                    raise SecAggFailure(f"secure aggregation: client {holder!r} sent a malformed share of client {owner!r}", client=holder)
                points[owner][holder] = (self._index[holder] + 1, int.from_bytes(share, "big"))
        short = sorted(o for o in self._s1 if len(points[o]) < t)
        if short:
            raise SecAggFailure(
                f"secure aggregation: too few shares to unmask clients {short} (reconstruction_threshold {t}; "
                f"dropped {sorted(set(self.ids) - set(responses))})"
            )
        ring = self._sum.copy()  # unmasked in place (uint64 wraps modulo 2^64; the ring's mask is applied at the end)
        mask = self.params.ring_mask
        stream = _Stream(ring.size)
        for owner in sorted(self._s2):
            ring -= stream.draw(_reconstruct(points[owner], t, owner))
        for owner in sorted(dropped):
            secret = _reconstruct(points[owner], t, owner)
            if _public(secret) != self._keys[owner][0]:
                raise SecAggFailure(f"secure aggregation: client {owner!r}'s mask key rebuilt from shares does not match its public key")
            key = _private(secret)
            for other in sorted(self.graph[owner] & self._s2):
                if owner in self._routed.get(other, ()):
                    pair = stream.draw(_mask_seed(key, self._keys[other][0]))
                    if self._index[other] > self._index[owner]:
                        ring -= pair
                    else:
                        ring += pair
        ring &= mask
        return ring

    def _known(self, cid: int) -> None:
        if cid not in self._index:
            raise SecAggFailure(f"secure aggregation: a message from unknown client {cid!r}", client=cid)


# -- in-process simulation ------------------------------------------------------------------------------------------


def secure_sum(
    vectors_by_client: Mapping[int, Vector],
    params: SecAggParams,
    *,
    weights: Mapping[int, float] | None = None,
    absent: Iterable[int] = (),
    dropped_before: Iterable[int] = (),
    dropped_after: Iterable[int] = (),
    seed: int | None = None,
    transcript: list[tuple[str, int, Any]] | None = None,
) -> SecAggResult:
    """Every stage in one process: the sum of the vectors of the clients that sent their masked input.

    ``absent`` clients never answer (no keys); ``dropped_before`` share keys, then drop before sending their masked
    vector (their pairwise masks are rebuilt from their neighbours' shares); ``dropped_after`` send it, then drop
    before unmasking (their input counts). ``transcript`` collects every client-to-server message (stage, client, msg).
    """
    absent, before, after = set(absent), set(dropped_before), set(dropped_after)
    ids = sorted(vectors_by_client)
    server = SecAggServer(params, ids, seed)
    clients = {cid: SecAggClient(cid, params, None if seed is None else f"{seed}".encode()) for cid in ids}
    log = transcript if transcript is not None else []
    layouts = {flatten(v)[1] for v in vectors_by_client.values()}
    if len(layouts) != 1:
        raise ValueError("secure_sum: every client's vector must have the same keys and shapes")
    (layout,) = layouts

    client_ids, graph_seed = server.setup_message()
    keys = {cid: c.stage_setup(client_ids, graph_seed) for cid, c in clients.items() if cid not in absent}
    log += [("setup", cid, msg) for cid, msg in keys.items()]
    key_msgs = server.receive_public_keys(keys)
    shares = {cid: clients[cid].stage_share_keys(msg) for cid, msg in key_msgs.items()}
    log += [("share_keys", cid, msg) for cid, msg in shares.items()]
    share_msgs = server.receive_shares(shares)
    masked = {
        cid: clients[cid].stage_collect_masked(msg, vectors_by_client[cid], None if weights is None else weights[cid])
        for cid, msg in share_msgs.items()
        if cid not in before
    }
    log += [("collect_masked", cid, msg) for cid, msg in masked.items()]
    survivors, dropped = server.receive_masked(masked)
    unmask = {cid: clients[cid].stage_unmask(survivors, dropped) for cid in survivors if cid not in after}
    log += [("unmask", cid, msg) for cid, msg in unmask.items()]
    return server.receive_unmask(unmask, layout)
