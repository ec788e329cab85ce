"""`make serve`'s command, `python -m deployments.local`, as a new user runs it on the embedded default (only the
port changed): it prints one line with the URL once the first model group is ready (not Serve's access lines),
the page it points to works and says the weights are random, a burst of 4 sessions (twice one group's capacity)
is served whole while the autoscaler adds the second group, and Ctrl-C stops it."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from deployments.client import RealtimeClient
from tests.deployments.clients import H, W, png_url

ROOT = Path(__file__).resolve().parents[2]
PORT = 18890
# 117 frames each, 7.3 s of video at the default 16 fps: the sessions paced to it keep the first group full while
# the autoscaler looks (sessions of 2 chunks ended before it asked, once a tiny chunk took ~0.2 s)
BURST_CHUNKS = 10


def test_make_serve_prints_the_url_when_ready_and_stops_on_ctrl_c(tmp_path):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": PORT}
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.local", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launched = time.monotonic()
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if "lingbot-serve is ready" in line:
                break
        ready = [line for line in lines if "lingbot-serve is ready" in line]
        assert ready, "\n".join(lines[-30:])
        took = time.monotonic() - launched               # Ray, Serve and the first group, as seen from here
        said = int(re.search(r"is ready \((\d+) s\)", ready[0]).group(1))
        assert took / 2 <= said <= took + 1, (said, took)  # the whole start, not only the wait for /readyz
        assert f"open http://127.0.0.1:{PORT}/ in a browser" in ready[0]
        assert not [line for line in lines if "WARNING: listening on" in line]    # loopback: nothing to warn of
        assert f"ws://127.0.0.1:{PORT}/v1/realtime/video" in ready[0]
        args = config["applications"][0]["args"]
        assert (args["max_groups"], args["max_sessions_per_group"], args["admission_wait_s"]) == (2, 2, 0)
        results, asked_s = asyncio.run(burst(4))         # first: nothing asked the groups anything before
        print(f"the second group was being added {asked_s:.1f} s after the burst began")
        assert asked_s < 8, asked_s             # the autoscaler asked for the second group within seconds
        for r in results:                       # every session served whole: none refused
            assert r.error is None and r.done is not None and r.done["chunks"] == BURST_CHUNKS, (r.error,
                                                                                          r.close_code)
        waited = [r for r in results if any(m["type"] == "session.queued" for m in r.messages)]
        assert len(waited) >= 2                 # at least those beyond the first group's capacity waited, told
        for r in waited:                        # their place and an estimate from the first group's measured start
            told = [m for m in r.messages if m["type"] == "session.queued"]
            assert {m["position"] for m in told} <= {1, 2, 3, 4}, told
            assert any(m["eta_s"] is not None and m["eta_s"] >= 1 for m in told), told   # the first start's measure
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/config", timeout=10) as r:
            served = json.loads(r.read())
        assert served["preset"] == "tiny" and served["random_weights"] is True
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/", timeout=10) as r:
            assert b"random weights" in r.read()
        assert not any(" GET /" in line or "WS /" in line for line in lines)    # no access lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    assert proc.returncode == 0, rest[-3000:]
    assert "lingbot-serve: stopping" in rest


async def burst(n: int) -> tuple[list, float]:
    """n sessions of BURST_CHUNKS chunks started at once, each read to its end; and the seconds until Serve was
    adding the second group (/readyz counts the groups running and starting)."""
    async def one(seed: int):
        async with RealtimeClient(f"ws://127.0.0.1:{PORT}/v1/realtime/video") as client:
            await client.start("a street at night", png_url(), W, H, BURST_CHUNKS, seed=seed)
            return await client.receive_session(timeout=400)

    async def second_group(t0: float) -> float:
        while True:
            groups = await asyncio.to_thread(_groups)
            if groups >= 2:
                return time.monotonic() - t0
            await asyncio.sleep(0.5)

    t0 = time.monotonic()
    watch = asyncio.ensure_future(asyncio.wait_for(second_group(t0), 120))
    results = await asyncio.gather(*(one(seed) for seed in range(n)))
    return results, await watch


def _groups() -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/readyz", timeout=10) as r:
        ready = json.loads(r.read())
    return ready["groups"] + ready["starting"]
