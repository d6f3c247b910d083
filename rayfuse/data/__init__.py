"""Data: the dataset registry, partitioners and data roles (no Ray here)."""

from rayfuse.data.datasets import DATASETS, Dataset, load_dataset, register_dataset
from rayfuse.data.partition import PARTITIONERS, class_counts, partition
from rayfuse.data.roles import ClientPlan, DataPlan, Split, client_splits, load_dataset_from_config, make_plan, pooled_train, server_splits

__all__ = [
    "DATASETS",
    "Dataset",
    "load_dataset",
    "register_dataset",
    "PARTITIONERS",
    "partition",
    "class_counts",
    "ClientPlan",
    "DataPlan",
    "Split",
    "make_plan",
    "load_dataset_from_config",
    "client_splits",
    "server_splits",
    "pooled_train",
]
