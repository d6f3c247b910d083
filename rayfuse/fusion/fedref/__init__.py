"""FedRef (Yoon & Choi 2025): FedAvg with a server-side reference-model fine-tuning step."""

from rayfuse.fusion.fedref.algorithm import FedRef

__all__ = ["FedRef"]
