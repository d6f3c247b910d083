"""Fusion methods and baselines, one module each. ``METHODS`` is the registry (``rayfuse list methods``)."""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points

from rayfuse.fusion.base import METHODS, Method, MethodParams, MethodResult, register_method

__all__ = ["METHODS", "Method", "MethodParams", "MethodResult", "register_method"]

_SKIP = {"base"}


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.name not in _SKIP and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    for entry in entry_points(group="rayfuse.methods"):  # third-party methods
        entry.load()


METHODS.add_loader(_discover)
