"""The FedAvg family: FedAvg, FedProx and the FedOpt server optimisers (FedAdagrad, FedAdam, FedYogi)."""

from rayfuse.fusion.fedavg.algorithm import FedAvg, FedAvgParams, FedProx, FedProxParams
from rayfuse.fusion.fedavg.fedopt import FedAdagrad, FedAdam, FedOpt, FedYogi

__all__ = ["FedAvg", "FedAvgParams", "FedProx", "FedProxParams", "FedOpt", "FedAdagrad", "FedAdam", "FedYogi"]
