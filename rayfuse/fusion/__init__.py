"""Fusion methods and baselines, one package per method (its client steps and its server loop side by side).

``kl/`` KL-fusion and its GMM / BNN / topic applications; ``gems/``; ``fedsa/``; ``epgan/``; ``fedavg/`` the FedAvg
family (FedProx, FedOpt); ``fedref/``; ``baselines/`` (local, average, ensemble, the pooled oracle, finetune).
``aggregate`` holds the averaging math every method shares. The contract the methods implement is
:mod:`rayfuse.method`; ``METHODS`` there is the registry (``rayfuse list methods``), filled from these packages.
"""

from rayfuse.method import METHODS, Method, MethodParams, MethodResult, register_method

__all__ = ["METHODS", "Method", "MethodParams", "MethodResult", "register_method"]
