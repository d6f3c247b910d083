"""KL-fusion (Claici et al. 2020): posteriors fused by minimising a sum of KL divergences, with its applications
(Gaussian mixtures, Bayesian MLP neurons, LDA topics) and the SPAHM / DP-cluster / pooled baselines."""

from rayfuse.fusion.kl.algorithm import KLFusion, KLParams
from rayfuse.fusion.kl.gmm import DPCluster, GMMOracle
from rayfuse.fusion.kl.spahm import SPAHM

__all__ = ["KLFusion", "KLParams", "GMMOracle", "DPCluster", "SPAHM"]
