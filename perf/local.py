"""What the perf scripts that run a local Serve app share: Ray and Serve started once on this machine (2 CPUs,
a small object store, the proxy on a port of the script's), the groups of app "lingbot" waited for, and a
first frame to start sessions from."""
from __future__ import annotations

import time


def ensure_serve(port: int, cpus: int = 2, app_args: dict | None = None, door: bool = True) -> None:
    """Ray and Serve on this machine, started on the first call (later calls reuse them); `cpus` logical CPUs, the
    environment of the app's settings `app_args` (the defaults when None), without the door in Serve's proxy when
    `door` is False (deployments/ingress/front.py)."""
    import ray

    from deployments.local import start_ray
    if not ray.is_initialized():
        start_ray(app_args, unset=() if door else ("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH",), num_cpus=cpus,
                  object_store_memory=300 * 2 ** 20, include_dashboard=False, log_to_driver=False)
        # (Serve imported after start_ray: it reads the environment on import)
        from ray import serve
        serve.start(http_options={"host": "127.0.0.1", "port": port})


def wait_for_groups(groups: int, timeout: float = 300.0) -> float:
    """Seconds until app "lingbot" runs `groups` groups and nothing else (no group starting or stopping)."""
    from ray import serve
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        status = serve.status().applications["lingbot"].deployments["WorldGroup"]
        if status.replica_states.get("RUNNING", 0) >= groups and len(status.replica_states) == 1:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def first_frame_png(seed: int = 0) -> bytes:
    """A random first frame at the tiny preset's size, as PNG bytes."""
    import io

    import numpy as np
    from PIL import Image

    from lingbot.config import get_preset
    preset = get_preset("tiny")
    pixels = np.random.RandomState(seed).randint(0, 255, (preset.height, preset.width, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()
