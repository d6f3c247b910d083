"""The content-addressed cache primitive (``rayfuse.cas``) every client-side store is built on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import filelock
import pytest

from rayfuse.cas import ContentCache, content_key

REPO = str(Path(__file__).resolve().parents[1])


def _write(content: str):
    def write(staging: Path) -> None:
        (staging / "a.txt").write_text(content)
        (staging / "b.txt").write_text(content)

    return write


def _visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_the_key_is_the_sha256_of_the_inputs_whatever_their_order():
    assert content_key({"a": 1, "b": [1, 2]}) == content_key({"b": [1, 2], "a": 1})
    assert content_key({"a": 1}) != content_key({"a": 2})
    assert len(content_key({"a": 1})) == 24 and int(content_key({"a": 1}), 16) >= 0


def test_an_entry_is_published_once_with_its_inputs_beside_it(tmp_path):
    entry = ContentCache(tmp_path).entry({"data": "x", "seed": 0})
    assert not entry.exists
    assert entry.publish(_write("first"))
    assert not entry.publish(_write("second"))  # an entry is never changed
    assert sorted(p.name for p in entry.folder.iterdir()) == ["a.txt", "b.txt", "key.json"]
    assert (entry.folder / "a.txt").read_text() == "first"
    assert json.loads((entry.folder / "key.json").read_text()) == {"data": "x", "seed": 0}
    assert entry.folder.name == content_key({"data": "x", "seed": 0})


def test_concurrent_writers_publish_one_complete_folder(tmp_path):
    entry = ContentCache(tmp_path).entry({"k": 1})
    start = threading.Barrier(8)
    published: list[str] = []

    def writer(i: int) -> None:
        def write(staging: Path) -> None:
            (staging / "a.txt").write_text(str(i))
            start.wait()  # every writer is mid-write before any renames
            (staging / "b.txt").write_text(str(i))

        if entry.publish(write):
            published.append(str(i))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(published) == 1
    assert [(entry.folder / f).read_text() for f in ("a.txt", "b.txt")] == published * 2  # one writer's files, both
    assert _visible(tmp_path) == [entry.key]  # the losers' staging folders are gone


def test_writers_holding_the_lock_compute_the_entry_once(tmp_path):
    cache = ContentCache(tmp_path)
    computed: list[int] = []

    def worker(i: int) -> None:
        entry = cache.entry({"k": 1})
        with entry.lock():
            if not entry.exists:
                computed.append(i)
                entry.publish(_write(str(i)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(computed) == 1


def test_an_error_mid_write_publishes_nothing(tmp_path):
    entry = ContentCache(tmp_path).entry({"k": 1})

    def write(staging: Path) -> None:
        (staging / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        entry.publish(write)
    assert not entry.exists and _visible(tmp_path) == []


def test_a_process_killed_mid_write_leaves_no_entry(tmp_path):
    script = (
        "import os, sys\n"
        "from rayfuse.cas import ContentCache\n"
        "def write(staging):\n"
        "    (staging / 'a.txt').write_text('half')\n"
        "    os._exit(9)  # killed mid-write: no cleanup runs\n"
        "ContentCache(sys.argv[1]).entry({'k': 1}).publish(write)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 9
    entry = ContentCache(tmp_path).entry({"k": 1})
    assert not entry.exists  # readers see no entry (the dead writer's hidden staging folder is all that is left)
    assert all(name.startswith(".") for name in _visible(tmp_path))
    assert entry.publish(_write("whole")) and (entry.folder / "b.txt").read_text() == "whole"


def test_the_lock_is_a_filelock_that_excludes_other_processes(tmp_path):
    entry = ContentCache(tmp_path).entry({"k": 1})
    lock = entry.lock()
    assert isinstance(lock, filelock.FileLock) and lock.lock_file == str(tmp_path / f"{entry.key}.lock")
    script = (
        "import sys, filelock\ntry:\n    filelock.FileLock(sys.argv[1]).acquire(timeout=0)\nexcept filelock.Timeout:\n    sys.exit(3)\n"
    )
    with lock:
        held = subprocess.run([sys.executable, "-c", script, lock.lock_file])
    free = subprocess.run([sys.executable, "-c", script, lock.lock_file])
    assert (held.returncode, free.returncode) == (3, 0)
