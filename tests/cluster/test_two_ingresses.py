"""A shared session watched at two ingress replicas, on a Ray cluster of this module's own (`ray start` on ports
no other module uses: it runs beside the package app) serving the app with `min_ingress_replicas` =
`max_ingress_replicas` = 2 behind one Serve proxy, which routes each WebSocket to the replica holding fewer.

The owner's session is on one replica; its viewers land on both (each replica's `lingbot_viewers` gauge shows
them), and those at the other replica watch through its relay (one subscription at the owner's replica's post):
every viewer gets the owner's own fragments, byte for byte, from a keyframe to the end. The session's bound on
viewers holds over both replicas (a fourth viewer is refused wherever it lands), and the owner is shown the viewers
of both."""
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deployments.client import RealtimeClient
from deployments.local import cluster_env
from lingbot.io.video import fragment_starts_with_keyframe, split_init_segment
from tests.cluster.processes import TOKEN_ENV, kill_cluster, ray_cli, start_head
from tests.deployments.clients import H, W, fragments, png_url, refused, run, until
from tests.deployments.observe import scrape
from tests.waits import async_wait_until

ROOT = Path(__file__).resolve().parents[2]
# above Ray's default worker port range (10002-19999) and apart from test_multinode's
GCS_PORT, AGENT_PORT, METRICS_PORT, PROXY = 26579, 28366, 28367, 28960
BASE = f"ws://127.0.0.1:{PROXY}"
SETTINGS = dict(preset="tiny", device="cpu", sp=2, max_sessions_per_group=2, min_groups=1, max_groups=1,
                min_ingress_replicas=2, max_ingress_replicas=2, decoder="tae", max_viewers_per_session=3,
                start_timeout_s=5, retry_after_s=7, stall_timeout_s=8, graceful_shutdown_timeout_s=5,
                max_sessions_per_key=0, max_starts_per_minute_per_key=0)


@pytest.fixture(scope="module")
def two_ingresses():
    temp_dir = Path("/tmp") / f"lingbot-2i-{os.getpid()}"            # short: Ray's socket paths have a limit
    ray_cli("get-auth-token", "--generate")
    try:
        start_head(temp_dir, GCS_PORT, "--num-cpus=2", "--include-dashboard=false",
                   f"--dashboard-agent-listen-port={AGENT_PORT}", f"--metrics-export-port={METRICS_PORT}",
                   "--object-store-memory=200000000", "--disable-usage-stats",
                   f"--system-config={json.dumps({'metrics_report_interval_ms': 2000})}",
                   env={**os.environ, **cluster_env(SETTINGS)})
        driver = ("import ray; from ray import serve; from deployments.app import build_app; "
                  f"ray.init(address='127.0.0.1:{GCS_PORT}', log_to_driver=False); "
                  f"serve.start(http_options={{'host': '127.0.0.1', 'port': {PROXY}}}); "
                  f"serve.run(build_app({SETTINGS!r}), name='lingbot', route_prefix='/')")
        done = subprocess.run([sys.executable, "-c", driver], env={**os.environ, **TOKEN_ENV}, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        deadline, ready = time.monotonic() + 120, False
        while not ready and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PROXY}/readyz", timeout=5) as r:
                    ready = json.loads(r.read())["ready"]
            except OSError:
                time.sleep(1)
        assert ready, "the app did not become ready"
        yield
    finally:
        kill_cluster(temp_dir, GCS_PORT)
        shutil.rmtree(temp_dir, ignore_errors=True)


def viewers_by_replica() -> list[float]:
    """Each ingress replica's `lingbot_viewers` (its process's series), as Ray last exported them."""
    return sorted(v for (name, labels), v in scrape(METRICS_PORT).items() if name == "lingbot_viewers")


def test_viewers_at_both_replicas_get_the_owners_fragments_and_the_sessions_bound_holds_over_both(two_ingresses):
    chunks = 12

    async def scenario():
        async with RealtimeClient(f"{BASE}/v1/realtime/video") as owner:
            await owner.start("a forest path", png_url(), W, H, chunks, seed=4, spectators=True)
            await until(owner, "video.start")
            shared = await until(owner, "session.shared")
            url = BASE + shared["watch_url"]
            viewers = [RealtimeClient(url) for _ in range(3)]
            for viewer in viewers:
                await viewer.__aenter__()
            watching = [asyncio.create_task(v.receive_session(timeout=180)) for v in viewers]
            spread: list = []

            async def on_both_replicas():
                spread[:] = await asyncio.to_thread(viewers_by_replica)
                return sum(spread) == 3 and len([n for n in spread if n]) == 2
            await async_wait_until(on_both_replicas, 60, "the viewers to show at both ingress replicas",
                                   interval_s=0.5)
            too_many = await refused(url)
            owned = await owner.receive_session(timeout=180)
            results = await asyncio.gather(*watching)
            for viewer in viewers:
                await viewer.__aexit__(None, None, None)
            return owned, results, spread, too_many

    owned, results, spread, too_many = run(scenario())
    assert owned.error is None and owned.done == {"type": "session.done", "chunks": chunks, "stopped": False}
    assert sorted(spread) in ([1, 2], [1.0, 2.0])                          # 2 at one replica, 1 at the other
    assert too_many[0]["code"] == "too_many_viewers" and too_many[1] == 1013
    told = [m["viewers"] for m in owned.messages if m["type"] == "session.shared"]
    assert 3 in told, told                                                 # the owner counts both replicas'
    init, own = split_init_segment(owned.data[0])[0], fragments(owned)
    for result in results:
        assert result.error is None and result.close_code == 1000, (result.error, result.close_code)
        assert result.init == init
        got = fragments(result)
        first = min(got)
        assert sorted(got) == list(range(first, chunks)) and fragment_starts_with_keyframe(got[first])
        assert all(got[k] == own[k] for k in got)                          # the owner's bytes, byte for byte
        assert result.done == {"type": "session.done", "chunks": chunks, "stopped": False}
