"""Soak and chaos on a local Serve app of the embedded default (tiny, CPU, SP-2, one group of 2 sessions).

Soak: sessions back to back at the group's capacity for `--minutes`, each one of a few fixed inputs (image,
prompt, seed, key script) over the second protocol (raw frames); the resident memory of every actor
(ingress, group replica, ranks, muxer, mailbox, snapshot keeper) is sampled every few seconds. Chaos: the
same load while a random rank or the muxer of the group is killed every `--chaos-interval` seconds; the
sessions resume on the rebuilt group.

A start refused with 1013 (no group free while one is rebuilt) is retried after 2 s, as a client would, and
counted apart. Checked and reported: every session that started completes with every chunk, in order, and
its raw frames are bitwise
those of the same inputs without a fault (one reference session per input, run first); no session leaks
(`live_sessions` is 0 after); memory after warm-up is flat (the growth of each actor role's unique resident
memory, USS, between the first and the last third of the run).

    python -m perf.soak [--minutes 10] [--chaos-interval 0] [--plot perf/results/soak.png] [--output-json F]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import urllib.request
from typing import Optional

PORT = 18805
INPUTS = [dict(seed=1, actions=[["w"], ["w"], ["j"], [], ["d"], ["l"]] * 4),
          dict(seed=2, actions=[["a"], ["i"], ["s"], ["k"], [], ["w"]] * 4)]


def start_app(settings: dict) -> None:
    from ray import serve

    from deployments.app import build_app
    from perf.local import ensure_serve
    ensure_serve(PORT)
    serve.run(build_app(settings), name="soak", route_prefix="/")


def actor_processes(app: str = "soak", started_only: bool = False) -> dict[str, list[int]]:
    """Role -> pids of the live actors of Serve app `app` on this machine (its replicas and what they own).
    With `started_only`, a group's actors count only once its start-up is over (it owns its muxer, made after
    its ranks joined): a group killed while it starts is no fault of a serving group."""
    from ray._private import state
    actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
    replicas = {f"ServeReplica:{app}:Ingress": "ingress", f"ServeReplica:{app}:WorldGroup": "group"}
    roles = {"RankWorker": "rank", "Muxer": "muxer", "ControlMailbox": "mailbox", "SnapshotKeeper": "keeper",
             "WatchPost": "post"}
    owners = {a["Address"]["Port"] for a in actors if a["ActorClassName"] in replicas}
    if started_only:
        owners = {a["OwnerAddress"]["Port"] for a in actors
                  if a["ActorClassName"] == "Muxer" and a["OwnerAddress"]["Port"] in owners}
    out: dict[str, list[int]] = {}
    for a in actors:
        role = replicas.get(a["ActorClassName"])
        if role is None and a["OwnerAddress"]["Port"] in owners:
            role = roles.get(a["ActorClassName"])
        if role:
            out.setdefault(role, []).append(a["Pid"])
    return out


class Sampler(threading.Thread):
    """Memory per actor role (summed over its processes), every `period` seconds: the unique set size (the
    resident memory only that process holds: what leaks; resident pages of the shared object store, which
    every process that wrote to it maps, are left out)."""

    def __init__(self, app: str = "soak", period: float = 2.0):
        super().__init__(daemon=True)
        self.app = app
        self.period = period
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        import psutil
        t0 = time.monotonic()
        while not self.halt.wait(self.period):
            rss = {}
            for role, pids in actor_processes(self.app).items():
                total = 0
                for pid in pids:
                    try:
                        total += psutil.Process(pid).memory_full_info().uss
                    except psutil.Error:
                        pass
                rss[role] = total
            self.samples.append((time.monotonic() - t0, rss))


async def run_session(url: str, image: bytes, inputs: dict, chunks: int, api_key=None):
    from deployments.client import FramesClient
    async with FramesClient(url, api_key=api_key) as client:
        await client.init("a quiet street", image, chunks, inputs["seed"], actions=inputs["actions"])
        return await client.receive_session(timeout=600)


def chaos(stop: threading.Event, interval: float, kills: list, rng: random.Random, app: str = "soak",
          max_kills: Optional[int] = None) -> None:
    """Every `interval` s, SIGKILL a random rank or the muxer of a group that has started (a group still starting
    is left alone: with a start as long as the interval, killing each new group before it serves would be a
    test of Serve's restarts, not of sessions surviving a serving group's fault); at most `max_kills` (None: no
    limit)."""
    while (max_kills is None or len(kills) < max_kills) and not stop.wait(interval):
        procs = actor_processes(app, started_only=True)
        victims = [("rank", p) for p in procs.get("rank", [])] + [("muxer", p) for p in procs.get("muxer", [])]
        if victims:
            role, pid = rng.choice(victims)
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append((time.monotonic(), role))
            except ProcessLookupError:
                pass


def growth(samples, role: str) -> float:
    """Resident memory of `role`: mean of the last third of the run minus the mean of the first third
    after warm-up (the first quarter is warm-up), in MiB."""
    series = [(t, rss[role]) for t, rss in samples if rss.get(role)]
    if len(series) < 8:
        return float("nan")
    series = series[len(series) // 4:]
    third = max(1, len(series) // 3)
    return (statistics.mean(v for _, v in series[-third:]) - statistics.mean(v for _, v in series[:third])) / 2 ** 20


def slope(samples, role: str, after_s: float = 180.0) -> float:
    """Resident memory of `role` in MiB per minute: the least-squares line through its samples after the first
    `after_s` seconds (start-up and warm-up); NaN with fewer than 8 such samples."""
    series = [(t / 60, rss[role] / 2 ** 20) for t, rss in samples if t >= after_s and rss.get(role)]
    if len(series) < 8:
        return float("nan")
    return statistics.linear_regression(*zip(*series)).slope


async def soak(url: str, image: bytes, minutes: float, capacity: int, chunks: int, references: dict,
               api_key=None, min_sessions: int = 0, overtime_s: float = 300.0) -> dict:
    """Sessions `capacity` at a time for `minutes`, and on past the deadline until `min_sessions` have been
    started (a short soak on a slow machine still sees the sessions it asserts on), for at most `overtime_s`."""
    import numpy as np
    deadline = time.monotonic() + minutes * 60
    started = 0
    report = {"sessions": 0, "chunks": 0, "incomplete": 0, "mismatched": 0, "resumed": 0, "errors": [],
              "refused_at_start": 0}

    async def worker(slot: int) -> None:
        nonlocal started
        n = 0
        while time.monotonic() < deadline or (started < min_sessions and time.monotonic() < deadline + overtime_s):
            inputs = INPUTS[(slot + n) % len(INPUTS)]
            n += 1
            started += 1
            result = await run_session(url, image, inputs, chunks, api_key)
            if result.close_code == 1013 and not result.chunks:   # no group free (one is being rebuilt): again
                report["refused_at_start"] += 1
                started -= 1
                await asyncio.sleep(2.0)
                continue
            report["sessions"] += 1
            report["chunks"] += len(result.chunks)
            report["resumed"] += sum(1 for m in result.messages if m["type"] == "session_resumed")
            if result.errors or result.close_code != 1000 or [c.index for c in result.chunks] != list(range(chunks)):
                report["incomplete"] += 1
                report["errors"] += [e.get("code") for e in result.errors] or [f"close {result.close_code}"]
                continue
            if not np.array_equal(result.frames, references[inputs["seed"]]):
                report["mismatched"] += 1
    await asyncio.gather(*[worker(i) for i in range(capacity)])
    return report


def live_sessions(base: str = f"http://127.0.0.1:{PORT}") -> int:
    with urllib.request.urlopen(f"{base}/healthz", timeout=10) as r:
        return json.loads(r.read())["live_sessions"]


def census(app: str = "soak") -> dict:
    """What the app's ingress and group hold once its sessions are over (their `census`): every per-session
    count 0, and the keeper owning no snapshot anyone still holds."""
    from ray import serve
    return {role: serve.get_deployment_handle(name, app).census.remote().result(timeout_s=60)
            for role, name in (("ingress", "Ingress"), ("group", "WorldGroup"))}


def plot(samples, kills, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    roles = sorted({r for _, rss in samples for r in rss})
    for role in roles:
        ax.plot([t / 60 for t, _ in samples], [rss.get(role, 0) / 2 ** 20 for _, rss in samples], label=role)
    t0 = time.monotonic() - samples[-1][0] if samples else 0
    for at, _role in kills:
        ax.axvline((at - t0) / 60, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("minutes")
    ax.set_ylabel("unique resident memory, MiB (all processes of the role)")
    ax.set_title(("chaos" if kills else "soak") + ": memory per actor role" + (" (dotted: a process killed)" if kills
                                                                               else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--chunks", type=int, default=8, help="chunks per session")
    ap.add_argument("--chaos-interval", type=float, default=0.0, help="seconds between kills (0: no chaos)")
    ap.add_argument("--seed", type=int, default=0, help="the chaos's choice of victims")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)

    from perf.local import first_frame_png
    image = first_frame_png()
    capacity = 2
    start_app(dict(preset="tiny", device="cpu", sp=2, min_groups=1, max_groups=1, max_sessions_per_group=capacity,
                   resume_wait_s=300, max_resumes=20, fps=48.0, max_starts_per_minute_per_key=0))
    url = f"ws://127.0.0.1:{PORT}/v1/realtime_video/generate"
    print("reference sessions (no faults) ...", file=sys.stderr)
    references = {i["seed"]: asyncio.run(run_session(url, image, i, args.chunks)).frames for i in INPUTS}
    sampler = Sampler()
    sampler.start()
    stop, kills = threading.Event(), []
    if args.chaos_interval > 0:
        threading.Thread(target=chaos, args=(stop, args.chaos_interval, kills, random.Random(args.seed)),
                         daemon=True).start()
    print(f"{'chaos' if args.chaos_interval else 'soak'} for {args.minutes:g} min ...", file=sys.stderr)
    report = asyncio.run(soak(url, image, args.minutes, capacity, args.chunks, references))
    stop.set()
    time.sleep(3)
    sampler.halt.set()
    report["live_sessions_after"] = live_sessions()
    report["census_after"] = census()
    report["kills"] = [role for _, role in kills]
    report["growth_mib"] = {role: round(growth(sampler.samples, role), 2)
                            for role in sorted({r for _, rss in sampler.samples for r in rss})}
    report["slope_mib_per_min"] = {role: round(slope(sampler.samples, role), 3) for role in report["growth_mib"]}
    report["samples"] = [(round(t, 1), rss) for t, rss in sampler.samples]
    if args.plot:
        plot(sampler.samples, kills, args.plot)
    from ray import serve
    serve.shutdown()
    print(f"{'chaos' if args.chaos_interval else 'soak'}: {args.minutes:g} min, {report['sessions']} sessions, "
          f"{report['chunks']} chunks, {len(kills)} processes killed, {report['resumed']} resumes")
    print(f"  incomplete sessions {report['incomplete']}, frames not bitwise the reference {report['mismatched']}, "
          f"live sessions after {report['live_sessions_after']}, starts refused (1013, retried) "
          f"{report['refused_at_start']}")
    print("  unique resident memory after warm-up, per role: slope after minute 3 (least squares), MiB per minute; "
          "growth (last third - first third), MiB")
    for role, growth_mib in report["growth_mib"].items():
        print(f"    {role:8s} slope {report['slope_mib_per_min'][role]:+7.3f} MiB/min   growth {growth_mib:+7.1f} MiB")
    print(f"  held after the run (per-session counts, object references): {json.dumps(report['census_after'])}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
