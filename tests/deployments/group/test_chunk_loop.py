"""The group's chunk loop without Ray: stand-in rank actors, muxer and mailbox whose `.remote` calls are asyncio
tasks, so the scheduling logic (order, delivery, replay after a resume, refusals, failures) runs as the replica runs it.
The real ranks, muxer and mailbox are tested end to end in tests/deployments/test_app.py and test_faults.py."""
import asyncio
import dataclasses
import itertools

from deployments.group.chunk_loop import ChunkLoop
from deployments.group.executor import GroupFailure, RankExecutor
from deployments.group.state import GroupPhase, GroupState
from deployments.session.codes import ErrorCode
from deployments.session.events import (
    ChunkControls,
    ChunkReady,
    InteractionRefused,
    Resume,
    Resumed,
    SessionDone,
    SessionFailed,
)
from deployments.session.requests import Interaction
from lingbot.config import ConfigError, get_preset
from tests.deployments.group.standins import GEOMETRY, SETTINGS, Mailbox, Metrics, Muxer, Rank, session


def run(scenario_sessions, ranks_kw=(), settings=SETTINGS, mailbox_posts=(), until=None, model=None):
    """Run the loop over `scenario_sessions` until every outbox saw a final event (or the loop failed);
    returns ({session: [events]}, rank call log, failures)."""
    async def scenario():
        log, failures = [], []
        ranks = RankExecutor([Rank(r, log, **dict(ranks_kw)) for r in range(2)], settings.chunk_timeout_s)
        mailbox = Mailbox()
        for sid, interaction in mailbox_posts:
            mailbox.queue.put_nowait((sid, interaction))
        loop = ChunkLoop("g", settings, GroupState(), ranks, Muxer(), mailbox, Metrics(), failures.append,
                         model=model)
        outboxes = {s.id: loop.add(s) for s in scenario_sessions}
        events = {sid: [] for sid in outboxes}

        async def drain(sid, box):
            while True:
                event = await box.get()
                events[sid].append(event)
                if isinstance(event, (SessionDone, SessionFailed)):
                    return
        readers = [asyncio.ensure_future(drain(sid, box)) for sid, box in outboxes.items()]
        waiting = asyncio.ensure_future(asyncio.gather(*readers))
        while not waiting.done() and not failures:
            await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.sleep(0.02)
        return events, log, failures
    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_two_sessions_interleave_and_every_chunk_runs_on_every_rank():
    events, log, failures = run([session("a", 3), session("b", 2)])
    assert not failures
    for sid, chunks in (("a", 3), ("b", 2)):
        ready = [e for e in events[sid] if isinstance(e, ChunkReady)]
        assert [e.index for e in ready] == list(range(chunks)) and events[sid][-1] == SessionDone(chunks)
        assert [e.data for e in ready] == [f"{sid}:{i}".encode() for i in range(chunks)]
        assert [e.num_frames for e in ready] == [GEOMETRY.pixel_frames(i) for i in range(chunks)]
        # each chunk's snapshot references, every rank's, travel with it to the ingress's ledger
        assert all({(s.chunk, s.rank) for s in e.snapshots} == {(e.index, 0), (e.index, 1)} for e in ready)
    # one call per chunk to each rank; only rank 0 sends its frames to the muxer
    for sid, chunks in (("a", 3), ("b", 2)):
        for index in range(chunks):
            assert sorted((r, m) for r, s, i, m in log if (s, i) == (sid, index)) == [(0, True), (1, False)]
    order = [(s, i) for r, s, i, m in log if r == 0]
    assert order.index(("b", 0)) < order.index(("a", 2))        # interleaved at chunk boundaries, not one by one


def test_a_resumed_session_replays_without_delivering_then_goes_on():
    resumed = session("r", 4)
    controls = [ChunkControls(keys=("w",) * 3), ChunkControls(keys=("a",) * 3)]
    resumed.resume_from(Resume(tuple(controls), None, 9 + 12), restored=0)
    events, log, failures = run([resumed])
    assert not failures
    assert [(i, m) for r, s, i, m in log if r == 0] == [(0, False), (1, False), (2, True), (3, True)]
    kinds = [type(e) for e in events["r"]]
    assert kinds == [Resumed, ChunkReady, ChunkReady, SessionDone]
    assert (events["r"][0].replayed, events["r"][0].restored) == (2, 0)
    assert [e.index for e in events["r"] if isinstance(e, ChunkReady)] == [2, 3]
    # the replayed chunks' snapshots reach the ledger with the first delivered chunk
    assert {s.chunk for s in events["r"][1].snapshots} == {0, 1, 2}


def test_a_flood_of_controls_is_refused_one_by_one_and_the_session_goes_on():
    posts = [("c", Interaction(f"e{i}", keys=["w"])) for i in range(4)]
    events, _, failures = run([session("c", 3)], mailbox_posts=posts)
    assert not failures
    refused = [e for e in events["c"] if isinstance(e, InteractionRefused)]
    assert [(e.code, e.event_id) for e in refused] == [(ErrorCode.TOO_MANY_CONTROLS, "e2"),
                                                        (ErrorCode.TOO_MANY_CONTROLS, "e3")]
    started = [eid for e in events["c"] if isinstance(e, ChunkReady) for eid in e.started]
    assert started == ["e0", "e1"]                            # the two that fit the queue start together
    assert events["c"][-1] == SessionDone(3)


def test_a_rank_that_fails_or_hangs_fails_the_group():
    _, _, failures = run([session("f", 3)], ranks_kw={"fail_at": 1})
    assert [str(e) for e in failures] == ["rank 0 lost its device"]
    quick = dataclasses.replace(SETTINGS, chunk_timeout_s=0.2)
    _, _, failures = run([session("h", 3)], ranks_kw={"hang_at": 0}, settings=quick)
    assert len(failures) == 1 and isinstance(failures[0], GroupFailure)
    assert str(failures[0]) == "chunk 0 of session h did not come back from every rank within 0.2 s"


def test_a_group_that_hands_on_starts_no_chunk():
    async def scenario():
        state = GroupState()
        state.move(GroupPhase.STOPPING)
        state.move(GroupPhase.FILLING)
        state.move(GroupPhase.HANDING_ON)
        log = []
        loop = ChunkLoop("g", SETTINGS, state, RankExecutor([Rank(0, log)], 5.0), Muxer(), Mailbox(), Metrics(),
                         lambda e: None)
        loop.add(session("s", 3))
        await asyncio.sleep(0.1)
        await loop.settle()
        return log
    assert asyncio.run(scenario()) == []


def test_with_the_ladder_on_a_loaded_group_runs_chunks_past_the_sink_on_cheaper_rungs():
    """quality_ladder auto, two sessions at 16 fps whose chunks cost 0.5 s each at full (a load of 1.33): the sink
    (chunks 0-2) runs at full; from chunk 3 both sessions step down, one rung each first (evenly), then to the
    floor (steps2), and the rung of every chunk goes to the ranks in its controls. With the ladder off, or an
    idle group, every chunk is at full."""
    from deployments.session.events import ModelFacts
    facts = ModelFacts.of(get_preset("tiny"))
    laddered = dataclasses.replace(SETTINGS, quality_ladder="auto")
    steps = []
    events, _, failures = run([session("a", 8), session("b", 8)], {"engine_s": 0.5, "steps": steps}, laddered,
                              model=facts)
    assert not failures and all(isinstance(events[s][-1], SessionDone) for s in "ab")
    by = {sid: [st for s, i, st in sorted(steps) if s == sid] for sid in "ab"}
    for sid in "ab":
        assert by[sid][:3] == [None] * 3 and set(by[sid][3:]) <= {3, 2} and by[sid][-1] == 2, by
    idle = []
    run([session("a", 5)], {"engine_s": 0.01, "steps": idle}, laddered, model=facts)
    off = []
    run([session("a", 5), session("b", 5)], {"engine_s": 0.5, "steps": off}, model=facts)
    assert {st for _, _, st in idle} == {None} and {st for _, _, st in off} == {None}


def test_a_session_that_pins_a_rung_runs_every_chunk_past_its_sink_there_with_the_ladder_on_or_off():
    """extra_params.quality: steps3 pins the rung past the sink (its own window's sink when it has one), with the
    ladder off as on; `full` stays at full on a loaded group while the ladder steps the other session down."""
    from deployments.session.events import ModelFacts
    facts = ModelFacts.of(get_preset("tiny"))
    for settings in (SETTINGS, dataclasses.replace(SETTINGS, quality_ladder="auto")):
        steps = []
        run([session("p", 6, quality="steps3"), session("w", 6, quality="steps2", window=(1, 4))],
            {"engine_s": 0.01, "steps": steps}, settings, model=facts)
        by = {sid: [st for s, i, st in sorted(steps) if s == sid] for sid in "pw"}
        assert by == {"p": [None] * 3 + [3] * 3, "w": [None] + [2] * 5}, (settings.quality_ladder, by)
    steps = []
    run([session("f", 8, quality="full"), session("a", 8)], {"engine_s": 0.5, "steps": steps},
        dataclasses.replace(SETTINGS, quality_ladder="auto"), model=facts)
    by = {sid: [st for s, i, st in sorted(steps) if s == sid] for sid in "fa"}
    assert by["f"] == [None] * 8 and by["a"][:3] == [None] * 3 and by["a"][-1] == 2, by


def test_decoder_rungs_step_down_at_once_and_climb_back_only_once_the_ranks_report_the_wan_decoder_warm():
    """Both decoders loaded, floor tiny_steps2, two Wan sessions whose chunks cost 0.05 s a DiT forward and 0.25 s
    a Wan decode (0.01 s a tiny one), for the first 24 chunks; then the group gets 5x faster: the sink runs every
    step; the ladder takes a session down onto the tiny decoder (ChunkControls.decoder, journaled with the chunk);
    the climb back holds the tiny decoder and asks the ranks to warm the Wan decoder (prewarm) chunk after chunk
    until a reply says it is warm (the 3rd here), and only the chunk after that runs on the Wan decoder."""
    from deployments.session.events import ModelFacts
    facts = ModelFacts.of(get_preset("tiny"), decoders=("wan", "tae"))
    laddered = dataclasses.replace(SETTINGS, quality_ladder="auto", quality_floor="tiny_steps2")
    ran, calls = [], itertools.count()

    def engine_s(c: ChunkControls) -> float:
        seconds = 0.05 * ((c.steps or 4) + 1) + (0.01 if c.decoder == "tae" else 0.25)
        return seconds if next(calls) < 2 * 24 else seconds / 5     # (each chunk is asked of 2 ranks)
    events, _, failures = run([session("a", 30, decoder="wan"), session("b", 30, decoder="wan")],
                              {"engine_s": engine_s, "controls": ran, "warm_after": 3}, laddered, model=facts)
    assert not failures and all(isinstance(events[s][-1], SessionDone) for s in "ab")
    climbed = 0
    for sid in "ab":
        chunks = [(c, warm) for s, i, c, warm in sorted(ran, key=lambda r: r[1]) if s == sid]
        assert all(c.steps is None for c, _ in chunks[:3])                                    # the sink
        for (before, warm), (after, _) in itertools.pairwise(chunks):
            if before.decoder == "tae" and after.decoder is None:          # a climb back to the Wan decoder ...
                assert before.prewarm == "wan" and warm is True, sid       # ... only once it was warm
            if after.prewarm is not None:
                assert after.decoder == "tae" and after.prewarm == "wan"
        climbs = [i for i, ((b, _), (a, _)) in enumerate(itertools.pairwise(chunks)) if b.decoder and not a.decoder]
        assert all([c.prewarm for c, _ in chunks[i - 2:i + 1]] == ["wan"] * 3 for i in climbs), sid
        assert {c.quality for c, _ in chunks} <= {"full", "steps3", "steps2", "tiny", "tiny_steps2"}
        climbed += len(climbs)
    assert climbed >= 1 and any(c.decoder == "tae" for _, _, c, _ in ran)


def test_the_ladder_turned_off_while_sessions_run_puts_them_at_full_from_their_next_chunk():
    """WorldGroup.reconfigure (Serve's user_config) turns the ladder off on a running group: on a loaded group the
    sessions were on cheaper rungs; every chunk planned after the switch runs at full, a pinned session keeps its
    rung. Turned on again, a new ladder starts them at full."""
    from deployments.session.events import ModelFacts
    facts = ModelFacts.of(get_preset("tiny"))

    async def scenario():
        log, steps = [], []
        ranks = RankExecutor([Rank(r, log, engine_s=0.5, steps=steps) for r in range(2)], SETTINGS.chunk_timeout_s)
        loop = ChunkLoop("g", dataclasses.replace(SETTINGS, quality_ladder="auto"), GroupState(), ranks, Muxer(),
                         Mailbox(), Metrics(), lambda e: None, model=facts)
        assert loop.ladder.mode == "auto"
        boxes = [loop.add(session("a", 10)), loop.add(session("b", 10)), loop.add(session("p", 10, quality="steps3"))]
        while not any(st == 2 for _, _, st in steps):           # loaded: some chunk down at the floor
            await asyncio.sleep(0.01)
        switched = len(steps)
        loop.ladder.set_mode("off")
        loop.ladder.set_mode("off")                          # the same mode again: nothing changes
        try:
            loop.ladder.set_mode("on")                       # checked as the setting is
        except ConfigError as e:
            assert str(e) == "quality_ladder 'on' must be off or auto"
        else:
            raise AssertionError("quality_ladder 'on' was taken")
        assert loop.ladder.mode == "off" and loop.ladder.active is None
        for box in boxes:
            while not isinstance(await box.get(), SessionDone):
                pass
        loop.ladder.set_mode("auto")
        assert loop.ladder.active is not None and loop.ladder.active.seats == {}
        return steps, switched                                  # (asyncio.run cancels the idle loop's tasks)

    steps, switched = asyncio.run(scenario())
    before, after = steps[:switched], steps[switched:]
    assert {st for s, _, st in before if s != "p"} >= {2} and after
    assert {st for s, _, st in after if s != "p"} == {None}      # at full from the next chunk
    assert {st for s, i, st in after if s == "p"} == {3}          # (all of p's after the switch are past its sink)


async def _on_the_tiny_decoder(engine_s, ran: list):
    """A loop with both decoders loaded and the floor at tiny_steps2, two Wan sessions of 40 chunks whose chunks
    cost `engine_s` (the ranks warm a prewarmed decoder at their 3rd chunk and log each chunk's controls to
    `ran`), returned once a chunk has run on the tiny decoder: (the loop, the sessions' outboxes)."""
    from deployments.session.events import ModelFacts
    facts = ModelFacts.of(get_preset("tiny"), decoders=("wan", "tae"))
    laddered = dataclasses.replace(SETTINGS, quality_ladder="auto", quality_floor="tiny_steps2")
    ranks = RankExecutor([Rank(r, [], engine_s=engine_s, controls=ran, warm_after=3) for r in range(2)],
                         SETTINGS.chunk_timeout_s)
    loop = ChunkLoop("g", laddered, GroupState(), ranks, Muxer(), Mailbox(), Metrics(), lambda e: None, model=facts)
    boxes = [loop.add(session(sid, 40, decoder="wan")) for sid in "ab"]
    while not any(c.decoder == "tae" for _, _, c, _ in ran):
        await asyncio.sleep(0.01)
    return loop, boxes


def test_the_ladder_turned_off_climbs_a_session_on_the_tiny_decoder_back_warm_at_every_step():
    """Both decoders loaded, floor tiny_steps2, a loaded group: once a session runs on the tiny decoder the ladder
    is turned off. Its next chunks run every denoising step, still on the tiny decoder, each warming the Wan
    decoder by one decode (prewarm) until a rank says it is warm (the 3rd here), and only then on the Wan decoder
    (no chunk decodes a whole warm-up at once); the others are at full from their next chunk; once nobody borrows
    the tiny decoder the loop lets the old ladder go."""
    async def scenario():
        ran = []
        loop, boxes = await _on_the_tiny_decoder(0.5, ran)
        switched = len(ran)
        loop.ladder.set_mode("off")
        assert loop.ladder.mode == "off" and loop.ladder.active is None and loop.ladder.winding is not None
        for box in boxes:
            while not isinstance(await box.get(), SessionDone):
                pass
        return ran, switched, loop.ladder.winding

    ran, switched, winding = asyncio.run(scenario())
    assert winding is None                                      # let go once both ran on their own decoder
    after = ran[switched:]
    assert all(c.steps is None for _, _, c, _ in after)          # every step from the switch on
    lent = 0
    for sid in "ab":
        chunks = [(c, warm) for s, i, c, warm in sorted(after, key=lambda r: r[1]) if s == sid]
        on_tiny = [c for c, _ in chunks if c.decoder == "tae"]
        assert all(c.prewarm == "wan" for c in on_tiny), sid     # each warms the Wan decoder
        first_own = next(i for i, (c, _) in enumerate(chunks) if c.decoder is None)
        assert all(c.decoder == "tae" for c, _ in chunks[:first_own])
        assert all(c.decoder is None and c.prewarm is None for c, _ in chunks[first_own:]), sid
        if first_own:                                           # it was on the tiny decoder: warm before it left
            assert chunks[first_own - 1][1] is True and [w for _, w in chunks[:first_own]].count(True) == 1
            lent += 1
    assert lent >= 1


def test_the_ladder_turned_off_and_on_again_carries_a_climb_under_way():
    """Off and at once on again while a session runs on the tiny decoder: the new ladder knows it borrowed the
    tiny decoder, so when the group (5x faster from then on) has room to climb, the session warms the Wan decoder
    chunk by chunk before it switches, as it would had the ladder stayed on."""
    fast = []

    def engine_s(c: ChunkControls) -> float:
        seconds = 0.05 * ((c.steps or 4) + 1) + (0.01 if c.decoder == "tae" else 0.25)
        return seconds / 5 if fast else seconds

    async def scenario():
        ran = []
        loop, boxes = await _on_the_tiny_decoder(engine_s, ran)
        on_tiny = {s for s, _, c, _ in ran if c.decoder == "tae"}
        loop.ladder.set_mode("off")
        loop.ladder.set_mode("auto")
        fast.append(True)
        switched = len(ran)
        for box in boxes:
            while not isinstance(await box.get(), SessionDone):
                pass
        return ran, switched, on_tiny

    ran, switched, on_tiny = asyncio.run(scenario())
    climbs = 0
    for sid in on_tiny:
        chunks = [(c, warm) for s, i, c, warm in sorted(ran[switched:], key=lambda r: r[1]) if s == sid]
        for (before, warm), (after, _) in itertools.pairwise(chunks):
            if before.decoder == "tae" and after.decoder is None:      # back on its own decoder ...
                assert before.prewarm == "wan" and warm is True, sid   # ... only once it was warm
                climbs += 1
        if chunks and chunks[0][0].decoder is None:                      # (its first chunk after the switch)
            raise AssertionError(f"{sid} left the tiny decoder at once")
    assert climbs >= 1
