"""EP-GAN (Chen et al. 2023): federated Bayesian GANs whose global prior is an expectation-propagation product of
the clients' factors."""

from rayfuse.fusion.epgan.algorithm import EPGAN, EPGANOracle, EPGANParams

__all__ = ["EPGAN", "EPGANOracle", "EPGANParams"]
