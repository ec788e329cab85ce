"""A shared session's fan-out (deployments/session/audience.py), without a server: each viewer starts at a keyframe,
a viewer whose queue fills skips to the next keyframe and is cut after max_skips, the end reaches every viewer
after what it holds, and a watch id is found only while its session is shared, on its own protocol's route."""
import asyncio

from deployments.session.audience import Ended, SharedChunk, Stage, ViewerLimits


def chunk(index, keyframe, nbytes=10):
    return SharedChunk(index, keyframe, (f"meta {index}", b"x" * nbytes), nbytes)


def drain(viewer):
    """What the viewer's queue holds, in order (its next() without waiting)."""
    out = []
    while viewer.queue:
        out.append(asyncio.run(viewer.next()).index)
    return out


def test_a_viewer_starts_at_the_next_keyframe_and_asks_for_one_once():
    asked = []
    stage = Stage(max_viewers=10)
    audience = stage.open("vllm", {"type": "watch.start"}, b"init", 5, lambda: asked.append(1))
    viewer = audience.join(ViewerLimits())
    assert asked == [1]                                   # joining asks the owner's encoder for a keyframe
    audience.publish(chunk(0, False))
    audience.publish(chunk(1, False))
    assert drain(viewer) == [] and asked == [1]           # still waiting; asked once until a keyframe comes
    audience.publish(chunk(2, True))
    audience.publish(chunk(3, False))
    assert drain(viewer) == [2, 3]
    audience.publish(chunk(4, False))
    later = audience.join(ViewerLimits())                 # a second viewer joins mid-stream: a new request
    assert asked == [1, 1]
    audience.publish(chunk(5, False))
    audience.publish(chunk(6, True))
    assert drain(viewer) == [4, 5, 6] and drain(later) == [6]
    assert audience.bytes_out == 10 * 6


def test_a_viewer_that_falls_behind_skips_to_a_keyframe_and_is_cut_after_max_skips():
    audience = Stage(10).open("vllm", {}, b"", 5, lambda: None)
    viewer = audience.join(ViewerLimits(queue_chunks=2, queue_bytes=1000, max_skips=2))
    other = audience.join(ViewerLimits(queue_chunks=8, queue_bytes=10_000, max_skips=2))
    for k, key in enumerate([True, False, False]):        # the third finds a full queue: all dropped, a skip
        audience.publish(chunk(k, key))
    assert viewer.skips == 1 and viewer.waiting_for_keyframe and not viewer.queue and not viewer.cut
    audience.publish(chunk(3, False))                     # not a keyframe: still waiting
    audience.publish(chunk(4, True))
    assert drain(viewer) == [4]
    assert drain(other) == [0, 1, 2, 3, 4]                # the other viewer lost nothing
    audience.publish(chunk(5, True, nbytes=600))
    audience.publish(chunk(6, False, nbytes=600))         # past queue_bytes: the second skip cuts it
    assert viewer.cut and asyncio.run(viewer.next()) is None
    audience.leave(viewer)
    assert audience.skips == 2 and audience.cuts == 1 and audience.viewers == {other}


def test_the_end_reaches_each_viewer_after_what_it_holds_and_the_watch_id_dies():
    stage = Stage(10)
    audience = stage.open("sglang", {}, b"", 5, lambda: None)
    viewer = audience.join(ViewerLimits())
    audience.publish(chunk(0, True))
    assert stage.find(audience.watch_id, "sglang") is audience
    assert stage.find(audience.watch_id, "vllm") is None             # the other protocol's route: not found
    stage.close(audience, Ended(7, stopped=False))
    assert asyncio.run(viewer.next()).index == 0
    assert asyncio.run(viewer.next()) == Ended(7, False)
    assert stage.find(audience.watch_id, "sglang") is None and audience.join(ViewerLimits()) is None


def test_watch_ids_are_long_random_and_bounded_viewers_per_session():
    stage = Stage(10)
    ids = {stage.open("vllm", {}, b"", 2, lambda: None).watch_id for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 32 for i in ids)         # 192 bits, URL-safe
    audience = next(iter(stage.audiences.values()))
    assert audience.join(ViewerLimits()) and audience.join(ViewerLimits())
    assert audience.join(ViewerLimits()) is None and stage.viewers == 2
    assert stage.find("not-a-watch-id", "vllm") is None


def test_the_stage_lets_viewers_in_within_its_bound_and_the_sessions_counting_those_elsewhere():
    stage = Stage(3)
    first = stage.open("vllm", {}, b"", 2, lambda: None)
    second = stage.open("vllm", {}, b"", 5, lambda: None)

    def join(audience):
        return asyncio.run(stage.join(audience, ViewerLimits()))
    a, _ = join(first)
    first.remote_viewers = 1                                 # (the owner's post: one viewer at another replica)
    assert join(first) == (None, "session") and first.watching == 2
    first.remote_viewers = 0
    assert join(first)[0] is not None and join(second)[0] is not None
    assert join(second) == (None, "replica") and stage.viewers == 3
    stage.leave(first, a)
    assert stage.viewers == 2 and first.watching == 1
    stage.close(second, Ended(1, True))
    assert join(second) == (None, "ended")
