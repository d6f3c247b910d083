"""The baselines every paper compares against: each client's local model, the one-shot parameter average, the
ensemble, the pooled-data oracle, and fine-tuning a fused or local model on the server's public sample."""

from rayfuse.fusion.baselines.average import Average
from rayfuse.fusion.baselines.ensemble import Ensemble
from rayfuse.fusion.baselines.finetune import Finetune
from rayfuse.fusion.baselines.local import Local
from rayfuse.fusion.baselines.oracle import GlobalOracle

__all__ = ["Average", "Ensemble", "Finetune", "Local", "GlobalOracle"]
