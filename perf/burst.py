"""A burst of sessions on a local Serve app of the embedded default (tiny, CPU, SP-2, 2 sessions a group): for
each session, arrival -> video.start and -> first chunk, whether it waited (told its place) or was refused, and
how long Serve took to be adding the groups the burst needs, and its stall ratio (a simulated player). Rows: a
burst of 4 with max_groups 2 and of 8 with max_groups 4, each without and with a spare group, in one run; with
`--ladder off,auto`, each row with the quality ladder off (2 sessions a group) and auto (a group takes up to
`--auto-cap` sessions while the floor rung holds them at real time):

    python -m perf.burst [--chunks 4] [--rows 8:4:0] [--ladder off,auto] [--output-json F]

This machine has 2 cores: Ray is told 4 logical CPUs so that 4 groups of SP-2 can be placed at all (each
needs 0.75); the groups then share the 2 cores, so the figures show the policy (who waits, for how long, who
is refused), not throughput. Every row starts from a freshly deployed app that has settled at its idle size.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from deployments.group.scaling import wanted_groups
from lingbot.stats import percentile
from perf.local import ensure_serve, first_frame_png, wait_for_groups

PORT = 18797
ROWS = [(4, 2, 0), (4, 2, 1), (8, 4, 0), (8, 4, 1)]        # (burst, max_groups, spare_groups)


def settings(max_groups: int, spare: int, generation: int, ladder: str = "off", cap: int = 2) -> dict:
    return dict(preset="tiny", device="cpu", sp=2, min_groups=1, max_groups=max_groups, max_sessions_per_group=cap,
                quality_ladder=ladder,
                spare_groups=spare, graceful_shutdown_timeout_s=5, metrics_interval_s=5.0 + generation,
                max_sessions_per_key=0, max_starts_per_minute_per_key=0)    # the whole burst comes from one address


def data_url() -> str:
    import base64
    return "data:image/png;base64," + base64.b64encode(first_frame_png()).decode()


async def one(seed: int, chunks: int, t0: float, image: str) -> dict:
    """One session of the burst, read to its end: when each thing happened, seconds after the burst began."""
    import websockets

    from deployments.client import RealtimeClient
    out = {"seed": seed, "positions": [], "eta_s": [], "start_s": None, "first_chunk_s": None, "refused": None,
           "done": False, "group": None, "chunks": []}
    frames = None
    async with RealtimeClient(f"ws://127.0.0.1:{PORT}/v1/realtime/video") as client:
        await client.start("a street at night", image, 112, 64, chunks, seed=seed)
        try:
            while True:
                raw = await asyncio.wait_for(client.ws.recv(), 600)
                now = time.monotonic() - t0
                if isinstance(raw, bytes):
                    out["first_chunk_s"] = out["first_chunk_s"] or now
                    out["chunks"].append({"index": len(out["chunks"]), "arrival_s": now, "num_frames": frames})
                    continue
                msg = json.loads(raw)
                if msg["type"] == "video.chunk_metadata":
                    frames = msg["num_frames"]
                elif msg["type"] == "session.queued":
                    out["positions"].append(msg["position"])
                    out["eta_s"].append(msg["eta_s"])
                elif msg["type"] == "video.start":
                    out["start_s"], out["group"] = now, msg["config"]["group"]
                elif msg["type"] == "error":
                    out["refused"] = msg["code"]
                elif msg["type"] == "session.done":
                    out["done"] = True
                    break
        except websockets.ConnectionClosed:
            pass
    return out


def groups_now() -> int:
    """WorldGroup replicas running or starting (what Serve is adding counts as soon as it starts it)."""
    from deployments.ingress.census import serve_counts
    return sum(serve_counts())


async def burst(n: int, chunks: int) -> tuple[list, dict]:
    image = data_url()
    t0 = time.monotonic()
    seen: dict = {}

    async def watch():
        while True:
            groups = await asyncio.to_thread(groups_now)
            seen.setdefault(groups, round(time.monotonic() - t0, 1))
            await asyncio.sleep(0.5)
    watcher = asyncio.ensure_future(watch())
    sessions = await asyncio.gather(*(one(seed, chunks, t0, image) for seed in range(n)))
    watcher.cancel()
    return sessions, seen


def measure(n: int, max_groups: int, spare: int, chunks: int, generation: int, ladder: str = "off",
            cap: int = 2) -> dict:
    from ray import serve

    from deployments.app import build_app
    from perf.realtime_metrics import simulate_playback
    serve.run(build_app(settings(max_groups, spare, generation, ladder, cap)), name="lingbot", route_prefix="/")
    wait_for_groups(max(1, wanted_groups(0, 2, spare)))       # the idle size: the spare groups hold no session
    time.sleep(15)                                  # settled: the autoscaler's window holds no earlier demand
    sessions, seen = asyncio.run(burst(n, chunks))
    wanted = min(wanted_groups(n, 2, spare), max_groups)
    firsts = [s["first_chunk_s"] for s in sessions if s["first_chunk_s"] is not None]
    stalls = [simulate_playback(s["chunks"], 16.0)["stall_ratio"] for s in sessions if s["chunks"]]
    row = {"burst": n, "max_groups": max_groups, "spare_groups": spare, "chunks": chunks, "ladder": ladder,
           "cap": cap, "first_chunk_p99_s": round(percentile(firsts, 0.99), 1) if firsts else None,
           "stall_mean": round(statistics.mean(stalls), 3) if stalls else None,
           "stall_max": round(max(stalls), 3) if stalls else None,
           "groups_wanted": wanted, "groups_seen": seen, "asked_s": seen.get(wanted),
           "refused": sum(s["refused"] is not None for s in sessions),
           "waited": sum(bool(s["positions"]) for s in sessions),
           "first_chunk_p50_s": round(statistics.median(firsts), 1) if firsts else None,
           "first_chunk_max_s": round(max(firsts), 1) if firsts else None, "sessions": sessions}
    serve.delete("lingbot")
    return row


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=4, help="chunks per session (at 16 fps, 0.75 s of video each)")
    ap.add_argument("--rows", default=None, help="only these rows, e.g. 4:2:0,8:4:1 (burst:max_groups:spare)")
    ap.add_argument("--ladder", default="off", help="quality ladder modes, each row run in each: off, auto or off,auto")
    ap.add_argument("--auto-cap", type=int, default=3, help="sessions a group may take with the ladder on")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    table = ROWS if args.rows is None else [tuple(int(x) for x in row.split(":")) for row in args.rows.split(",")]
    ensure_serve(PORT, cpus=4)
    rows = []
    runs = [(row, mode) for row in table for mode in args.ladder.split(",")]
    for generation, ((n, max_groups, spare), mode) in enumerate(runs, start=1):
        cap = 2 if mode == "off" else args.auto_cap
        print(f"burst of {n}, max_groups {max_groups}, spare_groups {spare}, ladder {mode} (cap {cap}) ...",
              file=sys.stderr, flush=True)
        rows.append(measure(n, max_groups, spare, args.chunks, generation, mode, cap))
    from ray import serve
    serve.shutdown()
    print(f"a burst at once (tiny, CPU, SP-2, 2 sessions a group, {args.chunks} chunks each; 2 cores, 4 logical CPUs)")
    print("| burst | max_groups | spare | ladder (cap) | groups wanted | Serve adding them after | waited (told) "
          "| refused | first chunk p50 | first chunk p99 | first chunk max | stall mean | stall max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        asked = "-" if r["asked_s"] is None else f"{r['asked_s']:.1f} s"
        print(f"| {r['burst']} | {r['max_groups']} | {r['spare_groups']} | {r['ladder']} ({r['cap']}) | "
              f"{r['groups_wanted']} | {asked} | {r['waited']} | {r['refused']} | {r['first_chunk_p50_s']} s | "
              f"{r['first_chunk_p99_s']} s | {r['first_chunk_max_s']} s | {r['stall_mean']} | {r['stall_max']} |")
        for s in r["sessions"]:
            print(f"    session {s['seed']}: admitted {s['start_s']} s, first chunk {s['first_chunk_s']} s, "
                  f"places {s['positions'][:1] + s['positions'][-1:]}, eta {s['eta_s'][:1]}, "
                  f"refused {s['refused']}", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
