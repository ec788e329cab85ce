"""Shared fixtures: the tiny preset, its random model and text encoder (built once per test session)."""
import json
import os
import re
import time

import pytest
import torch

from lingbot.config import get_preset
from lingbot.io.weights import build_random_text_encoder, build_random_transformer

torch.set_num_threads(int(os.environ.get("LINGBOT_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny():
    return get_preset("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny):
    return build_random_transformer(tiny.transformer, tiny.weights_seed)


@pytest.fixture(scope="session")
def tiny_text_encoder(tiny):
    return build_random_text_encoder(tiny.text, tiny.weights_seed)


@pytest.fixture(scope="session")
def tiny_runner(tiny, tiny_model, tiny_text_encoder):
    from lingbot.runtime.dit_runner import DiTRunner
    return DiTRunner(tiny, tiny_model, tiny_text_encoder)


def random_condition(preset, frames=60, seed=1):
    """Normalised image latents for LatentCondition (stand-in for nothing: any latent is a valid input)."""
    lh, lw = preset.latent_hw
    return torch.randn(16, frames, lh, lw, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def tiny_vae(tiny):
    from lingbot.io.weights import build_random_vae
    return build_random_vae(tiny.vae, tiny.weights_seed)


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_runner, tiny_vae):
    from lingbot.runtime.pipeline import WorldPipeline
    return WorldPipeline(tiny_runner, tiny_vae, skip_fixed_point=True)


def random_image(preset, seed=0):
    """A first frame in [-1, 1] of the preset's size."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, preset.height, preset.width, generator=g) * 2 - 1


# ---- malloc as a serving process leaves it, undone after each test: a RankWorker or a SnapshotKeeper built in
# this process fixes glibc's mmap threshold at 128 KiB (deployments/memory.py: right for the process that serves),
# and then every block of 128 KiB or more a later test allocates is mapped and faulted in anew. The tiny
# pipeline's chunks took 2.2x as long so (8 steady chunks: 1.16 s -> 2.54 s, 0.03 -> 1.9 s of system time), and
# the suite builds ranks in process (tests/deployments/group/) before it runs tests/lingbot/ and tests/perf/.
# Nothing can turn glibc's own raising of the threshold back on; it is set where that raising ends (32 MiB, the
# trim threshold twice that), so a test runs as in a fresh process that has freed a large block.
_MMAP_THRESHOLD_MAX, _M_TRIM_THRESHOLD = 32 * 2 ** 20, -1


@pytest.fixture(autouse=True)
def _malloc_as_a_test_process():
    yield
    import sys
    memory = sys.modules.get("deployments.memory")       # not imported: nothing here could have fixed it
    if memory is not None and memory.keep_large_blocks_mapped(_MMAP_THRESHOLD_MAX):
        memory._LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX)


# ---- where the suite's time goes: LINGBOT_TEST_PROFILE=path.json writes, per test, its wall seconds and the
# machine's busy CPU seconds meanwhile (all processes, Ray's included: /proc/stat), so a test that waits shows
# a low ratio and one that computes a high one (README.md, "Two commands")
def _busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]                       # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


_PROFILE: dict = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("LINGBOT_TEST_PROFILE"):
        yield
        return
    wall, busy = time.monotonic(), _busy_cpu_s()
    yield
    _PROFILE[item.nodeid] = {"wall_s": round(time.monotonic() - wall, 2), "busy_cpu_s": round(_busy_cpu_s() - busy, 2)}


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("LINGBOT_TEST_PROFILE")
    if path and _PROFILE:
        with open(path, "w") as f:
            json.dump(_PROFILE, f, indent=1)


# ---- two processes side by side (`make test` runs `python -m tests.side_by_side`): `--ray only` runs the modules
# that run Ray (a Serve app, a local cluster), in file order, as the suite always ran them (one at a time: fixed
# ports, one package app); `--ray none` runs the others beside them. Each process runs its modules in order, so a
# module's fixtures are made once. A module that starts a Ray of its own on ports no other module uses (its own
# GCS, dashboard, agent and proxy ports) runs beside the others too: BESIDE.
_USES_RAY = re.compile(r"^\s*(import ray|from ray|from deployments\.local|from perf\.local)|ray\.init\(|serve_app",
                       re.M)
BESIDE = ("cluster/test_multinode.py", "cluster/test_two_ingresses.py", "cluster/test_bare_cluster.py",
          "deployments/test_token.py")
_RAY_MODULES: dict = {}


def uses_ray(path) -> bool:
    """Whether the module at `path` runs in the `--ray only` process."""
    if path not in _RAY_MODULES:
        text = str(path)
        _RAY_MODULES[path] = text.endswith(".py") and not text.endswith(BESIDE) and \
            bool(_USES_RAY.search(open(path).read()))
    return _RAY_MODULES[path]


def pytest_addoption(parser):
    parser.addoption("--ray", choices=("all", "only", "none"), default="all",
                     help="run all modules, only those that run Ray, or none of those (tests/side_by_side.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "quiet: a served test of real time (a stall bound), run last, once the other "
                                       "process has ended (`quiet_machine`)")


def pytest_collection_modifyitems(config, items):
    which = config.getoption("--ray")
    if which != "all":
        want = which == "only"
        config.hook.pytest_deselected(items=[item for item in items if uses_ray(item.path) != want])
        items[:] = [item for item in items if uses_ray(item.path) == want]
    items.sort(key=lambda item: item.get_closest_marker("quiet") is not None)   # (stable: the rest keep their order)


QUIET_AFTER_ENV = "LINGBOT_QUIET_AFTER_PID"      # side_by_side.py: the other process, which quiet tests wait out


@pytest.fixture
def quiet_machine():
    """Wait (at most 15 minutes) until the process side_by_side.py runs beside this one has ended, so a test that
    bounds a stall measures this machine's cores, not their share left by the other process's tests."""
    import psutil
    pid = int(os.environ.get(QUIET_AFTER_ENV, "0"))
    deadline = time.monotonic() + 900
    while pid and time.monotonic() < deadline:
        try:                                     # (ended: gone, or a zombie side_by_side reaps after this one)
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(1.0)
