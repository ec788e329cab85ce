"""A crowd at the door: N WebSocket connections at once on a local Serve app of the embedded default (tiny, CPU,
SP-2, 2 groups of 2 sessions at most), each starting a 2-chunk session (a fifth of them on the second protocol),
plus sockets that send their request headers one every 5 s; meanwhile the health and config routes are asked
every 0.25 s. Reported per crowd: the share answered within 2 s of connecting (a first message: the stream's
start, `session.queued`/`queued`, or an error with its code), time to answer p50/p99, the slowest health
answer, sessions served, refused (by code) and waited, the slow-header sockets still held at the end, and the
ingress's memory per idle WebSocket (its USS with 60 idle connections open, under max_ingress_sessions, against
none).

    python -m perf.crowd [--crowds 300,1000] [--slow 200] [--doors on,off] [--output-json F]

`--doors on,off` measures both in one run, each on a fresh local Ray: with the door in Serve's proxy (the default
environment: deployments/ingress/front.py) and without it (every connection routed to the ingress replica).

Traffic stays on the loopback address. The crowd comes from one address, so the per-address limits are off
(max_connections_per_address 0, the per-key limits 0), as behind a proxy that names no clients.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from perf.local import ensure_serve, first_frame_png, wait_for_groups

PORT = 18811
ROOT = Path(__file__).resolve().parents[1]
ANSWERED_WITHIN_S = 2.0


def settings() -> dict:
    import yaml
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    return {**args, "max_connections_per_address": 0, "max_sessions_per_key": 0, "max_starts_per_minute_per_key": 0}


async def connection(i: int, image: bytes, out: list) -> None:
    """One viewer: connect, start a 2-chunk session, read to the end. Records when the first message came."""
    import websockets

    from deployments.client import FramesClient, RealtimeClient
    second = i % 5 == 4
    url = f"ws://127.0.0.1:{PORT}" + ("/v1/realtime_video/generate" if second else "/v1/realtime/video")
    row = {"second": second, "answer_s": None, "first": None, "served": False, "queued": False, "code": None}
    t0 = time.monotonic()
    try:
        client = FramesClient(url) if second else RealtimeClient(url)
        async with client:
            if second:
                await client.init("a street at night", image, 2, i)
            else:
                import base64
                await client.start("a street at night", "data:image/png;base64," + base64.b64encode(image).decode(),
                                   112, 64, 2, seed=i)
            while True:
                raw = await asyncio.wait_for(client.ws.recv(), 300)
                msg = _msgpack_map(raw) if second else (json.loads(raw) if isinstance(raw, str) else None)
                kind = None if msg is None else msg.get("type")
                if row["answer_s"] is None:
                    row["answer_s"], row["first"] = time.monotonic() - t0, kind or "chunk"
                if kind in ("session.queued", "queued"):
                    row["queued"] = True
                elif kind == "error":
                    row["code"] = msg.get("code")
                elif kind in ("session.done",) or (second and kind == "chunk_stats" and msg.get("chunk_index") == 1):
                    row["served"] = True
    except websockets.ConnectionClosed:
        pass
    except Exception as e:                       # the handshake failed or timed out: no answer
        row["code"] = row["code"] or f"no answer ({type(e).__name__})"
    out.append(row)


def _msgpack_map(raw) -> dict | None:
    """A second-protocol message as a map; None for a payload that follows its header."""
    import msgpack
    try:
        msg = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    return msg if isinstance(msg, dict) else None


def slow_headers(n: int) -> list:
    """`n` sockets that send a request line, then one header every 5 s, never the end of the headers."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", PORT), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(s)
    return socks


async def drip(socks: list, stop: asyncio.Event) -> int:
    """One more header on every socket every 5 s until `stop`; how many the server still holds at the end."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 5)
        except asyncio.TimeoutError:
            pass
        for s in socks:
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                pass
    alive = 0
    for s in socks:                              # held: nothing to read yet (answered, closed: data, b"", an error)
        s.setblocking(False)
        try:
            s.recv(1)
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
        s.close()
    return alive


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


async def health(stop: asyncio.Event, worst: dict) -> None:
    """Each route asked every 0.25 s by a prober of its own (one after the other, a route asked later in the
    round met the crowd's peak more often: the probes measured their place in the round as much as the route)."""
    async def probe(path: str) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(_get, f"http://127.0.0.1:{PORT}{path}")
                took = time.monotonic() - t0
            except Exception:
                took = float("inf")
            worst[path] = max(worst.get(path, 0.0), took)
            await asyncio.sleep(0.25)
    await asyncio.gather(*(probe(path) for path in ("/healthz", "/readyz", "/v1/config")))


async def crowd(n: int, slow: int) -> dict:
    image = first_frame_png()
    stop, worst, rows = asyncio.Event(), {}, []
    socks = slow_headers(slow)
    checker = asyncio.ensure_future(health(stop, worst))
    dripping = asyncio.ensure_future(drip(socks, stop))
    t0 = time.monotonic()
    await asyncio.gather(*(connection(i, image, rows) for i in range(n)))
    took = time.monotonic() - t0
    stop.set()
    held = await dripping
    await checker
    answers = sorted(r["answer_s"] for r in rows if r["answer_s"] is not None)
    codes: dict = {}
    for r in rows:
        if r["code"]:
            codes[r["code"]] = codes.get(r["code"], 0) + 1
    return {"connections": n, "slow_header_sockets": slow, "seconds": round(took, 1),
            "answered_within_2s": sum(a <= ANSWERED_WITHIN_S for a in answers) / n,
            "answer_p50_s": round(statistics.median(answers), 3) if answers else None,
            "answer_p99_s": round(answers[min(len(answers) - 1, int(0.99 * len(answers)))], 3) if answers else None,
            "health_max_s": {k: round(v, 3) for k, v in worst.items()},
            "served": sum(r["served"] for r in rows), "waited": sum(r["queued"] for r in rows), "refused": codes,
            "slow_header_sockets_held": held}


async def idle_memory(count: int = 60) -> float:
    """KiB of the ingress's USS per idle WebSocket (open, no start yet)."""
    import psutil
    import websockets

    from perf.soak import actor_processes
    [pid] = actor_processes("lingbot")["ingress"]
    proc = psutil.Process(pid)
    before = proc.memory_full_info().uss
    socks = [await websockets.connect(f"ws://127.0.0.1:{PORT}/v1/realtime/video") for _ in range(count)]
    await asyncio.sleep(1.0)
    during = proc.memory_full_info().uss
    await asyncio.gather(*(ws.close() for ws in socks))
    return (during - before) / count / 1024


def serve_with_door(door: bool, s: dict) -> None:
    """A fresh local Ray and the app of settings `s`, with the door in Serve's proxy or without it (the proxy reads
    its callback from the environment it starts with: deployments/ingress/front.py)."""
    from ray import serve

    from deployments.app import build_app
    ensure_serve(PORT, app_args=s, door=door)
    serve.run(build_app(s), name="lingbot", route_prefix="/")
    wait_for_groups(1)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--crowds", default="300,1000")
    ap.add_argument("--slow", type=int, default=200, help="slow-header sockets during each crowd")
    ap.add_argument("--doors", default="on,off", help="with the door in Serve's proxy, without it, or both in turn")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    import ray
    from ray import serve
    s = settings()
    s["start_timeout_s"] = 60                   # the idle-memory probe holds its sockets without a start
    rows, kib = [], None
    for door in args.doors.split(","):
        if door not in ("on", "off"):
            ap.error(f"--doors takes on and off, got {door!r}")
        print(f"door {door}: starting Ray and the app ...", file=sys.stderr, flush=True)
        serve_with_door(door == "on", s)
        if kib is None:
            kib = asyncio.run(idle_memory())
        for n in (int(x) for x in args.crowds.split(",")):
            print(f"door {door}: a crowd of {n} ...", file=sys.stderr, flush=True)
            time.sleep(10)                       # the previous crowd's sessions gone
            rows.append({"door": door, **asyncio.run(crowd(n, args.slow))})
        serve.shutdown()
        ray.shutdown()
    print(f"ingress memory per idle WebSocket: {kib:.1f} KiB")
    print("| door | connections | answered within 2 s | answer p50 | answer p99 | slowest health answer (/healthz, "
          "/readyz, /v1/config) | served | waited | refused | slow-header sockets held |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---|---:|")
    for r in rows:
        h = r["health_max_s"]
        slowest = ", ".join(f"{h.get(p, float('nan')):.2f}" for p in ("/healthz", "/readyz", "/v1/config"))
        print(f"| {r['door']} | {r['connections']} | {r['answered_within_2s']:.0%} | {r['answer_p50_s']} s "
              f"| {r['answer_p99_s']} s | {slowest} s | {r['served']} | {r['waited']} | {json.dumps(r['refused'])} "
              f"| {r['slow_header_sockets_held']} of {r['slow_header_sockets']} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"idle_websocket_kib": kib, "crowds": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
