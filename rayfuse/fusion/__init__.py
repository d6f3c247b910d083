"""Fusion methods and baselines, one package per method (its client steps and its server loop side by side).

``kl/`` KL-fusion and its GMM / BNN / topic applications; ``gems/``; ``fedsa/``; ``epgan/``; ``fedavg/`` the FedAvg
family (FedProx, FedOpt); ``fedref/``; ``baselines/`` (local, average, ensemble, the pooled oracle, finetune).
Only methods live here: the path from client replies to an aggregate that every method shares (validation, attacks,
clipping and DP, the robust rules, streaming folds, the averaging maths) is the framework's, :mod:`rayfuse.updates`.
The contract the methods implement is :mod:`rayfuse.method`; ``METHODS`` there is the registry (``rayfuse list
methods``), filled from these packages.
"""

from rayfuse.method import METHODS, Method, MethodParams, MethodResult, register_method

__all__ = ["METHODS", "Method", "MethodParams", "MethodResult", "register_method"]
