"""Process memory for models of several GB: freed blocks given back to the system.

By default glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after which blocks of
that size come from its heaps and stay resident when freed: temporaries of a few MiB to 32 MiB (a training step's
activations and their gradients, a merge's masks, the next smaller tensors) then pile up as resident memory that no
array uses (measured: +0.75 of a tensor per model in TIES's last pass; +0.2 to 0.4 of a 0.5 GB model after one
training step). A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops the raising) maps each block of
1 MiB or more on its own and unmaps it on free.

Process-wide and one way, so it is set only where a model is large (:data:`LARGE_MODEL_BYTES`): ``rayfuse fuse``, a
client's training of a large model, the coordinator's fold of a large one. Small models keep glibc's default (mapping
and unmapping every block of 1 MiB or more costs page faults a small model's training does not need). Skipped where
the C library is not glibc. Nothing here imports Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LARGE_MODEL_BYTES", "available_memory", "check_fits_memory", "return_freed_memory"]

#: A model (or merge) at least this large sets :func:`return_freed_memory` in the process that holds it, and trains
#: with its optimizer steps inside the backward pass (:func:`rayfuse.models.train_model`).
LARGE_MODEL_BYTES = 256 * 2**20

_done = False


def return_freed_memory() -> None:
    """Make glibc give every block of 1 MiB or more back to the system when it is freed (once per process)."""
    global _done
    if _done:
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(ctypes.c_int(-3), ctypes.c_int(1 << 20))  # M_MMAP_THRESHOLD (glibc's malloc.h)
    except (OSError, AttributeError):
        pass
    _done = True


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (``MemAvailable`` on Linux); ``None`` when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_memory(key: str, given: Any, need_bytes: float, what: str) -> None:
    """Refuse, before anything is allocated, a setting whose memory (``need_bytes``, estimated from it: ``what`` says
    of what) exceeds what this machine has available now: one :class:`~rayfuse.errors.InputError` at ``key`` instead
    of the allocator's traceback (or the kernel's OOM killer) later. Unknown available memory passes."""
    from rayfuse.errors import InputError

    free = available_memory()
    if free is not None and need_bytes > free:
        raise InputError(
            key,
            f"a value whose memory fits in the {free / 2**30:.1f} GiB available",
            given,
            f"{what} would need about {need_bytes / 2**30:.1f} GiB",
        )
