"""The served app's Prometheus metrics: the counters move by exactly what happened, and every series the Grafana
dashboard (cluster/grafana) queries is exported."""
import asyncio
import json
import urllib.error
import urllib.request

from deployments.client import FramesClient
from tests.deployments.clients import expect_error, frames_url, png, run, session, stalled_viewer
from tests.deployments.observe import metric, scrape, settled


def test_metrics_count_what_happened(serve_app):
    """Ray exports recorded metrics on the node's endpoint every METRICS_INTERVAL_MS: wait until the counters
    are settled, run one 3-chunk session and one bad message, then the counters move by exactly that."""
    import time

    from tests.deployments.conftest import METRICS_INTERVAL_MS, METRICS_PORT
    watched = [("lingbot_sessions_total", {"component": "ingress"}),
               ("lingbot_refusals_total", {"code": "invalid_json"}),
               ("lingbot_chunk_interval_seconds_count", {"group": "all"}),
               ("lingbot_stage_seconds_count", {"stage": "decode"}),
               ("lingbot_stage_seconds_count", {"stage": "probe_0"}),
               ("lingbot_chunks_total", {"quality": "full"})]

    def read():
        values = scrape(METRICS_PORT)
        return [metric(values, name, **labels) for name, labels in watched], values

    before = settled(lambda: read()[0], METRICS_INTERVAL_MS / 1000 + 1, 120,     # nothing in flight
                     "the counters to settle: two exports in a row alike")
    result = run(session(serve_app, 3))
    assert result.error is None
    run(expect_error(serve_app, ["{not json"], "invalid_json"))
    expected = [b + d for b, d in zip(before, [1, 1, 2, 3, 3, 3])]    # 3 chunks: 2 intervals, 3 decodes
    deadline = time.monotonic() + 60
    after, values = read()
    while after != expected and time.monotonic() < deadline:
        time.sleep(1)
        after, values = read()
    assert after == expected, dict(zip([n for n, _ in watched], zip(before, after)))
    assert metric(values, "lingbot_active_sessions") == 0        # every session has ended
    for rank in ("0", "1"):                                       # each CPU rank reports its own process
        assert metric(values, "lingbot_rank_device_memory_bytes", rank=rank) > 50 * 2 ** 20, rank
    assert any(n == "lingbot_video_rtf" and v > 0 for (n, _), v in values.items())


def test_grafana_dashboard_queries_only_exported_metrics(serve_app):
    """Every series the dashboard (cluster/grafana) queries is on a running app's metrics endpoint once the app did
    what each one counts: a recorded 120 fps session (it outruns the tiny model, so stalls are counted too), a bad
    message, and a viewer that stops reading an endless shared session of raw frames until it was skipped."""
    import re
    import time
    from pathlib import Path

    from tests.deployments.conftest import METRICS_PORT
    dashboard = json.loads((Path(__file__).parents[2] / "cluster/grafana/lingbot-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b(ray_lingbot_\w+)", target["expr"])}
    assert len(queried) >= 14
    assert run(session(serve_app, 3, fps=120, record=True)).done["chunks"] == 3
    run(expect_error(serve_app, ["{not json"], "invalid_json"))

    async def skipped_viewer():
        async with FramesClient(frames_url(serve_app)) as owner:
            await owner.init("a forest path", png(), None, 3, fps=120.0, spectators=True, decoder="tae")
            viewer = []

            async def on_chunk(result, chunk):
                shared = [m for m in result.messages if m["type"] == "shared"]
                if shared and not viewer:
                    viewer.append(await stalled_viewer(serve_app.split("/v1/")[0] + shared[0]["watch_url"]))
                skips = metric(await asyncio.to_thread(scrape, METRICS_PORT), "lingbot_viewer_skips_total")
                if skips >= 1 or len(result.chunks) >= 150:
                    await owner.ws.close()                  # the owner leaves: its endless session ends
            owned = await owner.receive_session(on_chunk, timeout=300)
            await viewer[0].close()
            return len(owned.chunks)
    chunks = run(skipped_viewer())
    assert chunks < 150, "the viewer that stopped reading was never skipped"
    exported: set = set()
    deadline = time.monotonic() + 60
    while not queried <= exported and time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
            exported.update(line.split("{")[0].split(" ")[0] for line in r.read().decode().splitlines()
                            if line and not line.startswith("#"))
        time.sleep(0 if queried <= exported else 2)
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
