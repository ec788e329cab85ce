"""Session snapshots: a fresh session given the snapshots of the chunks a continuation attends runs on bitwise
as the session they came from (K/V slots across the window's eviction, decoder and condition caches, RNG,
a prompt transition and a camera move running across the restore point)."""
import numpy as np
import pytest
import torch

from lingbot.camera import CameraEvent, Controls
from lingbot.runtime.snapshot import HostCopier, StateSnapshot, chunks_to_restore, restore_snapshots, take_snapshot
from tests.conftest import random_image


def controls(k):
    keys = ("w", "wj", "")[k % 3], "d" if k % 2 else "", "l"
    camera = CameraEvent("target", (0.1, 0.0, 0.4), (0.0, 0.0, 0.0, 1.0), 3) if k == 5 else None
    return Controls(keys=keys, camera=camera)


def prompt(k):
    return ("a snowy harbour", 3) if k == 4 else None


def test_chunks_to_restore_follow_the_window():
    assert chunks_to_restore(0, 3, 6) == [0]
    assert chunks_to_restore(4, 3, 6) == [0, 1, 2, 3, 4]
    assert chunks_to_restore(9, 3, 6) == [0, 1, 2, 8, 9]          # chunk 10 sees the sink and 8, 9


@pytest.mark.parametrize("restore_after", [1, 9])          # inside the first window; after evictions
def test_a_restored_session_continues_bitwise(tiny, tiny_pipeline, restore_after):
    image = random_image(tiny)
    whole = tiny_pipeline.new_session(image, "a harbour", seed=7)
    frames, snapshots = [], {}
    copier = HostCopier("cpu")                             # on CPU a plain copy, done when it returns
    for k in range(13):
        frames.append(whole.step(controls(k), prompt=prompt(k)).frames.clone())
        snapshots[k] = take_snapshot(whole, copier=copier, key="s") if k % 2 else take_snapshot(whole)
    assert not copier.asynchronous and copier.last is None and copier.pending == {}
    kv = whole.dit.kv
    needed = chunks_to_restore(restore_after, kv.sink_chunks, kv.window_chunks)
    fresh = tiny_pipeline.new_session(image, "a harbour", seed=7)
    restore_snapshots(fresh, [snapshots[c][0] for c in needed], snapshots[restore_after][1])
    for k in range(restore_after + 1, 13):
        got = fresh.step(controls(k), prompt=prompt(k)).frames
        assert torch.equal(got, frames[k]), k
    slot, state = snapshots[restore_after]
    assert slot.nbytes() == kv.keys.nbytes * 2 // kv.window_chunks and state.nbytes() > 0


def test_restore_refuses_what_cannot_continue(tiny, tiny_pipeline):
    image = random_image(tiny)
    whole = tiny_pipeline.new_session(image, "a harbour", seed=7)
    snaps = []
    for _ in range(3):
        whole.step()
        snaps.append(take_snapshot(whole))
    slots = [s for s, _ in snaps]
    with pytest.raises(ValueError, match=r"chunks \[1\] are missing"):
        restore_snapshots(tiny_pipeline.new_session(image, "a harbour", seed=7), [slots[0], slots[2]], snaps[2][1])
    with pytest.raises(ValueError, match="another rank or group size"):
        restore_snapshots(tiny_pipeline.new_session(image, "a harbour", seed=7), slots, snaps[2][1], rank=1,
                          world_size=2)
    used = tiny_pipeline.new_session(image, "a harbour", seed=7)
    used.step()
    with pytest.raises(ValueError, match="has not run a chunk"):
        restore_snapshots(used, slots, snaps[2][1])
    older = StateSnapshot.__new__(StateSnapshot)          # as a snapshot of the fields before `state` unpickles
    older.__dict__.update(index=2, rank=0, world_size=1, rng=snaps[2][1].state["dit"]["rng"])
    with pytest.raises(ValueError, match="another version"):
        restore_snapshots(tiny_pipeline.new_session(image, "a harbour", seed=7), slots, older)
    with pytest.raises(ValueError, match="right after a committed chunk"):
        take_snapshot(tiny_pipeline.new_session(image, "a harbour", seed=7))
    assert np.isfinite(snaps[-1][1].nbytes())
