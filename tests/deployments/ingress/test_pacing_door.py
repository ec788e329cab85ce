"""A viewer's queue in Serve's proxy (deployments/ingress/pacing_door.py), on a socket that takes nothing until let go:
whole chunks wait up to the bound, one more drops them all and the viewer waits for a keyframe (the chunk being
sent is finished first), the unmarked messages (the start, the end, the close) are never dropped, the third skip
cuts the viewer, and at the end what is queued goes out, the close last."""
import asyncio

from deployments.ingress.pacing_door import VIEWER_MARK, PacerLimits, ViewerPacer


def message(text, chunk=None, keyframe=None):
    m = {"type": "websocket.send", "text": text}
    if chunk is not None:
        m[VIEWER_MARK] = {"chunk": chunk} if keyframe is None else {"chunk": chunk, "keyframe": keyframe}
    return m


class Socket:
    """A send that blocks until `open` is set; what went out, in order."""

    def __init__(self):
        self.sent, self.open = [], asyncio.Event()

    async def send(self, m):
        await self.open.wait()
        assert VIEWER_MARK not in m                          # the mark stays in the proxy
        self.sent.append(m.get("text", m["type"]))


async def chunk(pacer, k, keyframe):
    await pacer.send(message(f"meta {k}", k, keyframe))
    await pacer.send(message(f"data {k}", k))


def test_a_viewer_behind_skips_to_a_keyframe_and_is_cut_at_the_third_skip():
    async def scenario():
        socket, cuts = Socket(), []
        pacer = ViewerPacer(socket.send, PacerLimits(queue_chunks=2, queue_bytes=10 ** 6, max_skips=3),
                            lambda: cuts.append(1))
        await pacer.send(message("start"))
        for k, key in enumerate([True, False, False]):
            await chunk(pacer, k, key)
        # "start" is being sent (blocked); chunks 0 and 1 wait; chunk 2 found the queue full: all dropped
        assert pacer.skips == 1 and pacer.waiting_for_keyframe and pacer.chunks == 0
        await chunk(pacer, 3, False)                         # dropped: not a keyframe
        await chunk(pacer, 4, True)
        await pacer.send(message("note"))                    # unmarked: kept in order
        socket.open.set()
        await asyncio.sleep(0.01)
        assert socket.sent == ["start", "meta 4", "data 4", "note"]
        socket.open.clear()
        await pacer.send(message("blocker"))                 # the socket stops taking
        await asyncio.sleep(0.01)
        for k in range(5, 8):
            await chunk(pacer, k, True)                      # the third chunk: the second skip
        for k in range(8, 11):
            await chunk(pacer, k, True)                      # the third skip cuts
        assert pacer.skips == 3 and pacer.cut and cuts == [1]
        await pacer.send(message("after"))                   # nothing more is queued
        assert not pacer.queue
        pacer.close()
    asyncio.run(scenario())


def test_at_the_end_what_is_queued_goes_out_and_the_close_last():
    async def scenario():
        socket = Socket()
        pacer = ViewerPacer(socket.send, PacerLimits(queue_chunks=4), lambda: None)
        await chunk(pacer, 0, True)
        await chunk(pacer, 1, False)
        await pacer.send(message("done"))
        await pacer.send({"type": "websocket.close", "code": 1000})
        socket.open.set()
        await pacer.finish(5.0)
        assert socket.sent == ["meta 0", "data 0", "meta 1", "data 1", "done", "websocket.close"]
        assert pacer.task.done() and pacer.bytes == 0
    asyncio.run(scenario())


def test_the_bytes_bound_holds_as_well_as_the_count():
    async def scenario():
        socket = Socket()
        pacer = ViewerPacer(socket.send, PacerLimits(queue_chunks=100, queue_bytes=25, max_skips=9), lambda: None)
        for k in range(3):
            await chunk(pacer, k, True)                      # 12 bytes a chunk: the third passes 25
        assert pacer.skips == 1 and pacer.bytes <= 25
        pacer.close()
    asyncio.run(scenario())


def test_the_limits_travel_through_the_environment():
    assert PacerLimits.from_env(PacerLimits(3, 1000, 2).to_env()) == PacerLimits(3, 1000, 2)
