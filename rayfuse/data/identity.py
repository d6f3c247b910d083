"""What a run's data *is*: the SHA-256 of the files a config names, so state computed from them is keyed by content.

A run's state (the finished methods and checkpoints of its folder, the clients' local models and step results under
``run.model_cache``) is tied to the content of the data it was computed on, not to the files' names and sizes: a
file regenerated in place (same labels and size, other values) has another digest, a file renamed or copied with
its bytes unchanged has the same one, and a file only touched (its mtime changed) too.

The files: a simulation's ``data.path`` and ``data.target.path``, and a silo config's server sets ``data.test.path``
and ``data.public.path`` (read on the server's node). The silos themselves are identified by the content hash each
client reports in the silo survey (:func:`rayfuse.data.silos.silo_schema`): only their clients can read them. A
folder (``imagefolder``) is identified by the relative paths and digests of the files under it (a class folder's name
is a label). A file is read in 1 MiB chunks; its digest is kept for this process only, by (path, size, mtime_ns,
inode, device), so each file is hashed once per process however many keys ask for it, and a file rewritten in place
(a new mtime or size) is hashed again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["sha256_file", "file_digest", "data_files", "content_data", "changed_files", "clear_digest_cache"]

CHUNK = 1 << 20

_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}  # (real path, size, mtime_ns, inode, device) -> SHA-256 hex


def clear_digest_cache() -> None:
    """Forget every digest this process computed (tests; a long-lived process that wants to re-read everything)."""
    _DIGESTS.clear()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, in hex (read now, in :data:`CHUNK` blocks; :func:`file_digest` keeps it per process)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _stat_key(path: Path) -> tuple[tuple[str, int, int, int, int], os.stat_result]:
    real = os.path.realpath(path)
    st = os.stat(real)
    return (real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev), st


def _file_sha256(path: Path) -> str:
    key, _ = _stat_key(path)
    known = _DIGESTS.get(key)
    if known is not None:
        return known
    _DIGESTS[key] = value = sha256_file(key[0])
    return value


def file_digest(path: str | os.PathLike[str]) -> str | None:
    """The SHA-256 (hex) of the file ``path``; of a folder, the SHA-256 of every regular file under it (its path
    relative to the folder, then its own SHA-256, in sorted order). ``None`` when ``path`` cannot be read: the reader of
    the data reports that in its own words (one line naming the key), so nothing is said here."""
    path = Path(path)
    try:
        if path.is_dir():
            digest = hashlib.sha256(b"folder|")
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                digest.update(f"{file.relative_to(path).as_posix()}|{_file_sha256(file)}|".encode())
            return digest.hexdigest()
        if path.is_file():
            return _file_sha256(path)
    except OSError:
        return None
    return None


def _expand(path: str, key: str) -> str:
    """A server set's path with ``${VAR}`` expanded as the server's node reads it (``rayfuse.data.silos.expand_path``);
    as written when a variable is unset (the reader refuses it, naming the key)."""
    from rayfuse.data.silos import expand_path
    from rayfuse.errors import InputError

    try:
        return expand_path(path, key=key)
    except InputError:
        return path


def data_files(data: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The data files of a config's ``data`` section (plain data: ``model_dump(mode="json")``) that the driver and the
    coordinator can read, by key path: ``{"data.path": {"path": <absolute path>, "sha256": <hex>}, ...}``. Files that
    do not exist are left out (their reader refuses them). A bundled or torchvision dataset has no file here: its
    content is fixed by rayfuse's version (bundled) or by torchvision's own checksums (downloaded), and hashing a
    whole torchvision root on every run would cost more than loading it."""
    sources: list[tuple[str, Any]] = []
    if data.get("silos"):
        sources += [
            (f"data.{key}.path", _expand(data[key]["path"], f"data.{key}.path"))
            for key in ("test", "public")
            if isinstance(data.get(key), Mapping) and data[key].get("path")
        ]
    else:
        if data.get("path"):
            sources.append(("data.path", data["path"]))
        target = data.get("target")
        if isinstance(target, Mapping) and target.get("path"):
            sources.append(("data.target.path", target["path"]))
    out: dict[str, dict[str, str]] = {}
    for key, path in sources:
        digest = file_digest(path)
        if digest is not None:
            out[key] = {"path": os.path.abspath(path), "sha256": digest}
    return out


def content_data(data: Mapping[str, Any], *, local: bool = False, unnamed: bool = False) -> dict[str, Any]:
    """``data`` (a config's ``data`` section as plain data) with every file name replaced by what the file holds: a
    key made from it is the same for a renamed or copied file and differs for one regenerated in place.

    ``local``: for a client's local model, which is trained on the client's own data only: a silo's paths are dropped
    (the silo survey's content hash of the client's silo stands for them, and no other silo enters the model except
    through the standardisation, keyed on its own), and so are the server's sets (``data.test``, ``data.public``,
    ``data.target``), which local training never reads.

    ``unnamed``: every file name is replaced by the same mark and nothing is read: the data section as a *setting*
    (which format, which columns...), to compare two configs apart from their files (whose content is compared on its
    own, :func:`changed_files`).
    """
    out = dict(data)
    files = data_files(data) if not (unnamed or local and data.get("silos")) else {}

    def content(key: str, path: Any) -> Any:
        if unnamed:
            return "<a file, compared by its content>"
        # a file that cannot be read keeps its name: the run stops at its reader before any key is used
        return {"sha256": files[key]["sha256"]} if key in files else path

    if data.get("silos"):
        out["silos"] = [
            {k: v for k, v in silo.items() if k not in ("path", "test_path")} if isinstance(silo, Mapping) else silo
            for silo in data["silos"]
        ]
        for key in ("test", "public"):
            if local:
                out.pop(key, None)
            elif isinstance(data.get(key), Mapping) and data[key].get("path"):
                out[key] = {**data[key], "path": content(f"data.{key}.path", data[key]["path"])}
        return out
    if data.get("path"):
        out["path"] = content("data.path", data["path"])
    if local:
        out.pop("target", None)
    elif isinstance(data.get("target"), Mapping) and data["target"].get("path"):
        out["target"] = {**data["target"], "path": content("data.target.path", data["target"]["path"])}
    return out


def changed_files(recorded: Mapping[str, Any], current: Mapping[str, Mapping[str, str]]) -> list[tuple[str, str, str, str]]:
    """The files of ``current`` (:func:`data_files`) whose content differs from ``recorded`` (the same form, as a run
    folder or the model cache recorded it): ``(key, path, recorded sha256, current sha256)`` each. A key ``recorded``
    lacks, or records in another form, is not a change (state written before content was recorded, or a file that
    was not readable then)."""
    out = []
    for key, now in current.items():
        then = recorded.get(key)
        if isinstance(then, Mapping) and isinstance(then.get("sha256"), str) and then["sha256"] != now["sha256"]:
            out.append((key, now["path"], then["sha256"], now["sha256"]))
    return out
