"""One client must never deny service to all: three attacks on a local Serve app of the embedded default (tiny,
CPU, SP-2, one group of one session, so a second session waits), each measured against the same run without it.

- `waiting`: a session waits for the full group while its client floods it at the allowed rate (45 messages a
  second: 120 KiB messages of an unknown type and interactions with 4 KiB prompts). Reported: the ingress
  replica's memory (USS) at the start and the end of the flood, and the refusals the flooder heard.
- `decode`: one session plays (paced, 16 fps) while an attacker on the second protocol sends, at the allowed
  rate, 64 KiB MessagePack messages of 20,000 empty arrays (before its init, which that protocol lets a client
  retry; one connection after another when it is cut). Reported: the player's steady chunk interval and
  `/healthz`'s p99 (asked every 0.1 s), with and without the attacker, and their ratios.
- `door`: 200 upgrades from one client address that never send a byte after the handshake, then a client with
  the API key from another address: how many of the 200 the door let through, and how long the keyed client
  took to be streaming.

    python -m perf.abuse [--seconds 20] [--attacks waiting,decode,door] [--output-json F]

Traffic stays on the loopback address; other client addresses are named in X-Forwarded-For (127.0.0.1 is a
trusted proxy here).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import statistics
import sys
import time
import urllib.request

import msgpack
import psutil

from perf.local import ensure_serve, first_frame_png, wait_for_groups

PORT = 18813
KEY = "abuse-test-key-0123456789"
HTTP = f"http://127.0.0.1:{PORT}"
VLLM = f"ws://127.0.0.1:{PORT}/v1/realtime/video"
SGLANG = f"ws://127.0.0.1:{PORT}/v1/realtime_video/generate"
RATE = 45.0                                 # the flooders' messages a second: under max_messages_per_s (50)
SETTINGS = {"preset": "tiny", "device": "cpu", "sp": 2, "max_sessions_per_group": 1, "min_groups": 1,
            "max_groups": 1, "admission_wait_s": 600, "api_keys": KEY, "trusted_proxies": "127.0.0.1",
            "max_sessions_per_key": 0, "max_starts_per_minute_per_key": 0}


def ingress_uss() -> int:
    """The ingress replica's unique memory (bytes)."""
    for proc in psutil.process_iter(["cmdline"]):
        if any("ServeReplica:lingbot:Ingress" in part for part in proc.info["cmdline"] or ()):
            return proc.memory_full_info().uss
    raise RuntimeError("no ingress replica process")


def healthz_s() -> float:
    t0 = time.monotonic()
    with urllib.request.urlopen(HTTP + "/healthz", timeout=30) as r:
        r.read()
    return time.monotonic() - t0


def image_url() -> str:
    return "data:image/png;base64," + base64.b64encode(first_frame_png()).decode()


async def player(seconds: float, arrivals: list) -> None:
    """An endless paced session for `seconds`: the arrival time of each chunk goes to `arrivals`."""
    from deployments.client import RealtimeClient
    async with RealtimeClient(VLLM, api_key=KEY) as c:
        await c.start("a street at night", image_url(), 112, 64, None, seed=1)

        def chunk(result, meta):
            arrivals.append(time.monotonic())
        try:
            await c.receive_session(chunk, timeout=seconds)
        except asyncio.TimeoutError:                # the session is endless: it is stopped after `seconds`
            pass
        finally:
            await c.send({"type": "session.stop"})


async def flood_waiting(seconds: float) -> dict:
    """Hold the one group with a player; a second session waits, its client flooding it."""
    from deployments.client import RealtimeClient
    arrivals: list = []
    playing = asyncio.ensure_future(player(seconds + 15, arrivals))
    while not arrivals:
        await asyncio.sleep(0.2)
    junk = json.dumps({"type": "x", "pad": "." * (120 * 2 ** 10)})
    heard: dict = {}
    async with RealtimeClient(VLLM, api_key=KEY) as c:
        await c.start("another street", image_url(), 112, 64, None, seed=2)

        async def listen():
            async for raw in c.ws:
                if isinstance(raw, str):
                    msg = json.loads(raw)
                    key = msg.get("code") or msg["type"]
                    heard[key] = heard.get(key, 0) + 1
        listening = asyncio.ensure_future(listen())
        await asyncio.sleep(1.0)
        before, t0, sent = ingress_uss(), time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            if sent % 2:
                await c.send(junk)
            else:
                await c.interact(f"e{sent}", prompt="p" * 4000)
            sent += 1
            await asyncio.sleep(max(0.0, t0 + sent / RATE - time.monotonic()))
        await asyncio.sleep(1.0)
        after = ingress_uss()
        listening.cancel()
    playing.cancel()
    return {"sent": sent, "uss_before_mib": before / 2 ** 20, "uss_after_mib": after / 2 ** 20,
            "uss_growth_mib": (after - before) / 2 ** 20, "heard": heard}


async def decode_attacker(stop: asyncio.Event, counts: dict) -> None:
    """The second protocol's pre-init junk at the allowed rate, reconnecting when cut."""
    import websockets
    junk = msgpack.packb({"type": "init", "pad": [[]] * 20_000})
    while not stop.is_set():
        try:
            async with websockets.connect(SGLANG, compression=None, additional_headers={
                    "Authorization": f"Bearer {KEY}"}) as ws:
                counts["connections"] = counts.get("connections", 0) + 1
                t0, sent = time.monotonic(), 0
                while not stop.is_set():
                    await ws.send(junk)
                    sent += 1
                    counts["sent"] = counts.get("sent", 0) + 1
                    await asyncio.sleep(max(0.0, t0 + sent / RATE - time.monotonic()))
        except websockets.ConnectionClosed:
            counts["cut"] = counts.get("cut", 0) + 1
        except OSError:
            await asyncio.sleep(0.1)


async def decode_run(seconds: float, attack: bool) -> dict:
    arrivals, health, counts = [], [], {}
    stop = asyncio.Event()

    async def probe():
        while not stop.is_set():
            health.append(await asyncio.to_thread(healthz_s))
            await asyncio.sleep(0.1)
    tasks = [asyncio.ensure_future(probe())]
    if attack:
        tasks.append(asyncio.ensure_future(decode_attacker(stop, counts)))
    await player(seconds, arrivals)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    intervals = [b - a for a, b in itertools.pairwise(arrivals[6:])]          # the steady state
    return {"chunks": len(arrivals), "interval_median_s": statistics.median(intervals),
            "healthz_p99_s": sorted(health)[int(0.99 * (len(health) - 1))], "attacker": counts}


async def door_run() -> dict:
    """200 silent upgrades from one address, then a keyed client from another."""
    import websockets
    silent, refused = [], 0
    for _ in range(200):
        try:
            ws = await websockets.connect(VLLM, compression=None, open_timeout=10,
                                          additional_headers={"X-Forwarded-For": "198.51.100.66"})
            silent.append(ws)
        except Exception:
            refused += 1
    codes: dict = {}
    for ws in silent:                       # how each was answered: its refusal's code, or "held" (none yet)
        try:
            code = json.loads(await asyncio.wait_for(ws.recv(), 2.0)).get("code") or "held"
        except asyncio.TimeoutError:
            code = "held"
        except websockets.ConnectionClosed as e:
            code = e.rcvd.reason if e.rcvd is not None else "closed"
        codes[code] = codes.get(code, 0) + 1
    from deployments.client import RealtimeClient
    t0 = time.monotonic()
    async with RealtimeClient(VLLM, api_key=KEY) as c:
        await c.start("a street at night", image_url(), 112, 64, 1, seed=3)
        result = await c.receive_session(timeout=120)
    first = result.arrivals[0] - t0 if result.arrivals else None
    for ws in silent:
        await ws.close()
    return {"silent": 200, "upgrades_failed": refused, "answered": codes,
            "keyed_first_chunk_s": first, "keyed_error": result.error}


async def main_async(args) -> dict:
    out: dict = {}
    attacks = args.attacks.split(",")
    if "waiting" in attacks:
        out["waiting"] = await flood_waiting(args.seconds)
        print(json.dumps(out["waiting"]), flush=True)
        await asyncio.sleep(3)
    if "decode" in attacks:
        base = await decode_run(args.seconds, attack=False)
        hit = await decode_run(args.seconds, attack=True)
        out["decode"] = {"without": base, "with": hit,
                         "interval_ratio": hit["interval_median_s"] / base["interval_median_s"],
                         "healthz_p99_ratio": hit["healthz_p99_s"] / base["healthz_p99_s"]}
        print(json.dumps(out["decode"]), flush=True)
        await asyncio.sleep(3)
    if "door" in attacks:
        out["door"] = await door_run()
        print(json.dumps(out["door"]), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.abuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="each flood's length (default %(default)s)")
    ap.add_argument("--attacks", default="waiting,decode,door")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    ensure_serve(PORT, app_args=SETTINGS)
    from ray import serve

    from deployments.app import build_app
    serve.run(build_app(SETTINGS), name="lingbot", route_prefix="/")
    print(f"group ready in {wait_for_groups(1):.1f} s", flush=True)
    out = asyncio.run(main_async(args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
