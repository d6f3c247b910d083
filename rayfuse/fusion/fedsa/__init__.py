"""FedSA (Xie et al. 2022): saliency-based teacher selection and selective knowledge amalgamation, with the
scratch / transfer baselines."""

from rayfuse.fusion.fedsa.algorithm import FedSA, FedSAParams, Scratch, Transfer

__all__ = ["FedSA", "FedSAParams", "Scratch", "Transfer"]
