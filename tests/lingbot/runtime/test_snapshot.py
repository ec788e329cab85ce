"""Session snapshots: a fresh session given the snapshots of the chunks a continuation attends runs on bitwise
as the session they came from (K/V slots across the window's eviction, decoder and condition caches, RNG,
a prompt transition and a camera move running across the restore point); a snapshot copies only the slots
no earlier one did, and shares what did not change with the previous one while that is alive."""
import numpy as np
import pytest
import torch

from lingbot.camera import CameraEvent, Controls
from lingbot.runtime.snapshot import (
    HostCopier,
    StateSnapshot,
    chunks_to_restore,
    restore_snapshots,
    slots_to_copy,
    take_snapshot,
)
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
    # every chunk: its own slot; every 3rd chunk: what the continuation attends since the last one
    assert [slots_to_copy(k, k - 1, 3, 6) for k in (0, 4, 9)] == [[0], [4], [9]]
    assert [slots_to_copy(k, k - 3, 3, 6) for k in (0, 3, 6, 9)] == [[0], [1, 2, 3], [5, 6], [8, 9]]
    assert slots_to_copy(9, -1, 3, 6) == [0, 1, 2, 8, 9]          # no earlier snapshot: all of them


CHUNKS = 13
IMAGE_SEED = 4321           # a first frame no other test runs: its condition is encoded, not replayed from the cache
EVERY = 3                   # the snapshots of the interval test: after chunks 0, 3, 6, 9, 12


@pytest.fixture(scope="module")
def whole(tiny, tiny_pipeline):
    """One session of CHUNKS chunks: its frames; a snapshot after every chunk (the odd ones through a copier
    that knows the session, the even ones without), and one every EVERY chunks copying only the slots no
    earlier one did."""
    session = tiny_pipeline.new_session(random_image(tiny, IMAGE_SEED), "a harbour", seed=7)
    frames, snapshots, every = [], {}, {}
    copier, sparse = HostCopier("cpu"), HostCopier("cpu")          # on CPU a plain copy, done when it returns
    for k in range(CHUNKS):
        frames.append(session.step(controls(k), prompt=prompt(k)).frames.clone())
        snapshots[k] = take_snapshot(session, copier=copier, key="s") if k % 2 else take_snapshot(session)
        if k % EVERY == 0:
            every[k] = take_snapshot(session, copier=sparse, key="s", since=k - EVERY)
    assert not copier.asynchronous and copier.last is None and copier.pending == {}
    return {"frames": frames, "snapshots": snapshots, "every": every, "copier": copier, "kv": session.dit.kv}


def _continues(tiny_pipeline, tiny, whole, slots, state, replay_to=None):
    """A fresh session restored from `slots` and `state`, the chunks up to `replay_to` run again: its frames
    from there on are the whole session's, bitwise."""
    fresh = tiny_pipeline.new_session(random_image(tiny, IMAGE_SEED), "a harbour", seed=7)
    restore_snapshots(fresh, slots, state)
    for k in range(state.index + 1, CHUNKS):
        got = fresh.step(controls(k), prompt=prompt(k)).frames
        assert torch.equal(got, whole["frames"][k]), (k, "replayed" if replay_to and k <= replay_to else "")


@pytest.mark.parametrize("restore_after", [1, 9])          # inside the first window; after evictions
def test_a_restored_session_continues_bitwise(tiny, tiny_pipeline, whole, restore_after):
    snapshots, kv = whole["snapshots"], whole["kv"]
    needed = chunks_to_restore(restore_after, kv.sink_chunks, kv.window_chunks)
    _continues(tiny_pipeline, tiny, whole, [snapshots[c][0][0] for c in needed], snapshots[restore_after][1])
    [slot], state = snapshots[restore_after]
    assert slot.index == restore_after and slot.nbytes() == kv.keys.nbytes * 2 // kv.window_chunks
    assert state.nbytes() > 0


def test_snapshots_every_k_chunks_copy_each_slot_once_and_restore_then_replay_bitwise(tiny, tiny_pipeline, whole):
    """Every 3 chunks, each snapshot copies the slots the continuation attends that no earlier one copied (a
    chunk that left the window before a snapshot needed it, 4 and 7 here, is never copied); a session
    delivered up to chunk 8 restores the newest snapshot at or before it (6, from the slots of snapshots 0, 3
    and 6) and replays 7 and 8: bitwise the session without the restore."""
    every = whole["every"]
    assert {k: [s.index for s in slots] for k, (slots, _) in every.items()} == \
        {0: [0], 3: [1, 2, 3], 6: [5, 6], 9: [8, 9], 12: [11, 12]}
    copied = [s for slots, _ in every.values() for s in slots]
    slots = [s for s in copied if s.index in chunks_to_restore(6, 3, 6)]
    assert [s.index for s in slots] == [0, 1, 2, 5, 6]
    _continues(tiny_pipeline, tiny, whole, slots, every[6][1], replay_to=8)


def test_what_did_not_change_is_not_copied_again(whole):
    """The text embedding is the same tensor from chunk 6 on (the transition started at 4 reached its target):
    while the snapshot of 9 is alive, the one of 11 shares its copy; the decoder cache changes every chunk."""
    snapshots = whole["snapshots"]
    text = [snapshots[k][1].state["dit"]["text"] for k in (9, 11)]
    assert text[0] is text[1] and whole["copier"].reused_bytes >= text[0].nbytes
    decoder = [snapshots[k][1].state["decoder"] for k in (9, 11)]
    assert all(decoder[0][key] is not decoder[1][key] for key in decoder[0])
    # the 9th shares with the 7th too (the even ones went through another copier): each state stands alone
    assert snapshots[9][1].state["dit"]["text"] is snapshots[7][1].state["dit"]["text"]
    assert snapshots[8][1].state["dit"]["text"] is not text[0]


def test_restore_refuses_what_cannot_continue(tiny, tiny_pipeline):
    image = random_image(tiny)
    whole = tiny_pipeline.new_session(image, "a harbour", seed=7)
    snaps = []
    for _ in range(3):
        whole.step()
        snaps.append(take_snapshot(whole))
    slots = [s for (s,), _ in snaps]
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


def test_the_budget_is_what_real_snapshots_hold(tiny, whole):
    """snapshot_budget's bytes against the snapshots of a real session (SP-1; SP-2 in
    tests/lingbot/parallel/test_group_once.py): a K/V slot, the state at its largest (chunks 4 and 5: a prompt
    transition running, so three text embeddings, before the condition's fixed point, so the encoder's cache),
    what one snapshot copies, and what a continuation needs (after chunk 5: the slots of 0-2, 4 and 5)."""
    from lingbot.runtime.budget import condition_chunk_bytes
    from lingbot.runtime.snapshot_budget import snapshot_footprint
    snapshots = whole["snapshots"]
    budget = snapshot_footprint(tiny)
    assert all(slot.nbytes() == budget.slot for (slot,), _ in snapshots.values())
    states = {k: state.nbytes() for k, (_, state) in snapshots.items()}
    assert max(states.values()) == budget.state == states[4] == states[5]
    # after the fixed point (chunk 10) and the transition: one text embedding, the fixed latents
    assert states[12] == sum(budget.decoder_cache) + budget.text[0] + budget.rng + condition_chunk_bytes(tiny)
    decoder = snapshots[5][1].state["decoder"]
    assert tuple(t.nbytes for t in decoder.values()) == budget.decoder_cache
    assert sum(t.nbytes for t in snapshots[5][1].state["condition"]["cache"].values()) == sum(budget.condition)
    assert max(sum(s.nbytes() for s in slots) + state.nbytes() for slots, state in snapshots.values()) \
        == budget.snapshot == budget.per_chunk
    needed = chunks_to_restore(5, 3, 6)
    assert sum(snapshots[c][0][0].nbytes() for c in needed) + states[5] == budget.held
    # every 3 chunks: at most 3 slots a snapshot while the window fills, 2 once it is full
    every = snapshot_footprint(tiny, interval=EVERY)
    copied = [len(slots) for slots, _ in whole["every"].values()]
    assert max(copied) == every.snapshot_slots == 3 and copied[-2:] == [every.steady_slots] * 2 == [2, 2]
    assert every.per_chunk == (2 * budget.slot + budget.state) / 3
