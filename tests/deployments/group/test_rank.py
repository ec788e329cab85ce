"""A rank worker without Ray (one rank, CPU): its lifecycle from join, and all device work on one thread of
its own whatever thread a call comes in on (CUDA graph trees, the current device and grad mode are per
thread)."""
import threading

import numpy as np

from deployments.group.messages import DeviceStats
from deployments.group.rank import RankWorker
from deployments.group.replica import device_metric_tags
from deployments.session.events import ChunkControls
from deployments.settings import ServeSettings
from tests.deployments.group.rank_calls import chunk, opening


def test_device_work_runs_on_one_thread():
    worker = RankWorker(ServeSettings.from_args({"sp": 1}).to_dict(), rank=0, world_size=1)
    info = worker.join(None)
    assert info.capacity == 2 and (info.facts.width, info.facts.height) == (112, 64)
    seen = set()
    worker.pipeline.runner.model.register_forward_pre_hook(lambda module, args: seen.add(threading.get_ident()))
    assert worker.open_session(opening("s", np.zeros((64, 112, 3), np.uint8), "a harbour", 1)) == 0   # from chunk 0
    callers = []

    def call(index):
        callers.append(threading.get_ident())
        reply = worker.run_chunk(chunk("s", index, ChunkControls(keys=("w", "", "l"))))
        assert not reply.stopped

    for index in range(2):                                  # two different calling threads, like Ray's pool
        t = threading.Thread(target=call, args=(index,))
        t.start()
        t.join(timeout=120)
    device_thread = worker._on_device(threading.get_ident)
    assert seen == {device_thread} and device_thread not in callers
    worker.stop("s")
    assert worker.run_chunk(chunk("s", 2, ChunkControls())).stopped


def test_the_rank_device_is_the_one_ray_assigned():
    import pytest

    from deployments.group.device import assigned_device
    # Ray narrowed the visible devices to the assignment: torch sees it as device 0
    assert assigned_device("cuda", {"GPU": ["3"]}, {"CUDA_VISIBLE_DEVICES": "3"}) == "cuda:0"
    # a process that sees several devices: the assigned id's position among them
    assert assigned_device("cuda", {"GPU": ["5"]}, {"CUDA_VISIBLE_DEVICES": "4,5"}) == "cuda:1"
    # the variable left alone (Ray's NOSET_CUDA_VISIBLE_DEVICES): the node's own numbering
    assert assigned_device("cuda", {"GPU": ["6"]}, {}) == "cuda:6"
    assert assigned_device("npu", {"NPU": ["2"]}, {"ASCEND_RT_VISIBLE_DEVICES": "2"}) == "npu:0"
    assert assigned_device("npu", {"NPU": ["7"]}, {}) == "npu:7"
    with pytest.raises(RuntimeError, match="assigned no NPU by Ray"):
        assigned_device("npu", {"GPU": ["0"]}, {})
    with pytest.raises(RuntimeError, match=r"assigned GPU 1 is not in CUDA_VISIBLE_DEVICES=0"):
        assigned_device("cuda", {"GPU": ["1"]}, {"CUDA_VISIBLE_DEVICES": "0"})


def test_a_cpu_rank_reports_its_process():
    worker = RankWorker(ServeSettings.from_args({"sp": 1}).to_dict(), rank=0, world_size=1)
    first = worker.device_stats()
    assert first.utilization != first.utilization                 # NaN: no earlier sample to compare with
    sum(i * i for i in range(3_000_000))                           # ~0.2 s of CPU time between the samples
    second = worker.device_stats()
    assert second.utilization > 0 and second.memory_used > 50 * 2 ** 20   # a torch process: > 50 MiB resident


def test_an_aborted_chunk_changes_nothing_and_runs_again():
    worker = RankWorker(ServeSettings.from_args({"sp": 1}).to_dict(), rank=0, world_size=1)
    worker.join(None)
    assert worker.open_session(opening("s", np.zeros((64, 112, 3), np.uint8), "a harbour", 1)) == 0   # from chunk 0
    assert not worker.run_chunk(chunk("s", 0, ChunkControls(keys=("w", "", "l")))).stopped
    worker.abort_chunk("s", 1)                              # the group gives chunk 1 up (a fresher control came)
    assert worker.run_chunk(chunk("s", 1, ChunkControls(keys=("w", "w", "w")))).stopped
    assert worker.sessions["s"].world.chunk_index == 1 and worker.sessions["s"].abort_index is None  # flag spent
    assert not worker.run_chunk(chunk("s", 1, ChunkControls(keys=("l", "l", "l")))).stopped   # run again, with it
    assert worker.sessions["s"].world.chunk_index == 2
    worker.abort_chunk("s", 1)                              # too late for a chunk already done: ignored
    assert not worker.run_chunk(chunk("s", 2, ChunkControls())).stopped
    worker.close_session("s")
    assert worker.sessions == {} and "s" in worker.stopped


def test_device_metrics_are_tagged_by_the_rank_that_measured_them():
    """Each rank measures its own device (whatever index the node gives it); the group tags by rank, and a
    rank without an accelerator (CPU) reports nothing."""
    rank0, rank1 = DeviceStats(90.0, 5 << 30), DeviceStats(40.0, 7 << 30)
    assert device_metric_tags("g1", [rank0, rank1]) == [(rank0, {"group": "g1", "rank": "0"}),
                                                     (rank1, {"group": "g1", "rank": "1"})]
    assert device_metric_tags("g1", [None, rank1]) == [(rank1, {"group": "g1", "rank": "1"})]
    worker = RankWorker(ServeSettings.from_args({"sp": 1}).to_dict(), rank=0, world_size=1)
    assert worker.device.type == "cpu" and worker.device_stats().memory_used > 0       # CPU: the rank's process


def test_a_rank_runs_the_dtype_of_its_settings():
    """The serving setting `dtype` reaches the rank's lifecycle (load, warm-up in bf16 on the CPU): the DiT,
    its K/V and the text encoder in bf16, the VAE as configured (float32); the facts and the footprint the
    rank reports are the bf16 model's; a session runs."""
    import torch

    from lingbot.config import get_preset, with_dtype
    from lingbot.runtime.budget import session_footprint
    worker = RankWorker(ServeSettings.from_args({"sp": 1, "dtype": "bfloat16"}).to_dict(), rank=0, world_size=1)
    info = worker.join(None)
    runner = worker.pipeline.runner
    assert info.facts.dtype == "bfloat16" and runner.preset.dtype == "bfloat16"
    assert runner.model.dtype == runner.text_encoder.model.dtype == torch.bfloat16
    assert next(worker.pipeline.vae.parameters()).dtype == torch.float32
    footprint = session_footprint(with_dtype(get_preset("tiny"), "bfloat16"), decoders=info.facts.decoders)
    assert info.session_bytes == footprint.total and info.facts.decoders == ("tae", "wan")
    assert footprint.latent_ring == 13 * 16 * 3 * 8 * 14 * 4          # both decoders: a ring of 13 chunks' latents
    assert worker.open_session(opening("s", np.zeros((64, 112, 3), np.uint8), "a harbour", 1)) == 0
    assert not worker.run_chunk(chunk("s", 0, ChunkControls(keys=("w", "", "l")))).stopped
    assert worker.sessions["s"].world.dit.kv.keys.dtype == torch.bfloat16
