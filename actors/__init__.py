"""The Ray layer: client and coordinator actors, the Ray federation and the Ray backend.

Everything that imports ``ray`` lives here; the ``rayfuse`` core stays importable (and testable) without it.
"""

from actors.client import ClientActor
from actors.coordinator import CoordinatorActor
from actors.federation import RayFederation

__all__ = ["ClientActor", "CoordinatorActor", "RayFederation", "RayBackend"]


def __getattr__(name: str):
    if name == "RayBackend":
        from actors.backend import RayBackend

        return RayBackend
    raise AttributeError(name)
