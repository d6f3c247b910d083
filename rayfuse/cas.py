"""A content-addressed cache: folders named by a SHA-256 of what they were computed from.

::

    <root>/<key>/             one entry: written once, complete, never changed
    <root>/<key>/key.json     the inputs the key was computed from
    <root>/<key>.lock         the entry's lock (a ``filelock.FileLock``)

:func:`content_key` hashes the inputs (plain JSON data). :meth:`CacheEntry.publish` writes an entry into a staging
folder beside it (``.<key>-*``) and renames it into place: a reader sees the whole entry or none of it, and a crash
mid-write leaves no entry (only a hidden staging folder). Of concurrent writers of one key the first rename wins and
the others' staging folders are removed. :meth:`CacheEntry.lock` serialises the processes that would compute the
same entry (the concurrent Ray Tune trials on one machine, or on a file system their nodes share), so it is computed
once and the others wait and read it.

The stores built on it: the clients' trained local models (:class:`rayfuse.store.LocalModelStore`), client-step
results (:class:`rayfuse.store.StepResultCache`) and the locks and atomic writes of a client's private state
(:class:`rayfuse.client.ClientStateStore`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from rayfuse.io import atomic_write_json

__all__ = ["ContentCache", "CacheEntry", "content_key", "discard_entry", "key_lock", "publish_folder"]

KEY_FILE = "key.json"


def content_key(inputs: Mapping[str, Any]) -> str:
    """The key of ``inputs``: the first 24 hex digits of the SHA-256 of their canonical JSON (sorted keys)."""
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def key_lock(path: str | os.PathLike) -> FileLock:
    """An exclusive inter-process lock on the file ``path`` (its folder is created); use it as a context manager.

    A ``filelock.FileLock``: an ``flock`` on POSIX, so it holds between the processes of one machine and, on a file
    system that supports ``flock`` (NFS v4, Lustre, GPFS...), between machines.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path))


def publish_folder(target: str | os.PathLike, write: Callable[[Path], None]) -> bool:
    """Write the folder ``target`` atomically: ``write(staging)`` fills a staging folder beside it, renamed into place.

    Returns ``True`` when this call published ``target``; ``False`` when ``target`` already existed or another writer
    renamed its own first (its entry stands; this one's staging folder is removed). An error in ``write`` publishes
    nothing and is raised.
    """
    target = Path(target)
    if target.is_dir():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        try:
            os.rename(staging, target)  # atomic; fails when target exists (it is never empty: key.json at least)
        except OSError:
            if target.is_dir():
                return False
            raise
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def discard_entry(folder: str | os.PathLike) -> None:
    """Remove a damaged published entry: renamed aside first (a reader sees the whole entry or none), then deleted; a
    concurrent discard of the same entry is not an error."""
    folder = Path(folder)
    aside = folder.parent / f".{folder.name}-discarded-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(folder, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


@dataclass(frozen=True)
class CacheEntry:
    """One entry of a :class:`ContentCache`: its ``key``, the ``inputs`` it was computed from, and its ``folder``."""

    root: Path
    key: str
    inputs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def folder(self) -> Path:
        return self.root / self.key

    @property
    def exists(self) -> bool:
        """Whether the entry is published (then it is complete)."""
        return self.folder.is_dir()

    def lock(self) -> FileLock:
        """The entry's lock: hold it to compute the entry once among concurrent processes."""
        return key_lock(self.root / f"{self.key}.lock")

    def publish(self, write: Callable[[Path], None]) -> bool:
        """Publish the entry: ``write(staging)`` writes its files, ``key.json`` (the inputs) is added, and the folder is
        renamed into place. ``False`` (nothing changed) when the entry already exists; see :func:`publish_folder`."""

        def fill(staging: Path) -> None:
            write(staging)
            atomic_write_json(staging / KEY_FILE, dict(self.inputs))

        return publish_folder(self.folder, fill)


class ContentCache:
    """Content-addressed entries under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def entry(self, inputs: Mapping[str, Any], key: str | None = None) -> CacheEntry:
        """The entry of ``inputs`` (``key``: their :func:`content_key`, when the caller computed it already)."""
        return CacheEntry(self.root, content_key(inputs) if key is None else key, dict(inputs))

    def lock(self, key: str) -> FileLock:
        """A lock named ``key`` in this cache (e.g. one over a group of entries), like :meth:`CacheEntry.lock`."""
        return key_lock(self.root / f"{key}.lock")
