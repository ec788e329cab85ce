"""A rank worker without Ray (one rank, CPU): its lifecycle from join, and all device work on one thread of
its own whatever thread a call comes in on (CUDA graph trees, the current device and grad mode are per
thread)."""
import threading

import numpy as np

from deployments.messages import ChunkControls
from deployments.rank import RankWorker
from deployments.settings import ServeSettings


def test_device_work_runs_on_one_thread():
    worker = RankWorker(ServeSettings.from_args({"sp": 1}).to_dict(), rank=0, world_size=1)
    info = worker.join(None)
    assert info.capacity == 2 and (info.width, info.height) == (112, 64)
    seen = set()
    worker.pipeline.runner.model.register_forward_pre_hook(lambda module, args: seen.add(threading.get_ident()))
    assert worker.open_session("s", np.zeros((64, 112, 3), np.uint8), "a harbour", 1, None)
    callers = []

    def call(index):
        callers.append(threading.get_ident())
        reply = worker.run_chunk("s", index, ChunkControls(keys=("w", "", "l")))
        assert not reply.stopped

    for index in range(2):                                  # two different calling threads, like Ray's pool
        t = threading.Thread(target=call, args=(index,))
        t.start()
        t.join(timeout=120)
    device_thread = worker._on_device(threading.get_ident)
    assert seen == {device_thread} and device_thread not in callers
    worker.stop("s")
    assert worker.run_chunk("s", 2, ChunkControls()).stopped
