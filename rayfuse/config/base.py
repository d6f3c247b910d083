"""The base of every schema a user's file is read into: unknown keys are errors, values frozen, floats finite,
a boolean is not a number; and the one check of a registered name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from rayfuse.errors import suggest

__all__ = ["StrictSchema", "StrictModel", "refuse_boolean_number"]


class StrictSchema(BaseModel):
    """Base of every schema a user's file is read into (config sections, method parameters, fuse and sweep files):
    unknown keys are errors, values are frozen, floats are finite (``allow_inf_nan=False``: ``lr: .inf`` and
    ``lr: nan`` are refused) and a boolean is not a number (``epochs: true`` is not 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: Any) -> Any:
        return refuse_boolean_number(cls, value, info)


class StrictModel(StrictSchema):
    """Base for config sections: a :class:`StrictSchema` whose defaults are validated too.

    ``--set`` values are parsed as YAML, so ``--set run.name=2024`` gives an int: text keys take numbers as text
    (``coerce_numbers_to_str``).
    """

    model_config = ConfigDict(validate_default=True, coerce_numbers_to_str=True)


def refuse_boolean_number(model: type[BaseModel], value: Any, info: Any) -> Any:
    """A ``mode="before"`` field check: a boolean given for a number field (``int``, ``float``, optional or not) is a
    ValueError (pydantic would read ``true`` as 1); ``value`` is returned unchanged otherwise."""
    if info.field_name not in model.model_fields:
        return value
    if isinstance(value, bool):
        kinds = _kinds(model.model_fields[info.field_name].annotation, top=True)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):
        kinds = _kinds(model.model_fields[info.field_name].annotation, top=False)  # the types of list items
    elif isinstance(value, Mapping) and any(isinstance(v, bool) for v in value.values()):
        kinds = _kinds(model.model_fields[info.field_name].annotation, top=False)
    else:
        return value
    if kinds & {int, float} and bool not in kinds:
        raise ValueError("a number, not a boolean")
    return value


def _kinds(annotation: Any, *, top: bool) -> set[Any]:
    """The types an annotation accepts as a value (``top``) or as the items / values of a list, tuple or dict in it."""
    import typing

    found: set[Any] = set()
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is None:
        return {annotation} if top else set()
    if origin in (list, tuple, set, dict) or (isinstance(origin, type) and issubclass(origin, (Sequence, Mapping))):
        if top:
            return found
        items = args[1:] if origin is dict or (isinstance(origin, type) and issubclass(origin, Mapping)) else args
        for arg in items:
            if arg is not Ellipsis:
                found |= _kinds(arg, top=True)
        return found
    for arg in args:  # a Union / Optional / Literal...
        found |= _kinds(arg, top=top)
    return found


def _registered(registry: Any, value: str) -> str:
    """``value`` if ``registry`` knows it (name or alias); else a ValueError listing the choices."""
    if value not in registry:
        names = registry.names(include_aliases=True)
        raise ValueError(f"a {registry.kind} in {{{', '.join(names)}}}{suggest(value, names)}")
    return value
