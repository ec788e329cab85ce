"""A serving process's own memory (deployments/memory.py): the trim gives back the heap freed in many threads'
arenas, at most once per interval; a fixed mmap threshold keeps large blocks out of them."""
import json
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil
import pytest

from deployments.memory import Trimmer, trim

# glibc's count of blocks mapped on their own (mallinfo2().hblks), read in a fresh process
MAPPED_BLOCKS = '''
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                'arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost'.split()]
libc = ctypes.CDLL('libc.so.6')
libc.mallinfo2.restype = Info
def mapped():
    return libc.mallinfo2().hblks
'''


def test_a_trim_gives_back_the_heap_freed_in_threads_arenas():
    """4 threads each allocate 70 MiB in 48 KiB blocks (under malloc's mmap threshold: in the thread's arena) and
    keep every 16th: the rest is free, but stays resident (a block kept above it pins the arena's top) until
    the trim hands its pages back."""
    proc = psutil.Process()
    kept = []

    def churn():
        blocks = [bytearray(48 * 1024) for _ in range(1500)]
        for block in blocks:
            block[::4096] = b"\1" * len(block[::4096])         # touched: resident
        kept.extend(blocks[::16])

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    before = proc.memory_full_info().uss
    assert trim()
    after = proc.memory_full_info().uss
    assert before - after > 100 * 2 ** 20, (before >> 20, after >> 20)
    assert len(kept) == 4 * 94


def _mapped_blocks(fixed: bool) -> list[int]:
    """In a fresh process: how many 4 MiB blocks are mapped on their own while held, allocated and freed three
    times over, then ten 256 KiB blocks held at once."""
    program = MAPPED_BLOCKS + ("from deployments.memory import keep_large_blocks_mapped\n"
                       "assert keep_large_blocks_mapped()\n" if fixed else "") + """
base = mapped()
seen = []
for _ in range(3):
    block = bytearray(4 << 20)
    seen.append(mapped() - base)
    del block
blocks = [bytearray(256 << 10) for _ in range(10)]
seen.append(mapped() - base)
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_a_fixed_mmap_threshold_keeps_every_large_block_out_of_the_arenas():
    """glibc raises its threshold past a mapped block once it is freed: the next one of that size comes from an
    arena (where a small block above it pins its pages); fixed, every large block is mapped on its own."""
    assert _mapped_blocks(fixed=False) == [1, 0, 0, 0]
    assert _mapped_blocks(fixed=True) == [1, 1, 1, 10]


def test_the_trimmer_trims_at_most_once_per_interval():
    now = [100.0]
    trimmer = Trimmer(every_s=10.0, clock=lambda: now[0])
    assert trimmer() is True                   # the first call trims
    now[0] = 109.9
    assert trimmer() is False
    now[0] = 110.0
    assert trimmer() is True and trimmer() is False


def _per_session(census: dict) -> dict:
    """Every per-session count of the census (deployments' `census`), by where it is held."""
    group = census["group"]
    counts = {f"group.{k}": v for k, v in group["group"].items() if k != "object_refs"}
    for i, rank in enumerate(group["ranks"]):
        counts |= {f"rank{i}.{k}": v for k, v in rank.items() if k != "object_refs"}
    counts |= {"muxer.sessions": group["muxer"]["sessions"], "mailbox.sessions": group["mailbox"]["sessions"],
               "ingress.live_sessions": census["ingress"]["live_sessions"],
               "keeper.object_refs": census["ingress"]["keeper_object_refs"],
               "keeper.keys": census["ingress"]["keeper_keys"], "keeper.sessions": census["ingress"]["keeper_sessions"]}
    return counts


def _refs(census: dict) -> dict:
    group = census["group"]
    ranks = {f"rank{i}": r["object_refs"] for i, r in enumerate(group["ranks"])}
    return {"ingress": census["ingress"]["object_refs"], "group": group["group"]["object_refs"],
            "muxer": group["muxer"]["object_refs"], **ranks}


def _settled(than: Optional[dict] = None, timeout_s: float = 20.0) -> dict:
    """The census once every session's end has reached every process (closes are told, not awaited): each
    per-session count 0, or (`than`, a census before) per-session counts and object references no higher than
    there (the group's watcher has a liveness probe of each actor in flight at times: the references at a
    moment when it has none)."""
    import time

    from perf.soak import census
    deadline = time.monotonic() + timeout_s
    while True:
        now = census("lingbot")
        counts = _per_session(now)
        if than is None:
            ok = not any(counts.values())
        else:
            limit, refs, refs_before = _per_session(than), _refs(now), _refs(than)
            ok = all(counts[k] <= limit[k] for k in counts) and all(refs[p] <= refs_before[p] for p in refs)
        if ok or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def test_finished_sessions_leave_nothing_behind(serve_app):
    """Sessions through the served group with snapshots after every chunk, two at a time: run to their end,
    stopped, and one whose client went away mid-stream. Afterwards every per-session structure of the ingress,
    the group, its ranks, muxer and mailbox is as it was before them (empty, unless an earlier test's session
    is still on its way out), the snapshot keeper owns no more snapshots anyone holds, and no process holds
    more object references than before them."""
    import asyncio
    import json

    from deployments.client import RealtimeClient
    from tests.deployments.clients import H, W, png_url, run, session

    async def gone_after_one_chunk():
        async with RealtimeClient(serve_app) as client:
            await client.start("a lake", png_url(), W, H, None, seed=7)
            while json.loads(await client.ws.recv())["type"] != "video.chunk_metadata":
                pass
        # the socket closed without a stop

    async def stopped_after_two_chunks(client, result, meta):
        if len(result.chunks) == 2:
            await client.send({"type": "session.stop"})

    run(session(serve_app, 1))                                  # what a first session makes once, made
    before = _settled()                  # (0 unless an earlier test's session is still on its way out)
    async def two_at_a_time():
        ended = await asyncio.gather(session(serve_app, 3, seed=1),
                                     session(serve_app, None, seed=2, on_chunk=stopped_after_two_chunks))
        await asyncio.gather(gone_after_one_chunk(), session(serve_app, 2, seed=3))
        return ended

    results = run(two_at_a_time())
    assert [r.done["chunks"] for r in results] == [3, 2] and results[1].done["stopped"] is True
    after = _settled(before)
    counts, counts_before = _per_session(after), _per_session(before)
    assert all(counts[k] <= counts_before[k] for k in counts), json.dumps([before, after])
    held, held_before = _refs(after), _refs(before)     # (one in flight before, e.g. a keeper ping, may be gone)
    assert all(held[p] <= held_before[p] for p in held), (held, held_before)


def test_what_a_lease_frees_is_told_outside_its_request(serve_app):
    """Serve ends a session's lease with Ray's recursive cancel, which also cancels the calls the lease made that
    have not run yet: a close told from the lease's `finally` and cancelled with it left the session on a rank or
    in the muxer (a 5-minute soak left three). A call made under `outside_the_request` (the lease's closes) or
    in a `fresh_task` (the chunk loop) has the actor's own task as its parent, not the request's; a task that
    inherits the request's context (the control) has the request's."""
    import asyncio

    import ray

    from deployments.detach import fresh_task, outside_the_request

    @ray.remote(num_cpus=0)
    class Request:
        async def parents(self) -> dict:
            context = ray.get_runtime_context()

            async def current():
                return context.get_task_id()
            return {"request": context.get_task_id(), "outside": outside_the_request(context.get_task_id),
                    "fresh_task": await fresh_task(current()), "inherited": await asyncio.ensure_future(current())}

    actor = Request.remote()
    try:
        first, second = ray.get([actor.parents.remote(), actor.parents.remote()], timeout=60)
    finally:
        ray.kill(actor)
    for ids in (first, second):
        assert ids["inherited"] == ids["request"]
        assert ids["outside"] != ids["request"] and ids["fresh_task"] != ids["request"]
    assert first["request"] != second["request"] and first["outside"] == second["outside"] == second["fresh_task"]


def test_the_keeper_holds_snapshots_under_keys_lends_them_and_frees_them_by_key_and_at_the_end(serve_app):
    """The snapshot keeper hands out keys, not references (a reference its owner hands out is tracked as
    borrowed, and Ray's owner keeps bookkeeping for every object it ever lent): a resume borrows what it
    restores from; a key let go frees its snapshot; a session's end frees the rest and refuses its late puts."""
    import numpy as np
    import ray

    from deployments.ingress.keeper import SnapshotKeeper

    keeper, other = (ray.remote(SnapshotKeeper).options(num_cpus=0, max_concurrency=4).remote() for _ in range(2))
    try:
        slots = [np.arange(1000, dtype=np.float32) + i for i in range(2)]
        keys = ray.get(keeper.keep.remote("s1", slots, {"chunk": 4}), timeout=60)
        again = ray.get(other.keep.remote("s1", slots, {"chunk": 4}), timeout=60)
        assert len(keys) == 3 and all(isinstance(k, str) for k in keys) and not set(keys) & set(again)
        lent = ray.get(ray.get(keeper.lend.remote(keys), timeout=60), timeout=60)
        assert np.array_equal(lent[1], slots[1]) and lent[2] == {"chunk": 4}
        assert ray.get(keeper.census.remote()) | {"object_refs": 0} == {"object_refs": 0, "keys": 3, "sessions": 1,
                                                                        "tombstones": 0}
        assert ray.get(keeper.release.remote("s1", keys[:1])) == 1
        assert ray.get(keeper.release.remote("s1", keys[:1])) == 0            # once
        with pytest.raises(KeyError, match="1 snapshot"):
            ray.get(keeper.lend.remote(keys[:2]), timeout=60)
        with pytest.raises(KeyError):
            ray.get(keeper.lend.remote(again[:1]), timeout=60)                # another keeper's key
        assert ray.get(keeper.release.remote("s2", keys[1:])) == 0            # only the session's own
        assert ray.get(keeper.release.remote("s1")) == 2                      # the end: the rest
        assert ray.get(keeper.keep.remote("s1", slots, {"chunk": 5}), timeout=60) is None   # a late put
        deadline = time.monotonic() + 20          # (the lent references' release reaches the owner in a moment)
        while ray.get(keeper.census.remote())["object_refs"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.get(keeper.census.remote()) == {"object_refs": 0, "keys": 0, "sessions": 0, "tombstones": 1}
    finally:
        ray.kill(keeper)
        ray.kill(other)
