"""One real Ray Serve app (tiny, CPU, SP-2 over gloo) for the serving tests of this package.

Ray start-up dominates, so the cluster lives for the whole package; the port is fixed, so Serve tests
run serially. Settings are the embedded default with short timeouts and one group of 2 sessions; both frame decoders are
loaded, the tiny one the default as on any CPU deployment (a chunk costs about half the Wan decoder's), so a
session may pick the Wan one."""

import tempfile

import pytest

PORT = 18765
METRICS_PORT = 18767
METRICS_INTERVAL_MS = 2000                # Ray exports recorded metrics this often (its default: 10 s)
URL = f"ws://127.0.0.1:{PORT}/v1/realtime/video"
HTTP = f"http://127.0.0.1:{PORT}"
TEST_SETTINGS = dict(preset="tiny", device="cpu", sp=2, max_sessions_per_group=2, min_groups=1, max_groups=1,
                     start_timeout_s=3, admission_wait_s=3, retry_after_s=7, stall_timeout_s=8,
                     pacing_lead_s=8, graceful_shutdown_timeout_s=5, decoder="tae,wan",
                     quality_floor="tiny_steps2",   # every rung may be pinned (the decoder rungs too)
                     max_in_flight_chunks=2,        # the GPU default, so the overlap is tested here too
                     max_fps=120.0,                 # sessions that ask for 120 fps run flat out
                     max_sessions_per_key=0, max_starts_per_minute_per_key=0,   # every test comes from one address
                     max_viewers_per_session=4,     # test_spectators.py: the fifth viewer is refused
                     recordings_dir=tempfile.mkdtemp(prefix="lingbot-test-recordings-"),
                     worlds_dir=tempfile.mkdtemp(prefix="lingbot-test-worlds-"),
                     trusted_proxies="127.0.0.1")   # (so a test can name another client in X-Forwarded-For)


@pytest.fixture(scope="package")
def serve_app():
    from deployments.local import start_ray
    # the environment before Serve is imported (the proxy's handshake limits and door), the token file its owner's
    # only, token authentication checked (local.py)
    start_ray(TEST_SETTINGS, num_cpus=2, object_store_memory=300 * 2 ** 20, include_dashboard=False,
              log_to_driver=False, _metrics_export_port=METRICS_PORT,
              _system_config={"metrics_report_interval_ms": METRICS_INTERVAL_MS})
    import ray
    from ray import serve

    from deployments.app import build_app
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(TEST_SETTINGS), name="lingbot", route_prefix="/")
    yield URL
    serve.shutdown()
    ray.shutdown()
