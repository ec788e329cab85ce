"""Multi-node behaviour on a real multi-node Ray cluster on this machine: a head (no CPUs for work, the
dashboard for `serve deploy`) and two worker nodes started by `ray start`, each its own raylet with its own
resources (1 CPU: one group of tiny SP-2 fits a node, two do not), and its own Serve proxy port
(RAY_SERVE_WORKER_PROXY_HTTP_PORT: on one machine the proxies of different nodes cannot share a port).

The app is brought up with `serve deploy` of serve_config.yaml (test settings layered on it). It checks
that each group's ranks and muxer share one node (STRICT_PACK) and the two groups sit on different nodes,
that a client on every node's proxy reaches sessions on both groups, and that removing a worker node
mid-session ends only that node's session while the app keeps serving new ones. The cluster runs under Ray's
token authentication, as cluster/README.md starts one by hand: every `ray` and `serve` command with
RAY_AUTH_MODE=token and the token in ~/.ray/auth_token (made first if missing)."""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import psutil
import pytest
import yaml

from deployments.client import RealtimeClient
from deployments.local import TOKEN_FILE, cluster_env
from tests.cluster import processes
from tests.cluster.processes import BIN, TOKEN_ENV
from tests.deployments.clients import H, W, png_url
from tests.waits import async_wait_until

ROOT = Path(__file__).resolve().parents[2]
# above Ray's default worker port range (10002-19999); each node its own agent port on one machine
GCS_PORT, DASHBOARD_PORT, AGENT_PORTS = 26479, 28265, (28266, 28267, 28268)
HEAD_PROXY, WORKER_PROXIES = 28900, (28901, 28902)
SETTINGS = dict(preset="tiny", device="cpu", sp=2, rank_cpus=0.3, max_sessions_per_group=1, min_groups=1,
                max_groups=2, admission_wait_s=0, retry_after_s=7, stall_timeout_s=60, pacing_lead_s=30,
                graceful_shutdown_timeout_s=5, max_in_flight_chunks=2)


def ray_cli(*args, env=None, timeout=180):
    return processes.ray_cli(*args, env=env, timeout=timeout)


def serve_deploy(folder: Path, quality_ladder: Optional[str] = None) -> None:
    """`serve deploy` of serve_config.yaml with the test settings layered on its app's args (and `quality_ladder`
    as the WorldGroup's user_config, where serve_config.yaml keeps it)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = HEAD_PROXY
    app = config["applications"][0]
    app["args"] = {**app["args"], **SETTINGS}
    if quality_ladder is not None:
        (group,) = [d for d in app["deployments"] if d["name"] == "WorldGroup"]
        group["user_config"] = {"quality_ladder": quality_ladder}
    config_path = folder / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    serve = subprocess.run([str(BIN / "serve"), "deploy", str(config_path), "--address",
                            f"http://127.0.0.1:{DASHBOARD_PORT}"],
                           env={**os.environ, **TOKEN_ENV}, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert serve.returncode == 0, serve.stdout + serve.stderr


def serve_rest(path: str) -> dict:
    """Serve's REST API on the head's dashboard, with the cluster's token."""
    request = urllib.request.Request(f"http://127.0.0.1:{DASHBOARD_PORT}{path}",
                                     headers={"Authorization": f"Bearer {TOKEN_FILE.read_text().strip()}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def group_modes(answers: int = 4) -> list[str]:
    """The quality ladder's mode as the running groups report it (WorldGroup.census through a deployment
    handle, from a driver of its own on the cluster), `answers` times (Serve routes each to some group)."""
    code = (f"import json, ray; from ray import serve; ray.init(address='127.0.0.1:{GCS_PORT}', "
            "logging_level='ERROR', log_to_driver=False); h = serve.get_deployment_handle('WorldGroup', 'lingbot'); "
            "print(json.dumps([h.census.remote().result(timeout_s=60)['settings']['quality_ladder'] "
            f"for _ in range({answers})]))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **cluster_env(), **TOKEN_ENV},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def state(kind: str, **filters) -> list[dict]:
    """Ray's state API through the head's dashboard, with the cluster's token."""
    from ray.util.state.api import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource
    client = StateApiClient(address=f"http://127.0.0.1:{DASHBOARD_PORT}",
                            headers={"Authorization": f"Bearer {TOKEN_FILE.read_text().strip()}"})
    rows = client.list(StateResource(kind), ListApiOptions(filters=[(k, "=", v) for k, v in filters.items()],
                                                           detail=True, limit=1000), raise_on_missing_output=True)
    return [r if isinstance(r, dict) else r.__dict__ for r in rows]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    temp_dir = Path("/tmp") / f"lingbot-mn-{os.getpid()}"            # short: Ray's socket paths have a limit
    ray_cli("get-auth-token", "--generate")                            # `ray start` makes none itself
    ray_cli("start", "--head", f"--port={GCS_PORT}", "--num-cpus=0", f"--temp-dir={temp_dir}",
            "--include-dashboard=true", f"--dashboard-port={DASHBOARD_PORT}", "--object-store-memory=150000000",
            f"--dashboard-agent-listen-port={AGENT_PORTS[0]}", "--disable-usage-stats")
    workers = []
    try:
        for i, port in enumerate(WORKER_PROXIES):
            ray_cli("start", f"--address=127.0.0.1:{GCS_PORT}", "--num-cpus=1", "--object-store-memory=150000000",
                    f"--resources={json.dumps({f'worker_{i}': 1})}",
                    f"--dashboard-agent-listen-port={AGENT_PORTS[i + 1]}",
                    env={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(port)})
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = [n for n in state("nodes", state="ALIVE") if not n["is_head_node"]]
            time.sleep(1)
        assert len(workers) == 2, workers
        serve_deploy(tmp_path_factory.mktemp("deploy"))
        deadline = time.monotonic() + 300
        ready = False
        while not ready and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{HEAD_PROXY}/readyz", timeout=5) as r:
                    ready = json.loads(r.read()) == {"ready": True, "groups": 1, "starting": 0}
            except OSError:
                pass
            time.sleep(2)
        assert ready, "the app did not become ready"
        yield {n["node_id"]: n for n in workers}
    finally:
        processes.kill_cluster(temp_dir, GCS_PORT)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ingress_log() -> Path:
    """The Serve log file of the app's ingress replica (the file its process holds open, on whichever node)."""
    (ingress,) = state("actors", class_name="ServeReplica:lingbot:Ingress", state="ALIVE")
    paths = sorted({f.path for f in psutil.Process(ingress["pid"]).open_files()
                    if "replica_lingbot_Ingress" in f.path and f.path.endswith(".log")})
    assert paths, "the ingress replica holds no Serve log file open"
    return Path(paths[0])


def url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/realtime/video"


async def open_session(port: int, seed: int, chunks=None, full_retries: int = 0) -> tuple[RealtimeClient, dict]:
    """A started session. With `full_retries`, a refusal for a full deployment is tried again after its
    retry_after_s, as a client does (a group frees a stopped session's seat a moment after its client was told
    the session is done)."""
    client = RealtimeClient(url(port))
    await client.__aenter__()
    await client.start("a street at night", png_url(), W, H, chunks, seed=seed)
    while True:
        msg = json.loads(await client.ws.recv())
        if msg["type"] == "video.start":
            return client, msg
        if msg["type"] == "error" and msg["code"] == "capacity_exhausted" and full_retries > 0:
            await client.__aexit__()
            await asyncio.sleep(msg["retry_after_s"])
            return await open_session(port, seed, chunks, full_retries - 1)
        assert msg["type"] != "error", msg


def test_load_brings_a_second_group_on_the_free_node(cluster):
    """One group (capacity 1) is up; a second session queues, Serve's autoscaler adds a group, and Ray places
    it on the worker node that has room (each node fits one). Every group's ranks and muxer share its node.
    With admission_wait_s 0 the queued session is admitted there, not refused at the moment Serve reports the
    last allowed group running (before its lease is routed to it: may_wait)."""
    assert len(state("placement_groups", state="CREATED")) == 1

    async def scenario():
        a, start_a = await open_session(HEAD_PROXY, seed=1)                  # takes the first group
        reading = asyncio.ensure_future(a.receive_session(timeout=300))     # a watches on meanwhile
        t0 = time.monotonic()
        b, start_b = await open_session(HEAD_PROXY, seed=2)                  # admitted once the second is up
        print(f"b admitted after {time.monotonic() - t0:.1f} s")
        await a.send({"type": "session.stop"})
        await b.send({"type": "session.stop"})
        ends = [await reading, await b.receive_session(timeout=120)]
        for c in (a, b):
            await c.__aexit__()
        return start_a, start_b, ends

    start_a, start_b, ends = asyncio.run(scenario())
    for end in ends:                                   # each stopped by its client, not ended by the server
        assert end.error is None and end.done is not None, (end.error, end.close_code, len(end.chunks))
    assert start_a["config"]["group"] != start_b["config"]["group"]
    groups = state("placement_groups", state="CREATED")
    assert len(groups) == 2
    nodes = []
    for pg in groups:
        bundle_nodes = {b["node_id"] for b in pg["bundles"]}
        assert len(pg["bundles"]) == 1 + SETTINGS["sp"] + 1 and len(bundle_nodes) == 1, pg   # replica, ranks, muxer
        nodes.append(bundle_nodes.pop())
    assert set(nodes) == set(cluster)                                   # one group on each worker node
    print("placements:", {pg["placement_group_id"][:8]: node[:8] for pg, node in zip(groups, nodes)})
    by_pg = {pg["placement_group_id"]: node for pg, node in zip(groups, nodes)}
    for cls in ("RankWorker", "Muxer"):
        actors = state("actors", class_name=cls, state="ALIVE")
        assert len(actors) == (4 if cls == "RankWorker" else 2)
        for a in actors:
            assert a["node_id"] == by_pg[a["placement_group_id"]], (cls, a["node_id"])


def test_a_serve_deploy_that_changes_only_the_quality_ladder_switches_the_running_groups_in_place(cluster, tmp_path):
    """`serve deploy` again with the WorldGroup's user_config (serve_config.yaml's `deployments:`) changed to
    quality_ladder: auto and nothing else: Serve's lightweight update. No replica or rank is replaced (every one
    alive after it was alive before; measured: the same value changed under `args:` rebuilt the app, a new
    group), and the running groups report the new mode (WorldGroup.reconfigure); then back to off the same way.
    First in this file, on the one group min_groups starts."""
    def replicas() -> set:
        app = serve_rest("/api/serve/applications/")["applications"]["lingbot"]
        return {(r["replica_id"], r["state"]) for r in app["deployments"]["WorldGroup"]["replicas"]}

    def ranks() -> set:
        return {a["actor_id"] for a in state("actors", class_name="RankWorker", state="ALIVE")}

    def settled() -> dict:
        deadline = time.monotonic() + 120
        while True:
            app = serve_rest("/api/serve/applications/")["applications"]["lingbot"]
            if app["status"] == "RUNNING" or time.monotonic() > deadline:
                return app
            time.sleep(1)

    assert settled()["status"] == "RUNNING"
    before, ranks_before = replicas(), ranks()
    assert set(group_modes()) == {"off"} and before and ranks_before
    for mode in ("auto", "off"):
        serve_deploy(tmp_path, quality_ladder=mode)
        deadline = time.monotonic() + 60
        while set(group_modes()) != {mode} and time.monotonic() < deadline:
            time.sleep(1)
        app = settled()
        assert app["deployments"]["WorldGroup"]["deployment_config"]["user_config"] == {"quality_ladder": mode}
        assert set(group_modes()) == {mode} and app["status"] == "RUNNING", app["status"]
        assert replicas() == before and ranks() == ranks_before         # the same groups, switched in place


def test_every_nodes_proxy_reaches_sessions_on_both_groups(cluster):
    async def scenario():
        out = []
        for port in (HEAD_PROXY, *WORKER_PROXIES):
            a, start_a = await open_session(port, seed=1, chunks=2)
            b, start_b = await open_session(port, seed=2, chunks=2)      # capacity 1 per group: the other group
            results = [await c.receive_session(timeout=120) for c in (a, b)]
            for c in (a, b):
                await c.__aexit__()
            out.append((port, {start_a["config"]["group"], start_b["config"]["group"]}, results))
        return out

    for port, groups, results in asyncio.run(scenario()):
        assert len(groups) == 2, port
        for r in results:
            assert r.error is None and r.done["chunks"] == 2, (port, r.error)
            assert sum(c["num_frames"] for c in r.chunks) == 21


def test_a_session_on_a_lost_node_resumes_on_the_other_group(cluster):
    """Kill the raylet of the worker node that does not hold the ingress, while a session streams on each
    group. The other group's session streams on, untouched. The lost one waits (the other group is full),
    and once that session stops it resumes there: restored from the snapshots its ranks left in the
    object store through the ingress's keeper, on the surviving node, so not lost with theirs."""
    ingress_node = state("actors", class_name="ServeReplica:lingbot:Ingress", state="ALIVE")[0]["node_id"]
    (victim,) = [n for n in cluster if n != ingress_node]
    groups = {pg["placement_group_id"]: pg["bundles"][0]["node_id"] for pg in state("placement_groups",
                                                                                    state="CREATED")}
    group_actors = state("actors", class_name="ServeReplica:lingbot:WorldGroup", state="ALIVE")
    group_nodes = {a["name"].rsplit("#", 1)[-1]: a["node_id"] for a in group_actors}
    tag = next(k for k in cluster[victim]["resources_total"] if k.startswith("worker_"))
    victim_raylet = [p for p in psutil.process_iter(["name", "cmdline"])
                     if p.info["name"] == "raylet" and tag in " ".join(p.info["cmdline"] or [])]
    log = ingress_log()

    def resuming_since(offset: int) -> bool:
        """The ingress logged a session's group failing (it resumes it, waiting for a group) after `offset`."""
        with open(log, "rb") as f:
            f.seek(offset)
            return b"its group failed after" in f.read()

    async def scenario():
        opened = [await open_session(HEAD_PROXY, seed=s) for s in (3, 4)]   # endless, one on each group
        for c, _ in opened:                   # both streaming, 3 chunks in (their snapshots reach the ingress)
            chunks = 0
            while chunks < 3:
                chunks += isinstance(await c.ws.recv(), bytes)
        by_node = {group_nodes[start["config"]["group"]]: c for c, start in opened}
        lost, survivor = by_node[victim], by_node[ingress_node]
        logged = log.stat().st_size
        for proc in victim_raylet:
            proc.send_signal(signal.SIGKILL)
        after = []

        async def stop_two_chunks_after_the_resume(result, meta):
            if any(m["type"] == "session.resumed" for m in result.messages):
                after.append(meta)
                if len(after) == 2:
                    await lost.send({"type": "session.stop"})
        streamed = []                         # the survivor's chunks since the kill
        waiting = asyncio.create_task(lost.receive_session(stop_two_chunks_after_the_resume, timeout=300))
        surviving = asyncio.create_task(survivor.receive_session(lambda result, meta: streamed.append(meta),
                                                                 timeout=300))
        await async_wait_until(lambda: resuming_since(logged) and streamed, 120,
                               "the ingress to resume the lost session while the other streams on", interval_s=0.5)
        assert not waiting.done() and not surviving.done()                   # one streams, one waits for a group
        await survivor.send({"type": "session.stop"})
        survivor_result = await asyncio.wait_for(surviving, 120)
        lost_result = await asyncio.wait_for(waiting, 240)
        for c, _ in opened:
            await c.__aexit__()
        fresh = (await open_session(HEAD_PROXY, seed=5, chunks=2, full_retries=2))[0]
        fresh_result = await fresh.receive_session(timeout=120)
        await fresh.__aexit__()
        return lost_result, survivor_result, fresh_result

    assert len(victim_raylet) == 1 and len(groups) == 2 and len(group_actors) == 2
    lost, survivor, fresh = asyncio.run(scenario())
    assert survivor.error is None and survivor.done["stopped"] is True and len(survivor.chunks) >= 2
    [resumed] = [m for m in lost.messages if m["type"] == "session.resumed"]
    assert lost.error is None and lost.done["stopped"] is True, lost.error
    # restored from a snapshot, not replayed from the start; how many chunks it replays depends on how far the
    # keeper's puts lagged the chunks when the node died (best effort: a busy machine replays more)
    assert resumed["restored_chunks"] >= 1, resumed
    assert resumed["restored_chunks"] + resumed["replayed_chunks"] == resumed["generation_chunk_index"], resumed
    indices = [c["transport_chunk_index"] for c in lost.chunks]           # 3 were read before the kill
    assert indices == list(range(3, 3 + len(indices))) and indices[-1] >= resumed["transport_chunk_index"] + 1
    assert fresh.error is None and fresh.done["chunks"] == 2
    with urllib.request.urlopen(f"http://127.0.0.1:{HEAD_PROXY}/healthz", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
