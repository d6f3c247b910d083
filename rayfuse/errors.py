"""The project's error types.

``InputError`` is the one error type for bad input (config, files, arguments). Its message is a single line that
names the key path, the expected value and what was given, so the CLI can print it as is and exit with code 2.
``RunFailure`` is raised when a run cannot go on (too few clients left, every update rejected...): exit code 1.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["InputError", "RunFailure", "NonFiniteError", "SecAggFailure", "suggest", "key_error", "KEYED_ERROR"]


#: how long a string or path in an error's "got" may be before its middle is cut
PATH_LIMIT = 240


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error's "got": at most ``limit`` characters, cut at the end. A string or a path is kept
    whole up to :data:`PATH_LIMIT` characters and past that cut in the middle (its first ``limit`` characters kept): a
    file's path names the file at its end, and a temporary folder's path alone can pass 80 characters."""
    text = repr(value)
    if isinstance(value, (str, os.PathLike)):
        return text if len(text) <= PATH_LIMIT else text[:limit] + "..." + text[-(PATH_LIMIT - limit - 3) :]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def suggest(given: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` when ``given`` is close to one of ``choices``, else ``""``."""
    close = difflib.get_close_matches(str(given), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class InputError(ValueError):
    """Bad input: a config key, a file, a command-line argument.

    Parameters
    ----------
    path : str
        Where the problem is: a dotted config key path (``partition.alpha``) or a file path.
    expected : str
        What would have been accepted, in words.
    got : object, optional
        What was given. Omitted from the message when ``_MISSING``.
    hint : str, optional
        One short remedy, appended after a semicolon.
    """

    _MISSING = object()

    def __init__(self, path: str, expected: str, got: Any = _MISSING, hint: str = "") -> None:
        self.path = path
        self.expected = expected
        self.got = got
        self.hint = hint
        message = f"{path}: expected {expected}"
        if got is not InputError._MISSING:
            message += f", got {_short(got)}"
        if hint:
            message += f"; {hint}"
        super().__init__(message)

    def at(self, path: str) -> InputError:
        """The same error at another key path (a method's relative path made absolute)."""
        has_got = self.got is not InputError._MISSING
        return _rebuild_input_error(type(self), path, self.expected, has_got, self.got if has_got else None, self.hint)

    def __reduce__(self) -> tuple:
        # Pickling (Ray sends an error raised in an actor, task or Tune trial to the driver) and copy.copy (Ray Tune's
        # traceback shortening) rebuild an exception from its args, which hold only the message: rebuild from the fields
        # instead, keeping "no got" as it was (the sentinel is not the same object after unpickling).
        has_got = self.got is not InputError._MISSING
        return _rebuild_input_error, (type(self), self.path, self.expected, has_got, self.got if has_got else None, self.hint)


def _rebuild_input_error(cls: type, path: str, expected: str, has_got: bool, got: Any, hint: str) -> InputError:
    return cls(path, expected, got, hint) if has_got else cls(path, expected, hint=hint)


# The pydantic error type of :func:`key_error`: its context holds the key path (``loc``) and the message (``expected``).
KEYED_ERROR = "rayfuse_keyed"


def key_error(loc: str | int | tuple[str | int, ...], expected: str) -> ValueError:
    """The error a cross-field check in a config schema raises for a key other than the one it validates.

    ``loc`` is the key path relative to the model whose validator raises it (``"path"``, ``("groups", 3)``; from the
    top-level config: ``("federation", "min_clients")``); ``expected`` is the one-line rest of the message (what was
    expected, and what was given). Raised inside a pydantic validator, it reaches
    :func:`rayfuse.config.pydantic_input_error` with the path as data, appended to the error's own location
    (a ``pydantic_core.PydanticCustomError``, a ``ValueError``; pydantic_core is imported when first needed).
    """
    from pydantic_core import PydanticCustomError

    path = tuple(loc) if isinstance(loc, tuple) else (loc,)
    return PydanticCustomError(KEYED_ERROR, "{expected}", {"loc": tuple(str(p) for p in path), "expected": expected})


class RunFailure(RuntimeError):
    """A run could not go on (failure policy exhausted, quorum lost, every update rejected)."""


class NonFiniteError(RunFailure):
    """A model produced NaN or Inf where a finite number was required."""


class SecAggFailure(RunFailure):
    """Secure aggregation could not finish: too few holders left to reconstruct a secret, or a malformed message.

    ``client`` names the client whose message was malformed (``None`` when no one client is to blame, e.g. too many
    dropped); the message is one line naming the clients and, for dropouts, the reconstruction threshold.
    """

    def __init__(self, message: str, client: Any = None) -> None:
        self.client = client
        super().__init__(message)

    def __reduce__(self) -> tuple:
        # Rebuild with the client too (the default rebuilds from args, which hold only the message).
        return type(self), (str(self), self.client)
