"""The privacy accountant every DP option of rayfuse uses: Opacus' own, behind two cached functions.

Central DP-FedAvg (:mod:`rayfuse.updates.central_dp`), the one-shot DP upload (:mod:`rayfuse.updates.privacy`) and the
``train.dp`` / ``dp`` settings in the config all turn a noise multiplier into an epsilon, or a target epsilon into a
noise multiplier, here. Nothing is derived by hand: :func:`compute_epsilon` asks Opacus' ``RDPAccountant`` or
``PRVAccountant`` for the sampled Gaussian mechanism composed ``steps`` times, and :func:`noise_multiplier_for`
is Opacus' ``get_noise_multiplier``. Opacus is imported when first needed, so the config and the server stay light.
"""

from __future__ import annotations

import functools
import math
import warnings

from rayfuse.errors import key_error

__all__ = ["UnreachableEpsilon", "compute_epsilon", "noise_multiplier_for", "require_one_noise"]

# Opacus' RDP warning when the optimal order is at the edge of its alpha grid: the bound still holds, it could only be
# tighter (tiny noise: the smallest alpha; much noise: the largest)
_EDGE_OF_ALPHAS = "Optimal order is the"


def require_one_noise(noise_multiplier: float | None, target_epsilon: float | None) -> None:
    """The check of every DP setting that takes ``noise_multiplier`` or ``target_epsilon``: exactly one of the two.
    Raises :func:`rayfuse.errors.key_error` at ``noise_multiplier`` (it runs inside the settings' validators)."""
    if (noise_multiplier is None) == (target_epsilon is None):
        given = "both" if noise_multiplier is not None else "neither"
        raise key_error("noise_multiplier", f"exactly one of noise_multiplier and target_epsilon, got {given}")


def compute_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """The epsilon at ``delta`` of ``steps`` compositions of the Gaussian mechanism subsampled at ``sample_rate``
    (Opacus' accountant ``accountant``, ``rdp`` or ``prv``). 0 for no steps; ``inf`` without noise.

    Parameters
    ----------
    noise_multiplier : float
        ``z``: the noise's standard deviation over the sensitivity.
    sample_rate : float
        ``q``: the Poisson sampling probability (1: every release sees the data).
    steps : int
        The number of releases (rounds, steps); 0 spends nothing.
    delta : float
        The delta of the guarantee.
    accountant : {"rdp", "prv"}
    """
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    return _epsilon(float(noise_multiplier), float(sample_rate), int(steps), float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EDGE_OF_ALPHAS)
        # numpy's overflow / division warnings of the PRV accountant at extreme noise: its result (or its error) says it
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        return float(acc.get_epsilon(delta=delta))


# The noise search's bounds (class 6 of issue 31: no input hangs). Opacus' own search doubles the noise up to its
# MAX_SIGMA (1e6) and then bisects without a bound on the steps, so a target it cannot reach from below (1e300, inf)
# bisects towards zero noise for ever. Here the search is Opacus' (the same steps, the same answer for every target it
# can reach within these bounds) with the range and the steps bounded: the least noise searched is MIN_NOISE (its
# epsilon is in the hundreds of thousands for one release at delta 1e-5: no meaningful guarantee needs less), the most
# is Opacus' own limit, and no search takes more than MAX_SEARCH_STEPS accountant calls.
MIN_NOISE = 1e-3
MAX_NOISE = 1e6
MAX_SEARCH_STEPS = 200
EPSILON_TOLERANCE = 0.01  # Opacus' default epsilon_tolerance: within 0.01 of the target, on the safe side
# Opacus' PRV accountant discretises a grid that grows without bound as the noise shrinks (seconds, then gigabytes, at
# noise whose RDP epsilon is in the hundreds; measured with Opacus 1.6). A search with it takes targets up to
# PRV_MAX_EPSILON and never asks it about noise whose RDP epsilon (an upper bound of the PRV one, within a few percent
# where both were measured) exceeds _PRV_RDP_CAP.
PRV_MAX_EPSILON = 100.0
_PRV_RDP_CAP = 300.0


class UnreachableEpsilon(ValueError):
    """A ``target_epsilon`` no noise multiplier in ``[MIN_NOISE, MAX_NOISE]`` reaches (or not a finite number > 0);
    the message is one short clause, to follow ``expected`` in the callers' :class:`~rayfuse.errors.InputError`."""


@functools.lru_cache(maxsize=64)
def noise_multiplier_for(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp") -> float:
    """The noise multiplier that spends ``target_epsilon`` at ``delta`` in ``steps`` releases at ``sample_rate``:
    Opacus' ``get_noise_multiplier`` (double the noise from 10 until the epsilon is below the target, then bisect to
    within 0.01 of it, on the safe side), bounded to noise in ``[MIN_NOISE, MAX_NOISE]`` and ``MAX_SEARCH_STEPS``
    accountant calls. Raises :class:`UnreachableEpsilon` (a ``ValueError``) for a target outside what that range
    reaches, and for one that is not a finite number > 0."""
    target = float(target_epsilon)
    if not math.isfinite(target) or target <= 0:
        raise UnreachableEpsilon(f"a finite epsilon > 0, not {target!r}")
    if accountant == "rdp" and target < _rdp_floor(float(delta)):  # what the doubling would find, without its calls
        raise UnreachableEpsilon(
            f"at least {_fmt(_rdp_floor(float(delta)))}, the least epsilon any noise reaches at delta "
            f"{float(delta):g} with the rdp accountant"
        )
    if accountant == "prv" and target > PRV_MAX_EPSILON:
        raise UnreachableEpsilon(
            f"at most {PRV_MAX_EPSILON:g} with the prv accountant (its cost grows without bound as the "
            "noise shrinks; the rdp accountant takes larger targets)"
        )
    args = (float(sample_rate), int(steps), float(delta), accountant)

    def eps(sigma: float) -> float:
        return _searched_epsilon(float(sigma), *args)

    calls = 0
    sigma_low, sigma_high, eps_high = 0.0, 10.0, math.inf
    while not eps_high <= target:  # NaN too: the step bound ends it
        sigma_high *= 2
        calls += 1
        if sigma_high > MAX_NOISE or calls > MAX_SEARCH_STEPS:  # Opacus' limit: its largest noise is 655360
            raise UnreachableEpsilon(
                f"at least {_fmt(eps(sigma_high / 2))}, the epsilon of the most noise searched (noise multiplier {sigma_high / 2:g})"
            )
        eps_high = eps(sigma_high)
    while target - eps_high > EPSILON_TOLERANCE:
        calls += 1
        if calls > MAX_SEARCH_STEPS:
            raise UnreachableEpsilon(f"an epsilon the noise search reaches within {MAX_SEARCH_STEPS} steps")
        sigma = (sigma_low + sigma_high) / 2
        if sigma < MIN_NOISE:  # the least noise searched: the target is within reach only if its epsilon gets there
            least = eps(MIN_NOISE)
            if least >= target:
                sigma_low = MIN_NOISE
                continue
            if target - least <= EPSILON_TOLERANCE:
                return MIN_NOISE
            raise UnreachableEpsilon(
                f"at most {_fmt(least)}, the epsilon of the least noise searched (noise multiplier "
                f"{MIN_NOISE:g}; give noise_multiplier for less noise)"
            )
        found = eps(sigma)
        if found < target:
            sigma_high, eps_high = sigma, found
        else:
            sigma_low = sigma
    return sigma_high


@functools.lru_cache(maxsize=64)
def _rdp_floor(delta: float) -> float:
    """The RDP accountant's epsilon at ``delta`` in the limit of infinite noise (zero Renyi divergence at every order
    of its grid): no noise multiplier gets below it, so a smaller target is refused without a search (at large noise
    and sample rates below 1 Opacus' RDP takes seconds a call)."""
    import numpy as np
    from opacus.accountants.analysis.rdp import get_privacy_spent
    from opacus.accountants.rdp import RDPAccountant

    orders = RDPAccountant.DEFAULT_ALPHAS
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EDGE_OF_ALPHAS)  # the largest order, as always in this limit
        eps, _ = get_privacy_spent(orders=orders, rdp=np.zeros(len(orders)), delta=delta)
    return float(eps)


def _searched_epsilon(sigma: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """The epsilon of noise ``sigma`` in a search: an accountant that cannot evaluate it (Opacus' PRV accountant fails
    on very little noise) ends the search as an unreachable target."""
    try:
        if accountant == "prv" and _epsilon(sigma, sample_rate, steps, delta, "rdp") > _PRV_RDP_CAP:
            # too little noise for the PRV accountant to evaluate in bounded time: taken as above every target it is
            # asked for (at most PRV_MAX_EPSILON), so the search moves to more noise, the safe side
            return math.inf
        return _epsilon(sigma, sample_rate, steps, delta, accountant)
    except (ArithmeticError, MemoryError, RuntimeError, ValueError) as exc:
        raise UnreachableEpsilon(
            f"an epsilon Opacus' {accountant} accountant can evaluate (it failed at noise multiplier "
            f"{sigma:g}: {str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"
        ) from None


def _fmt(value: float) -> str:
    return f"{value:.4g}"
