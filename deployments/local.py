"""Serving on this machine: `python -m deployments.local [serve_config.yaml]` (what `make serve` runs) starts a local
Ray, deploys the config's app, and prints one line with the URL once the first model group is ready; Ctrl-C
stops it. It also holds what every local start shares (the tests' and the benchmarks' too): the environment
Ray's processes must start with (`prepare_environment`: the proxy's handshake limit and its door, bounded by the
app's settings (deployments/ingress/front.py), the autoscaler's metric pushes) and Ray's token authentication,
which stays on.

Ray's control plane (its GCS, raylets, workers and the dashboard, whose job API runs shell commands) listens
beyond this process; with token authentication every request must carry the cluster's token. Ray 2.60's
`ray.init()` turns it on for a new local cluster and reads the token from ~/.ray/auth_token (or the file named by
RAY_AUTH_TOKEN_PATH), writing one there readable by all when there is none; `prepare_environment` makes that
file first, readable by its owner only (`own_token_file`), and `start_ray` checks after `ray.init` that the
cluster's GCS refuses a call without the token (`check_token_auth`), so a RAY_ADDRESS naming a cluster without
token authentication is refused too. A RAY_AUTH_MODE other than `token` in the environment is refused. The `ray`
and `serve` CLIs of the same user reach the cluster with `RAY_AUTH_MODE=token` (they read the same file);
docs/security.md has the rest.

The proxy's WebSocket handshake is parsed by the `websockets` library, which reads header lines of at most
WEBSOCKETS_MAX_LINE_LENGTH bytes (8 KiB by default) and never answers a longer one: the client waits until it
gives up. Serve offers no setting for it; the library reads the variable when the proxy starts, so it is set
before Ray starts (workers inherit the environment). With 32 KiB (twice max_header_bytes), a handshake whose
headers are too large for the ingress reaches the ingress and is refused at once (headers_too_large), while the
proxy buffers at most 128 lines of 32 KiB (4 MiB) for one handshake; a single header line beyond 32 KiB still
goes unanswered (docs/architecture.md, "The protocol").
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

# what every node's Ray processes start with, here and in the cluster manifests (cluster/render.py)
CLUSTER_ENV = {
    "WEBSOCKETS_MAX_LINE_LENGTH": str(32 * 2 ** 10),    # see the module docstring
    # handles and replicas push the autoscaler's metrics every second (Serve's default is 10 s): a waiting
    # session is seen by the autoscaler within about a second (deployments/group/scaling.py)
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    # Serve's proxy (uvicorn) would take X-Forwarded-For from any local connection (127.0.0.1, ::1) as the
    # client's address, so a client on the node could name any address; the ingress reads it itself, from the
    # proxies in trusted_proxies only (deployments/ingress/access.py, client_address)
    "FORWARDED_ALLOW_IPS": "",
}
TOKEN_FILE = Path.home() / ".ray" / "auth_token"     # where Ray keeps a local cluster's token by default


def lingbot_app(config: dict) -> dict:
    """The lingbot app of a Serve config (the one application built by deployments.app:build_app)."""
    apps = [a for a in config["applications"] if a.get("import_path") == "deployments.app:build_app"]
    if len(apps) != 1:
        raise ValueError("the serve config must hold exactly one app with import_path deployments.app:build_app")
    return apps[0]


def group_user_config(app: dict) -> Optional[dict]:
    """The WorldGroup's user_config under the app's `deployments:` (what `serve run` and `serve deploy` apply), or
    None where the file gives none."""
    groups = [d for d in app.get("deployments") or [] if d.get("name") == "WorldGroup"]
    return groups[0].get("user_config") if groups else None


def cluster_env(args: Optional[dict] = None) -> dict:
    """CLUSTER_ENV and the door in Serve's proxies (deployments/ingress/front.py), bounded by the app's settings
    `args` (the defaults when None): the most WebSockets its ingress replicas hold together."""
    from .ingress.front import proxy_env
    from .settings import ServeSettings
    s = ServeSettings.from_args(args or {})
    from .ingress.pacing_door import PacerLimits
    viewers = PacerLimits(s.viewer_queue_chunks, s.viewer_queue_bytes, s.viewer_max_skips)
    return {**CLUSTER_ENV, **proxy_env(s.max_ingress_sessions * s.max_ingress_replicas, s.retry_after_s,
                                       s.stall_timeout_s, s.max_connections_per_address, s.trusted_proxies, viewers,
                                       s.stall_max_bytes)}


def prepare_environment(args: Optional[dict] = None) -> None:
    """Set the environment for a Ray about to start in this process (a started one keeps its own): cluster_env of
    the app's settings `args`, and the token file its owner's only (own_token_file). RAY_AUTH_MODE
    is left to Ray, whose `ray.init()` turns token authentication on for a new local cluster (and makes the token):
    set here after Ray was imported, it would reach the processes Ray starts but not this one's Ray, which reads
    it once on import and so would make no token for them. Anything but `token` is refused."""
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode != "token":
        raise RuntimeError(f"RAY_AUTH_MODE={mode}: lingbot-serve keeps Ray's token authentication on (without it "
                           "anyone who reaches this machine can run code through Ray's job API); unset it")
    own_token_file()
    os.environ.update(cluster_env(args))


def token_file() -> Path:
    """The file Ray reads its token from where RAY_AUTH_TOKEN gives none: the one RAY_AUTH_TOKEN_PATH names, else
    ~/.ray/auth_token (the order of Ray's C++ AuthenticationTokenLoader; HOME as it reads it)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def own_token_file() -> Path:
    """token_file(), readable by its owner only before Ray starts: made where there is none (mode 0600 from the
    start, a new token_hex(32), its folder 0700 where made here; none while RAY_AUTH_TOKEN holds the token), an
    existing one that group or others may read set to 0600, its token kept. Ray would write a missing one with
    open(path, "w"), readable by all, and keeps an existing one."""
    path = token_file()
    if not os.environ.get("RAY_AUTH_TOKEN"):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            return path
    if path.is_file() and path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return path


def check_token_auth(gcs_address: str, timeout_s: float = 10.0) -> None:
    """Return when the GCS at `gcs_address` refuses a call without a token (UNAUTHENTICATED); RuntimeError when it
    answers one (its token authentication is off, whatever this process's RAY_AUTH_MODE: Ray joins such a cluster
    through RAY_ADDRESS without a word) or cannot be asked. The call is Ray's own GetClusterId, on a channel without
    Ray's token interceptor (TLS where RAY_USE_TLS says so)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        from ray._common.tls_utils import load_certs_from_env
        chain, key, ca = load_certs_from_env()
        channel = grpc.secure_channel(gcs_address, grpc.ssl_channel_credentials(ca, key, chain))
    else:
        channel = grpc.insecure_channel(gcs_address)
    with channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return
            raise RuntimeError(f"could not check the token authentication of the Ray cluster at {gcs_address}: "
                               f"its GCS answered {e.code().name} ({e.details()})") from None
    raise RuntimeError(f"the Ray cluster at {gcs_address} answers without a token: its token authentication is off; "
                       "lingbot-serve does not run on such a cluster (start every node with RAY_AUTH_MODE=token, "
                       "cluster/README.md)")


def start_ray(app_args: Optional[dict] = None, unset: tuple = (), **init_args):
    """prepare_environment(app_args) less the variables named in `unset` (perf runs without the proxy's door),
    then `ray.init(**init_args)` (a new local cluster, or the one RAY_ADDRESS names) and check_token_auth of its
    GCS; on a refusal Ray is shut down again. Returns ray.init's context."""
    prepare_environment(app_args)
    for key in unset:
        os.environ.pop(key, None)
    import ray
    context = ray.init(**init_args)
    try:
        check_token_auth(context.address_info["gcs_address"])
    except RuntimeError:
        ray.shutdown()
        raise
    return context


def wait_ready(url: str, timeout_s: float, since: Optional[float] = None) -> float:
    """Seconds from `since` (a time.monotonic(); default: now) until GET url/readyz answers 200 (a model group
    runs); TimeoutError after waiting timeout_s."""
    t0 = time.monotonic()
    since = t0 if since is None else since
    while time.monotonic() - t0 < timeout_s:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - since
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"no model group was ready within {timeout_s:g} s; see the Ray logs")


def main(argv=None) -> int:
    started = time.monotonic()                  # "ready (N s)" counts the whole start: Ray, Serve, the first group
    parser = argparse.ArgumentParser(prog="python -m deployments.local", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="serve_config.yaml", help="a Serve config (default: %(default)s)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--print-env", action="store_true",
                        help="print the environment every node's `ray start` needs for this config (shell exports: "
                             "eval \"$(python -m deployments.local --print-env CONFIG)\") and exit")
    args = parser.parse_args(argv)
    import yaml
    with open(args.config) as f:
        config = yaml.safe_load(f)
    app = lingbot_app(config)
    if args.print_env:
        import shlex
        for key, value in cluster_env(app.get("args")).items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    http = config.get("http_options") or {}
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    from .ingress.access import beyond_loopback, exposure_refusal
    from .settings import ServeSettings
    settings = ServeSettings.from_args(app.get("args") or {})
    refusal = exposure_refusal(host, settings.api_key_set, settings.allow_anonymous)
    if refusal:                                  # (the ingress refuses it too: said here before Ray starts)
        print(refusal, file=sys.stderr, flush=True)
        return 2
    if beyond_loopback(host) and not settings.api_key_set:
        print(f"lingbot-serve: WARNING: serving everyone on {host}:{port} without api_keys (allow_anonymous: true)",
              flush=True)
    logging.basicConfig(level=logging.WARNING)
    # Ray's own line on the token ("set RAY_AUTH_MODE=disabled to opt out") would contradict the one printed below
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    print(f"lingbot-serve: starting local Ray and the app of {args.config} ({app.get('args', {}).get('preset')})",
          flush=True)
    start_ray(app.get("args"), log_to_driver=True, logging_level=logging.WARNING)
    import ray
    from ray import serve
    logging.getLogger("ray.serve").setLevel(logging.WARNING)    # the one line below says when it is ready

    from .app import compose_app
    print(f"lingbot-serve: Ray's dashboard and control plane take the token in {token_file()} (the ray and serve "
          "CLIs: RAY_AUTH_MODE=token)", flush=True)
    serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
    serve.run(compose_app(app.get("args"), group_user_config(app)), name=app.get("name", "lingbot"),
              route_prefix=app.get("route_prefix", "/"),
              logging_config={"enable_access_log": False})
    seconds = wait_ready(url, args.ready_timeout_s, since=started)
    print(f"\nlingbot-serve is ready ({seconds:.0f} s): open {url}/ in a browser; WebSocket clients: "
          f"{url.replace('http', 'ws')}/v1/realtime/video. Ctrl-C stops it.\n", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("lingbot-serve: stopping", flush=True)
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
