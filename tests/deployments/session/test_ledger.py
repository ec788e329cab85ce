"""The continuity ledger without Ray: journal, owed interactions and the snapshot keys it keeps through faults,
drains and resumes, and lets go of (the keeper frees what they name)."""
import pickle

from deployments.session.events import ChunkControls, ChunkReady, InteractionState, ModelFacts, SnapshotRef
from deployments.session.ledger import ContinuityLedger
from deployments.session.requests import Interaction
from lingbot.config import get_preset

FACTS = ModelFacts.of(get_preset("lingbot-world-v2-14b"))      # sink 3 chunks, window 6 chunks
FPS = 16.0


def chunk(index: int, started=(), snapshots=(), frames=None, prompt=None) -> ChunkReady:
    frames = frames or FACTS.geometry.pixel_frames(index)
    return ChunkReady(index, b"", frames, list(started), [], [], {}, 0.0,
                      controls=ChunkControls(keys=(f"k{index}",) * 3, prompt=prompt),
                      interactions=InteractionState({}, f"held{index}"), snapshots=tuple(snapshots))


def refs(index: int, ranks=(0, 1)) -> list[SnapshotRef]:
    return [SnapshotRef(index, r, f"slot{index}.{r}", f"state{index}.{r}") for r in ranks]


def ledger_after(chunks: int, ranks: int = 2, released=None) -> ContinuityLedger:
    ledger = ContinuityLedger(ranks, release=(released if released is not None else []).extend)
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
    # only what the continuation after 9 attends (0-2, 8 and 9) is kept, and only the newest state
    assert sorted(ledger.slots) == [0, 1, 2, 8, 9] and sorted(ledger.states) == [9]
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
    assert sorted(ledger.slots) == [0, 1, 2, 6, 7, 8]                              # 7's set, and 8 on its way
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


def test_snapshots_every_k_chunks_restore_the_newest_and_journal_the_rest():
    """Every 3 chunks (snapshot_interval_chunks 3) a snapshot carries the slots no earlier one did, the older
    ones without a state: a resume restores the newest snapshot at or before the last delivered chunk from
    the slots of several snapshots, and replays the chunks after it (at most 2)."""
    carried = {0: [0], 3: [1, 2, 3], 6: [5, 6], 9: [8, 9]}
    ledger = ContinuityLedger(2)
    ledger.facts = FACTS
    for i in range(9):
        snaps = [SnapshotRef(c, r, f"slot{c}.{r}", f"state{i}.{r}" if c == i else None)
                 for c in carried.get(i, []) for r in (0, 1)]
        ledger.delivered(chunk(i, snapshots=snaps), FPS, now=100.0 + i)
    assert ledger.restorable() == 6 and sorted(ledger.states) == [6]
    assert sorted(ledger.slots) == [0, 1, 2, 5, 6]                  # 3's slot left the window: let go
    resume = ledger.resume()
    assert resume.snapshot_index == 6 and resume.next_index == 9           # 7 and 8 replayed from the journal
    assert [r.slots for r in resume.restore] == [tuple(f"slot{c}.{r}" for c in (0, 1, 2, 5, 6)) for r in (0, 1)]
    assert [r.state for r in resume.restore] == ["state6.0", "state6.1"]


def test_every_key_let_go_is_released_once_and_none_a_resume_needs():
    """What the ledger stops holding goes to `release` as it goes (once each, a key replaced by a newer snapshot
    of its chunk too); what it holds is exactly what it was given minus what it released, and a resume names
    only keys it holds."""
    released = []
    ledger = ledger_after(12, released=released)
    given = {k for i in range(12) for r in refs(i) for k in (r.slot, r.state)}
    assert len(released) == len(set(released))                     # each once
    assert set(released) | ledger._keys() == given and not set(released) & ledger._keys()
    assert sorted(ledger.slots) == [0, 1, 2, 10, 11] and sorted(ledger.states) == [11]
    assert "slot5.0" in released and "state10.1" in released and "slot0.0" not in released
    ledger.keep([SnapshotRef(11, 0, "slot11.0-again", "state11.0-again")])    # the same chunk snapshotted again
    assert released[-2:] == ["slot11.0", "state11.0"]
    resume = ledger.resume(owner="the keeper")
    needed = {k for r in resume.restore for k in (*r.slots, r.state)}
    assert needed <= ledger._keys() and {r.owner for r in resume.restore} == {"the keeper"}


def test_keys_that_come_in_and_are_already_older_are_released_at_once():
    """A reply may carry several snapshots (a put was late: SNAPSHOTS_IN_FLIGHT): delivered with chunk 5, the
    snapshots of 3 and 4; 4 is the newest complete set, so 3's state goes back at once, never held."""
    released = []
    ledger = ledger_after(3, released=released)
    ledger.delivered(chunk(3), FPS, now=200.0)
    ledger.delivered(chunk(4), FPS, now=201.0)
    released.clear()
    ledger.delivered(chunk(5, snapshots=refs(3) + refs(4)), FPS, now=202.0)
    assert ledger.restorable() == 4
    assert {"state3.0", "state3.1", "state2.0", "state2.1"} <= set(released)
    assert not {"state4.0", "state4.1"} & set(released) and "state3.0" not in ledger._keys()


def test_a_prompt_repeated_over_chunks_is_sent_once_in_a_resume():
    """Each chunk's controls come from the group over Ray, so an equal prompt is a new str each time: the ledger
    keeps one of them, and a resume of 50 chunks that carry the same 4,096-character prompt pickles (as it
    crosses to the new group) to about one prompt's size."""
    ledger = ContinuityLedger(2)
    prompts = ["".join(["w"] * 4096) for _ in range(50)]
    assert prompts[0] is not prompts[1]
    for i, prompt in enumerate(prompts):
        ledger.delivered(chunk(i, prompt=prompt), FPS, now=100.0 + i)
    ledger.delivered(chunk(50), FPS, now=150.0)
    resume = ledger.resume()
    assert len(pickle.dumps(resume)) < 2 * 4096
    assert all(c.prompt is resume.journal[0].prompt for c in resume.journal[:50]) and resume.journal[50].prompt is None
    again = pickle.loads(pickle.dumps(resume))
    assert again.journal == resume.journal and again.journal[49].prompt == "w" * 4096
    assert [c.keys for c in again.journal] == [(f"k{i}",) * 3 for i in range(51)]
