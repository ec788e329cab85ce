"""One world, many viewers: what do viewers cost the owner of a shared session, and how far behind it do they see?

On a local Serve app of the embedded default (tiny, CPU, SP-2, one group), one owner session of N chunks at the
served fps, shared at its start, steered by a key interaction every 2 s; meanwhile V viewers watch it
(`WS /v1/realtime/watch/{id}`) from load generator processes of at most 250 viewers each, joining as soon as
the watch id is known. Per V, side by side in one run: the owner's VIDEO_RTF and control-to-display p50
(perf/realtime_metrics.py), each viewer's lag behind the owner (a chunk's fragment at the viewer against the same
chunk at the owner, p50/p99; goal: p99 within one chunk interval), the chunks viewers got and skipped, and the
CPU seconds and memory (USS) of the ingress replica and of Serve's proxy per viewer. With `--slow 10` a row more
runs the largest crowd with 10 viewers that read at half the owner's pace: they fall behind, skip and are cut,
and nobody else moves. With `--ingress-replicas 2` the app runs two ingress replicas (Serve's proxy routes each
WebSocket to the one holding fewer): the owner's session is on one, its viewers on both, those at the other
watching through its relay; a row says how many watched at the owner's replica and how many elsewhere (the owner's
post, half way), and the costs sum both replicas and their posts.

    python -m perf.spectators [--viewers 0,10,100,1000] [--chunks 24] [--slow 10] [--ingress-replicas 1]
                              [--output-json F]

Traffic stays on the loopback address; the viewers come from one address, so the per-address limits are off.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import time

from perf.local import ensure_serve, first_frame_png, wait_for_groups

PORT = 18813
PER_PROCESS = 250           # viewers per load generator process


def settings(viewers: int, replicas: int = 1) -> dict:
    return {"preset": "tiny", "device": "cpu", "sp": 2, "min_groups": 1, "max_groups": 1,
            "min_ingress_replicas": replicas, "max_ingress_replicas": replicas,
            "max_sessions_per_group": 2, "max_viewers_per_session": viewers + 20, "max_viewers": viewers + 20,
            "max_ingress_sessions": viewers + 40, "max_ingress_connections": max(1024, viewers + 100),
            "max_connections_per_address": 0, "max_sessions_per_key": 0,
            "max_starts_per_minute_per_key": 0, "spectators_need_key": False}


# ---- the viewers (in load generator processes) ----------------------------------------------------
async def _viewer(url: str, slow_s: float, out: list) -> None:
    """One viewer: the wall time each chunk's fragment arrived, by generation index; a slow one sleeps `slow_s`
    after each fragment. Ends at session.done or the close."""
    import websockets
    arrivals, meta, end = {}, None, "open"
    try:
        async with websockets.connect(url, compression=None, max_size=2 ** 26, ping_interval=None,
                                      open_timeout=60) as ws:
            async for msg in ws:
                if isinstance(msg, str):
                    body = json.loads(msg)
                    if body["type"] == "video.chunk_metadata":
                        meta = body
                    elif body["type"] == "session.done":
                        end = "done"
                        break
                    elif body["type"] == "error":
                        end = body["code"]
                elif meta is not None:
                    arrivals[meta["generation_chunk_index"]] = time.time()
                    meta = None
                    if slow_s:
                        await asyncio.sleep(slow_s)
    except Exception as e:                      # a cut viewer sees its transport aborted
        end = end if end != "open" else type(e).__name__
    out.append({"arrivals": arrivals, "end": end, "slow": bool(slow_s)})


def _crowd(url: str, normal: int, slow: int, slow_s: float, results) -> None:
    async def all_of_them():
        out: list = []
        await asyncio.gather(*(_viewer(url, 0.0, out) for _ in range(normal)),
                             *(_viewer(url, slow_s, out) for _ in range(slow)))
        return out
    results.put(asyncio.run(all_of_them()))


# ---- the owner -------------------------------------------------------------------------------------
async def owner_session(chunks: int, viewers: int, slow: int, fps: float) -> dict:
    from deployments.client import RealtimeClient, image_data_url
    from perf.realtime_metrics import session_metrics
    from perf.soak import actor_processes
    image = image_data_url(first_frame_png(), "image/png")
    pids = actor_processes("lingbot")
    ctx = multiprocessing.get_context("spawn")
    results, procs = ctx.Queue(), []
    usage_before = process_usage(pids)
    async with RealtimeClient(f"ws://127.0.0.1:{PORT}/v1/realtime/video") as client:
        await client.start("a forest path", image, 112, 64, chunks, seed=1, spectators=True)
        t0 = time.monotonic()
        controls: list = []
        state = {"arrivals": {}}

        async def on_chunk(result, meta):
            state["arrivals"][meta["generation_chunk_index"]] = time.time()
            shared = [m for m in result.messages if m["type"] == "session.shared"]
            if shared and len(result.chunks) == chunks // 2:
                state["where"] = await where_they_watch(shared[0]["watch_id"])
            if shared and not procs and viewers + slow:
                url = f"ws://127.0.0.1:{PORT}{shared[0]['watch_url']}"
                plan, left_slow = [], slow
                for start in range(0, viewers + slow, PER_PROCESS):
                    n = min(PER_PROCESS, viewers + slow - start)
                    s = min(left_slow, n)
                    left_slow -= s
                    plan.append((n - s, s))
                for normal, s in plan:
                    p = ctx.Process(target=_crowd, args=(url, normal, s, 2 * 12 / fps, results), daemon=True)
                    p.start()
                    procs.append(p)
        steer = asyncio.create_task(_controls(client, t0, controls))
        result = await client.receive_session(on_chunk, timeout=600)
        wall = time.monotonic() - t0
        steer.cancel()
    usage_after = process_usage(pids)
    crowd = []
    for _ in procs:
        crowd += await asyncio.to_thread(results.get, True, 120)
    for p in procs:
        p.join(30)
    if result.error is not None:
        raise RuntimeError(f"the owner's session failed: {result.error}")
    chunk_rows = [{"index": m["generation_chunk_index"], "arrival_s": a - t0, "num_frames": m["num_frames"],
                   "byte_length": len(d), "started": m.get("started_event_ids") or []}
                  for m, d, a in zip(result.chunks, result.data, result.arrivals)]
    metrics = session_metrics(chunk_rows, wall, fps, controls=controls)
    row = summarise(viewers, slow, metrics, state["arrivals"], crowd, usage_before, usage_after, 12 / fps)
    return {**row, "where": state.get("where")}


async def where_they_watch(watch_id: str) -> dict:
    """The viewers of `watch_id` at the owner's replica and at the others, as its post counts them."""
    import ray

    from deployments.ingress.relay import NAMESPACE, TAG_CHARS
    post = ray.get_actor(f"post-{watch_id[:TAG_CHARS]}", namespace=NAMESPACE)
    counts = (await post.census.remote()).get(watch_id, {})
    return {"owners_replica": counts.get("local", 0), "elsewhere": counts.get("seats", 0)}


async def _controls(client, t0: float, sent: list) -> None:
    rng, slot = random.Random(7), 0
    while True:
        await asyncio.sleep(max(0.0, t0 + 2.0 * (slot + rng.random()) - time.monotonic()))
        sent.append({"event_id": f"c{slot}", "sent_s": time.monotonic() - t0})
        await client.interact(f"c{slot}", keys=["l"] * 3 if slot % 2 == 0 else ["j"] * 3)
        slot += 1


def process_usage(pids: dict) -> dict:
    """CPU seconds and USS bytes of the ingress replicas (with their watch posts) and Serve's proxy here."""
    import psutil
    from ray._private import state
    proxies = [a["Pid"] for a in state.actors().values()
               if a["State"] == "ALIVE" and a["ActorClassName"] == "ProxyActor"]
    out = {}
    for role, role_pids in (("ingress", pids["ingress"] + pids.get("post", [])), ("proxy", proxies[:1])):
        usage = [(p.cpu_times(), p.memory_full_info().uss) for p in map(psutil.Process, role_pids)]
        if usage:
            out[role] = {"cpu_s": sum(c.user + c.system for c, _ in usage), "uss": sum(u for _, u in usage)}
    return out


def summarise(viewers, slow, metrics, owner_arrivals, crowd, before, after, interval_s) -> dict:
    from lingbot.stats import percentile
    lags = [(t - owner_arrivals[i]) * 1e3 for v in crowd if not v["slow"] for i, t in v["arrivals"].items()
            if i in owner_arrivals]
    normal = [v for v in crowd if not v["slow"]]
    chunks_got = [len(v["arrivals"]) for v in normal]
    cost = {role: {"cpu_s": after[role]["cpu_s"] - before[role]["cpu_s"],      # during the session, owner's included
                   "uss_mib_delta": (after[role]["uss"] - before[role]["uss"]) / 2 ** 20}
            for role in after if role in before}
    return {"viewers": viewers, "slow_viewers": slow, "owner_rtf": metrics["video_rtf"],
            "owner_control_p50_ms": metrics["control_to_display"].get("median_ms"),
            "lag_p50_ms": percentile(lags, 0.5) if lags else None,
            "lag_p99_ms": percentile(lags, 0.99) if lags else None,
            "chunk_interval_ms": interval_s * 1e3,
            "viewer_chunks_min": min(chunks_got) if chunks_got else None,
            "viewer_chunks_max": max(chunks_got) if chunks_got else None,
            "viewers_done": sum(v["end"] == "done" for v in normal),
            "slow_ends": sorted({v["end"] for v in crowd if v["slow"]}), "cost": cost}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--viewers", default="0,10,100,1000")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--slow", type=int, default=10, help="slow viewers in a last row beside the largest crowd")
    ap.add_argument("--ingress-replicas", type=int, default=1)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    from ray import serve

    from deployments.app import build_app
    crowds = [int(x) for x in args.viewers.split(",")]
    rows_plan = [(v, 0) for v in crowds] + ([(max(crowds), args.slow)] if args.slow else [])
    s = settings(max(crowds) + args.slow, args.ingress_replicas)
    print("starting Ray and the app ...", file=sys.stderr, flush=True)
    ensure_serve(PORT, app_args=s)
    serve.run(build_app(s), name="lingbot", route_prefix="/")
    wait_for_groups(1)
    from deployments.settings import ServeSettings
    fps = ServeSettings(**s).fps
    rows = []
    for viewers, slow in rows_plan:
        print(f"{viewers} viewers, {slow} slow: a {args.chunks}-chunk session ...", file=sys.stderr, flush=True)
        time.sleep(3)                            # the previous row's viewers gone
        rows.append({**asyncio.run(owner_session(args.chunks, viewers, slow, fps)),
                     "ingress_replicas": args.ingress_replicas})
    serve.shutdown()
    print(table(rows))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def table(rows: list) -> str:
    base = rows[0]

    def ms(v):
        return "-" if v is None else f"{v:.0f}"
    lines = ["| viewers (slow) | owner RTF | vs the first row | owner control p50 ms | viewer lag p50 / p99 ms "
             "(chunk interval) | chunks per viewer | viewers done | slow viewers' end | ingress CPU ms / viewer "
             "| proxy CPU ms / viewer | ingress USS +MiB | ingress replicas: watching at the owner's / elsewhere |",
             "|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|---|"]
    def per_viewer(r, role):
        """CPU ms per viewer: the session's CPU seconds beyond the row without viewers', per viewer."""
        n = r["viewers"] + r["slow_viewers"]
        if not n or role not in r["cost"] or role not in base["cost"]:
            return "-"
        return f"{(r['cost'][role]['cpu_s'] - base['cost'][role]['cpu_s']) / n * 1e3:.1f}"
    def where(r):
        w = r.get("where")
        return f"{r.get('ingress_replicas', 1)}: " + ("-" if not w else f"{w['owners_replica']} / {w['elsewhere']}")
    for r in rows:
        cost = r["cost"]
        lines.append(
            f"| {r['viewers']} ({r['slow_viewers']}) | {r['owner_rtf']:.3f} | {r['owner_rtf'] / base['owner_rtf']:.3f} "
            f"| {ms(r['owner_control_p50_ms'])} | {ms(r['lag_p50_ms'])} / {ms(r['lag_p99_ms'])} "
            f"({r['chunk_interval_ms']:.0f}) | {r['viewer_chunks_min']}-{r['viewer_chunks_max']} | "
            f"{r['viewers_done']} | {', '.join(r['slow_ends']) or '-'} | "
            f"{per_viewer(r, 'ingress')} | {per_viewer(r, 'proxy')} | "
            f"{cost.get('ingress', {}).get('uss_mib_delta', 0):.1f} | {where(r)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
