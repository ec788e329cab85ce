"""A Ray cluster of a test module's own, started by `ray start` on ports no other module uses (so it runs beside
the package app: tests/side_by_side.py), under Ray's token authentication as cluster/README.md starts one by hand,
and every process of it killed at the end."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from deployments.local import cluster_env, own_token_file

BIN = Path(sys.executable).parent
TOKEN_ENV = {"RAY_AUTH_MODE": "token"}           # the token itself: ~/.ray/auth_token, Ray's default place
# (made its owner's only before any `ray` command: own_token_file; Ray would write it readable by all)


def ray_cli(*args, env=None, app_args=None, timeout=180) -> str:
    """`ray ARGS` with the cluster's environment (the door's bounds from the app's settings `app_args`), its
    stdout; AssertionError with its output when it fails."""
    own_token_file()
    run_env = {**os.environ, **cluster_env(app_args), **TOKEN_ENV, **(env or {})}
    done = subprocess.run([str(BIN / "ray"), *args], env=run_env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"ray {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def cluster_processes(temp_dir: Path, gcs_port: int) -> list:
    """Every process of the cluster: their command lines name its temp dir, or its GCS port at any of this
    machine's addresses (Ray's client server and agents name the node's own IP, not 127.0.0.1)."""
    port = re.compile(rf":{gcs_port}\b")
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.pid != os.getpid() and (str(temp_dir) in cmd or port.search(cmd)):
            out.append(proc)
    return out


def kill_cluster(temp_dir: Path, gcs_port: int) -> None:
    """Kill the cluster's processes and their children (its dashboard agent names itself only
    "ray::DashboardAgent" and would keep the cluster's agent and metrics ports)."""
    procs = cluster_processes(temp_dir, gcs_port)
    for proc in list(procs):
        try:
            procs += proc.children(recursive=True)
        except psutil.Error:
            pass
    procs = list({p.pid: p for p in procs}.values())
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)


def start_head(temp_dir: Path, gcs_port: int, *args, env: dict, tries: int = 2) -> None:
    """`ray start --head` on `gcs_port` with `temp_dir` and `args`, tried again once after its leftovers are killed
    when the node did not register in time (seen on a busy 2-core machine: "the node registration may not be
    complete yet before the timeout")."""
    own_token_file()
    for attempt in range(tries):
        done = subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={gcs_port}", f"--temp-dir={temp_dir}",
                               *args], env={**env, **TOKEN_ENV}, capture_output=True, text=True, timeout=180)
        if done.returncode == 0:
            return
        kill_cluster(temp_dir, gcs_port)
        if attempt == tries - 1:
            raise AssertionError(f"ray start --head:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        time.sleep(5)
