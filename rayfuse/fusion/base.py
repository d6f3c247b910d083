"""What a fusion method is: parameters, a server loop, and the client steps it calls.

One module per method under ``rayfuse/fusion/``. A module defines its client steps (functions decorated with
:func:`rayfuse.federation.client_step`) and a :class:`Method` subclass registered with :func:`register_method`.
Dropping a new module into the package is all it takes to add a method: the registry imports every module of
``rayfuse.fusion`` (and the ``rayfuse.methods`` entry-point group) on first use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from rayfuse.registry import Registry

if TYPE_CHECKING:
    from rayfuse.coordinator import ServerContext
    from rayfuse.models.params import Params

__all__ = ["Method", "MethodParams", "MethodResult", "METHODS", "register_method"]


class MethodParams(BaseModel):
    """A method's parameters: unknown keys are errors, values frozen after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


@dataclass
class MethodResult:
    """What a method's server loop returns.

    ``metrics`` are the final metrics (on the global test set); ``params`` the fused model, saved as
    ``models/<label>.safetensors`` when given; ``info`` anything else worth recording (per-client numbers, notes).
    Per-round metrics are logged through :meth:`ServerContext.log` as the loop runs.
    """

    metrics: dict[str, float]
    params: "Params | None" = None
    info: dict[str, Any] = field(default_factory=dict)


class Method(ABC):
    """Base class of fusion methods and baselines."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    Params: ClassVar[type[MethodParams]] = MethodParams
    summary: ClassVar[str] = ""
    uses_local_models: ClassVar[bool] = False  # needs every client's trained local model
    oracle: ClassVar[bool] = False  # not feasible in a real federation (reported as an upper reference)
    multi_round: ClassVar[bool] = False  # checkpoints each round; ``--resume`` continues mid-method

    def __init__(self, params: MethodParams, label: str | None = None) -> None:
        self.params = params
        self.label = label or self.name

    @abstractmethod
    def run(self, server: "ServerContext") -> MethodResult:
        """The server loop."""


METHODS: Registry[type[Method]] = Registry("method")


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator adding a :class:`Method` subclass to the registry under ``cls.name``."""
    METHODS.register(cls.name, cls, aliases=cls.aliases)
    return cls
