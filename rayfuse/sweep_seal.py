"""The seal of a sweep folder: ``rayfuse tune --resume`` restores only state this user's rayfuse wrote.

``Tuner.restore`` unpickles what the sweep folder holds (``tuner.pkl``, the experiment state files, the searcher's
state, a trial's ``error.pkl``...): a file planted there runs as the user who resumes. So rayfuse seals the folder
while a sweep runs and verifies the seal before anything is restored:

* the key: 32 random bytes in ``$RAYFUSE_HOME/sweep.key`` (default ``$XDG_CONFIG_HOME/rayfuse``, else
  ``~/.config/rayfuse``), created mode 0600 at the first sweep; a key file that another user owns or that others
  can read or write is refused;
* the seal: ``<experiment>/rayfuse-seal.json`` lists every file of the experiment folder with its SHA-256 (all but
  rayfuse's own outputs: the trials' run folders ``runs/``, ``results.parquet``, ``best.yaml``) and an HMAC-SHA256 of
  that list under the key. rayfuse writes it right after Tune writes ``tuner.pkl`` (whose hash it then keeps: a
  later change of ``tuner.pkl`` is never sealed), every few seconds while the sweep runs, and when it ends;
* :func:`verify_sweep` (before ``Tuner.restore``) refuses a folder without a seal, a seal that does not verify under
  this user's key, any file added, changed or missing since the seal, and a folder (or a file in it) that another
  user owns or that is writable by others (by its group too, unless that group is the user's own private group).

What this does not cover: a sweep whose driver was killed (kill -9) in the seconds between a save of Tune's and the
next seal is refused, and files a process running as the same user wrote while the sweep ran are sealed with the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rayfuse.errors import InputError
from rayfuse.io import atomic_write_json, parse_json

__all__ = ["SEAL_FILE", "key_file", "load_key", "state_files", "seal_sweep", "verify_sweep", "check_sweep_folder", "sealing"]

SEAL_FILE = "rayfuse-seal.json"
SEAL_FORMAT = 1
PINNED = ("tuner.pkl",)  # written once, when the sweep starts: its first hash is the one sealed from then on
_OUTPUTS = {SEAL_FILE, "results.parquet", "results.parquet.tmp", "best.yaml"}
_OUTPUT_DIRS = {"runs"}
MAX_SEAL_BYTES = 256 << 20  # a seal lists every state file with its hash: ~100 bytes each


def key_file() -> Path:
    """Where this user's sweep key lives: ``$RAYFUSE_HOME/sweep.key``, else ``$XDG_CONFIG_HOME/rayfuse/sweep.key``,
    else ``~/.config/rayfuse/sweep.key``."""
    home = os.environ.get("RAYFUSE_HOME")
    if home:
        return Path(home) / "sweep.key"
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "rayfuse" / "sweep.key"


def load_key(*, create: bool = False) -> bytes:
    """This user's sweep key; with ``create``, written (mode 0600) when there is none. :class:`InputError` for a key
    file that is missing (without ``create``), owned by another user, readable or writable by others, or malformed."""
    file = key_file()
    if create and not file.exists():
        file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another sweep created it first: read theirs
        else:
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(32))
    try:
        info, key = _read_regular(file, limit=33, what="a key file of yours that only you can read and write (mode 0600)")
    except FileNotFoundError:
        raise InputError(
            str(file),
            "this user's sweep key (written when a sweep starts)",
            "no such file",
            "a sweep started by another user or on another machine cannot be resumed here",
        ) from None
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise InputError(
            str(file),
            "a key file of yours that only you can read and write (mode 0600)",
            f"owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}",
            f"chmod 600 {file}",
        )
    if len(key) != 32:
        raise InputError(str(file), "a 32-byte sweep key", f"{len(key)} bytes", "delete it (it is written again at the next sweep)")
    return key


def state_files(experiment: str | os.PathLike) -> dict[str, str]:
    """Every file of the experiment folder Tune may read back, as relative path -> SHA-256 (a symbolic link by its
    target); rayfuse's own outputs are left out."""
    root = Path(experiment)
    out: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if here == root:
            dirs[:] = [d for d in dirs if d not in _OUTPUT_DIRS]
        for name in files + [d for d in dirs if (here / d).is_symlink()]:
            path = here / name
            rel = path.relative_to(root).as_posix()
            if rel in _OUTPUTS:
                continue
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = "symlink:" + os.readlink(path)
            elif stat.S_ISREG(mode):
                out[rel] = _sha256(path)
            else:  # a FIFO, socket or device is never opened (a FIFO blocks the reader): listed by its kind, refused on verify
                out[rel] = "special:" + _kind(mode)
    return dict(sorted(out.items()))


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "folder"),
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return f"file of mode {mode:o}"


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """An open descriptor of ``path`` (a link followed) and its status, only when it is a regular file: the status is
    checked before opening, and again on the descriptor (O_NONBLOCK: a FIFO swapped in between never blocks the open)."""
    before = os.stat(path)
    if not stat.S_ISREG(before.st_mode):
        raise _NotRegular(_kind(before.st_mode))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _NotRegular(_kind(info.st_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


class _NotRegular(OSError):
    """What :func:`_open_regular` found instead of a regular file."""


def _read_regular(path: Path, *, limit: int, what: str) -> tuple[os.stat_result, bytes]:
    """The status and the first ``limit`` bytes of a regular file (:func:`_open_regular`); :class:`InputError` naming
    ``path`` (expecting ``what``) for anything else."""
    try:
        fd, info = _open_regular(path)
    except _NotRegular as exc:
        raise InputError(str(path), what, f"a {exc}", "rayfuse reads only regular files here") from None
    with os.fdopen(fd, "rb") as handle:
        return info, handle.read(limit)


def _sha256(path: Path) -> str:
    try:
        fd, _ = _open_regular(path)
    except _NotRegular as exc:  # replaced by a FIFO (or another special file) since it was listed
        return f"special:{exc}"
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _mac(key: bytes, files: Mapping[str, str]) -> str:
    text = json.dumps({"format": SEAL_FORMAT, "files": dict(files)}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def seal_sweep(experiment: str | os.PathLike, *, pinned: Mapping[str, str] | None = None, key: bytes | None = None) -> dict[str, str]:
    """Write ``<experiment>/rayfuse-seal.json`` over the folder's files as they are now (a file named in ``pinned`` is
    sealed with its pinned hash, whatever it holds now); return the sealed list."""
    root = Path(experiment)
    files = state_files(root)
    for name, digest in (pinned or {}).items():
        if name in files:
            files[name] = digest
    key = key if key is not None else load_key(create=True)
    atomic_write_json(root / SEAL_FILE, {"format": SEAL_FORMAT, "files": files, "mac": _mac(key, files)})
    return files


def _writable_by_others(info: os.stat_result) -> bool:
    mode = info.st_mode
    if mode & stat.S_IWOTH:
        return not (stat.S_ISDIR(mode) and mode & stat.S_ISVTX)  # a sticky folder (/tmp): others cannot replace entries
    if mode & stat.S_IWGRP:
        import grp
        import pwd

        try:
            group, user = grp.getgrgid(info.st_gid), pwd.getpwuid(os.getuid())
        except KeyError:
            return True
        private = group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
        return not private
    return False


def check_sweep_folder(storage: str | os.PathLike, experiment: str | os.PathLike | None = None) -> None:
    """:class:`InputError` when the storage folder, its parents, the experiment folder or anything in it is owned by
    another user (the storage's parents may be root's) or writable by others, or is neither a regular file, a folder
    nor a symbolic link (a FIFO blocks its reader). A folder reached through a symbolic link (the storage, the
    experiment folder, a link inside it) is held to the same rules as the link: its target, and the target's parents,
    are checked too."""
    given = Path(storage).absolute()
    resolved = given.resolve()
    chains = [resolved, *resolved.parents]
    if given != resolved:  # reached through a link: the folders that hold the links can swap them too
        chains += [p for p in [given, *given.parents] if p not in chains]
    for parent in chains:
        if not os.path.lexists(parent):
            continue
        info = os.stat(parent) if parent.exists() else os.lstat(parent)
        if _writable_by_others(info) or (parent == resolved and info.st_uid != os.getuid()):
            raise InputError(
                str(parent),
                "a sweep storage folder only you can write (Tune unpickles what it holds on --resume)",
                f"mode {stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}",
                f"chmod go-w {parent}, or use another --storage",
            )
    if experiment is None or not Path(experiment).exists():
        return
    root = Path(experiment)
    for folder, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            path = Path(folder) / name if name != "." else Path(folder)
            _check_sweep_entry(path, os.lstat(path))
            if path.is_symlink():  # the target of a link (the experiment folder itself, or a link inside it) too
                _check_link_target(path)


def _check_sweep_entry(path: Path, info: os.stat_result) -> None:
    hint = "a folder others can write may hold planted state: start the sweep anew elsewhere"
    if info.st_uid != os.getuid() or (not stat.S_ISLNK(info.st_mode) and _writable_by_others(info)):
        raise InputError(
            str(path),
            "a sweep file only you can write (Tune unpickles the folder's state on --resume)",
            f"mode {stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}",
            hint,
        )
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        raise InputError(
            str(path),
            "a regular file, a folder or a symbolic link in a sweep folder",
            f"a {_kind(info.st_mode)}",
            "rayfuse never reads it (a FIFO would block): remove it, or start the sweep anew elsewhere",
        )


def _check_link_target(link: Path) -> None:
    """A link's target as if it stood where the link does, and the target's parents as a storage folder's."""
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):  # a dangling link or a loop: nothing to read through it (sealed by its text)
        return
    _check_sweep_entry(target, os.stat(target))
    for parent in target.parents:
        info = os.stat(parent)
        if _writable_by_others(info):
            raise InputError(
                str(parent),
                f"a folder only you can write above {target} (reached through the link {link})",
                f"mode {stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}",
                "a folder others can write may hold planted state: start the sweep anew elsewhere",
            )


def verify_sweep(experiment: str | os.PathLike, storage: str | os.PathLike | None = None) -> dict[str, str]:
    """Check that this user's rayfuse sealed the experiment folder as it is now, before ``Tuner.restore`` reads it;
    return the sealed list. :class:`InputError` (naming the file) otherwise; nothing in the folder is parsed but the
    seal's JSON."""
    root = Path(experiment)
    check_sweep_folder(storage if storage is not None else root.parent, root)
    seal = root / SEAL_FILE
    hint = "rayfuse restores only a sweep it sealed with your key; start the sweep anew (another name or --storage)"
    if not os.path.lexists(seal):
        raise InputError(str(seal), "the seal rayfuse writes while a sweep runs", "no such file", hint)
    _, text = _read_regular(seal, limit=MAX_SEAL_BYTES + 1, what="the seal rayfuse writes while a sweep runs (a regular file)")
    if len(text) > MAX_SEAL_BYTES:
        raise InputError(str(seal), f"a seal of at most {MAX_SEAL_BYTES >> 20} MiB (rayfuse's own are far smaller)", "a larger file", hint)
    record = parse_json(text, str(seal), "a seal written by rayfuse", hint)
    try:
        files, mac = record["files"], record["mac"]
        if record.get("format") != SEAL_FORMAT or not isinstance(files, dict) or not isinstance(mac, str):
            raise ValueError("unknown seal format")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError("malformed file list")
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(str(seal), "a seal written by rayfuse", f"a damaged file ({type(exc).__name__})", hint) from None
    if not hmac.compare_digest(_mac(load_key(), files), mac):
        raise InputError(str(seal), "a seal made with your sweep key", "a seal that does not verify (another user's, or edited)", hint)
    now = state_files(root)
    for name in sorted(set(files) | set(now)):
        if files.get(name) != now.get(name):
            what = (
                "a file added after the seal"
                if name not in files
                else "a missing file"
                if name not in now
                else "a file changed after the seal"
            )
            raise InputError(str(root / name), "the file as this sweep's rayfuse sealed it", what, hint)
    return files


@contextlib.contextmanager
def sealing(experiment: str | os.PathLike, *, pinned: Mapping[str, str] | None = None, every: float = 2.0) -> Iterator[Any]:
    """Seal the experiment folder now (pinning ``tuner.pkl``'s present hash unless ``pinned`` gives it), every
    ``every`` seconds while the block runs (a background thread), and once more when it ends, however it ends."""
    root = Path(experiment)
    key = load_key(create=True)
    pins = dict(pinned or {})
    for name in PINNED:
        if name not in pins and (root / name).is_file():
            pins[name] = _sha256(root / name)
    stop = threading.Event()
    lock = threading.Lock()

    def seal() -> None:
        with lock:
            if root.is_dir():
                seal_sweep(root, pinned=pins, key=key)

    def loop() -> None:
        while not stop.wait(every):
            try:
                seal()
            except OSError:  # a file Tune replaced while it was read: the next pass seals it
                continue

    seal()
    thread = threading.Thread(target=loop, name="rayfuse-sweep-seal", daemon=True)
    thread.start()
    try:
        yield pins
    finally:
        stop.set()
        thread.join()
        seal()
