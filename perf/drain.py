"""Redeploy -> what a viewer sees: a session streams at real time (16 fps, paced) on a local Serve app of the
embedded default (tiny, CPU, SP-2) while the app is redeployed (`serve.run` of a changed config: Serve
replaces the ingress and every group). The old groups keep the session until a new group runs, then hand
it on with the snapshots of its last chunk; it goes on there through the old ingress. Measured with one
group and with two, in one run:

    python -m perf.drain [--chunks 60] [--output-json perf/results/drain_tiny_cpu.json]

Columns: the median chunk interval before the redeploy; redeploy -> the session moved (the new group's
start dominates); how many times it moved (a rolling update of two groups may move it twice) and each
move's time as the server reports it (Moving at the ingress -> the new group restored it); the longest
gap between two chunks at the client; the player's stall (1-chunk start buffer) over the whole session,
and the part of it before the first move (the new groups starting on the same cores);
chunks delivered, contiguous; whether every chunk's raw frames equal those of the same session run without
a redeploy.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import threading
import time

from perf.local import ensure_serve, first_frame_png, wait_for_groups
from perf.realtime_metrics import simulate_playback

PORT = 18796
FPS = 16.0


def settings(groups: int, generation: int) -> dict:
    # graceful_shutdown_timeout_s: how long the old ingress keeps its WebSockets (and a stopping group waits
    # for a new one); metrics_interval_s only makes each deploy a changed config
    return dict(preset="tiny", device="cpu", sp=2, min_groups=groups, max_groups=groups, max_sessions_per_group=2,
                max_chunks=1000, graceful_shutdown_timeout_s=300, metrics_interval_s=5.0 + generation)


def deploy(groups: int, generation: int) -> None:
    from ray import serve

    from deployments.app import build_app
    serve.run(build_app(settings(groups, generation)), name="lingbot", route_prefix="/")


def start(groups: int) -> None:
    ensure_serve(PORT)
    deploy(groups, 0)
    wait_for_groups(groups)


async def session(chunks: int, fps: float, redeploy=None):
    from deployments.client import FramesClient
    actions = [["w"], ["j"], ["d"], [], ["l"]] * (chunks + 1)
    out: dict = {}
    async with FramesClient(f"ws://127.0.0.1:{PORT}/v1/realtime_video/generate") as client:
        await client.init("a forest path", first_frame_png(), chunks, 3, fps=fps, actions=actions)

        async def on_chunk(result, chunk):
            n = len(result.chunks)
            if n % 10 == 0:
                print(f"    chunk {n}", file=sys.stderr)
            if redeploy is not None and n == 5:
                out["redeployed_at"] = time.monotonic()
                out["thread"] = threading.Thread(target=redeploy, daemon=True)
                out["thread"].start()
            moves = [m for m in result.messages if m["type"] == "session_resumed"]
            if moves and "moved_at" not in out:
                out["moved_at"] = time.monotonic()
        result = await client.receive_session(on_chunk, timeout=900)
    return result, out


def measure(groups: int, chunks: int, generation: int) -> dict:
    import numpy as np
    clean, _ = asyncio.run(session(chunks, 120.0))
    result, marks = asyncio.run(session(chunks, FPS, lambda: deploy(groups, generation)))
    marks["thread"].join()                        # serve.run returns once the new app runs
    moves = [m for m in result.messages if m["type"] == "session_resumed"]
    if result.errors or len(result.chunks) != chunks or not moves:
        raise RuntimeError(f"the session did not move: errors {result.errors}, {len(result.chunks)} chunks, "
                           f"{len(moves)} moves")
    arrivals = [a - result.started_at for a in result.arrivals]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    played = [{"index": c.index, "arrival_s": a, "num_frames": len(c.frames)} for c, a in zip(result.chunks, arrivals)]
    player = simulate_playback(played, FPS)
    before = simulate_playback(played[:moves[0]["chunk_index"]], FPS)    # up to the first chunk from a new group
    starts = player["play_start_s"]
    stalls = {c["index"]: round((starts[c["index"]] - starts[p["index"]] - p["num_frames"] / FPS) * 1e3)
              for p, c in itertools.pairwise(played)}
    return {"groups": groups, "chunks": len(result.chunks), "interval_before_s": statistics.median(gaps[1:4]),
            "redeploy_to_move_s": marks["moved_at"] - marks["redeployed_at"], "moves": len(moves),
            "reasons": sorted({m["reason"] for m in moves}),
            "replayed_chunks": sum(m["replayed_chunks"] for m in moves),
            "move_s": [m["gap_ms"] / 1e3 for m in moves],
            "longest_gap_s": max(gaps), "stall_ms": player["total_stall_ms"],
            "stall_before_move_ms": before["total_stall_ms"],
            "stalled_chunks_ms": {i: ms for i, ms in stalls.items() if ms > 0},
            "moved_at_chunks": [m["chunk_index"] for m in moves],
            "contiguous": [c.index for c in result.chunks] == list(range(chunks)),
            "bitwise": all(np.array_equal(a.frames, b.frames) for a, b in zip(clean.chunks, result.chunks))}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=60, help="chunks per session (at 16 fps, 0.75 s of video each)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for generation, groups in enumerate((1, 2), start=1):
        start(groups)
        print(f"{groups} group(s): redeploy after chunk 5 of {args.chunks} ...", file=sys.stderr)
        rows.append(measure(groups, args.chunks, generation))
    from ray import serve
    serve.shutdown()
    print("redeploy during a session (tiny, CPU, SP-2, 16 fps; serve.run of a changed config)")
    print(f"  {'groups':>6} {'interval':>9} {'redeploy->moved':>16} {'moves':>6} {'move (server)':>14} "
          f"{'replayed':>9} {'longest gap':>12} {'stall':>8} {'of it before':>13} {'chunks':>7} {'bitwise':>8}")
    for r in rows:
        move = "+".join(f"{s:.2f}" for s in r["move_s"]) + "s"
        print(f"  {r['groups']:>6} {r['interval_before_s']:>8.2f}s {r['redeploy_to_move_s']:>15.1f}s {r['moves']:>6} "
              f"{move:>14} {r['replayed_chunks']:>9} {r['longest_gap_s']:>11.2f}s {r['stall_ms']:>6.0f}ms "
              f"{r['stall_before_move_ms']:>11.0f}ms "
              f"{r['chunks']:>7} {r['bitwise'] and r['contiguous']!s:>8}")
        print(f"         moved at chunks {r['moved_at_chunks']}; stalled chunks (ms) {r['stalled_chunks_ms']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
