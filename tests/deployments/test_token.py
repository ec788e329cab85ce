"""deployments/local.py: Ray's token file is its owner's only before any Ray starts (Ray would write a missing one
readable by all), and a cluster whose GCS answers a call without the token (token authentication off) is refused.

The clusters run in child processes (each its own session and a temporary HOME, killed by process group at the
end: another Ray of the suite may run on this machine), never in the pytest process."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from deployments.local import check_token_auth, cluster_env, prepare_environment, token_file

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = """
import sys, time, ray
ctx = ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2 ** 20,
               _temp_dir=sys.argv[1])
print(ctx.address_info["gcs_address"], flush=True)
time.sleep(600)                            # until the test kills its process group
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A HOME of the test's own, no token in the environment; what prepare_environment sets is undone after."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in cluster_env().items():
        monkeypatch.setenv(key, value)                     # (recorded, so restored or removed after the test)
    return tmp_path


def test_prepare_environment_makes_the_token_file_its_owners_only_before_ray_starts(home):
    prepare_environment()
    path = home / ".ray" / "auth_token"
    assert token_file() == path
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}", path.read_text())
    token = path.read_text()
    prepare_environment()                                   # an existing token is kept
    assert path.read_text() == token


def test_an_existing_token_file_others_may_read_is_tightened_its_token_kept(home, monkeypatch):
    path = home / ".ray" / "auth_token"
    path.parent.mkdir()
    path.write_text("0123abcd" * 8)
    path.chmod(0o644)                                       # as Ray 2.60 writes it
    prepare_environment()
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == "0123abcd" * 8
    named = home / "elsewhere" / "token"                    # the file RAY_AUTH_TOKEN_PATH names is Ray's
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(named))
    prepare_environment()
    assert named.stat().st_mode & 0o777 == 0o600 and re.fullmatch(r"[0-9a-f]{64}", named.read_text())


def start_cluster(mode: str, home: Path, temp_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_AUTH_MODE=mode)
    return subprocess.Popen([sys.executable, "-c", CLUSTER, str(temp_dir)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def gcs_address(proc: subprocess.Popen, timeout_s: float = 90.0) -> str:
    """The GCS address the cluster's process prints once ray.init returned (its output when it does not: killed
    after timeout_s)."""
    watchdog = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if re.fullmatch(r"[\w.\-]+:\d+", lines[-1]):
                return lines[-1]
    finally:
        watchdog.cancel()
    raise AssertionError(f"no GCS address (at most {timeout_s:g} s):\n" + "\n".join(lines[-30:]))


@pytest.fixture(scope="module")
def clusters():
    """{mode: GCS address} of two small local clusters, RAY_AUTH_MODE=disabled and =token, started side by side."""
    dirs = {mode: Path(tempfile.mkdtemp(prefix=f"lb-{mode[:3]}-", dir="/tmp")) for mode in ("disabled", "token")}
    procs = {mode: start_cluster(mode, d, d / "ray") for mode, d in dirs.items()}
    try:
        yield {mode: gcs_address(proc) for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)        # Ray's processes share the session's process group
            except ProcessLookupError:
                pass
            proc.wait()
            proc.stdout.close()
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def test_a_cluster_without_token_authentication_is_refused(clusters):
    check_token_auth(clusters["token"])                     # refuses a call without the token: passes
    with pytest.raises(RuntimeError, match=rf"the Ray cluster at {re.escape(clusters['disabled'])} answers without "
                                           "a token: its token authentication is off; lingbot-serve does not run"):
        check_token_auth(clusters["disabled"])
    with pytest.raises(RuntimeError, match=r"could not check the token authentication .* UNAVAILABLE"):
        check_token_auth("127.0.0.1:1", timeout_s=5)


def test_start_ray_refuses_a_ray_address_without_token_authentication(clusters, tmp_path):
    """RAY_ADDRESS naming the cluster without token authentication: ray.init joins it; start_ray leaves again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), RAY_ADDRESS=clusters["disabled"])
    code = "from deployments.local import start_ray; start_ray(log_to_driver=False)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "its token authentication is off" in done.stderr, done.stderr[-3000:]
