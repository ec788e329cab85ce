"""deployments/local.py: a local Ray started as `make serve` starts it keeps Ray's token authentication on. Its
dashboard's job API (which runs shell commands for whoever may submit) refuses a request without the token,
or with a wrong one, and answers the token Ray keeps in ~/.ray/auth_token, a file only its owner may read.

Ray runs in a child process (as `make serve` runs it), so this module never shares a Ray with the package's
serving app; the dashboard's port is fixed, so it runs under the Serve tests' lock."""
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deployments.local import TOKEN_FILE, prepare_environment

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PORT = 18269
MARKER = Path("/tmp") / f"lingbot-job-ran-{os.getpid()}"
RAY = f"""
import sys
from deployments.local import start_ray
start_ray(num_cpus=1, include_dashboard=True, dashboard_port={DASHBOARD_PORT}, object_store_memory=80 * 2 ** 20,
          log_to_driver=False)
print("ray is up", flush=True)
sys.stdin.read()                           # until the test closes it
import ray
ray.shutdown()
"""


def request(path: str, token=None, body=None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{DASHBOARD_PORT}{path}", headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def local_ray():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}     # a new user's shell
    proc = subprocess.Popen([sys.executable, "-c", RAY], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "ray is up":
            line = proc.stdout.readline()
            assert line, "\n".join(lines[-30:])
            lines.append(line.rstrip())
        deadline = time.monotonic() + 60                  # the dashboard answers a little after ray.init returns
        while time.monotonic() < deadline:
            try:
                request("/api/version")
                break
            except OSError:
                time.sleep(0.5)
        yield
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_dashboards_job_api_refuses_a_request_without_the_token(local_ray):
    status, body = request("/api/jobs/")
    assert (status, body) == (401, b"Unauthorized: Missing authentication token")
    status, _ = request("/api/jobs/", token="0" * 32)
    assert status == 403
    job = {"entrypoint": f"touch {MARKER}"}                    # what an attacker would send
    assert request("/api/jobs/", body=job)[0] == 401
    token = TOKEN_FILE.read_text().strip()
    status, body = request("/api/jobs/", token=token)
    assert status == 200 and [j["type"] for j in json.loads(body)] == ["DRIVER"]     # the refused one left no job
    assert not MARKER.exists()
    assert TOKEN_FILE.stat().st_mode & 0o777 == 0o600           # the token is its owner's only


def test_a_mode_other_than_token_is_refused(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(RuntimeError, match="RAY_AUTH_MODE=disabled: lingbot-serve keeps Ray's token authentication"):
        prepare_environment()


def test_the_local_default_listens_on_this_machine_and_an_app_beyond_it_without_keys_does_not_start(tmp_path, capsys):
    """serve_config.yaml listens on 127.0.0.1 (as Ray's dashboard and Jupyter). An app that would listen beyond
    this machine without api_keys is refused unless allow_anonymous says so on purpose: by `make serve`'s command
    before it starts Ray (exit 2), and by the ingress itself wherever it is deployed (a cluster manifest whose keys
    Secret is missing: ConfigError, the app does not start)."""
    import yaml

    from deployments.ingress.access import exposure_refusal
    from deployments.ingress.app import check_exposure
    from deployments.local import main
    from lingbot.config import ConfigError
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    for host in ("127.0.0.1", "localhost", "::1", "127.0.1.1"):
        assert exposure_refusal(host, frozenset(), False) is None, host
    assert exposure_refusal("0.0.0.0", frozenset({"k"}), False) is None
    assert exposure_refusal("10.0.0.5", frozenset(), True) is None
    refusal = exposure_refusal("0.0.0.0", frozenset(), False)
    assert refusal.startswith("lingbot-serve refuses to listen on 0.0.0.0 without api_keys") and \
        "allow_anonymous: true" in refusal
    config["http_options"]["host"] = "0.0.0.0"
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main([str(path)]) == 2                                          # (before it starts Ray)
    assert refusal in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"refuses to listen on 0\.0\.0\.0 without api_keys"):
        check_exposure("0.0.0.0", frozenset(), False)
    check_exposure("0.0.0.0", frozenset(), True)                           # on purpose: a warning in the log
    check_exposure(None, frozenset(), False)                               # Serve could not say: not refused
