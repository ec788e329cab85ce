"""What the package's served app shows of itself, read the way the served tests read it: the node's Prometheus
metrics (Ray exports them every METRICS_INTERVAL_MS) and the ingress's count of live sessions (/healthz)."""
import json
import re
import urllib.request

from tests.deployments.conftest import HTTP
from tests.waits import wait_until


def scrape(port):
    """The node's Prometheus text -> {(name, frozenset(labels)): value}, names without Ray's prefix."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(?:ray_)?(lingbot_\w+)(?:\{(.*)\})? (\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(values, name, **labels):
    """Sum of `name` over the series whose labels include `labels` (0 when none is exported yet)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= ls)


def settled(read, interval_s: float, timeout_s: float, what: str):
    """`read()` every `interval_s` (longer than an export) until two reads in a row agree: nothing is in flight;
    that value. AssertionError naming `what` if they still differ after `timeout_s`."""
    reads = []

    def two_alike() -> bool:
        reads.append(read())
        return len(reads) > 1 and reads[-1] == reads[-2]
    wait_until(two_alike, timeout_s, what, interval_s)
    return reads[-1]


def live_sessions() -> int:
    """The ingress's open WebSocket connections (sessions, waiting or refused ones too), from /healthz."""
    with urllib.request.urlopen(f"{HTTP}/healthz", timeout=10) as r:
        return json.loads(r.read())["live_sessions"]
