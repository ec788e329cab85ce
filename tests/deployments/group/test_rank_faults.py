"""A group of two rank workers (no Ray) on real gloo process groups in spawned processes: the group start
waits for a rank that loads slowly (the group start timeout, not the collective one), and a peer that dies
or hangs inside a collective makes the surviving rank's chunk call raise, soon, instead of hanging: the
group replica treats any exception from a rank's run_chunk as the group's failure
(deployments/group/engine.py)."""
import os
import signal
import time

import numpy as np

from lingbot.parallel import ParallelError
from lingbot.parallel.launch import run_ranks

IMAGE = np.zeros((64, 112, 3), np.uint8)


def _settings(**overrides):
    from deployments.settings import ServeSettings
    return ServeSettings.from_args({"sp": 2, **overrides}).to_dict()


def _in_the_nth_all_to_all(n, action):
    """From now on, the n-th all-to-all of this process runs `action` first (the peer is then inside it)."""
    import torch.distributed as dist
    original, calls = dist.all_to_all_single, []

    def all_to_all_single(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            action()
        return original(*args, **kwargs)
    dist.all_to_all_single = all_to_all_single


def _chunk_outcome(worker, index):
    """('ok', s) or (error type, message, s) of one chunk call, timed."""
    from deployments.session.events import ChunkControls
    from tests.deployments.group.rank_calls import chunk
    t0 = time.monotonic()
    try:
        worker.run_chunk(chunk("s", index, ChunkControls(keys=("w", "", "l"))))
        return ("ok", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _start(rank, world_size, init_method, settings, load_delay_s=0.0):
    """Join (rank 0 loading `load_delay_s` late, as from slow storage or the text encoder), then a session
    and its first chunk."""
    import lingbot.builder
    from deployments.group.rank import RankWorker
    from tests.deployments.group.rank_calls import opening
    if rank == 0 and load_delay_s:
        build = lingbot.builder.build_pipeline

        def slow_build(*args, **kwargs):
            time.sleep(load_delay_s)
            return build(*args, **kwargs)
        lingbot.builder.build_pipeline = slow_build
    worker = RankWorker(settings, rank, world_size)
    t0 = time.monotonic()
    worker.join(init_method)
    joined_s = time.monotonic() - t0
    assert worker.open_session(opening("s", IMAGE, "a harbour", 1)) == 0
    assert _chunk_outcome(worker, 0)[0] == "ok"
    return worker, joined_s


def _killed_in_a_collective(rank, world_size, init_method, settings):
    worker, _ = _start(rank, world_size, init_method, settings)
    if rank == 1:                     # dies inside the third all-to-all of chunk 1 (layer 1 of the first probe)
        _in_the_nth_all_to_all(3, lambda: os.kill(os.getpid(), signal.SIGKILL))
    return _chunk_outcome(worker, 1)


def test_a_rank_killed_inside_a_collective_fails_the_other_ranks_chunk_call_at_once():
    settings = _settings(collective_timeout_s=120.0)
    try:
        run_ranks(_killed_in_a_collective, 2, settings, timeout_s=240)
        raise AssertionError("rank 1 was to die")
    except ParallelError as e:
        assert "exited with code -9" in e.rank_errors[1]
        kind, message, seconds = e.results[0]
    assert kind == "ParallelError" and "rank 0/2: all_to_all failed" in message, message
    assert seconds < 30, f"rank 0 took {seconds:.1f} s to notice (collective timeout 120 s)"


def _slow_load_then_a_hung_peer(rank, world_size, init_method, settings, load_delay_s, hang_s, released):
    """Rank 1 hangs (alive) for up to `hang_s`; rank 0 ends the hang by creating the file `released` once its
    own chunk call has returned, so the test does not wait out the whole hang."""
    worker, joined_s = _start(rank, world_size, init_method, settings, load_delay_s if rank == 0 else 0.0)
    if rank == 1:                     # hangs inside the third all-to-all of chunk 1, alive

        def hang():
            until = time.monotonic() + hang_s
            while time.monotonic() < until and not os.path.exists(released):
                time.sleep(0.1)
        _in_the_nth_all_to_all(3, hang)
    outcome = _chunk_outcome(worker, 1)
    if rank == 0:
        open(released, "w").close()
    return joined_s, outcome


def test_a_slow_load_does_not_abort_the_group_and_a_hung_peer_fails_the_chunk_call_within_the_timeout(tmp_path):
    """Rank 0 loads 2 collective timeouts late: rank 1 waits for it after load (the group start timeout)
    instead of timing out in the warm-up's first collective. Then rank 1 hangs inside a collective: rank 0's
    chunk call raises after the collective timeout, long before the peer would have come back."""
    timeout_s, load_delay_s, hang_s = 4.0, 8.0, 30.0
    settings = _settings(collective_timeout_s=timeout_s, group_start_timeout_s=120.0)
    (_, outcome0), (joined1, outcome1) = run_ranks(_slow_load_then_a_hung_peer, 2, settings, load_delay_s, hang_s,
                                                   str(tmp_path / "released"), timeout_s=240)
    assert joined1 >= load_delay_s                            # it did wait for rank 0, past the collective timeout
    kind, message, seconds = outcome0
    assert kind == "ParallelError" and "rank 0/2: all_to_all failed" in message, message
    assert timeout_s - 0.5 <= seconds < hang_s - 5, f"{seconds:.1f} s (timeout {timeout_s} s, hang {hang_s} s)"
    assert outcome1[0] == "ParallelError"                     # the hung rank fails too once it comes back


def test_nccl_failures_end_the_process():
    """An NCCL failure is asynchronous: only a watchdog that ends the process makes it reach the group's
    failure path; the settings that would let the rank live on are overridden, the others are kept."""
    from lingbot.parallel.comm import NCCL_ERROR_HANDLING, nccl_failures_end_the_process
    for before, after in ((None, "3"), ("3", "3"), ("1", "1"), ("0", "3"), ("2", "3")):
        env = {} if before is None else {NCCL_ERROR_HANDLING: before}
        nccl_failures_end_the_process(env)
        assert env[NCCL_ERROR_HANDLING] == after, before
    legacy = {"NCCL_ASYNC_ERROR_HANDLING": "0"}              # the old name, still read by torch
    nccl_failures_end_the_process(legacy)
    assert legacy[NCCL_ERROR_HANDLING] == "3"
