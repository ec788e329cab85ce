"""Snapshots as files (lingbot/runtime/snapshot_file.py): a session's snapshots written and read back restore a
fresh session that runs on bitwise as the session they came from; tensors of every dtype come back equal; what
is not a snapshot is refused on writing, and a truncated, altered or foreign file on reading."""
import json
import struct

import numpy as np
import pytest
import torch

from lingbot.camera import CameraEvent, Controls
from lingbot.runtime.snapshot import chunks_to_restore, restore_snapshots, take_snapshot
from lingbot.runtime.snapshot_file import MAGIC, SnapshotFileError, dump, load
from tests.conftest import random_image

CHUNKS = 8


def controls(k):
    camera = CameraEvent("target", (0.1, 0.0, 0.4), (0.0, 0.0, 0.0, 1.0), 3) if k == 3 else None
    return Controls(keys=(("w", "wj", "")[k % 3], "d", "l"), camera=camera)


def test_a_snapshot_read_back_from_its_file_continues_the_session_bitwise(tiny, tiny_pipeline):
    session = tiny_pipeline.new_session(random_image(tiny, 77), "a harbour", seed=3)
    frames, snapshots = [], {}
    for k in range(CHUNKS):
        frames.append(session.step(controls(k), prompt=("a storm", 2) if k == 2 else None).frames.clone())
        snapshots[k] = take_snapshot(session, since=-1)           # every slot a continuation attends
    at = 4                                                        # inside a camera move and a prompt transition
    slots, state = snapshots[at]
    assert [s.index for s in slots] == chunks_to_restore(at, session.dit.kv.sink_chunks, session.dit.kv.window_chunks)
    data = dump([slots, state])
    back_slots, back_state = load(data)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(slots, back_slots))
    fresh = tiny_pipeline.new_session(random_image(tiny, 77), "a harbour", seed=3)
    restore_snapshots(fresh, back_slots, back_state)
    for k in range(at + 1, CHUNKS):
        assert torch.equal(fresh.step(controls(k)).frames, frames[k]), k


def test_tensors_of_every_dtype_and_plain_values_come_back_equal():
    obj = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": (torch.arange(5, dtype=torch.int64), None, 1.5, "x"),
           "c": [np.eye(4), True, {"d": torch.zeros(0, 2)}], "e": torch.tensor(3.0)[None][0]}
    back = load(dump(obj))
    assert torch.equal(back["a"], obj["a"]) and back["a"].dtype == torch.bfloat16
    assert torch.equal(back["b"][0], obj["b"][0]) and back["b"][1:] == (None, 1.5, "x")
    assert np.array_equal(back["c"][0], np.eye(4)) and back["c"][1] is True and back["c"][2]["d"].shape == (0, 2)
    assert back["e"].shape == () and float(back["e"]) == 3.0


def test_what_is_not_a_snapshot_is_refused_and_a_damaged_file_too():
    with pytest.raises(SnapshotFileError, match="cannot hold a builtin_function_or_method"):
        dump({"f": print})
    with pytest.raises(SnapshotFileError, match="string keys"):
        dump({1: torch.zeros(1)})
    data = dump({"t": torch.ones(4)})
    for broken in (data[:-3], b"x" + data[1:], data[:len(MAGIC) + 4]):
        with pytest.raises(SnapshotFileError):
            load(broken)
    length = struct.unpack_from("<Q", data, len(MAGIC))[0]
    header = json.loads(data[len(MAGIC) + 8:len(MAGIC) + 8 + length])
    for change in ({"structure": {"c": "os.system", "f": {}}}, {"structure": {"x": 1}},
                   {"tensors": [{"dtype": "complex64", "shape": [4], "offset": 0, "nbytes": 16}]},
                   {"tensors": [{"dtype": "float32", "shape": [400], "offset": 0, "nbytes": 1600}]}):
        altered = json.dumps({**header, **change}).encode()
        with pytest.raises(SnapshotFileError):
            load(MAGIC + struct.pack("<Q", len(altered)) + altered + data[len(MAGIC) + 8 + length:])
