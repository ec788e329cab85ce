"""Control-to-display latency against stalls, for fixed pacing leads, the adaptive one, and the adaptive
one with restarts of stale chunks (restart_stale_chunks), in one run.

Starts a local Ray Serve app of the embedded default (serve_config.yaml: tiny, CPU, SP-2) once per pacing
configuration, runs SESSIONS sessions at once with a key interaction in every 2 s slot (random phase), and
prints, per configuration: control-to-display p50 / p90 / p99 (send -> the player shows the first chunk
that started the event), the stall ratio, TTFC and the steady chunk interval (definitions:
perf/realtime_metrics.py).

    python -m perf.interactivity [--chunks 32] [--sessions 2] [--leads 1.5,0.75,0.25] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import yaml

from perf import realtime
from perf.realtime_metrics import aggregate, session_metrics

PORT = 18800


def configurations(leads: list[float]) -> list[tuple[str, dict]]:
    out = [(f"fixed {lead:g} s", {"pacing": "fixed", "pacing_lead_s": lead}) for lead in leads]
    adaptive = {"pacing": "adaptive", "pacing_lead_s": max(leads)}
    return out + [(f"adaptive (<= {max(leads):g} s)", {**adaptive, "restart_stale_chunks": False}),
                  ("adaptive + restart", {**adaptive, "restart_stale_chunks": True})]


def measure(args, base: dict, overrides: dict) -> dict:
    from ray import serve

    from deployments.app import build_app
    serve.run(build_app({**base, **overrides}), name="lingbot", route_prefix="/")
    url = f"ws://127.0.0.1:{PORT}/v1/realtime/video"
    bench = realtime.build_parser().parse_args([
        "--url", url, "--num-chunks", str(args.chunks), "--sessions", str(args.sessions),
        "--concurrency", str(args.sessions), "--warmup-sessions", "0", "--control-interval", str(args.interval),
        "--camera-pattern", "hold"])
    width, height = realtime.served_size(url)
    sessions = asyncio.run(realtime.run_all(bench, width, height))
    metrics = [session_metrics(s["chunks"], s["wall_s"], bench.fps, controls=s["controls"]) for s in sessions]
    agg = aggregate(metrics)
    c = agg["control_to_display"]
    return {"control_p50_ms": c.get("median_ms"), "control_p90_ms": c.get("p90_ms"),
            "control_p99_ms": c.get("p99_ms"), "controls": c["count"],
            "stall_ratio": statistics.mean(m["playback"]["stall_ratio"] for m in metrics),
            "ttfc_ms": statistics.mean(m["ttfc_ms"] for m in metrics),
            "steady_interval_ms": agg.get("steady_interval_ms_mean", metrics[0]["interval_steady"].get("mean_ms")),
            "video_rtf": statistics.mean(m["video_rtf"] for m in metrics),
            "restarted_chunks": sum(c.get("restarted", 0) for s in sessions for c in s["chunks"]),
            "chunks": sum(len(s["chunks"]) for s in sessions)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=32, help="chunks per session")
    ap.add_argument("--sessions", type=int, default=2, help="sessions at once")
    ap.add_argument("--interval", type=float, default=2.0, help="one interaction per this many seconds")
    ap.add_argument("--leads", default="1.5,0.75,0.25", help="fixed leads to compare (s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    leads = [float(v) for v in args.leads.split(",")]
    from deployments.local import prepare_environment
    prepare_environment()      # Ray's token authentication stays on (deployments/local.py)
    import ray
    from ray import serve
    config = yaml.safe_load((Path(__file__).resolve().parent.parent / "serve_config.yaml").read_text())
    base = dict(config["applications"][0]["args"], min_groups=1, max_groups=1,
                max_sessions_per_group=max(2, args.sessions))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    rows = []
    try:
        for name, overrides in configurations(leads):
            print(f"-- {name}: {args.sessions} sessions x {args.chunks} chunks, a control every {args.interval:g} s",
                  flush=True)
            rows.append({"pacing": name, **measure(args, base, overrides)})
    finally:
        serve.shutdown()
        ray.shutdown()
    chunk_s = 12 / 16
    print(f"\n{'pacing':<24}{'control p50':>12}{'p90':>8}{'p99':>8}{'  (chunks)':>10}{'stall ratio':>13}"
          f"{'TTFC':>8}{'interval':>10}{'RTF':>7}{'restarts':>10}")
    for r in rows:
        print(f"{r['pacing']:<24}{r['control_p50_ms']:>10.0f}ms{r['control_p90_ms']:>6.0f}ms{r['control_p99_ms']:>6.0f}ms"
              f"{r['control_p50_ms'] / 1e3 / chunk_s:>10.2f}{r['stall_ratio']:>13.1%}{r['ttfc_ms']:>6.0f}ms"
              f"{r['steady_interval_ms']:>8.0f}ms{r['video_rtf']:>7.2f}{r['restarted_chunks']:>5.0f}/{r['chunks']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
