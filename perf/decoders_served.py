"""The embedded default served with each frame decoder: how many sessions at once stay at real time. One local
Serve app of serve_config.yaml's embedded default (tiny, CPU, SP-2, 2 sessions a group, 2 groups held
running so that no group start is in the figures) loads both decoders; perf.realtime then runs K sessions at
once asking for one decoder (extra_params.decoder), K = 1..4, each decoder in turn, in one run:

    python -m perf.decoders_served [--num-chunks 16] [--max-sessions 4] [--output-json out.json]

The figure that says real time is the player's: a simulated player with a 1-chunk buffer, and the share of
the playback it stalled. The server paces each session at real time (it runs ahead by a learned lead), so
chunk intervals sit at 750 ms (12 frames at 16 fps) with jitter either side, and the share of intervals under
750 ms (shown too, "interval SLO") says little about a paced stream; a stall says the chunk came late.
"Near real time": under 1% of the playback stalled in every session.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from perf.local import ensure_serve, wait_for_groups

PORT = 18798
ROOT = Path(__file__).resolve().parents[1]


def embedded_default() -> dict:
    args = dict(yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"])
    return {**args, "decoder": "wan,tae", "min_groups": args["max_groups"]}


def near_real_time(session: dict) -> bool:
    return session["metrics"]["playback"]["stall_ratio"] < 0.01


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-chunks", type=int, default=16)
    ap.add_argument("--max-sessions", type=int, default=4)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    from ray import serve

    from deployments.app import build_app
    from perf import realtime
    settings = embedded_default()
    ensure_serve(PORT)
    serve.run(build_app(settings), name="lingbot", route_prefix="/")
    wait_for_groups(settings["max_groups"])
    rows = []
    for decoder in ("wan", "tae"):
        for k in range(1, args.max_sessions + 1):
            report = realtime.main(["--url", f"ws://127.0.0.1:{PORT}/v1/realtime/video", "--num-chunks",
                                    str(args.num_chunks), "--sessions", str(k), "--concurrency", str(k),
                                    "--warmup-sessions", "1" if k == 1 else "0", "--decoder", decoder])
            sessions = report["sessions"]
            rows.append({"decoder": decoder, "sessions": k,
                         "near_real_time": all(near_real_time(s) for s in sessions),
                         "slo_attainment_min": min(s["metrics"].get("slo_attainment", 0.0) for s in sessions),
                         "steady_interval_ms_mean": report["metrics"].get("steady_interval_ms_mean",
                                                                         report["metrics"].get("interval_steady",
                                                                                               {}).get("mean_ms")),
                         "stall_ratio_mean": report["metrics"].get("stall_ratio_mean",
                                                                   report["metrics"].get("playback", {})
                                                                   .get("stall_ratio")),
                         "stage_medians_ms": report["stage_medians_ms"]})
    serve.shutdown()
    print(f"the embedded default served (tiny, CPU, SP-2; 2 groups of 2; {args.num_chunks} chunks a session)")
    print(render(rows))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))
    return rows


def render(rows: list) -> str:
    lines = ["| decoder | sessions at once | stalled (mean) | near real time | steady interval ms | "
             "interval SLO (worst session) | decode ms (median) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        decode = r["stage_medians_ms"].get("decode")
        lines.append(f"| {r['decoder']} | {r['sessions']} | {r['stall_ratio_mean']:.1%} | "
                     f"{'yes' if r['near_real_time'] else 'no'} | {r['steady_interval_ms_mean']:.0f} | "
                     f"{r['slo_attainment_min']:.0%} | {'-' if decode is None else f'{decode:.0f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
