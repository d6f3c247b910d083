"""``fedlora``: federated LoRA fine-tuning of one shared base (FFA-LoRA, stacking, SVD, averaged factors); ``fedmerge``:
fine-tunes merged with the clients' Fisher / RegMean statistics; a Hugging Face folder as the base (``hf_model``)."""

from rayfuse.fusion.lora.algorithm import FedLora, FedLoraParams, combine_round, lora_targets
from rayfuse.fusion.lora.fedmerge import FedMerge, FedMergeParams
from rayfuse.fusion.lora.hf import hf_model

__all__ = ["FedLora", "FedLoraParams", "FedMerge", "FedMergeParams", "combine_round", "hf_model", "lora_targets"]
