"""Attacks on clients' model updates, to measure robust aggregation against (``federation.attacks``).

A simulation of compromised clients. The update pipeline (:mod:`rayfuse.updates.pipeline`, its second stage) applies
them wherever a method combines the clients' parameter updates (the FedAvg family, ``average``, ``finetune``'s
``base: average``; ``aligned`` with ``merge: average`` or ``nonparametric``, before alignment): the server replaces
the accepted update of each attacking client by the attack's, before aggregation, and records an ``attack`` event
(client, round, attack). Nothing is applied unless configured; a method that fuses something else (posteriors,
statistics, predictions) is refused with attacks before the run starts. ``w`` is the client's honest model,
``w_ref`` the model it started from: the round's broadcast global model for the FedAvg family and ``aligned``'s
later rounds; for one-shot fusion (``average``, ``aligned``'s round 1) the run's initial model (the clients' common
start with ``train.shared_init``).

* ``sign_flip`` -- ``w_ref - (w - w_ref)``: the update reversed.
* ``scale`` -- ``w_ref + s (w - w_ref)`` (``scale``, default 10): a boosted (or, with ``s < 0``, reversed) update.
* ``gaussian`` -- ``w_ref + N(0, std^2)`` per coordinate (``std``, default 1): a random update; seeded by the run's
  seed, the client and the round.
* ``little_is_enough`` -- "A little is enough" (Baruch et al. 2019): every colluding client sends, per coordinate,
  ``mean - z std`` of the honest updates of the round (the clients not attacking in it; population std). Colluders
  need the honest updates: the simulation computes the attack where the server has gathered them, an explicit
  simulation of collusion (a real attacker would estimate them, e.g. from its own honest updates; the simulation uses
  those when no honest client reports). ``z`` defaults to the paper's ``z_max = Phi^-1((n - s) / n)`` with
  ``s = floor(n / 2 + 1) - m`` for ``n`` updates and ``m`` colluders in the round (``(n - s) / n`` capped at 0.999).

Only float tensors are attacked; integer tensors (BatchNorm's ``num_batches_tracked``) stay the client's. Every
result has each tensor's dtype and shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from statistics import NormalDist

import numpy as np

from rayfuse.config import AttackSpec
from rayfuse.method import Update
from rayfuse.seeding import make_rng

__all__ = [
    "ATTACKS",
    "attack_sign_flip",
    "attack_scale",
    "attack_gaussian",
    "attack_little_is_enough",
    "compute_lie_z",
    "apply_attacks",
    "DEFAULT_SCALE",
    "DEFAULT_STD",
]

ATTACKS = ("sign_flip", "scale", "gaussian", "little_is_enough")
DEFAULT_SCALE = 10.0
DEFAULT_STD = 1.0
_LIE_P_MAX = 0.999

Params = dict[str, np.ndarray]


def _is_float(array: np.ndarray) -> bool:
    return np.asarray(array).dtype.kind == "f"


def _around_reference(
    params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], move: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> Params:
    """``move(w, w_ref)`` (float64) per float tensor, cast back to its dtype; integer tensors: the client's own."""
    out: Params = {}
    for key, value in params.items():
        value = np.asarray(value)
        if not _is_float(value):
            out[key] = value.copy()
            continue
        out[key] = move(value.astype(np.float64), np.asarray(reference[key], dtype=np.float64)).astype(value.dtype)
    return out


def attack_scale(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], scale: float) -> Params:
    """``w_ref + scale (w - w_ref)`` per float tensor (integer tensors: the client's own)."""
    return _around_reference(params, reference, lambda w, ref: ref + scale * (w - ref))


def attack_sign_flip(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> Params:
    """``w_ref - (w - w_ref)``: the update reversed (:func:`attack_scale` with ``scale = -1``)."""
    return attack_scale(params, reference, -1.0)


def attack_gaussian(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], std: float, rng: np.random.Generator) -> Params:
    """``w_ref + N(0, std^2)`` per coordinate of each float tensor, drawn from ``rng`` in the parameters' key order."""
    return _around_reference(params, reference, lambda w, ref: ref + rng.normal(0.0, std, size=w.shape))


def compute_lie_z(n: int, m: int) -> float:
    """Baruch et al.'s ``z_max = Phi^-1((n - s) / n)``, ``s = floor(n / 2 + 1) - m``, for ``n`` updates of which
    ``m`` collude (``(n - s) / n`` capped at 0.999; 0 when it is at most one half)."""
    if n < 1 or m < 1:
        raise ValueError(f"n and m must be >= 1, got n={n}, m={m}")
    s = math.floor(n / 2 + 1) - m
    p = min((n - s) / n, _LIE_P_MAX)
    return max(0.0, NormalDist().inv_cdf(p)) if p > 0.5 else 0.0


def attack_little_is_enough(honest: Sequence[Mapping[str, np.ndarray]], z: float, own: Mapping[str, np.ndarray] | None = None) -> Params:
    """Per coordinate, ``mean - z std`` of the ``honest`` models (population std, unweighted), each float tensor cast
    back to its dtype; integer tensors are ``own``'s (the colluder's own model; default: the first honest model's)."""
    if not honest:
        raise ValueError("little_is_enough needs at least one honest model")
    keep = own if own is not None else honest[0]
    out: Params = {}
    for key in honest[0]:
        first = np.asarray(honest[0][key])
        if not _is_float(first):
            out[key] = np.asarray(keep[key]).copy()
            continue
        stack = np.stack([np.asarray(h[key], dtype=np.float64) for h in honest])
        out[key] = (stack.mean(axis=0) - z * stack.std(axis=0)).astype(first.dtype)
    return out


def apply_attacks(
    updates: Mapping[int, Update], reference: Mapping[str, np.ndarray], attacks: Sequence[AttackSpec], *, round: int, seed: int
) -> tuple[dict[int, Update], list[AttackSpec]]:
    """The round's updates with each attacking client's replaced by its attack's, and the attacks applied.

    Parameters
    ----------
    updates : dict of int to Update
        The round's accepted updates by client id.
    reference : dict of ndarray
        ``w_ref``: the model the clients started from.
    attacks : list of AttackSpec
        ``federation.attacks`` (at most one per client); those on clients not in ``updates`` or not attacking
        ``round`` do nothing.
    round : int
        The round (1 for one-shot methods).
    seed : int
        The run's seed (``gaussian`` draws from ``make_rng(seed, "attack", client, round)``).
    """
    active = [a for a in attacks if a.client in updates and a.attacks_round(round)]
    if not active:
        return dict(updates), []
    attackers = {a.client for a in active}
    colluders = [a for a in active if a.kind == "little_is_enough"]
    honest = [updates[c].params for c in sorted(updates) if c not in attackers]
    if colluders and not honest:  # no honest client reported: the colluders use their own honest updates
        honest = [updates[a.client].params for a in colluders]
    out = dict(updates)
    for attack in sorted(active, key=lambda a: a.client):
        own = updates[attack.client].params
        if attack.kind == "sign_flip":
            params = attack_sign_flip(own, reference)
        elif attack.kind == "scale":
            params = attack_scale(own, reference, DEFAULT_SCALE if attack.scale is None else attack.scale)
        elif attack.kind == "gaussian":
            rng = make_rng(seed, "attack", attack.client, round)
            params = attack_gaussian(own, reference, DEFAULT_STD if attack.std is None else attack.std, rng)
        else:
            z = compute_lie_z(len(updates), len(colluders)) if attack.z is None else attack.z
            params = attack_little_is_enough(honest, z, own)
        out[attack.client] = dataclasses.replace(updates[attack.client], params=params)
    return out, sorted(active, key=lambda a: a.client)
