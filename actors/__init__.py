"""The Ray layer: client and coordinator actors, the Ray federation and the Ray backend.

Everything that imports ``ray`` lives here; the ``rayfuse`` core stays importable (and testable) without it.
Exports are resolved lazily so that a client worker, which imports ``actors.client``, does not pull in the
coordinator's dependencies (torch) before a step needs them.
"""

from importlib import import_module

__all__ = ["ClientActor", "CoordinatorActor", "RayFederation", "RayBackend"]

_WHERE = {
    "ClientActor": "actors.client",
    "CoordinatorActor": "actors.coordinator",
    "RayFederation": "actors.federation",
    "RayBackend": "actors.backend",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
