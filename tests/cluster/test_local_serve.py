"""`make serve`'s command, `python -m deployments.local`, as a new user runs it: it prints one line with the URL
once the first model group is ready (not Serve's access lines), the page it points to works and says the
weights are random, and Ctrl-C stops it."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PORT = 18890


def test_make_serve_prints_the_url_when_ready_and_stops_on_ctrl_c(tmp_path):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": PORT}
    config["applications"][0]["args"].update(sp=1, max_groups=1)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.local", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        assert f"open http://127.0.0.1:{PORT}/ in a browser" in ready[0]
        assert f"ws://127.0.0.1:{PORT}/v1/realtime/video" in ready[0]
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
