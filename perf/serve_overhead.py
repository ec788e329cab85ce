"""Serving overhead: TTFC and chunk inter-arrival through the whole stack (Ray Serve ingress -> group ->
SP ranks -> muxer -> WebSocket) against the in-process pipeline's chunk time for the same preset and SP
degree, side by side in one run; plus the root -> muxer transfer time per chunk.

    python -m perf.serve_overhead [--chunks 16] [--sp 2] [--url ws://host:port/v1/realtime/video]

Without --url it starts a local Ray + Serve app (tiny, CPU) with pacing off, so chunks come as fast as
the group makes them.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import time

import numpy as np

from deployments.client import RealtimeClient, image_data_url

PORT = 18766


def start_local_app(sp: int) -> str:
    from deployments.local import start_ray
    start_ray(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,   # token auth: local.py
              object_store_memory=300 * 2 ** 20)
    from ray import serve

    from deployments.app import build_app
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({"preset": "tiny", "sp": sp, "pacing_lead_s": 1000, "max_groups": 1}), name="lingbot",
              route_prefix="/")
    return f"ws://127.0.0.1:{PORT}/v1/realtime/video"


async def one_session(url: str, chunks: int, seed: int):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (64, 112, 3), dtype=np.uint8)).save(buf, "PNG")
    async with RealtimeClient(url) as client:
        t0 = time.monotonic()
        await client.start("a lighthouse at dusk", image_data_url(buf.getvalue(), "image/png"), 112, 64, chunks,
                           seed=seed)
        result = await client.receive_session()
    if result.error:
        raise RuntimeError(result.error)
    return t0, result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--url", default=None)
    args = ap.parse_args(argv)
    url = args.url or start_local_app(args.sp)
    asyncio.run(one_session(url, 2, 0))                                   # warm-up
    t0, served = asyncio.run(one_session(url, args.chunks, 1))
    ttfc = served.arrivals[0] - t0
    gaps = np.diff(served.arrivals)                                       # gap i = arrival(i+1) - arrival(i)
    steady = gaps[5:]                                                     # arrivals of chunks >= 6
    transfer = [c["timings"]["root_to_muxer"] for c in served.chunks]
    outside = [c["timings"]["outside_engine"] for c in served.chunks[6:]]
    if args.url is None:
        from ray import serve
        serve.shutdown()
        import ray
        ray.shutdown()
    # in process, same preset and SP degree (perf/sp_time.py's measurement, same machine, same run)
    from lingbot.parallel import Comm
    from lingbot.parallel.launch import run_local
    from perf.sp_time import measure
    if args.sp > 1:
        local = run_local(measure, args.sp, "tiny", args.chunks, timeout_s=600)[0]
    else:
        local = measure(Comm(), "tiny", args.chunks)
    step = local["step_s"]
    print(f"tiny, SP-{args.sp}, {args.chunks} chunks, pacing off, this machine ({os.cpu_count()} cores)")
    print(f"  served: TTFC {ttfc * 1e3:.0f} ms; chunk inter-arrival (chunks >= 6) median "
          f"{np.median(steady) * 1e3:.0f} ms, mean {np.mean(steady) * 1e3:.0f}, "
          f"p90 {np.percentile(steady, 90) * 1e3:.0f}")
    print(f"  in-process pipeline step (chunks >= 6) median {step * 1e3:.0f} ms")
    print(f"  serving overhead: served interval / in-process step = {np.median(steady) / step:.2f}x; "
          f"group time outside the engine per chunk median {statistics.median(outside) * 1e3:.0f} ms")
    print(f"  root -> muxer transfer per chunk ({served.chunks[1]['num_frames']} frames, "
          f"{served.chunks[1]['num_frames'] * 64 * 112 * 3 / 1e3:.0f} kB uint8): median "
          f"{statistics.median(transfer) * 1e3:.2f} ms, max {max(transfer) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
