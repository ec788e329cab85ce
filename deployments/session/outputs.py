"""Where a session's chunks go besides its owner: its viewers while shared (sharing.py), its recording
(recording.py) and its saved worlds (worlds.py, a resumed one's too). The session's life (life.py) hands each
delivered chunk here once, and the owner's share, unshare and save; nothing here ever makes a chunk wait.

Plain Python: no Ray, no Starlette."""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

from lingbot.io.frames import FMP4

from .audience import Stage
from .codes import ErrorCode, ProtocolError
from .events import Admitted, ChunkReady, Resume, SnapshotOwner
from .ports import SAVE, SHARE, ClientGone
from .recording import Recorder, Recordings
from .requests import StartRequest
from .sharing import Sharing
from .worlds import World, Worlds, open_world, restored, save_world

log = logging.getLogger("ray.serve")

FINISH_WAIT_S = 10.0      # a session's end waits this long for its recording to be stored (then it is stored later)


class Outputs:
    def __init__(self, session_id: str, wire, groups, stage: Optional[Stage], recordings: Optional[Recordings],
                 settings, worlds: Optional[Worlds] = None):
        self.wire, self.groups, self.settings = wire, groups, settings
        self.sharing = Sharing(session_id, wire, groups, stage, settings)
        self.recordings = recordings
        self.recorder: Optional[Recorder] = None
        self.tenant = ""                  # who started the session (access.py): its recording is theirs
        self.worlds = worlds              # the ingress's saved worlds (None: worlds_dir is empty)
        self.world: Optional[World] = None    # the saved world the session resumed
        self.saving: Optional[asyncio.Task] = None    # a session.save being stored

    async def open_world(self, start: StartRequest, ledger) -> StartRequest:
        """A start with a world_id: the world's own start, its chunks in the `ledger` (the group replays them);
        ProtocolError (closing) when there is no such world for this client or this deployment cannot go on
        with it. A start without one is returned as it is."""
        if start.world_id is None:
            return start
        self.world = await open_world(self.worlds, start, self.tenant, await self.groups.facts())
        ledger.journal, ledger.interactions = list(self.world.journal.chunks), self.world.interactions
        return self.world.start(start)

    async def world_resume(self, owner: Optional[SnapshotOwner]) -> Optional[Resume]:
        """What the session's group does first when it resumed a saved world (None: a new session)."""
        return None if self.world is None else await restored(self.world, owner, self.groups, self.settings.sp)

    async def asked(self, control: str, send_lock: asyncio.Lock, start: StartRequest, ledger,
                    refuse) -> Optional[ProtocolError]:
        """The owner's session.share or session.unshare, answered under `send_lock`; the refusal. A session.save
        (the world after the chunks its `ledger` delivered) runs as a task of its own, one at a time: the
        client's messages and the chunks go on while it is stored; it answers, or `refuse`s, when done, and the
        session's end waits for it (end)."""
        try:
            if control == SAVE:
                if self.saving is not None and not self.saving.done():
                    return ProtocolError(ErrorCode.WORLD_LIMIT, "a save of this session is being stored; one at a "
                                         "time")
                self.saving = asyncio.ensure_future(self._save(send_lock, start, ledger, refuse))
                return None
            async with send_lock:
                return await (self.sharing.share() if control == SHARE else self.sharing.unshare())
        except ProtocolError as e:
            return e

    async def _save(self, send_lock: asyncio.Lock, start: StartRequest, ledger, refuse) -> None:
        try:
            facts = ledger.facts or await self.groups.facts()
            world_id, index = await save_world(self.worlds, start, ledger, self.tenant, self.world, facts, self.groups)
            async with send_lock:
                await self.wire.send(self.wire.saved_message(world_id, index))
        except ProtocolError as e:
            await refuse(e)
        except (ClientGone, ConnectionError, RuntimeError):     # the client left meanwhile: the world is stored
            pass

    def streaming_on(self, admitted: Admitted, start: StartRequest, group_sid: str) -> None:
        self.sharing.streaming_on(admitted, start, group_sid)

    async def open(self, admitted: Admitted, start: StartRequest, share: bool,
                   send_lock: asyncio.Lock) -> list[ProtocolError]:
        """The session streams for the first time: recorded if it asked to be (or the deployment records every
        session), shared if it asked; the owner told of each (under `send_lock`). The refusals (none closes the
        session)."""
        async with send_lock:
            return await self._open(admitted, start, share)

    async def _open(self, admitted: Admitted, start: StartRequest, share: bool) -> list[ProtocolError]:
        refusals = []
        record = self.settings.record_sessions if start.record is None else start.record
        if record and start.output == FMP4:
            if self.recordings is None:
                if start.record:
                    refusals.append(ProtocolError(ErrorCode.RECORDING_UNAVAILABLE, "this deployment cannot write "
                                                  "recordings now (recordings_dir); the session goes on unrecorded"))
            else:
                facts = admitted.facts if admitted.facts is not None else await self.groups.facts()
                self.recorder = self.recordings.begin(start, facts, self.tenant)
                if self.world is not None:
                    self.recorder.continues(self.world.journal.chunks)
                await self.wire.send(self.wire.recording_message(self.recorder.id))
        if share:
            refusal = await self.sharing.share()
            if refusal is not None:
                refusals.append(refusal)
        return refusals

    async def delivered(self, event: ChunkReady, transport_index: int, send) -> bool:
        """A chunk the owner got: to its viewers and its recording (neither waits); the owner told how many watch
        when that changed (`send`: the session's bounded send). False when that send found the owner gone."""
        told = self.sharing.delivered(event, transport_index)
        if self.recorder is not None:
            self.recorder.delivered(event)
        return told is None or await send(told)

    async def end(self, chunks: int, stopped: bool) -> None:
        """The session ended as it should (done or stopped): viewers told; its recording stored before the owner
        is told (at most FINISH_WAIT_S: a slow store finishes it later), so that it can be fetched at once."""
        self.sharing.end(chunks, stopped)
        if self.saving is not None:                      # its answer before the end (the client may be waiting)
            await asyncio.wait({self.saving}, timeout=FINISH_WAIT_S)
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.recordings.finish_later(recorder)), FINISH_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("recording %s: still being stored after %g s", recorder.id, FINISH_WAIT_S)

    def ended(self, chunks: int) -> None:
        """Every end, the abrupt ones too (the client left, a refusal, a fault): what end() did not do yet."""
        self.sharing.end(chunks, True)
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            self.recordings.finish_later(recorder)
