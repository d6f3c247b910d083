"""Models: the registry, parameter dicts and training loops (no Ray here)."""

from rayfuse.models.params import (
    Params,
    check_params,
    get_params,
    model_with_params,
    num_bytes,
    params_equal,
    params_layout,
    restore_taken,
    set_params,
    take_params,
)
from rayfuse.models.registry import MODELS, build_model, check_model_fits, register_model
from rayfuse.models.training import TrainStats, compute_loss, predict_proba, train_model

__all__ = [
    "Params",
    "check_params",
    "get_params",
    "num_bytes",
    "params_equal",
    "set_params",
    "take_params",
    "restore_taken",
    "model_with_params",
    "params_layout",
    "MODELS",
    "build_model",
    "check_model_fits",
    "register_model",
    "TrainStats",
    "compute_loss",
    "predict_proba",
    "train_model",
]
