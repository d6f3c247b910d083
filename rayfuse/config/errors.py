"""Pydantic's validation errors as the one-line :class:`rayfuse.errors.InputError` (key path, expected, got)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from rayfuse.config.experiment import ExperimentConfig
from rayfuse.errors import KEYED_ERROR, InputError, suggest

__all__ = ["pydantic_input_error", "validate_file_section"]

_Schema = TypeVar("_Schema", bound=BaseModel)


def validate_file_section(schema: type[_Schema], data: Mapping[str, Any], file: object, prefix: str = "") -> _Schema:
    """``data`` (a part of a file, at key path ``prefix``) validated against ``schema``; its first problem is one
    :class:`InputError` naming the file and the key path."""
    try:
        return schema.model_validate(dict(data))
    except ValidationError as exc:
        err = pydantic_input_error(exc, prefix=prefix, model=schema)
        raise InputError(f"{file}: {err.path}", err.expected, err.got, err.hint) from None


def pydantic_input_error(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> InputError:
    """Turn pydantic's first error into one :class:`InputError` line (key path, expected, got)."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    loc = [str(p) for p in error["loc"]]
    msg = str(error.get("msg", "invalid value"))
    got = error.get("input", InputError._MISSING)
    kind = error.get("type", "")
    context = error.get("ctx") or {}
    if kind == KEYED_ERROR:
        # a cross-field check's error (rayfuse.errors.key_error): the key it names, relative to the model whose
        # validator raised it (the top-level config's: an absolute path), and the rest of the line (expected, got)
        loc = loc + [str(p) for p in context["loc"]]
        msg = str(context["expected"])
        got = InputError._MISSING
    path = ".".join(p for p in [prefix, *loc] if p) or "config"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if kind == "extra_forbidden":
        parent = loc[:-1]
        known = _known_keys(model or ExperimentConfig, parent)
        hint = suggest(loc[-1], known).strip(" ()") if known else ""
        expected = f"one of the keys {{{', '.join(known)}}}" if known else "no such key"
        return InputError(path, f"a known key, not {loc[-1]!r}: " + expected, InputError._MISSING, hint + more)
    if kind == "missing":
        return InputError(path, "this required key to be set", InputError._MISSING, more.strip())
    msg = re.sub(r"^(Value error, |Assertion failed, )", "", msg)
    msg = re.sub(r"^Input should be ", "", msg)
    msg = msg[0].lower() + msg[1:] if msg else msg
    found = re.search(r" \((did you mean '[^']*'\?)\)$", msg)  # from suggest(): goes after "got"
    if found:
        msg = msg[: found.start()]
    return InputError(path, msg, got, "; ".join(h for h in (found.group(1) if found else "", more.strip()) if h))


def _known_keys(model: type[BaseModel], parent: list[str]) -> list[str]:
    """The keys a nested section of ``model`` accepts (for "did you mean" on an unknown key)."""
    for part in parent:
        if part.isdigit():  # an item of a list of sections (data.silos.0)
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        candidates = _section_models(field.annotation)
        if not candidates:
            return []
        model = candidates[0]
    return sorted(model.model_fields)


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    """The config sections (models) an annotation holds: itself, or inside an Optional, a list or a dict's values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _section_models(arg)]
