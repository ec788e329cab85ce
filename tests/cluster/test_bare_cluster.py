"""A Ray cluster started by hand without lingbot-serve's environment (the proxies' door, stall guard,
FORWARDED_ALLOW_IPS and header limit: `python -m deployments.local --print-env`): the app still serves, and says
so loudly: `GET /readyz` names what is missing, and `lingbot_proxy_protection_missing{protection}` is 1 for each.
On ports of its own (it runs beside the package app: tests/side_by_side.py)."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from deployments.ingress.front import PROTECTIONS
from deployments.local import cluster_env
from tests.cluster.processes import TOKEN_ENV, kill_cluster, ray_cli, start_head
from tests.deployments.observe import metric, scrape

ROOT = Path(__file__).resolve().parents[2]
GCS_PORT, AGENT_PORT, METRICS_PORT, PROXY = 26679, 28466, 28467, 28970
NAME = "lingbot_proxy_protection_missing"
SETTINGS = dict(preset="tiny", device="cpu", sp=1, max_sessions_per_group=1, min_groups=1, max_groups=1,
                decoder="tae")


def readyz() -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PROXY}/readyz", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def test_a_cluster_started_without_the_environment_says_what_its_proxies_lack():
    temp_dir = Path("/tmp") / f"lingbot-bare-{os.getpid()}"
    bare = {k: v for k, v in os.environ.items() if k not in cluster_env(SETTINGS)}      # as a by-hand start
    ray_cli("get-auth-token", "--generate")
    try:
        start_head(temp_dir, GCS_PORT, "--num-cpus=2", "--include-dashboard=false",
                   f"--dashboard-agent-listen-port={AGENT_PORT}", f"--metrics-export-port={METRICS_PORT}",
                   "--object-store-memory=150000000", "--disable-usage-stats",
                   f"--system-config={json.dumps({'metrics_report_interval_ms': 1000})}", env=bare)
        driver = ("import ray; from ray import serve; from deployments.app import build_app; "
                  f"ray.init(address='127.0.0.1:{GCS_PORT}', log_to_driver=False); "
                  f"serve.start(http_options={{'host': '127.0.0.1', 'port': {PROXY}}}); "
                  f"serve.run(build_app({SETTINGS!r}), name='lingbot', route_prefix='/')")
        done = subprocess.run([sys.executable, "-c", driver], env={**bare, **TOKEN_ENV}, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        body = readyz()
        deadline, missing = time.monotonic() + 60, {}
        while time.monotonic() < deadline and len(missing) < 4:
            values = scrape(METRICS_PORT)
            missing = {p: metric(values, NAME, protection=p) for p in PROTECTIONS
                       if any(n == NAME and ("protection", p) in labels for n, labels in values)}
            time.sleep(1)
    finally:
        kill_cluster(temp_dir, GCS_PORT)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert body["unprotected"] == ["door", "stall_guard", "forwarded_for", "header_limit"]   # (ready or not yet)
    assert missing == {"door": 1, "stall_guard": 1, "forwarded_for": 1, "header_limit": 1}
