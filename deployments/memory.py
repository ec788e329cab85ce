"""A serving process's own memory: the heap it freed, given back to the system, and the object references it
still holds (what a finished session must not leave behind: the tests and `perf.soak` read them).

Why the trim: glibc's malloc keeps what a process frees in the arena of the thread that allocated it (up to 8
arenas per core) for reuse, and hands memory back to the system only from the top of an arena. The snapshot
keeper (16 threads unpickling snapshots and putting them in the object store) and the ranks (a device thread
and a put thread copying and pickling them) allocate and free a snapshot's worth of host memory per chunk:
the soak measured their resident memory climbing by 9 and 6 MiB a minute while the memory they had in use,
the Python objects and the object store stayed flat; the growth was free memory the arenas kept
(docs/architecture.md, "Memory over a day"). `malloc_trim(0)` gives every whole free page of every arena back.

Why a fixed mmap threshold: a block above malloc's mmap threshold (128 KiB at start) is its own mapping, given
back whole when freed; but glibc raises the threshold to the size of every such block freed (up to 32 MiB), so
after the first snapshot copy is freed, every later one is carved from an arena, and a small block allocated
meanwhile above it pins the pages a trim could give back. `keep_large_blocks_mapped()` fixes the threshold
(which also turns glibc's raising off), so a snapshot's buffers never enter an arena."""
from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

TRIM_EVERY_S = 10.0
MMAP_THRESHOLD = 128 * 1024          # glibc's own starting value, kept: blocks this large are mapped on their own
_M_MMAP_THRESHOLD = -3               # mallopt's parameter number (malloc.h)


def _libc():
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return lib
    except (OSError, AttributeError):            # not glibc (musl, macOS): nothing to trim
        return None


_LIBC = _libc()


def trim() -> bool:
    """Give every whole free page of every malloc arena back to the system; False where the C library is not
    glibc (nothing done)."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


def keep_large_blocks_mapped(threshold: int = MMAP_THRESHOLD) -> bool:
    """Every block of `threshold` bytes or more is mapped on its own and unmapped when freed, for the rest of this
    process's life (call it before the process allocates much: a free chunk already in an arena is reused
    first); False where the C library is not glibc (nothing done)."""
    if _LIBC is None:
        return False
    return _LIBC.mallopt(_M_MMAP_THRESHOLD, threshold) == 1


class Trimmer:
    """`trim()` at most once per `every_s`: called as often as convenient (after every snapshot put, every
    session closed), from any thread; True when it trimmed."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self.last = float("-inf")
        self.lock = threading.Lock()

    def __call__(self) -> bool:
        now = self.clock()
        with self.lock:
            if now - self.last < self.every_s:
                return False
            self.last = now
        return trim()


def held_refs() -> int:
    """Object references this process holds, borrows or owns that are still alive (its entries in Ray's reference
    table; 0 outside a Ray worker)."""
    import ray
    if not ray.is_initialized():
        return 0
    return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())
