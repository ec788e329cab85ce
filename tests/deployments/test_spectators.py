"""Spectators over both protocols on the package's app: a shared session watched by viewers who get the owner's own
bytes from a keyframe on (a late one joins at a keyframe the owner's encoder makes for it), the session's end and
the owner's unshare reach every viewer with their codes, and a watch id that leads nowhere is refused alike
whether it ever existed or not."""
import asyncio
import inspect
import json

import numpy as np
import websockets

from deployments.client import FramesClient, RealtimeClient
from lingbot.io.video import fragment_starts_with_keyframe, read_frames, split_init_segment
from tests.deployments.clients import H, W, fragments, frames_url, png, png_url, refused, run, stalled_viewer, until
from tests.deployments.conftest import METRICS_PORT, PORT, TEST_SETTINGS
from tests.deployments.observe import metric, scrape
from tests.waits import wait_until

BASE = f"ws://127.0.0.1:{PORT}"


def test_viewers_get_the_owners_fragments_from_a_keyframe_and_the_end(serve_app):
    """An owner shares at its start (extra_params.spectators): three viewers join at once, a fourth after the owner's
    second chunk, a fifth is one too many (max_viewers_per_session 4 here). Every viewer gets a watch.start, the init
    segment, then the owner's own fragments, byte for byte, from its first keyframe on, with metadata that carries
    nothing the owner sent, and session.done when the session ends. The late viewer's first chunk starts with a
    keyframe its joining asked for (x264's own keyframes are 20 chunks apart) and decodes to the owner's frames."""
    chunks = 6

    async def scenario():
        async with RealtimeClient(serve_app) as owner:
            await owner.start("a forest path", png_url(), W, H, chunks, seed=4, spectators=True)
            start = await until(owner, "video.start")
            shared = await until(owner, "session.shared")
            url = BASE + shared["watch_url"]
            viewers = [RealtimeClient(url) for _ in range(4)]
            for viewer in viewers[:3]:
                await viewer.__aenter__()
            watching = [asyncio.create_task(v.receive_session(timeout=120)) for v in viewers[:3]]
            late: dict = {}

            async def on_chunk(result, meta):
                if len(result.chunks) == 2 and not late:
                    await viewers[3].__aenter__()
                    late["task"] = asyncio.create_task(viewers[3].receive_session(timeout=120))
                    late["too_many"] = await refused(url)
            owned = await owner.receive_session(on_chunk, timeout=120)
            results = [*await asyncio.gather(*watching), await late["task"]]
            for viewer in viewers:
                await viewer.__aexit__(None, None, None)
            return start, shared, owned, results, late["too_many"]

    start, shared, owned, results, too_many = run(scenario())
    assert owned.error is None and owned.done == {"type": "session.done", "chunks": chunks, "stopped": False}
    watch_id = shared["watch_id"]
    assert len(watch_id) == 40 and shared["watch_url"] == f"/v1/realtime/watch/{watch_id}"
    assert start["request_id"] not in watch_id
    init = split_init_segment(owned.data[0])[0]
    own = fragments(owned)
    whole = read_frames(owned.video)
    for result in results:
        assert result.error is None and result.close_code == 1000, (result.error, result.close_code)
        assert result.start["type"] == "watch.start" and result.start["config"]["mime"] == start["config"]["mime"]
        assert result.init == init
        got = fragments(result)
        first = min(got)
        assert sorted(got) == list(range(first, chunks)), sorted(got)
        assert all(got[k] == own[k] for k in got)                             # the owner's bytes, byte for byte
        assert fragment_starts_with_keyframe(got[first])
        assert all("started_event_ids" not in meta and "timings" not in meta for meta in result.chunks)
        assert result.done == {"type": "session.done", "chunks": chunks, "stopped": False}
        skip = 0 if first == 0 else 9 + 12 * (first - 1)                     # chunk 0 has 9 frames, later ones 12
        assert np.array_equal(read_frames(result.video), whole[skip:])
    assert min(fragments(results[3])) >= 2                                    # the late one: from a later keyframe
    assert too_many[0]["code"] == "too_many_viewers" and too_many[1] == 1013
    assert TEST_SETTINGS["max_viewers_per_session"] == 4


def test_the_second_protocols_viewers_get_its_frames_and_an_unshare_ends_their_stream(serve_app):
    """The second protocol: the owner shares after its first chunk (a `share` map), two viewers on its watch route
    get the same raw frames as the owner, bitwise, from their first chunk on; the owner's `unshare` two chunks later
    closes them (1000, "unshared") while the owner's session goes on to its end, and its watch id is dead."""
    chunks = 8

    async def scenario():
        async with FramesClient(frames_url(serve_app)) as owner:
            await owner.init("a forest path", png(), chunks, 5, decoder="tae")
            state: dict = {}

            async def on_chunk(result, chunk):
                if len(result.chunks) == 1:
                    await owner.share()
                shared = [m for m in result.messages if m["type"] == "shared"]
                if shared and "viewers" not in state:            # (its answer came with a later chunk's messages)
                    state["url"] = BASE + shared[0]["watch_url"]
                    state["viewers"] = [FramesClient(state["url"]) for _ in range(2)]
                    for viewer in state["viewers"]:
                        await viewer.__aenter__()
                    state["tasks"] = [asyncio.create_task(v.receive_session(timeout=120)) for v in state["viewers"]]
                    state["unshare_at"] = len(result.chunks) + 2
                if len(result.chunks) == state.get("unshare_at"):
                    await owner.share(False)
                    state["viewed"] = await asyncio.gather(*state["tasks"])
                    async with FramesClient(state["url"]) as again:
                        state["again"] = await again.receive_session(timeout=30)
            owned = await owner.receive_session(on_chunk, timeout=120)
            for viewer in state["viewers"]:
                await viewer.__aexit__(None, None, None)
            return owned, state

    owned, state = run(scenario())
    assert owned.errors == [] and (owned.close_code, owned.close_reason) == (1000, "generation complete")
    assert [c.index for c in owned.chunks] == list(range(chunks))
    assert any(m["type"] == "unshared" for m in owned.messages)
    frames = {c.index: c.frames for c in owned.chunks}
    for viewed in state["viewed"]:
        assert viewed.errors == [] and (viewed.close_code, viewed.close_reason) == (1000, "unshared")
        assert viewed.messages[0]["type"] == "watch_start" and viewed.messages[0]["width"] == W
        assert viewed.chunks and all(np.array_equal(c.frames, frames[c.index]) for c in viewed.chunks)
        assert [c.index for c in viewed.chunks] == list(range(viewed.chunks[0].index, viewed.chunks[-1].index + 1))
        assert all("actions" not in c.stats for c in viewed.chunks)
    again = state["again"]
    assert again.close_code == 1008 and again.errors[0]["code"] == "watch_not_found"


def test_a_watch_id_that_leads_nowhere_is_refused_alike_and_a_viewer_only_pings(serve_app):
    """An unknown id, a live one on the other protocol's route, and one whose session ended are refused the same
    way (watch_not_found, 1008). A viewer's ping is answered; anything else it sends is refused with
    viewer_read_only, and it goes on watching."""
    async def scenario():
        unknown = await refused(f"{BASE}/v1/realtime/watch/{'A' * 32}")
        async with RealtimeClient(serve_app) as owner:
            await owner.start("a forest path", png_url(), W, H, 2, seed=1, spectators=True)
            shared = await until(owner, "session.shared")
            other = await refused(f"{BASE}/v1/realtime_video/watch/{shared['watch_id']}")
            async with RealtimeClient(BASE + shared["watch_url"]) as viewer:
                await viewer.send({"type": "session.ping", "t": 1})
                await viewer.send({"type": "session.interaction", "interaction": {"event_id": "x", "event": {}}})
                watched = await viewer.receive_session(timeout=120)
            await owner.receive_session(timeout=120)
        ended = await refused(BASE + shared["watch_url"])
        return unknown, other, ended, watched

    unknown, other, ended, watched = run(scenario())
    for error, code in (unknown, other, ended):
        assert (error["code"], error["message"], code) == ("watch_not_found", "no shared session has this watch id",
                                                           1008)
    assert any(m["type"] == "session.pong" and m["t"] == 1 for m in watched.messages)
    assert [m["code"] for m in watched.messages if m["type"] == "error"] == ["viewer_read_only"]
    assert watched.done == {"type": "session.done", "chunks": 2, "stopped": False} and watched.close_code == 1000


def test_a_viewer_that_stops_reading_is_skipped_then_cut_and_the_owner_streams_on(serve_app):
    """A viewer of the second protocol's raw frames (about 250 KB a chunk) that stops reading (a small receive
    buffer, no reads): once the kernel's buffers are full its chunks wait in Serve's proxy, at most
    viewer_queue_chunks of them; each one more drops them and the viewer waits for the next keyframe (a skip), and
    the third skip cuts it (the door's viewer_too_slow), long before the stall timeout would, while the owner's
    endless session streams on with every chunk in order, and a reading viewer beside it is not touched. Then the
    ingress holds no viewer."""
    from perf.soak import census

    async def scenario():
        async with FramesClient(frames_url(serve_app)) as owner:
            await owner.init("a forest path", png(), None, 3, fps=120.0, spectators=True, decoder="tae")
            state: dict = {}

            async def on_chunk(result, chunk):
                shared = [m for m in result.messages if m["type"] == "shared"]
                if shared and "slow" not in state:
                    url = BASE + shared[0]["watch_url"]
                    state["slow"] = await stalled_viewer(url)
                    state["reader"] = FramesClient(url)
                    await state["reader"].__aenter__()
                    state["reading"] = asyncio.create_task(state["reader"].receive_session(timeout=300))
                    state["at"] = len(result.chunks)
                if "slow" in state and "cut" not in state and len(result.chunks) % 2 == 0:
                    viewers = (await asyncio.to_thread(census, "lingbot"))["ingress"]["viewers"]
                    if viewers < 2:                        # the slow one's connection is gone
                        state["cut"] = len(result.chunks)
                if ("cut" in state and len(result.chunks) >= state["cut"] + 2) or len(result.chunks) >= 120:
                    await owner.ws.close()             # the owner leaves: its endless session ends
            owned = await owner.receive_session(on_chunk, timeout=300)
            try:                                            # the slow viewer: its connection was cut
                while True:
                    await asyncio.wait_for(state["slow"].recv(), 30)
            except websockets.ConnectionClosed as e:
                slow_close = e.rcvd.code if e.rcvd is not None else 1006
            read = await state["reading"]
            await state["reader"].__aexit__(None, None, None)
            return owned, state, slow_close, read

    owned, state, slow_close, read = run(scenario())
    assert owned.errors == [] and [c.index for c in owned.chunks] == list(range(len(owned.chunks)))
    assert "cut" in state, f"the slow viewer was not cut in {len(owned.chunks)} chunks"
    assert slow_close == 1006                               # cut by the door: the transport aborted
    assert read.errors == [] and read.chunks                # the reading viewer lost nothing it was sent
    indices = [c.index for c in read.chunks]
    assert indices == list(range(indices[0], indices[-1] + 1))
    frames = {c.index: c.frames for c in owned.chunks}
    assert all(np.array_equal(c.frames, frames[c.index]) for c in read.chunks)
    wait_until(lambda: census("lingbot")["ingress"]["viewers"] == 0, 30, "the viewers to have left the ingress")
    wait_until(lambda: metric(scrape(METRICS_PORT), "lingbot_refusals_total", code="viewer_too_slow") >= 1, 30,
               "the door to count its cut (viewer_too_slow, not the stall timeout)")


def test_a_viewer_at_another_replica_watches_through_one_subscription(serve_app):
    """Two ingress replicas' stages, each with its relay and its post (real Ray actors). A watch id leads to the
    replica that handed it out (its tag); another replica mirrors that session once however many of its viewers
    watch (one subscription at the post), the owner's replica publishes to its post once it knows a replica
    subscribes, and a keyframe those viewers want reaches the owner. Both viewers get the init segment and every
    chunk from the first keyframe, the end with its fields; ids of no replica, of no session there and of the
    other protocol lead nowhere; a mirror whose last viewer left ends its subscription. The session's bound on
    viewers holds over both replicas (seats at the owner's post), and the owner's replica counts the viewers
    elsewhere."""
    import ray

    from deployments.ingress.relay import Relay
    from deployments.session.audience import Ended, SharedChunk, Stage, ViewerLimits

    async def until(check, what):
        """`check()` (a value, or an awaitable of one) every 0.1 s until true; AssertionError after 30 s."""
        for _ in range(300):
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"waited 30 s for {what}")

    async def subscribers(relay, watch_id, what="subscribers"):
        return (await relay.post.census.remote()).get(watch_id, {}).get(what, 0)

    async def no_subscribers(relay, watch_id, what="subscribers"):
        return not await subscribers(relay, watch_id, what)

    async def scenario():
        here, there = Stage(10, Relay()), Stage(10, Relay())
        keyframes = []
        owner = here.open("vllm", {"type": "watch.start"}, b"", 3, lambda: keyframes.append(1))
        assert owner.watch_id.startswith(here.relay.tag) and len(owner.watch_id) == 40
        nowhere = [await there.relay.mirror(w, d, there) for w, d in [
            ("zzzzzzzz" + "A" * 32, "vllm"), (here.relay.tag + "A" * 32, "vllm"), (owner.watch_id, "sglang")]]
        mirror = await there.relay.mirror(owner.watch_id, "vllm", there)
        local, _ = await here.join(owner, ViewerLimits(8))
        viewers = [(await there.join(mirror, ViewerLimits(8)))[0],
                   (await there.join(there.find(owner.watch_id, "vllm"), ViewerLimits(8)))[0]]
        full = [(await there.join(mirror, ViewerLimits(8)))[1]]               # 1 here and 2 there of 3
        await until(lambda: owner.watch_id in here.relay.subscribed and keyframes and owner.remote_viewers == 2,
                    "the owner's replica to learn of the subscriber, its viewers and its keyframe request")
        full.append((await here.join(owner, ViewerLimits(8)))[1])
        counted = [owner.watching]
        here.leave(owner, local)                                              # a seat free: one more there
        await until(lambda: no_subscribers(here.relay, owner.watch_id, "local"), "the post to count it")
        extra, _ = await there.join(mirror, ViewerLimits(8))
        await until(lambda: owner.remote_viewers == 3, "the owner's replica to count the third viewer there")
        there.leave(mirror, extra)
        await until(lambda: owner.remote_viewers == 2, "the owner's replica to count it gone")
        one_subscription = await subscribers(here.relay, owner.watch_id)
        here.init_known(owner, b"INIT")
        chunks = [SharedChunk(i, i in (1, 4), (json.dumps({"i": i}), bytes([i]) * 100), 108) for i in range(6)]
        for chunk in chunks:
            here.publish(owner, chunk)
        got = [[await asyncio.wait_for(v.next(), 30) for _ in range(5)] for v in viewers]
        here.close(owner, Ended(6, False))
        ends = [await asyncio.wait_for(v.next(), 30) for v in viewers]
        await until(lambda: owner.watch_id not in there.audiences, "the mirror to end")
        # a mirror whose viewers all leave ends its subscription at the owner's replica
        second = here.open("vllm", {"type": "watch.start"}, b"", 5, lambda: None)
        other = await there.relay.mirror(second.watch_id, "vllm", there)
        await until(lambda: subscribers(here.relay, second.watch_id), "the second subscription")
        viewer, _ = await there.join(other, ViewerLimits(8))
        there.leave(other, viewer)
        await until(lambda: second.watch_id not in there.relay.mirrors, "the mirror to stop")
        await until(lambda: no_subscribers(here.relay, second.watch_id), "the post to drop the subscription")
        here.close(second, Ended(0, True))
        for relay in (here.relay, there.relay):
            ray.kill(relay.post)
        return nowhere, mirror, one_subscription, got, ends, full, counted

    nowhere, mirror, one_subscription, got, ends, full, counted = run(scenario())
    assert nowhere == [None, None, None]
    assert full == ["session", "session"] and counted == [3]
    assert one_subscription == 1 and mirror.init == b"INIT" and mirror.mirror
    for chunks in got:
        assert [c.index for c in chunks] == [1, 2, 3, 4, 5]                 # from the first keyframe on
        assert [c.messages for c in chunks] == [(json.dumps({"i": i}), bytes([i]) * 100) for i in range(1, 6)]
    assert ends == [Ended(6, False), Ended(6, False)]
