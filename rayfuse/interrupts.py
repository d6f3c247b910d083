"""Interruption by a signal: SIGTERM handled like SIGINT (Ctrl-C).

``ray job stop``, schedulers (Slurm, Kubernetes) and container runtimes stop a process with SIGTERM. While
:func:`sigterm_as_interrupt` is active (the command line holds it around every command), SIGTERM raises
:class:`Interrupted`, a ``KeyboardInterrupt``: the run stops the way Ctrl-C stops it (its clients and coordinator are
stopped, every round checkpoint already written stays), and ``rayfuse`` prints the ``--resume`` hint and exits with
128 + the signal's number (143 for SIGTERM, 130 for SIGINT). Ray installs its own SIGTERM handler when a driver
connects (one that exits with status 1); :func:`reinstall_sigterm` puts this one back after ``ray.init``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Interrupted", "as_interrupted", "sigterm_as_interrupt", "reinstall_sigterm"]

_active = False
_received: int | None = None  # the signal the handler last turned into Interrupted


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM; ``run_dir`` is its run folder once one was claimed (``None`` before).

    Parameters
    ----------
    signum : int
        The signal (``signal.SIGINT`` for Ctrl-C).
    run_dir : Path, optional
        The run folder to continue with ``rayfuse run --resume``.
    """

    def __init__(self, signum: int = signal.SIGINT, run_dir: Path | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.run_dir = run_dir

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


def _raise_interrupted(signum: int, frame: Any) -> None:
    global _received
    _received = int(signum)
    raise Interrupted(signum)


def as_interrupted(exc: KeyboardInterrupt) -> Interrupted:
    """``exc`` as an :class:`Interrupted` of the signal that caused it: a library that catches the interrupt and raises
    a plain ``KeyboardInterrupt`` of its own (``ray.get`` does) loses the signal, which the handler recorded."""
    if isinstance(exc, Interrupted):
        return exc
    return Interrupted(_received if _received is not None else signal.SIGINT)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While active (in the main thread), SIGTERM raises :class:`Interrupted`; the previous handler comes back after."""
    global _active, _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    _active, _received = True, None
    try:
        yield
    finally:
        _active = False
        signal.signal(signal.SIGTERM, previous)


def reinstall_sigterm() -> None:
    """Put :func:`sigterm_as_interrupt`'s handler back if it is active (after a library, Ray, replaced it)."""
    if _active and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupted)
