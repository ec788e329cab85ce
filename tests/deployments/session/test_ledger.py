"""The continuity ledger without Ray: journal, owed interactions and the snapshot references it keeps through
faults, drains and resumes (the references are plain strings here: the ledger only holds them)."""
from deployments.session.events import ChunkControls, ChunkReady, InteractionState, ModelFacts, SnapshotRef
from deployments.session.ledger import ContinuityLedger
from deployments.session.requests import Interaction
from lingbot.config import get_preset

FACTS = ModelFacts.of(get_preset("lingbot-world-v2-14b"))      # sink 3 chunks, window 6 chunks
FPS = 16.0


def chunk(index: int, started=(), snapshots=(), frames=None) -> ChunkReady:
    frames = frames or FACTS.geometry.pixel_frames(index)
    return ChunkReady(index, b"", frames, list(started), [], [], {}, 0.0,
                      controls=ChunkControls(keys=(f"k{index}",) * 3),
                      interactions=InteractionState({}, f"held{index}"), snapshots=tuple(snapshots))


def refs(index: int, ranks=(0, 1)) -> list[SnapshotRef]:
    return [SnapshotRef(index, r, f"slot{index}.{r}", f"state{index}.{r}") for r in ranks]


def ledger_after(chunks: int, ranks: int = 2) -> ContinuityLedger:
    ledger = ContinuityLedger(ranks)
    ledger.facts = FACTS
    for i in range(chunks):
        ledger.delivered(chunk(i, snapshots=refs(i, range(ranks))), FPS, now=100.0 + i)
    return ledger


def test_the_facts_are_the_engine_window():
    assert (FACTS.sink_chunks, FACTS.window_chunks) == (3, 6)
    assert FACTS.restore_chunks(1) == [0, 1] and FACTS.restore_chunks(9) == [0, 1, 2, 8, 9]


def test_a_resume_restores_the_newest_complete_set_and_journals_the_rest():
    ledger = ledger_after(10)
    assert ledger.chunks == 10 and ledger.frames_delivered == 9 + 12 * 9
    assert ledger.restorable() == 9
    # the sink and the window's recent chunks are kept (the continuation after 9 attends 0-2, 8 and 9), and only
    # the newest state
    assert sorted(ledger.slots) == [0, 1, 2, 4, 5, 6, 7, 8, 9] and sorted(ledger.states) == [9]
    resume = ledger.resume(now=200.0, wall=5000.0)
    assert resume.snapshot_index == 9 and resume.next_index == 10
    assert [r.slots for r in resume.restore] == [tuple(f"slot{c}.{r}" for c in (0, 1, 2, 8, 9)) for r in (0, 1)]
    assert [r.state for r in resume.restore] == ["state9.0", "state9.1"]
    assert resume.journal[3].keys == ("k3",) * 3 and resume.interactions.held == "held9"
    # the player starts at the first chunk and waits when it runs dry (each chunk came 1 s after the last and
    # plays 0.75 s): it runs out 0.75 s after the last one arrived, given on the wall clock
    assert resume.playback_end == 5000.0 + (109.0 + 12 / FPS - 200.0)


def test_a_late_rank_keeps_the_previous_set_and_memory_stays_bounded():
    ledger = ledger_after(8)
    ledger.delivered(chunk(8, snapshots=refs(8, ranks=(0,))), FPS, now=200.0)    # rank 1's put is late
    assert ledger.restorable() == 7                                               # 8 is not complete
    ledger.keep(refs(8, ranks=(1,)))                                              # it arrives with the next event
    assert ledger.restorable() == 8
    # a rank whose snapshots keep failing: no set completes, and still only the sink and the window are held
    ledger = ledger_after(0)
    for i in range(30):
        ledger.delivered(chunk(i, snapshots=refs(i, ranks=(0,))), FPS, now=100.0 + i)
    assert ledger.restorable() is None and ledger.resume().restore == () and ledger.resume().snapshot_index == -1
    assert sorted(ledger.slots) == [0, 1, 2, 24, 25, 26, 27, 28, 29] and sorted(ledger.states) == [27, 28, 29]


def test_a_drain_hands_over_the_last_chunk_and_owed_interactions_follow_the_session():
    ledger = ledger_after(5)
    ledger.delivered(chunk(5), FPS, now=300.0)                # its snapshots come with Moving
    assert ledger.restorable() == 4
    ledger.keep(refs(5))
    assert ledger.restorable() == 5
    for event_id in ("a", "b", "c"):
        ledger.posted(Interaction(event_id, keys=["w"]))
    ledger.refused("b")                                       # the group refused it: not owed any more
    ledger.delivered(chunk(6, started=["a"], snapshots=refs(6)), FPS, now=301.0)
    assert [i.event_id for i in ledger.unstarted] == ["c"]     # a started; c is posted again after a resume


def test_before_admission_nothing_is_restorable():
    ledger = ContinuityLedger(2)
    ledger.keep(refs(0))
    assert ledger.restorable() is None and ledger.resume().snapshot_index == -1
