"""The quality ladder under load, off against auto, side by side in one run, on a local Serve app of the embedded
default with the Wan decoder on top (`decoder: wan,tae`; tiny, CPU, SP-2, both groups running, 3 sessions a
group so that the cap does not hide the load): for 1 to 6 sessions at once, each paced at 16 fps with a key
press every 2 s, the time to the first chunk (with the ladder on, admission waits for a seat the floor holds),
the stall ratio per session after it (a simulated player, perf/realtime_metrics.py), the share of chunks per
rung and control-to-display p50. The app is redeployed with `serve.run` between the passes (from Python,
that replaces the groups: docs/architecture.md, "Rungs"), and each pass waits for both groups to run.

    python -m perf.ladder [--sessions 1,2,3,4,5,6] [--chunks 10] [--modes off,auto]
                          [--output-json perf/results/ladder_tiny_cpu.json]

A mode is `off`, `auto` (down to the default floor, steps2) or `auto:<floor>`: `auto:tiny_steps2` lets the ladder
use the decoder rung too (the tiny decoder in place of the Wan decoder, switched exactly: lingbot/runtime/
decoding.py); `pin:<rung>` runs the ladder off with every session pinned to that rung (extra_params.quality),
what each rung alone buys on this machine.

This machine has 2 cores: Ray is told 4 logical CPUs so that both groups of SP-2 are placed; they then share
the 2 cores, so the figures compare the two modes on the same machine, not a GPU's throughput.

`--config serve_config.yaml` runs the app a new user runs instead: that file's args as `make serve` deploys them,
with the LINGBOT_* variables of the environment over them (e.g. LINGBOT_DECODER=wan,tae LINGBOT_MIN_GROUPS=2
LINGBOT_QUALITY_FLOOR=tiny_steps2), Ray told the machine's CPUs, the mode as the WorldGroup's user_config; with
`--fresh` each row runs on an app deployed for it (as a user meets it: nothing learned by an earlier row), and
`--decoder wan` has each session ask for the Wan decoder.

    LINGBOT_DECODER=wan,tae LINGBOT_MIN_GROUPS=2 LINGBOT_QUALITY_FLOOR=tiny_steps2 python -m perf.ladder \
        --config serve_config.yaml --fresh --decoder wan --sessions 4,6,8 --chunks 24 --modes off,auto
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from typing import Optional

from perf.local import ensure_serve, wait_for_groups
from perf.realtime import BenchmarkError, build_parser, default_image, run_session
from perf.realtime_metrics import session_metrics

PORT = 18812
W, H, FPS = 112, 64, 16.0


def settings(mode: str) -> dict:
    ladder, _, floor = mode.partition(":")
    if ladder == "pin":                            # the ladder off, every rung allowed to be pinned
        ladder, floor = "off", "tiny_steps2"
    return dict(preset="tiny", device="cpu", sp=2, min_groups=2, max_groups=2, max_sessions_per_group=3,
                decoder="wan,tae", quality_ladder=ladder, quality_floor=floor or "steps2",
                graceful_shutdown_timeout_s=5, admission_wait_s=60,
                max_sessions_per_key=0, max_starts_per_minute_per_key=0)   # every session comes from one address


def config_app(path: str) -> tuple[dict, int]:
    """(the app's args of the serve config at `path`, as `make serve` reads them; its groups at the start)."""
    import yaml

    from deployments.local import lingbot_app
    from deployments.settings import ServeSettings
    with open(path) as f:
        args = dict(lingbot_app(yaml.safe_load(f)).get("args") or {})
    args.update(max_sessions_per_key=0, max_starts_per_minute_per_key=0)   # every session comes from one address
    return args, ServeSettings.from_args(args).min_groups      # (the environment's LINGBOT_* over the file's)


async def row(n: int, chunks: int, seed: int, quality: Optional[str] = None, decoder: Optional[str] = None,
              port: int = PORT) -> list[dict]:
    """n sessions at once (pinned to `quality`: a rung; asking for `decoder`); each one's metrics (stall ratio,
    chunks per rung, control-to-display)."""
    args = build_parser().parse_args(["--url", f"ws://127.0.0.1:{port}/v1/realtime/video", "--num-chunks",
                                      str(chunks), "--fps", str(FPS), "--control-interval", "2",
                                      "--seed", str(seed), *(["--quality", quality] if quality else []),
                                      *(["--decoder", decoder] if decoder else [])])
    image = default_image(W, H)
    runs = await asyncio.gather(*(run_session(args, i, image, W, H) for i in range(n)), return_exceptions=True)
    for r in runs:                                  # a refusal (capacity_exhausted) is a row's figure; else a fault
        if isinstance(r, BaseException) and not (isinstance(r, BenchmarkError) and "capacity_exhausted" in str(r)):
            raise r
    return [session_metrics(r["chunks"], r["wall_s"], FPS, controls=r["controls"]) if isinstance(r, dict) else None
            for r in runs]


def summary(mode: str, n: int, sessions: list[Optional[dict]]) -> dict:
    refused = sum(m is None for m in sessions)
    sessions = [m for m in sessions if m is not None]
    rungs: dict = {}
    for m in sessions:
        for name, count in m["chunks_per_rung"].items():
            rungs[name] = rungs.get(name, 0) + count
    total = sum(rungs.values())
    shown = [ms for m in sessions for ms in m["control_latencies_ms"]]
    stalls = [m["playback"]["stall_ratio"] for m in sessions]
    firsts = sorted(m["ttfc_ms"] for m in sessions)
    return {"ladder": mode, "sessions": n, "refused": refused, "first_chunk_p50_ms": statistics.median(firsts),
            "first_chunk_max_ms": firsts[-1], "stall_ratio_mean": statistics.mean(stalls),
            "stall_ratio_max": max(stalls), "stall_ratio_per_session": stalls,
            "below_full_share": 1 - rungs.get("full", 0) / total if total else 0.0, "chunks_per_rung": rungs,
            "control_to_display_p50_ms": statistics.median(shown) if shown else None}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,2,3,4,5,6", help="the rows: sessions at once")
    ap.add_argument("--chunks", type=int, default=10, help="chunks per session (the first 3 are the sink: full)")
    ap.add_argument("--modes", default="off,auto", help="off, auto, auto:<floor> (e.g. auto:tiny_steps2)")
    ap.add_argument("--config", default=None, help="run the app of this serve config (and the environment's "
                                                   "LINGBOT_* variables) instead; modes: off or auto")
    ap.add_argument("--fresh", action="store_true", help="each row on an app deployed for it")
    ap.add_argument("--decoder", default=None, help="the decoder each session asks for (extra_params.decoder)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    counts = [int(x) for x in args.sessions.split(",")]
    import os

    from ray import serve

    from deployments.app import build_app, compose_app
    if args.config:
        app_args, groups = config_app(args.config)
        ensure_serve(PORT, cpus=os.cpu_count(), app_args=app_args)
    else:
        groups = 2
        ensure_serve(PORT, cpus=4)

    def deploy(mode: str) -> None:
        if args.config:
            serve.run(compose_app(app_args, {"quality_ladder": mode}), name="lingbot", route_prefix="/")
        else:
            serve.run(build_app(settings(mode)), name="lingbot", route_prefix="/")
        wait_for_groups(groups)
    rows = []
    for mode in modes:
        if not args.fresh:
            deploy(mode)
        for n in counts:
            if args.fresh:
                serve.delete("lingbot")
                deploy(mode)
            print(f"ladder {mode}: {n} sessions at once ...", file=sys.stderr, flush=True)
            pinned = mode.partition(":")[2] if mode.startswith("pin:") else None
            rows.append(summary(mode, n, asyncio.run(row(n, args.chunks, seed=100 * n, quality=pinned,
                                                         decoder=args.decoder))))
    serve.shutdown()
    if args.config:
        print(f"the quality ladder off and auto on the app of {args.config} and the environment's LINGBOT_* "
              f"({groups} groups{', each row on a fresh app' if args.fresh else ''}; {args.chunks} chunks at 16 fps "
              f"a session, decoder {args.decoder or 'the default'}, a key every 2 s; {os.cpu_count()} CPUs)")
    else:
        print(f"the quality ladder off and auto (tiny, CPU, SP-2, 2 groups of 3 sessions, Wan decoder, {args.chunks} "
              f"chunks at 16 fps a session, a key every 2 s; 2 cores, 4 logical CPUs)")
    print("| sessions | ladder | refused | first chunk p50 | first chunk max | stall ratio mean | stall ratio max | "
          "chunks by rung | control -> display p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in counts:
        for r in (r for r in rows if r["sessions"] == n):
            p50 = "-" if r["control_to_display_p50_ms"] is None else f"{r['control_to_display_p50_ms']:.0f} ms"
            first = f"{r['first_chunk_p50_ms'] / 1e3:.1f} s | {r['first_chunk_max_ms'] / 1e3:.1f} s"
            rungs = ", ".join(f"{k} {v}" for k, v in r["chunks_per_rung"].items())
            print(f"| {n} | {r['ladder']} | {r['refused']} | {first} | {r['stall_ratio_mean']:.1%} | "
                  f"{r['stall_ratio_max']:.1%} | {rungs} | {p50} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
