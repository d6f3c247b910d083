"""``fedlora``: federated LoRA fine-tuning of one shared base (FFA-LoRA, stacking, SVD, averaged factors)."""

from rayfuse.fusion.lora.algorithm import FedLora, FedLoraParams, combine_round, lora_targets

__all__ = ["FedLora", "FedLoraParams", "combine_round", "lora_targets"]
