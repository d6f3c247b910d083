"""``distill``: one-shot fusion by distilling the clients' ensemble into one student (FedDF, DENSE, Co-Boosting)."""

from rayfuse.fusion.distill.algorithm import Distill, DistillParams

__all__ = ["Distill", "DistillParams"]
