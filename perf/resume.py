"""Fault -> next chunk: how long a viewer waits when the group serving its session fails, on a local Serve app
of the embedded default (tiny, CPU, SP-2). A session runs flat out (fps 120, so pacing never holds it);
after chunk N arrives, one rank of its group is killed (SIGKILL); the session resumes on a healthy group,
which restores it from the snapshots of its last delivered chunks and replays the few after them (or,
with snapshots off, replays all N from the journal) and goes on. Measured with a spare group (2 groups:
the other one takes it) and without (1 group: Serve rebuilds it first), at chunk 10 and chunk 100, for
both ways of resuming, in one run.

    python -m perf.resume [--at 10,100] [--output-json perf/results/resume_tiny_cpu.json]

Columns: the median chunk interval before the fault; fault -> the next chunk at the client; the chunks
restored from snapshots and replayed; the time the server reports for restoring and replaying, and the
rest (the group's exit and, without a spare, its rebuild, re-admission, and the next chunk itself).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import time

from perf.local import ensure_serve, first_frame_png, wait_for_groups

PORT = 18795


def start_app(groups: int, snapshots: bool) -> None:
    from ray import serve

    from deployments.app import build_app
    ensure_serve(PORT)
    serve.run(build_app(dict(preset="tiny", device="cpu", sp=2, min_groups=groups, max_groups=groups,
                             max_sessions_per_group=2, resume_wait_s=300, max_chunks=1000, snapshots=snapshots,
                             max_fps=120.0)),
              name="lingbot", route_prefix="/")
    wait_for_groups(groups)


def rank_pids(group: str) -> list[int]:
    """The rank processes of the group (Serve replica) with this id."""
    from ray._private import state
    actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
    ports = {a["Address"]["Port"] for a in actors if (a["Name"] or "").endswith(f"#WorldGroup#{group}")}
    return sorted(a["Pid"] for a in actors
                  if a["ActorClassName"] == "RankWorker" and a["OwnerAddress"]["Port"] in ports)


async def faulted_session(at: int) -> dict:
    from deployments.client import RealtimeClient, image_data_url
    from lingbot.config import get_preset
    preset = get_preset("tiny")
    out: dict = {}
    async with RealtimeClient(f"ws://127.0.0.1:{PORT}/v1/realtime/video") as client:
        await client.start("a forest path", image_data_url(first_frame_png()), preset.width, preset.height, at + 3,
                           fps=120.0)

        async def on_chunk(result, meta):
            n = len(result.chunks)
            if n % 10 == 0:
                print(f"    chunk {n}", file=sys.stderr)
            if n == at:
                group = result.start["config"]["group"]
                os.kill(rank_pids(group)[0], signal.SIGKILL)
                out["killed_at"] = time.monotonic()
        result = await client.receive_session(on_chunk, timeout=900)
    arrivals = result.arrivals
    resumed = [m for m in result.messages if m["type"] == "session.resumed"]
    if result.error is not None or not resumed or len(result.chunks) != at + 3:
        raise RuntimeError(f"the session did not resume: error {result.error}, {len(result.chunks)} chunks")
    intervals = [b - a for a, b in itertools.pairwise(arrivals[1:at])]
    fault_to_next = arrivals[at] - out["killed_at"]
    return {"fault_at_chunk": at, "interval_before_s": statistics.median(intervals), "fault_to_next_chunk_s":
            fault_to_next, "replay_s": resumed[0]["replay_s"], "replayed_chunks": resumed[0]["replayed_chunks"],
            "restored_chunks": resumed[0]["restored_chunks"],
            "gap_s": resumed[0]["gap_s"], "chunks": len(result.chunks),
            "contiguous": [c["transport_chunk_index"] for c in result.chunks] == list(range(at + 3))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", default="10,100", help="chunks delivered before the fault (comma-separated)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for snapshots in (True, False):
        for groups in (2, 1):
            start_app(groups, snapshots)
            for at in (int(a) for a in args.at.split(",")):
                print(f"snapshots {snapshots}, {groups} group(s), fault after chunk {at} ...", file=sys.stderr)
                row = {"snapshots": snapshots, "groups": groups, **asyncio.run(faulted_session(at))}
                row["rebuilt_in_s"] = wait_for_groups(groups)
                rows.append(row)
    from ray import serve
    serve.shutdown()
    print("fault -> next chunk (tiny, CPU, SP-2; a rank of the session's group SIGKILLed)")
    print(f"  {'resume from':<12} {'groups':<16} {'fault at':>8} {'interval':>9} {'fault->next':>12} {'restored':>9} "
          f"{'replayed':>9} {'replay':>8} {'other':>8}")
    for r in rows:
        name = "2 (spare group)" if r["groups"] == 2 else "1 (rebuilt)"
        wait = r["fault_to_next_chunk_s"]
        print(f"  {'snapshots' if r['snapshots'] else 'journal':<12} {name:<16} {r['fault_at_chunk']:>8} "
              f"{r['interval_before_s']:>8.2f}s {wait:>11.2f}s {r['restored_chunks']:>9} {r['replayed_chunks']:>9} "
              f"{r['replay_s']:>7.2f}s {wait - r['replay_s']:>7.2f}s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
