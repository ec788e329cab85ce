"""A rank's snapshots without Ray (one rank, CPU, the tiny pipeline): a keeper that keeps what it is given under
keys and lends it back, a muxer that keeps the frames, and ray.get that returns what it is given. With
snapshot_interval_chunks 3, each snapshot copies the K/V slots no earlier one did; a session resumed from the
continuity ledger restores the newest snapshot at or before its last delivered chunk, replays the chunks after
it, and goes on bitwise as the session without the fault."""
import types
from concurrent.futures import wait

import numpy as np
import pytest

from deployments.group.rank import RankWorker
from deployments.session.events import ChunkControls, ChunkReady, InteractionState, ModelFacts, SnapshotOwner
from deployments.session.ledger import ContinuityLedger
from deployments.settings import ServeSettings
from lingbot.parallel import Comm
from tests.deployments.group.rank_calls import chunk, opening

INTERVAL = 3
KEYS = (("w", "", "l"), ("i", "a", ""), ("", "d", "j"), ("s", "", "k"))


class Keeper:
    """keep.remote(session, slots, state) -> keys; lend.remote(keys) -> the objects themselves (ray.get returns
    what it is given here), as SnapshotKeeper lends the references of what it keeps."""

    def __init__(self, fail_first: bool = False):
        self.kept, self.fail_first, self.held = [], fail_first, {}
        self.keep = types.SimpleNamespace(remote=self._keep)
        self.lend = types.SimpleNamespace(remote=lambda keys: [self.held[k] for k in keys])

    def _keep(self, session_id, slots, state):
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("the keeper's node is gone")
        self.kept.append(([s.index for s in slots], state.index))
        keys = [f"{session_id}.{len(self.held) + i}" for i in range(len(slots) + 1)]
        self.held.update(zip(keys, [*slots, state]))
        return keys


class Muxer:
    def __init__(self):
        self.frames = {}
        self.encode = types.SimpleNamespace(remote=self._encode)

    def _encode(self, session_id, index, frames, sent):
        self.frames[session_id, index] = frames


@pytest.fixture
def worker(monkeypatch, tiny_pipeline):
    """A rank on the session-wide tiny pipeline; malloc left as the test process has it (a serving rank fixes
    the mmap threshold for its process's life, deployments/memory.py: here every large block would be mapped
    anew, the chunks twice as slow, and nothing tested depends on it)."""
    import ray

    from deployments.group import rank
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(rank, "keep_large_blocks_mapped", lambda: True)
    worker = RankWorker(ServeSettings(sp=1).to_dict(), rank=0, world_size=1)
    worker.pipeline, worker.comm = tiny_pipeline, Comm()          # joined: the session-wide tiny pipeline
    return worker


def _controls(index: int, rungs: bool = False) -> ChunkControls:
    """Chunk `index`'s keys; with `rungs`, a cheaper rung on some chunks past the sink (2, 3 or all steps)."""
    return ChunkControls(keys=KEYS[index % len(KEYS)], steps=(2, 3, None)[index % 3] if rungs else None)


def _run(worker, session_id, index, muxer, rungs=False):
    """One chunk, then its snapshot's copy and put done (the next chunk's reply carries its references)."""
    reply = worker.run_chunk(chunk(session_id, index, _controls(index, rungs), muxer))
    assert not reply.stopped
    worker._on_device(lambda: None)
    wait([f for _, f in worker.sessions[session_id].snapshots.puts])
    return reply


def _delivered(ledger, index, reply, rungs=False):
    frames = 9 if index == 0 else 12
    ledger.delivered(ChunkReady(index, b"", frames, [], [], [], {}, 0.0, controls=_controls(index, rungs),
                                interactions=InteractionState({}, None), snapshots=reply.snapshots), 16.0)


def test_snapshots_every_3_chunks_resume_by_restore_and_replay_bitwise(worker, tiny_pipeline):
    image = np.random.RandomState(3).randint(0, 256, (64, 112, 3), dtype=np.uint8)
    muxer, keeper = Muxer(), Keeper()
    ledger = ContinuityLedger(1)
    ledger.facts = ModelFacts.of(tiny_pipeline.preset)
    assert worker.open_session(opening("a", image, "a harbour", 5, keeper, every_chunks=INTERVAL)) == 0
    for index in range(9):                            # delivered up to chunk 8, then the group fails
        _delivered(ledger, index, _run(worker, "a", index, muxer))
    for index in (9, 10):                             # the session without the fault goes on
        _run(worker, "a", index, muxer)
    # every 3rd chunk, the slots its continuation attends that no earlier snapshot copied
    assert keeper.kept == [([0], 0), ([1, 2, 3], 3), ([5, 6], 6), ([8, 9], 9)]
    assert ledger.restorable() == 6 and sorted(ledger.slots) == [0, 1, 2, 5, 6] and sorted(ledger.states) == [6]
    resume = ledger.resume(SnapshotOwner(keeper, "a"))
    assert (resume.snapshot_index, resume.next_index) == (6, 9)

    # the new group: restored to chunk 6 from the slots of three snapshots, 7 and 8 replayed, then on
    again = Keeper(fail_first=True)                   # its first put is lost: the next copies every slot again
    assert worker.open_session(opening("b", image, "a harbour", 5, again, INTERVAL, resume.restore[0])) == 7
    for index in range(7, 11):
        _run(worker, "b", index, muxer)
        assert np.array_equal(muxer.frames["b", index], muxer.frames["a", index]), index
    # a drain hands the last chunk over: snapshotted now though 10 is not due, with every slot it attends
    refs = worker.flush_snapshots("b")
    assert again.kept == [([0, 1, 2, 9, 10], 10)]
    assert [(r.chunk, r.state is not None) for r in refs] == [(0, False), (1, False), (2, False), (9, False),
                                                             (10, True)]
    assert worker.flush_snapshots("b") == ()           # nothing newer to take


def test_chunks_run_on_cheaper_rungs_replay_bitwise_from_the_journal(worker, tiny_pipeline):
    """Chunks past the sink on the step rungs (2, 3 or all denoising forwards, the rung in each chunk's controls,
    so in the journal): resumed from the snapshot of chunk 3 with 4 and 5 replayed as they ran, the session goes
    on bitwise; the rungs changed its frames against the same session at full steps."""
    image = np.random.RandomState(6).randint(0, 256, (64, 112, 3), dtype=np.uint8)
    muxer, keeper = Muxer(), Keeper()
    ledger = ContinuityLedger(1)
    ledger.facts = ModelFacts.of(tiny_pipeline.preset)
    assert worker.open_session(opening("r", image, "a harbour", 8, keeper, every_chunks=INTERVAL)) == 0
    assert worker.open_session(opening("f", image, "a harbour", 8, Keeper(), every_chunks=INTERVAL)) == 0
    for index in range(6):
        _delivered(ledger, index, _run(worker, "r", index, muxer, rungs=True), rungs=True)
        if index <= 4:
            _run(worker, "f", index, muxer)
    for index in (6, 7):
        _run(worker, "r", index, muxer, rungs=True)
    assert all(np.array_equal(muxer.frames["r", i], muxer.frames["f", i]) for i in (0, 1, 2))   # the sink: all
    assert not np.array_equal(muxer.frames["r", 4], muxer.frames["f", 4])       # chunk 4 ran 3 steps
    resume = ledger.resume(SnapshotOwner(keeper, "r"))
    assert resume.snapshot_index == 3 and [c.steps for c in resume.journal[3:6]] == [2, 3, None]
    assert worker.open_session(opening("r2", image, "a harbour", 8, Keeper(), INTERVAL, resume.restore[0])) == 4
    for index in range(4, 8):                         # 4, 5 replayed (their journaled rungs), then on
        worker.run_chunk(chunk("r2", index, resume.journal[index] if index < 6 else _controls(index, True), muxer))
        worker._on_device(lambda: None)
        assert np.array_equal(muxer.frames["r2", index], muxer.frames["r", index]), index


DECODER_RUNGS = {3: ChunkControls(decoder="tae"), 4: ChunkControls(steps=2, decoder="tae"),
                 5: ChunkControls(decoder="tae", prewarm="wan"), 6: ChunkControls(), 7: ChunkControls(steps=3)}


def test_a_session_whose_chunks_switched_decoders_resumes_bitwise(worker, tiny, tiny_runner, tiny_vae):
    """A Wan session on a rank that loaded both decoders, its chunks 3-5 on the decoder rungs (the tiny decoder,
    one with 2 steps, one warming the Wan decoder a decode ahead of the climb) and back on its own decoder at 6:
    resumed from the snapshot of chunk 3, 4 and 5 replayed from the journal (their decoders in it), it goes on
    bitwise; the tiny chunks' frames are not the Wan decoder's."""
    from lingbot.io.weights import build_random_tae
    from lingbot.models.tae import TinyFrameDecoder
    from lingbot.models.vae import FrameDecoder
    from lingbot.runtime.pipeline import WorldPipeline
    worker.pipeline = WorldPipeline(tiny_runner, tiny_vae, decoders={
        "tae": TinyFrameDecoder(build_random_tae(tiny.tae, tiny.weights_seed)), "wan": FrameDecoder(tiny_vae)})
    image = np.random.RandomState(8).randint(0, 256, (64, 112, 3), dtype=np.uint8)
    muxer, keeper = Muxer(), Keeper()
    ledger = ContinuityLedger(1)
    ledger.facts = ModelFacts.of(tiny, decoders=("tae", "wan"))
    assert worker.open_session(opening("d", image, "a harbour", 8, keeper, INTERVAL, decoder="wan")) == 0
    assert worker.open_session(opening("w", image, "a harbour", 8, None, decoder="wan")) == 0     # on its own
    replies = {}
    for index in range(8):
        controls = DECODER_RUNGS.get(index, ChunkControls())
        replies[index] = reply = worker.run_chunk(chunk("d", index, controls, muxer))
        worker._on_device(lambda: None)
        wait([f for _, f in worker.sessions["d"].snapshots.puts])
        if index < 6:
            ledger.delivered(ChunkReady(index, b"", 9 if index == 0 else 12, [], [], [], {}, 0.0, controls=controls,
                                        interactions=InteractionState({}, None), snapshots=reply.snapshots), 16.0)
        if index < 4:
            worker.run_chunk(chunk("w", index, ChunkControls(), muxer))
    assert replies[5].warm is False and replies[4].warm is None         # one decode of the Wan decoder's 13
    assert np.array_equal(muxer.frames["d", 2], muxer.frames["w", 2])   # the same session until chunk 3 ...
    assert not np.array_equal(muxer.frames["d", 3], muxer.frames["w", 3])   # ... decoded by the tiny decoder
    decoding = worker.sessions["d"].world.decoding
    assert decoding.ring_chunks == 13 and [i for i, _ in decoding.ring] == list(range(8))
    resume = ledger.resume(SnapshotOwner(keeper, "d"))
    assert resume.snapshot_index == 3 and [c.decoder for c in resume.journal[3:6]] == ["tae"] * 3
    assert worker.open_session(opening("d2", image, "a harbour", 8, Keeper(), INTERVAL, resume.restore[0],
                                       decoder="wan")) == 4
    for index in range(4, 8):                         # 4, 5 replayed (their journaled decoders), then on
        worker.run_chunk(chunk("d2", index, resume.journal[index] if index < 6 else DECODER_RUNGS[index], muxer))
        worker._on_device(lambda: None)
        assert np.array_equal(muxer.frames["d2", index], muxer.frames["d", index]), index


def test_a_session_of_its_own_window_resumes_bitwise(worker, tiny_pipeline):
    """A session with its own K/V window (sink 2 chunks, window 4; the model's: 3 and 6), snapshotted every
    chunk: its ledger keeps what that window's continuation attends, and a resume after chunk 6 restores 5
    and goes on bitwise as the session without the fault (that the window differs from the model's from its
    first dropped chunk on: tests/lingbot/runtime/test_kv_cache.py)."""
    image = np.random.RandomState(5).randint(0, 256, (64, 112, 3), dtype=np.uint8)
    muxer, keeper = Muxer(), Keeper()
    ledger = ContinuityLedger(1)
    ledger.facts = ModelFacts.of(tiny_pipeline.preset).windowed((2, 4))
    assert worker.open_session(opening("w", image, "a harbour", 6, keeper, window=(2, 4))) == 0
    for index in range(7):
        _delivered(ledger, index, _run(worker, "w", index, muxer))
    for index in (7, 8):
        _run(worker, "w", index, muxer)
    # chunk 6's snapshot comes with chunk 7's reply (not delivered): a continuation after 5 attends the sink and 5
    assert ledger.restorable() == 5 and sorted(ledger.slots) == [0, 1, 5]
    resume = ledger.resume(SnapshotOwner(keeper, "w"))
    assert worker.open_session(opening("w2", image, "a harbour", 6, Keeper(), restore=resume.restore[0],
                                       window=(2, 4))) == 6
    for index in (6, 7, 8):                           # 6 replayed, then on
        _run(worker, "w2", index, muxer)
        assert np.array_equal(muxer.frames["w2", index], muxer.frames["w", index]), index


def test_closed_sessions_leave_nothing_on_the_rank(worker):
    """Sessions with snapshots, run and closed (one mid-chunk-stream, one after a flush): the rank's per-session
    structures (its sessions, the copier's last copies and pending copies, puts not done) are back to empty."""
    image = np.random.RandomState(4).randint(0, 256, (64, 112, 3), dtype=np.uint8)
    muxer, keeper = Muxer(), Keeper()
    before = worker.holdings()
    assert {k: v for k, v in before.items() if k != "object_refs"} == {"sessions": 0, "snapshot_copies": 0,
                                                                      "copies_pending": 0, "snapshots_unput": 0}
    for n, sid in enumerate(("x", "y", "z")):
        assert worker.open_session(opening(sid, image, "a harbour", n, keeper, every_chunks=2)) == 0
        for index in range(3 + n):
            _run(worker, sid, index, muxer)
    worker.flush_snapshots("y")
    assert worker.holdings()["sessions"] == 3 and worker.holdings()["snapshot_copies"] == 3
    for sid in ("x", "y", "z"):
        worker.close_session(sid)
    worker._on_device(lambda: None)                    # the copier forgets on the device thread
    assert worker.holdings() == before


def test_a_copy_queued_behind_a_sessions_close_is_not_taken(worker, tiny_pipeline):
    """A chunk queues its snapshot's copy on the device thread as it ends; a close from another thread can be
    queued before it. The late copy is not taken: the rank holds no host copy of the closed session (the served
    memory test once found one left after every session had ended)."""
    image = np.random.RandomState(4).randint(0, 256, (64, 112, 3), dtype=np.uint8)
    muxer, keeper = Muxer(), Keeper()
    assert worker.open_session(opening("c", image, "a field", 2, keeper, every_chunks=2)) == 0
    _run(worker, "c", 0, muxer)                                # copied (chunk 0 is due)
    _run(worker, "c", 1, muxer)                                # not due: chunk 1 is not copied yet
    held = worker.sessions["c"]
    worker.close_session("c")
    worker._on_device(worker.snapshots.take, "c", held.world, held.snapshots)     # a copy queued behind the close
    assert worker.holdings()["snapshot_copies"] == 0 and worker.holdings()["sessions"] == 0
