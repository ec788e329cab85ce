"""Worlds that last: what does saving a world cost, and how long until a resumed world plays again?

On a local Serve app of the embedded default (tiny, CPU, SP-2, one group; worlds in a temporary folder), unpaced
sessions (each chunk as soon as it is made) of the first protocol: a fresh start's time to its first chunk and
its steady chunk time, then per world length K (chunks): a session saves its world after K chunks (the save's
latency, from session.save sent to session.saved read, and the world's bytes on disk: journal, first frame and the
snapshot of its newest restore point), and new sessions resume it, `--resumes` times one after the other, from
its snapshot and (the same world without it, as a deployment with max_world_snapshot_bytes 0 saves it) by
replaying its journal: the time to the first new chunk, and the chunks restored and replayed (the median resume
of each). Beside it, modelled for the real presets at 832x480 (lingbot/runtime/snapshot_budget.py): a
world's bytes as saved today (journal and first frame) and what a snapshot of its K/V window, decoder caches and
latent ring would add, per SP degree.

    python -m perf.worlds [--lengths 2,6,12] [--resumes 3] [--output-json F]

Traffic stays on the loopback address."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from perf.local import ensure_serve, first_frame_png, wait_for_groups

PORT = 18815
JOURNAL_BYTES_PER_CHUNK = 120          # a chunk's controls in the journal's JSON, measured below (about)


def settings(worlds_dir: str) -> dict:
    return {"preset": "tiny", "device": "cpu", "sp": 2, "min_groups": 1, "max_groups": 1, "max_sessions_per_group": 2,
            "worlds_dir": worlds_dir, "max_sessions_per_key": 0, "max_starts_per_minute_per_key": 0}


async def _read(client, until: str, chunks: list) -> dict:
    """Messages until one of type `until` (chunk metadata noted with its arrival time in `chunks`)."""
    while True:
        msg = await asyncio.wait_for(client.ws.recv(), 600)
        if isinstance(msg, bytes):
            continue
        body = json.loads(msg)
        if body["type"] == "video.chunk_metadata":
            chunks.append((time.monotonic(), body["generation_chunk_index"]))
        if body["type"] == "error":
            raise RuntimeError(f"the server refused: {body}")
        if body["type"] == until:
            return body


async def saved_world(length: int) -> dict:
    """A fresh unpaced session saving its world after `length` chunks: its chunk times, the save's latency."""
    from deployments.client import RealtimeClient, image_data_url
    async with RealtimeClient(f"ws://127.0.0.1:{PORT}/v1/realtime/video") as client:
        t0 = time.monotonic()
        await client.start("a forest path", image_data_url(first_frame_png(), "image/png"), 112, 64, None, seed=1,
                           realtime_output_pacing=False)
        chunks: list = []
        while len(chunks) < length:
            await _read(client, "video.chunk_metadata", chunks)
        sent = time.monotonic()
        await client.save()
        answer = await _read(client, "session.saved", chunks)
        latency = time.monotonic() - sent
        await client.send({"type": "session.stop"})
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(chunks[1:])]     # steady: after the first two chunks
    return {"first_s": chunks[0][0] - t0, "chunk_s": statistics.median(gaps) if gaps else None,
            "save_s": latency, "world_id": answer["world_id"], "chunks": answer["chunk_index"] + 1}


async def resumed_world(world_id: str) -> dict:
    from deployments.client import RealtimeClient
    async with RealtimeClient(f"ws://127.0.0.1:{PORT}/v1/realtime/video") as client:
        t0 = time.monotonic()
        await client.resume_world(world_id, 1, realtime_output_pacing=False)
        chunks: list = []
        resumed = await _read(client, "session.resumed", chunks)
        await _read(client, "video.chunk_metadata", chunks)
        first = time.monotonic() - t0
        await _read(client, "session.done", chunks)
    return {"first_s": first, "replay_s": resumed["replay_s"], "replayed": resumed["replayed_chunks"],
            "restored": resumed["restored_chunks"]}


def without_snapshot(folder: Path, world_id: str) -> str:
    """A copy of the world without its snapshot, under a new id (as a deployment keeping none saves it)."""
    import hashlib
    import secrets
    twin = secrets.token_hex(16)
    body = json.loads((folder / f"{world_id}.json").read_bytes())
    raw = json.dumps({**body, "id": twin}).encode()
    (folder / f"{twin}.frame").write_bytes((folder / f"{world_id}.frame").read_bytes())
    (folder / f"{twin}.json").write_bytes(raw)
    meta = json.loads((folder / f"{world_id}.meta.json").read_bytes())
    meta.update(id=twin, sha256=hashlib.sha256(raw).hexdigest(), snapshot=None)
    (folder / f"{twin}.meta.json").write_text(json.dumps(meta))
    return twin


def world_bytes(folder: Path, world_id: str) -> dict:
    return {f.name.split(".", 1)[1]: f.stat().st_size for f in folder.glob(f"{world_id}.*")}


def modelled(chunks: tuple[int, ...] = (100, 1000)) -> list[dict]:
    """The real presets' worlds at 832x480: as saved today (journal and first frame), and with a snapshot of
    what a continuation needs (every rank's K/V slots it attends and its state: snapshot_budget's `held`)."""
    from lingbot.config import get_preset
    from lingbot.runtime.snapshot_budget import snapshot_footprint
    rows = []
    for name in ("lingbot-world-v2-14b",):
        preset = get_preset(name)
        frame = 3 * preset.height * preset.width * 4
        for sp in (1, 4, 8):
            snap = sum(snapshot_footprint(preset, sp, r, decoders=("tae", "wan")).held for r in range(sp))
            for n in chunks:
                rows.append({"preset": name, "sp": sp, "chunks": n, "journal_bytes": frame
                             + n * JOURNAL_BYTES_PER_CHUNK, "snapshot_bytes": snap})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2,6,12", help="world lengths (chunks) to save and resume")
    ap.add_argument("--resumes", type=int, default=3, help="resumes of each world (the median is shown)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    from ray import serve

    from deployments.app import build_app
    folder = Path(tempfile.mkdtemp(prefix="lingbot-perf-worlds-"))
    s = settings(str(folder))
    print("starting Ray and the app ...", file=sys.stderr, flush=True)
    ensure_serve(PORT, app_args=s)
    serve.run(build_app(s), name="lingbot", route_prefix="/")
    wait_for_groups(1)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        print(f"a world of {length} chunks: save, resume ...", file=sys.stderr, flush=True)
        saved = asyncio.run(saved_world(length))
        bare = without_snapshot(folder, saved["world_id"])
        resumes = [asyncio.run(resumed_world(saved["world_id"])) for _ in range(args.resumes)]
        replays = [asyncio.run(resumed_world(bare)) for _ in range(args.resumes)]
        rows.append({**saved, "bytes": world_bytes(folder, saved["world_id"]), "resumes": resumes,
                     "replays": replays})
    serve.shutdown()
    out = {"measured": rows, "modelled": modelled()}
    print(table(out))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def median_resume(resumes: list[dict]) -> dict:
    """The resume of median time to its first chunk."""
    return sorted(resumes, key=lambda r: r["first_s"])[len(resumes) // 2]


def table(out: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"
    lines = ["| world (chunks) | fresh first chunk ms | steady chunk ms | save ms | bytes: journal / frame / snapshot "
             "| resume from the snapshot: first chunk ms (restored + replayed) | by replaying the journal: first "
             "chunk ms (replayed) | a replayed chunk / a steady one |",
             "|---:|---:|---:|---:|---|---|---|---:|"]
    for r in out["measured"]:
        b, snap, replay = r["bytes"], median_resume(r["resumes"]), median_resume(r["replays"])
        per = replay["replay_s"] / replay["replayed"] if replay["replayed"] else None
        ratio = "-" if per is None or not r["chunk_s"] else f"{per / r['chunk_s']:.2f}"
        lines.append(f"| {r['chunks']} | {ms(r['first_s'])} | {ms(r['chunk_s'])} | {ms(r['save_s'])} | "
                     f"{b.get('json', 0)} / {b.get('frame', 0)} / {b.get('snap', 0)} | {ms(snap['first_s'])} "
                     f"({snap['restored']} + {snap['replayed']}) | {ms(replay['first_s'])} ({replay['replayed']}) | "
                     f"{ratio} |")
    lines += ["", "| preset | SP | chunks | saved today (journal + frame) | a K/V snapshot would add |",
              "|---|---:|---:|---:|---:|"]
    for m in out["modelled"]:
        lines.append(f"| {m['preset']} | {m['sp']} | {m['chunks']} | {m['journal_bytes'] / 2 ** 20:.1f} MiB | "
                     f"{m['snapshot_bytes'] / 2 ** 30:.1f} GiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
