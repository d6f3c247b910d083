"""The privacy accountant every DP option of rayfuse uses: Opacus' own, behind two cached functions.

Central DP-FedAvg (:mod:`rayfuse.fusion.central_dp`), the one-shot DP upload (:mod:`rayfuse.fusion.privacy`) and the
``train.dp`` / ``dp`` settings in the config all turn a noise multiplier into an epsilon, or a target epsilon into a
noise multiplier, here. Nothing is derived by hand: :func:`compute_epsilon` asks Opacus' ``RDPAccountant`` or
``PRVAccountant`` for the sampled Gaussian mechanism composed ``steps`` times, and :func:`noise_multiplier_for`
is Opacus' ``get_noise_multiplier``. Opacus is imported when first needed, so the config and the server stay light.
"""

from __future__ import annotations

import functools
import warnings

__all__ = ["compute_epsilon", "noise_multiplier_for", "require_one_noise"]

# Opacus' RDP warning when the optimal order is at the edge of its alpha grid: the bound still holds, it could only be
# tighter (tiny noise: the smallest alpha; much noise: the largest)
_EDGE_OF_ALPHAS = "Optimal order is the"


def require_one_noise(noise_multiplier: float | None, target_epsilon: float | None) -> None:
    """The check of every DP setting that takes ``noise_multiplier`` or ``target_epsilon``: exactly one of the two.
    Raises ``ValueError`` in the config's ``@key@ expected`` form."""
    if (noise_multiplier is None) == (target_epsilon is None):
        given = "both" if noise_multiplier is not None else "neither"
        raise ValueError(f"@noise_multiplier@ exactly one of noise_multiplier and target_epsilon, got {given}")


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
        return float(acc.get_epsilon(delta=delta))


@functools.lru_cache(maxsize=64)
def noise_multiplier_for(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp") -> float:
    """The noise multiplier that spends ``target_epsilon`` at ``delta`` in ``steps`` releases at ``sample_rate``
    (Opacus' ``get_noise_multiplier``: a binary search to within 0.01 of epsilon, on the safe side). Raises Opacus'
    ``ValueError`` when no noise up to its limit reaches the target."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EDGE_OF_ALPHAS)
        return float(get_noise_multiplier(target_epsilon=float(target_epsilon), target_delta=float(delta), sample_rate=float(sample_rate),
                                          steps=int(steps), accountant=accountant))
