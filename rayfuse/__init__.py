"""rayfuse: federated model fusion on Ray.

The core (``rayfuse.fusion``, ``rayfuse.data``, ``rayfuse.models`` and the modules beside them) never imports Ray;
the Ray layer lives in the ``actors`` package. ``rayfuse run`` / ``rayfuse list`` are the command line;
:func:`rayfuse.run`, :func:`rayfuse.fuse` and :func:`rayfuse.load_fused` the Python API (:mod:`rayfuse.api`, imported on first use so that
``import rayfuse`` stays cheap).

Submodules import what they need from the module that defines it (``from rayfuse.errors import InputError``), never
``from rayfuse import ...``: this package imports :mod:`rayfuse.api`, which imports them.
"""

from typing import Any

from rayfuse.errors import InputError, RunFailure
from rayfuse.version import __version__

__all__ = ["InputError", "RunFailure", "RunResult", "fuse", "load_fused", "resume", "run", "__version__"]

_API = ("run", "resume", "fuse", "load_fused", "RunResult")


def __getattr__(name: str) -> Any:
    """Export the Python API lazily: ``rayfuse.run`` imports :mod:`rayfuse.api` (and torch, pandas) on first use."""
    if name in _API:
        from rayfuse import api

        return getattr(api, name)
    raise AttributeError(f"module 'rayfuse' has no attribute {name!r}")
