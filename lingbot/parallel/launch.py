"""Local multi-process launch: N processes on this machine joined in one process group.

Used by `lingbot generate --sp N` on a CPU machine and by the multi-rank tests. (On a cluster the Ray
rank actors do the same joining; see deployments/.)

The ranks are forked from a fork server that imported torch and the engine once (multiprocessing's
"forkserver"): a rank starts in milliseconds instead of re-importing them (~3.5 s of CPU each), and, unlike
a plain fork, from a clean single-threaded process that never ran a torch op or touched a device. The
server starts with the first launch and keeps the environment of that moment: a rank sees the variables
set before the first launch of its process, not those set later.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from .comm import Comm, ParallelError, free_port

log = logging.getLogger(__name__)

# imported once by the fork server, so every rank forked from it has them: the engine (it brings torch), and
# what building a pipeline imports on first use (the text encoder's transformers, torch's meta-device
# machinery and dynamo): ~3.5 s of imports a rank would make on its own
PRELOAD = ["torch", "lingbot.builder", "lingbot.parallel.comm", "transformers.models.umt5.modeling_umt5",
           "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "torch._meta_registrations"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)        # read when the server starts (the first launch)
    return ctx


def _pack(value) -> bytes:
    """Results travel by value (torch.save bytes): tensors shared by file descriptor would die with the rank."""
    import io

    import torch
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    import io

    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(fn, rank, world_size, init_method, device, timeout_s, args, results, threads, join):
    import torch
    torch.set_num_threads(threads)
    comm = None
    try:
        if join:
            comm = Comm.init(rank, world_size, init_method, device, timeout_s)
            value = fn(comm, *args)
        else:                        # the rank joins on its own (RankLifecycle, RankWorker)
            value = fn(rank, world_size, init_method, *args)
        results.put((rank, True, _pack(value)))
    except BaseException as e:       # report, then exit non-zero: peers see the closed connection
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
    finally:
        if comm is not None:
            try:
                comm.close()
            except Exception:
                pass


def run_local(fn: Callable[..., Any], world_size: int, *args, device: str = "cpu", timeout_s: float = 60.0,
              threads_per_rank: int | None = None) -> list[Any]:
    """Run fn(comm, *args) on `world_size` local ranks; return their results in rank order.

    Raises ParallelError naming every failed rank (with its error) if any rank failed (`rank_errors`; the
    values of the ranks that did not fail in `results`); waits at most timeout_s plus start-up for the
    whole group."""
    return _launch(fn, world_size, args, device, timeout_s, threads_per_rank, join=True)


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 60.0,
              threads_per_rank: int | None = None) -> list[Any]:
    """As run_local, but each rank joins the group on its own: fn(rank, world_size, init_method, *args)."""
    return _launch(fn, world_size, args, "cpu", timeout_s, threads_per_rank, join=False)


def _launch(fn, world_size: int, args: tuple, device: str, timeout_s: float, threads_per_rank: int | None,
            join: bool) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, init_method, device, timeout_s, args, results, threads, join))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s + 60.0           # + process start-up and imports
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        for r in dead:
                            outcomes[r] = (False, f"process exited with code {procs[r].exitcode} without a result")
                if time.monotonic() > deadline:
                    for r in range(world_size):
                        outcomes.setdefault(r, (False, "no result before the deadline"))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failed:
        lines = "; ".join(f"rank {r}: {str(v).splitlines()[0]}" for r, v in sorted(failed.items()))
        error = ParallelError(f"{len(failed)} of {world_size} ranks failed: {lines}")
        error.rank_errors = failed
        error.results = {r: _unpack(v) for r, (ok, v) in outcomes.items() if ok}
        raise error
    return [_unpack(outcomes[r][1]) for r in range(world_size)]
