"""A Ray cluster of a test module's own, started by `ray start` on ports no other module uses (so it runs beside
the package app: tests/side_by_side.py), under Ray's token authentication as cluster/README.md starts one by hand,
and every process of it killed at the end."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from deployments.local import cluster_env

BIN = Path(sys.executable).parent
TOKEN_ENV = {"RAY_AUTH_MODE": "token"}           # the token itself: ~/.ray/auth_token, Ray's default place


def ray_cli(*args, env=None, app_args=None, timeout=180) -> str:
    """`ray ARGS` with the cluster's environment (the door's bounds from the app's settings `app_args`), its
    stdout; AssertionError with its output when it fails."""
    run_env = {**os.environ, **cluster_env(app_args), **TOKEN_ENV, **(env or {})}
    done = subprocess.run([str(BIN / "ray"), *args], env=run_env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"ray {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def cluster_processes(temp_dir: Path, gcs_port: int) -> list:
    """Every process of the cluster (their command lines name its temp dir, or its GCS port)."""
    marks = (str(temp_dir), f"127.0.0.1:{gcs_port}")
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.pid != os.getpid() and any(m in cmd for m in marks):
            out.append(proc)
    return out


def kill_cluster(temp_dir: Path, gcs_port: int) -> None:
    procs = cluster_processes(temp_dir, gcs_port)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)
