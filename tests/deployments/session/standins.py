"""Stand-ins for a session's collaborators without Ray or Starlette (deployments/session/ports.py): a wire that
plays a client's messages and records what it was sent, leases and groups that play a group's events, metrics and
limits that count; `live` runs one session's life with them to its end (tests/deployments/session/test_life*.py)."""
import asyncio
import collections
import time

import numpy as np

from deployments.session.codes import ErrorCode, ProtocolError
from deployments.session.events import (
    Admitted,
    ChunkControls,
    ChunkReady,
    InteractionState,
    ModelFacts,
    SessionFailed,
    SnapshotRef,
)
from deployments.session.life import SessionLife
from deployments.session.ports import ACTIVITY, STOP, ClientGone
from deployments.session.requests import Interaction, StartRequest
from deployments.session.waiting import Growth
from deployments.settings import ServeSettings
from lingbot.config import get_preset

FACTS = ModelFacts.of(get_preset("tiny"))
SETTINGS = ServeSettings(admission_wait_s=0.5, resume_wait_s=0.5, start_timeout_s=2.0)


class Wire:
    """A client: messages it will send (a dict, or a float: wait that long first), and what it received."""

    def __init__(self, messages=()):
        self.incoming = collections.deque(messages)
        self.wait_until = None                   # the end of the wait at the front (from when it was first read)
        self.log: list = []
        self.decodes: list[bool] = []            # each decoded message: was it read as a start?

    async def receive(self, timeout):
        """The next message, as a socket gives it: a read that is cancelled loses nothing (a wait at the front
        goes on counting from when it was first read). A ProtocolError in the script is what decoding it gives."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            now = loop.time()
            if not self.incoming or isinstance(self.incoming[0], float):
                if self.incoming and self.wait_until is None:
                    self.wait_until = now + self.incoming[0]
                if self.incoming and now >= self.wait_until:
                    self.incoming.popleft()
                    self.wait_until = None
                    continue
                if now >= deadline:
                    raise asyncio.TimeoutError
                until = min(deadline, self.wait_until if self.incoming else deadline)
                await asyncio.sleep(max(0.0, min(until - now, 0.05)))
                continue
            msg = self.incoming.popleft()
            break
        if msg == "gone":
            raise ClientGone()
        return msg

    async def decode(self, raw, limit, start):
        """The received message decoded (its refusal raised), counted in `decodes`."""
        self.decodes.append(start)
        if isinstance(raw, ProtocolError):
            raise raw
        return raw

    async def send(self, data):
        self.log.append(("send", data))

    def keepalive_reply(self, msg):
        return {"pong": True} if msg["type"] == "ping" else None

    async def parse_start(self, msg, facts):
        if msg["type"] != "start":
            raise ProtocolError(ErrorCode.NOT_STARTED, "start first")
        return StartRequest("p", np.zeros((3, facts.height, facts.width), np.float32), facts.width, facts.height,
                            msg.get("chunks"), None, 16.0, 1, None, [], unknown_fields=msg.get("unknown", ()))

    def control(self, msg, seq):
        if msg["type"] == "stop":
            return STOP
        if msg["type"] == "beat":
            return ACTIVITY
        if msg["type"] == "bad":
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, "unknown message type 'bad'")
        return Interaction(msg["id"], keys=["w"], prompt=msg.get("prompt"))

    def queued(self, interaction):
        return {"queued": interaction.event_id}

    def queued_message(self, position, eta_s):
        return {"waiting": position, "eta_s": eta_s}

    def limit_error(self, code, text):
        return ProtocolError(code, text, close=1000)

    async def send_error(self, error):
        self.log.append(("error", error.code))

    async def close_with(self, error):
        self.log.append(("close", error.code, error.close))

    async def send_admitted(self, admitted, start, session_id):
        self.log.append(("admitted", admitted.group))

    async def send_chunk(self, event, transport_index, send):
        self.log.append(("chunk", event.index, transport_index))
        return True

    async def send_resumed(self, event, chunk_index, transport_index, gap_s, reason, send):
        self.log.append(("resumed", chunk_index, event.restored, reason))
        return True

    async def finish(self, stopped, chunks):
        self.log.append(("done", stopped, chunks))


class Lease:
    """One streaming call: yields its events; a float is a pause; it waits forever after the last one."""

    def __init__(self, events):
        self.events = list(events)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        while self.events:
            event = self.events.pop(0)
            if isinstance(event, float):
                await asyncio.sleep(event)
                continue
            return event
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


AT_MAX = Growth(running=1, starting=0, max_groups=1)


class Groups:
    """Serve's routing stood in for by a list of leases, one per call; the requests are kept. `growth` is what
    Serve's status says about the groups (by default: at max_groups, none starting: no group can come)."""

    def __init__(self, *leases, growth=AT_MAX):
        self.leases = list(leases)
        self.requests, self.posted, self.released = [], [], []
        self.released_by = []                                  # how many releases each lease came after
        self.census = growth

    async def facts(self):
        return FACTS

    def lease(self, request):
        self.requests.append(request)
        self.released_by.append(len(self.released))
        return self.leases.pop(0) if self.leases else Lease([SessionFailed(ErrorCode.CAPACITY_EXHAUSTED, "full")])

    def post(self, mailbox, session_id, interaction):
        self.posted.append((mailbox, session_id, interaction.event_id))

    async def keeper(self):
        return "keeper"

    def let_go(self, session_id, keys=None):
        self.released.append((session_id, keys))

    async def growth(self):
        return self.census(time.monotonic()) if callable(self.census) else self.census


class Metrics:
    def __init__(self):
        self.refusals, self.resumes, self.unknown = [], [], 0
        self.bytes: dict[str, int] = {}

    def video_bytes(self, role, count):
        self.bytes[role] = self.bytes.get(role, 0) + count

    def unknown_fields(self, count):
        self.unknown += count

    def refused(self, code):
        self.refusals.append(code)

    def admitted(self):
        pass

    def chunk_interval(self, seconds):
        pass

    def resumed(self, outcome, reason):
        self.resumes.append((outcome, reason))


class Limits:
    def __init__(self):
        self.active = 0

    def admit(self, tenant, now):
        self.active += 1

    def release(self, tenant):
        self.active -= 1


def admitted(group: str) -> Admitted:
    return Admitted(group, f"mailbox-{group}", "video/mp4", 2, FACTS)


def chunk(index: int, started=()) -> ChunkReady:
    snapshots = tuple(SnapshotRef(index, r, f"slot{index}.{r}", f"state{index}.{r}") for r in range(2))
    return ChunkReady(index, b"x", FACTS.geometry.pixel_frames(index), list(started), [], [], {}, 0.1,
                      controls=ChunkControls(keys=("w",) * 3), interactions=InteractionState({}, None),
                      snapshots=snapshots)


def live(wire: Wire, groups: Groups, settings=SETTINGS, metrics=None):
    """Run one session's life to its end; (the life, the phases it went through, the limits)."""
    async def scenario():
        life = SessionLife(wire, groups, settings, metrics or Metrics())
        phases = []
        enter = life.enter

        def recording(phase):
            enter(phase)
            phases.append(phase)
        life.enter = recording
        limits = Limits()
        await asyncio.wait_for(life.run("t", limits), 30)
        return life, phases, limits
    return asyncio.run(scenario())
