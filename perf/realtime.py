"""Realtime streaming benchmark for any server of the realtime video protocol (docs/architecture.md).

One (or more) unmeasured warm-up sessions, then M measured sessions, optionally K at once. Per session:
TTFC, chunk inter-arrival (all / steady), VIDEO_RTF at a stated fps, chunk deadline and SLO attainment,
a simulated player, and (from servers that report them, like ours) per-stage medians. It checks that the
chunk indices are contiguous and that the chunk and frame counts are exact (the stream is decoded).
With --control-interval S it also sends a key interaction in every S-second slot (at a random phase inside
the slot) and reports control-to-display latency: send -> the player shows the first chunk that started
the event. Writes JSON and prints a table. Metric definitions: perf/realtime_metrics.py.

    python -m perf.realtime --url ws://127.0.0.1:8000/v1/realtime/video --num-chunks 16 --sessions 3 \\
        [--concurrency 2] [--warmup-sessions 1] [--fps 16] [--control-interval 2] [--profile-stages] \
        [--decoder tae] \
        [--output-json out.json] [--plot p.png]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Optional

from deployments.client import RealtimeClient, image_data_url
from lingbot.config import LINGBOT_GEOMETRY
from perf.realtime_metrics import aggregate, session_metrics

PATTERNS = {"forward": ["w", "w", "w"], "orbit": ["dj", "dj", "dj"], "hold": ["", "", ""]}


class BenchmarkError(RuntimeError):
    pass


def default_image(width: int, height: int) -> str:
    import numpy as np
    from PIL import Image
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return image_data_url(buf.getvalue(), "image/png")


async def run_session(args, index: int, image_url: str, width: int, height: int) -> dict:
    script = [PATTERNS[args.camera_pattern]] * args.num_chunks
    extra = {"flow_shift": args.flow_shift} if args.flow_shift is not None else {}
    if args.decoder is not None:
        extra["decoder"] = args.decoder
    if args.quality is not None:
        extra["quality"] = args.quality
    if args.profile_stages:
        extra["profile_stages"] = True
    async with RealtimeClient(args.url, open_timeout=args.first_chunk_timeout) as client:
        await client.start(args.prompt, image_url, width, height, args.num_chunks, args.fps, args.seed + index,
                           script=script, **extra)
        t0 = time.monotonic()                  # the clock starts once session.start has been sent
        controls: list[dict] = []
        steer = asyncio.create_task(_controls(client, args.control_interval, t0, controls, args.seed + index))
        result = await client.receive_session(timeout=args.first_chunk_timeout + args.chunk_timeout * args.num_chunks,
                                              ping_interval=args.ping_interval if args.ping_interval > 0 else None)
        wall = time.monotonic() - t0
        steer.cancel()
    if result.error is not None:
        raise BenchmarkError(f"session {index}: server error {result.error.get('code')}: {result.error.get('message')}")
    chunks = []
    for meta, data, arrival in zip(result.chunks, result.data, result.arrivals):
        chunks.append({"index": meta["generation_chunk_index"], "transport_index": meta["transport_chunk_index"],
                       "arrival_s": arrival - t0, "num_frames": meta["num_frames"],
                       "byte_length": len(data), "timings": meta.get("timings"),
                       "started": meta.get("started_event_ids") or [], "quality": meta.get("quality", "full"),
                       "restarted": (meta.get("group_clock") or {}).get("restarted", 0.0)})
    _check(chunks, result, args.num_chunks)
    if args.save_video:
        with open(f"{args.save_video}.{index}.mp4", "wb") as f:
            f.write(result.video)
    return {"session_index": index, "request_id": result.start["request_id"], "chunks": chunks, "wall_s": wall,
            "frames_decoded": _decoded_frames(result.video), "controls": controls}


async def _controls(client, interval: float, t0: float, sent: list, seed: int) -> None:
    """A key interaction in every `interval`-second slot, at a uniformly random phase inside the slot;
    records each event's send time (seconds since t0) in `sent`."""
    if interval <= 0:
        return
    rng = random.Random(seed)
    slot = 0
    while True:
        at = t0 + interval * (slot + rng.random())
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        event_id = f"c{slot}"
        keys = ["l", "l", "l"] if slot % 2 == 0 else ["j", "j", "j"]
        sent.append({"event_id": event_id, "sent_s": time.monotonic() - t0})
        await client.interact(event_id, keys=keys)
        slot += 1


def _check(chunks: list[dict], result, expected: int) -> None:
    indices = [c["index"] for c in chunks]
    if indices != list(range(len(indices))):
        raise BenchmarkError(f"chunk indices are not contiguous from 0: {indices[:20]}")
    if [c["transport_index"] for c in chunks] != indices:
        raise BenchmarkError("transport indices differ from generation indices")
    if len(chunks) != expected:
        raise BenchmarkError(f"{len(chunks)} chunks received, {expected} asked for")
    frames = sum(c["num_frames"] for c in chunks)
    if frames != LINGBOT_GEOMETRY.video_frames(expected):
        raise BenchmarkError(f"{frames} frames announced, {LINGBOT_GEOMETRY.video_frames(expected)} expected")
    if result.done is None or result.done.get("chunks") != expected:
        raise BenchmarkError(f"session.done missing or wrong: {result.done}")


def _decoded_frames(video: bytes) -> int:
    from lingbot.io.video import read_frames
    return int(read_frames(video).shape[0])


def stage_medians(chunks: list[dict]) -> dict:
    stages: dict[str, list] = {}
    for c in chunks:
        for name, seconds in (c.get("timings") or {}).items():
            stages.setdefault(name, []).append(seconds * 1e3)
    return {name: statistics.median(v) for name, v in stages.items()}


async def run_all(args, width: int, height: int) -> list[dict]:
    image_url = image_data_url(args.image) if args.image else default_image(width, height)
    for w in range(args.warmup_sessions):
        await run_session(args, -1 - w, image_url, width, height)
    out: list[dict] = []
    for start in range(0, args.sessions, args.concurrency):
        batch = range(start, min(start + args.concurrency, args.sessions))
        out += await asyncio.gather(*[run_session(args, i, image_url, width, height) for i in batch])
    return out


def served_size(url: str) -> tuple[int, int]:
    import urllib.request
    http = url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0]
    with urllib.request.urlopen(f"{http}/v1/config", timeout=10) as r:
        cfg = json.loads(r.read())
    return cfg["width"], cfg["height"]


def table(report: dict) -> str:
    m, w = report["metrics"], report["workload"]
    rows = [("Endpoint", report["endpoint"]), ("Geometry", f"{w['width']}x{w['height']}"),
            ("Chunks per session", w["num_chunks"]),
            ("Sessions (at once)", f"{report['config']['sessions']} ({report['config']['concurrency']})"),
            ("Real-time basis (fps)", w["fps"]), ("Video seconds per session", f"{w['video_seconds']:.2f}")]
    if m.get("sessions", 1) == 1:
        rows += [("", ""), ("TTFC", f"{m['ttfc_ms']:.0f} ms")]
        for name in ("interval_all", "interval_steady"):
            s = m[name]
            label = "All chunks" if name == "interval_all" else "Steady state"
            if not s["count"]:
                rows.append((f"{label} (n=0)", "-"))
                continue
            rows += [(f"{label} (n={s['count']}) mean / median", f"{s['mean_ms']:.0f} / {s['median_ms']:.0f} ms"),
                     ("  std / max", f"{s['std_ms']:.0f} / {s['max_ms']:.0f} ms"),
                     ("  p90 / p95 / p99", f"{s['p90_ms']:.0f} / {s['p95_ms']:.0f} / {s['p99_ms']:.0f} ms")]
        rows += [("", ""), ("VIDEO_RTF (at the fps above)", f"{m['video_rtf']:.3f}"),
                 ("VIDEO_RTFX", f"{m['video_rtfx']:.3f}")]
        if m.get("steady_state_reached"):
            rows += [("VIDEO_RTF steady state", f"{m['steady_video_rtf']:.3f}"),
                     ("Chunk deadline", f"{m['chunk_deadline_ms']:.0f} ms"),
                     ("Steady chunks within deadline", f"{m['slo_attainment']:.0%} ({m['slo_violations']} late)")]
        p = m["playback"]
        rows += [("", ""), ("Start buffer", f"{p['buffer_chunks']} chunk(s)"), ("Underruns", p["underrun_count"]),
                 ("Total stall", f"{p['total_stall_ms']:.0f} ms"), ("Stall ratio", f"{p['stall_ratio']:.1%}")]
        rows += _control_rows(m["control_to_display"])
    else:
        rows += [("", ""), ("TTFC mean / max", f"{m['ttfc_ms_mean']:.0f} / {m['ttfc_ms_max']:.0f} ms"),
                 ("Steady interval mean (spread)",
                  f"{m['steady_interval_ms_mean']:.0f} ({m['steady_interval_ms_spread']:.0f}) ms"),
                 ("VIDEO_RTF mean (best / worst)",
                  f"{m['video_rtf_mean']:.3f} ({m['video_rtf_best']:.3f} / {m['video_rtf_worst']:.3f})"),
                 ("Chunk deadline", f"{m['chunk_deadline_ms']:.0f} ms"), ("Underruns", m["underrun_count"]),
                 ("Stall ratio (mean)", f"{m['stall_ratio_mean']:.1%}")]
        rows += _control_rows(m["control_to_display"])
    if report["config"].get("control_interval_s"):
        rows.append(("Chunks restarted for a control", f"{m['chunks_restarted']} / {m['chunks_received']}"))
    rungs = m.get("chunks_per_rung") or {}
    total = sum(rungs.values())
    if total:
        rows += [("", "")] + [(f"Chunks at {name}", f"{n / total:.0%} ({n})") for name, n in sorted(rungs.items())]
    stages = report.get("stage_medians_ms") or {}
    if stages:
        rows.append(("", ""))
        rows += [(f"stage {name} (median)", f"{ms:.2f} ms") for name, ms in stages.items()]
    lines = [" LingBot-World realtime streaming benchmark ".center(60, "=")]
    lines += [f"{label:<44}{value!s:>16}" if label else "-" * 60 for label, value in rows]
    return "\n".join(lines + ["=" * 60])


def _control_rows(s: dict) -> list:
    if not s["count"]:
        return []
    return [("", ""), (f"Control-to-display (n={s['count']}) p50", f"{s['median_ms']:.0f} ms"),
            ("  p90 / p99", f"{s['p90_ms']:.0f} / {s['p99_ms']:.0f} ms")]


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=110)
    for s in report["sessions"]:
        xs = [c["index"] for c in s["chunks"][1:]]
        ys = [(c["arrival_s"] - p["arrival_s"]) * 1e3 for p, c in zip(s["chunks"], s["chunks"][1:])]
        ax.plot(xs, ys, marker="o", ms=3, label=f"session {s['session_index']}")
    deadline = report["metrics"]["chunk_deadline_ms"]
    frames = LINGBOT_GEOMETRY.pixel_frames(1)
    ax.axhline(deadline, color="red", ls="--", lw=1,
               label=f"deadline {deadline:.0f} ms ({frames} frames @ {report['workload']['fps']} fps)")
    ax.axvline(report["config"]["warmup_chunks"] - 0.5, color="gray", ls=":", lw=1, label="steady state from here")
    ax.set_xlabel("chunk index")
    ax.set_ylabel("inter-arrival (ms)")
    ax.set_title(f"chunk interval over a session: {report['endpoint']}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime/video")
    ap.add_argument("--image", default=None, help="first frame (default: a generated gradient)")
    ap.add_argument("--prompt", default="A sunlit forest path winding between tall pines.")
    ap.add_argument("--num-chunks", type=int, default=16)
    ap.add_argument("--width", type=int, default=None, help="default: the server's (GET /v1/config)")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--fps", type=float, default=16.0, help="playback fps sent with session.start")
    ap.add_argument("--target-fps", type=float, default=None, help="real-time basis (default: --fps)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--flow-shift", type=float, default=None)
    ap.add_argument("--decoder", default=None, help="the frame decoder the sessions ask for (extra_params.decoder; "
                                                    "default: the server's)")
    ap.add_argument("--quality", default=None, help="the rung the sessions pin (extra_params.quality; default: auto)")
    ap.add_argument("--camera-pattern", choices=sorted(PATTERNS), default="forward")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1, help="measured sessions run this many at once")
    ap.add_argument("--warmup-sessions", type=int, default=1)
    ap.add_argument("--warmup-chunks", type=int, default=6, help="steady state = chunk index >= this")
    ap.add_argument("--chunk-slo-ms", type=float, default=None, help="default: 12 / fps")
    ap.add_argument("--playback-buffer-chunks", type=int, default=1)
    ap.add_argument("--first-chunk-timeout", type=float, default=900.0)
    ap.add_argument("--chunk-timeout", type=float, default=300.0)
    ap.add_argument("--ping-interval", type=float, default=20.0)
    ap.add_argument("--control-interval", type=float, default=0.0,
                    help="send a key interaction in every slot of this many seconds (0: none)")
    ap.add_argument("--profile-stages", action="store_true", help="ask the server for device-synced stage times")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--save-video", default=None, help="prefix: writes PREFIX.<session>.mp4")
    ap.add_argument("--plot", default=None, help="PNG of chunk interval over each session")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("num_chunks", "sessions", "concurrency", "playback_buffer_chunks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    width, height = (args.width, args.height) if args.width and args.height else served_size(args.url)
    fps = args.target_fps or args.fps
    sessions = asyncio.run(run_all(args, width, height))
    for s in sessions:
        s["metrics"] = session_metrics(s["chunks"], s["wall_s"], fps, args.warmup_chunks, args.chunk_slo_ms,
                                       args.playback_buffer_chunks, s["controls"])
        if s["frames_decoded"] != s["metrics"]["total_frames"]:
            raise BenchmarkError(f"session {s['session_index']}: decoded {s['frames_decoded']} frames, "
                                 f"metadata says {s['metrics']['total_frames']}")
        s["stage_medians_ms"] = stage_medians(s["chunks"])
    all_chunks = [c for s in sessions for c in s["chunks"]]
    report = {
        "benchmark": "lingbot_world_realtime", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "endpoint": args.url, "hostname": platform.node(), "git_revision": _git_revision(),
        "workload": {"num_chunks": args.num_chunks, "num_frames": LINGBOT_GEOMETRY.video_frames(args.num_chunks),
                     "width": width, "height": height, "fps": fps, "seed": args.seed,
                     "camera_pattern": args.camera_pattern,
                     "video_seconds": LINGBOT_GEOMETRY.video_frames(args.num_chunks) / fps},
        "config": {"sessions": args.sessions, "concurrency": args.concurrency, "warmup_sessions": args.warmup_sessions,
                   "warmup_chunks": args.warmup_chunks, "chunk_slo_ms": args.chunk_slo_ms, "target_fps": fps,
                   "mux_fps": args.fps, "playback_buffer_chunks": args.playback_buffer_chunks,
                   "profile_stages": args.profile_stages, "control_interval_s": args.control_interval},
        "sessions": sessions, "metrics": aggregate([s["metrics"] for s in sessions]),
        "stage_medians_ms": stage_medians(all_chunks),
    }
    print(table(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
    if args.plot:
        plot(report, args.plot)
    return report


def _git_revision() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    try:
        main()
    except BenchmarkError as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        sys.exit(1)
