"""A serving process's own memory: the heap it freed, given back to the system, and the object references it
still holds (what a finished session must not leave behind: the tests and `perf.soak` read them).

Why the trim: glibc's malloc keeps what a process frees in the arena of the thread that allocated it (up to 8
arenas per core) for reuse, and hands memory back to the system only from the top of an arena. The snapshot
keeper (16 threads unpickling snapshots and putting them in the object store) and the ranks (a device thread
and a put thread copying and pickling them) allocate and free a snapshot's worth of host memory per chunk:
the soak measured their resident memory climbing by 9 and 6 MiB a minute while the memory they had in use,
the Python objects and the object store stayed flat; the growth was free memory the arenas kept
(docs/architecture.md, "Memory over a day"). `malloc_trim(0)` gives every whole free page of every arena back."""
from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

TRIM_EVERY_S = 10.0


def _libc():
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
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
