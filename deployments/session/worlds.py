"""Worlds that last: a session's world saved (`session.save`), resumed by a later session (a start with its
`world_id`), forked by several at once (docs/architecture.md, "Worlds").

A world is what it takes to make its frames again: its start and every delivered chunk's controls (the journal,
lingbot/runtime/journal.py), the interaction state after the last chunk (key scripts and transitions still
running), the camera script of its start, the first frame exactly as the model took it, and the settings that
change frames (`frame_settings`). A resume replays the journal on the new session's group without delivering it
(the path a session takes after a fault: `session.resumed {reason: "saved"}`) and goes on from the saved chunk,
so its frames are those of the session that never stopped. A saved world never changes: a save of a resumed
world is a new world that names its `parent`.

Three files per world in the store (deployments/storage.py, `worlds_dir`): `<id>.json` (the world), `<id>.frame`
(the first frame, float32 little-endian [3, H, W]) and `<id>.meta.json` (owner, created, chunks, bytes, parent),
written last: a world without it is incomplete and not found. A world is the key's that saved it (a hash of the
key is kept; without api_keys it is nobody's, found by its 128-bit id); another key's world is answered like one
that does not exist. Bounds: `max_worlds_per_key`, `max_world_bytes_per_key`, `max_world_chunks`, and
`world_keep_s` (expired worlds are swept at each save).

Where the session has a restore point (the snapshots its ranks left at the ingress's keeper: the K/V slots its
next chunk attends and every rank's state) and it fits `max_world_snapshot_bytes` and the key's bytes, the world
keeps it too (`<id>.snap`, lingbot/runtime/snapshot_file.py: no pickle): a resume on a group of the same size
restores it and replays only the chunks after it. Otherwise (no snapshot yet, too large: at 14B one is ~24 GiB,
another group size) the resume replays every chunk; the frames are the same either way.

Plain Python: no Ray, no Starlette. The blocking store calls run on the worlds' own thread."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from lingbot.runtime.journal import ChunkControls, JournalError, WorldJournal, image_digest
from lingbot.runtime.snapshot import SlotSnapshot, StateSnapshot
from lingbot.runtime.snapshot_file import SnapshotFileError, dump, load

from ..storage import Store, stem
from .codes import CLOSE_POLICY, CLOSE_SERVER_ERROR, ErrorCode, ProtocolError
from .events import InteractionState, ModelFacts, RankRestore, Resume, SnapshotOwner
from .recording import owner_hash
from .requests import StartRequest

log = logging.getLogger("ray.serve")

WORLD_VERSION = 1
WORLD_ID = re.compile(r"[0-9a-f]{32}")


def frame_settings(facts: ModelFacts) -> dict:
    """The deployment's settings that change a session's frames (beside what its journal holds)."""
    return {"preset": facts.preset, "width": facts.width, "height": facts.height, "steps": facts.steps,
            "dtype": facts.dtype, "vae_dtype": facts.vae_dtype, "random_weights": facts.random_weights}


def interactions_json(state: Optional[InteractionState]) -> Optional[dict]:
    """A group's interaction state (its planner's records of what is left of each event; plain maps where it was
    read from a saved world) as JSON values."""
    if state is None:
        return None
    return {"events": {eid: {k: v for k, v in (p if isinstance(p, dict) else dataclasses.asdict(p)).items()
                             if k != "event_id"} for eid, p in state.events.items()}, "held": state.held}


def interactions_from_json(data: Any) -> Optional[InteractionState]:
    """The state back, its events as plain maps (the group's planner takes them so); JournalError when garbled."""
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("events"), dict) or \
            not isinstance(data.get("held"), (str, type(None))):
        raise JournalError("the world's interaction state is garbled")
    events = {}
    for eid, p in data["events"].items():
        if not isinstance(p, dict) or set(p) - {"camera_chunks", "keys", "prompt_chunks"}:
            raise JournalError("the world's interaction state is garbled")
        for name in ("camera_chunks", "prompt_chunks"):
            if not isinstance(p.get(name), (int, type(None))) or isinstance(p.get(name), bool):
                raise JournalError("the world's interaction state is garbled")
        if p.get("keys") is not None and not (isinstance(p["keys"], list)
                                              and all(isinstance(k, str) for k in p["keys"])):
            raise JournalError("the world's interaction state is garbled")
        events[str(eid)] = dict(p)
    return InteractionState(events, data["held"])


@dataclass
class World:
    id: str
    journal: WorldJournal
    interactions: Optional[InteractionState]
    action_script: list
    frames: dict                          # frame_settings at the save
    parent: Optional[str]
    image: np.ndarray                     # float32 [3, H, W]: the first frame the model took
    snapshot: Optional[tuple[int, list]] = None   # (its chunk, each rank's (slots, state)): a restore point

    @property
    def chunk_index(self) -> int:
        """The last chunk the world holds (the resume goes on from the next)."""
        return len(self.journal.chunks) - 1

    def start(self, asked: StartRequest) -> StartRequest:
        """The resumed session's start: the world's own (its frames'), the client's transport choices, and
        `asked.chunks` chunks more than the world holds (None: endless)."""
        j = self.journal
        return replace(asked, prompt=j.prompt, image=self.image, width=j.width, height=j.height, fps=j.fps,
                       seed=j.seed, flow_shift=j.flow_shift, action_script=list(self.action_script),
                       trajectory=j.trajectory, decoder=j.decoder, window=j.window,
                       chunks=None if asked.chunks is None else len(j.chunks) + asked.chunks)

    def resume(self, restore: tuple[RankRestore, ...] = ()) -> Resume:
        """What the session's group does first: restore the world's snapshot (`restore`: each rank's keys at the
        session's keeper) and replay the chunks after it, or (none) replay every chunk; then it goes on, and the
        client gets a stream of its own from its first chunk (fresh_stream)."""
        index = self.snapshot[0] if restore and self.snapshot is not None else -1
        return Resume(tuple(self.journal.chunks), self.interactions, 0, index, restore if index >= 0 else (),
                      fresh_stream=True)

    def mismatch(self, facts: ModelFacts) -> Optional[ProtocolError]:
        """The refusal when this deployment would not make the world's frames (its settings, its decoders)."""
        here = frame_settings(facts)
        diffs = [f"{k} {self.frames.get(k)!r} (here {v!r})" for k, v in here.items() if self.frames.get(k) != v]
        decoders = {self.journal.decoder} | {d for c in self.journal.chunks for d in (c.decoder, c.prewarm) if d}
        missing = sorted(decoders - set(facts.decoders))
        if missing:
            diffs.append(f"decoders {', '.join(missing)} (not loaded here)")
        steps = {c.steps for c in self.journal.chunks if c.steps is not None}
        if not diffs and any(not 1 <= n <= facts.steps for n in steps):
            return ProtocolError(ErrorCode.WORLD_CORRUPT, "the world's chunks name impossible denoising steps",
                                 close=CLOSE_POLICY)
        if not diffs:
            return None
        return ProtocolError(ErrorCode.WORLD_MISMATCH, "this world was saved under settings that change the frames: "
                             + "; ".join(diffs), close=CLOSE_POLICY)


def world_json(world_id: str, journal: WorldJournal, interactions, action_script, frames: dict,
               parent: Optional[str]) -> bytes:
    body = {"version": WORLD_VERSION, "id": world_id, "parent": parent, "frames": frames,
            "action_script": [list(k) for k in action_script], "interactions": interactions_json(interactions),
            "journal": json.loads(journal.to_json())}
    return json.dumps(body, allow_nan=False).encode()


def read_snapshot(data: bytes, index: int, chunks: int) -> tuple[int, list]:
    """A world's stored snapshot back: (its chunk, each rank's (slots, state)); JournalError when it is not the
    whole restore point of chunk `index` (of a world of `chunks` chunks)."""
    try:
        ranks = load(data)
    except SnapshotFileError as e:
        raise JournalError(f"the world's snapshot: {e}") from None
    if not (isinstance(ranks, list) and ranks and 0 <= index < chunks):
        raise JournalError("the world's snapshot is garbled")
    out = []
    for rank, item in enumerate(ranks):
        slots, state = item if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None)
        if not (isinstance(state, StateSnapshot) and isinstance(slots, list) and slots
                and all(isinstance(s, SlotSnapshot) for s in slots) and state.index == index
                and all((s.rank, s.world_size) == (rank, len(ranks)) for s in [*slots, state])):
            raise JournalError("the world's snapshot is not one restore point of every rank")
        out.append((slots, state))
    return index, out


def read_world(world_id: str, raw: bytes, frame: Optional[bytes]) -> World:
    """A stored world back, whole; JournalError when anything is missing, garbled or altered."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JournalError(f"not a JSON world: {e}") from None
    if not isinstance(data, dict) or data.get("version") != WORLD_VERSION or data.get("id") != world_id:
        raise JournalError(f"not a version {WORLD_VERSION} world with this id")
    journal = WorldJournal.from_json(json.dumps(data.get("journal")))
    script, frames, parent = data.get("action_script"), data.get("frames"), data.get("parent")
    if not (isinstance(script, list) and all(isinstance(s, list) and all(isinstance(k, str) for k in s)
                                             for s in script)) or not isinstance(frames, dict) \
            or not (parent is None or (isinstance(parent, str) and WORLD_ID.fullmatch(parent))):
        raise JournalError("the world's script, settings or parent are garbled")
    size = 3 * journal.height * journal.width * 4
    if frame is None or len(frame) != size:
        raise JournalError("the world's first frame is missing or truncated")
    image = np.frombuffer(frame, dtype="<f4").reshape(3, journal.height, journal.width).astype(np.float32)
    if image_digest(image) != journal.image_sha256:
        raise JournalError("the world's first frame is not the one its journal names")
    return World(world_id, journal, interactions_from_json(data.get("interactions")),
                 [tuple(s) for s in script], frames, parent, image)


class Worlds:
    """The ingress's worlds: the store, the one thread that reads and writes it, the bounds."""

    def __init__(self, store: Store, settings):
        self.store = store
        self.keep_s = settings.world_keep_s
        self.max_worlds, self.max_bytes = settings.max_worlds_per_key, settings.max_world_bytes_per_key
        self.max_chunks = settings.max_world_chunks
        self.max_snapshot_bytes = settings.max_world_snapshot_bytes
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="worlds")

    @classmethod
    def from_settings(cls, settings) -> Optional[Worlds]:
        """None where worlds_dir is empty (worlds off) or cannot be opened (logged)."""
        if not settings.worlds_dir:
            return None
        try:
            return cls(Store(settings.worlds_dir), settings)
        except Exception as e:                           # (a bad URL, a missing fsspec backend, no permission)
            log.error("worlds_dir %r cannot be used (%s: %s); worlds are off", settings.worlds_dir,
                      type(e).__name__, e)
            return None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- saving ----------------------------------------------------------------------------------
    async def save(self, start: StartRequest, chunks: list[ChunkControls], interactions, facts: ModelFacts,
                   tenant: str, parent: Optional[str], snapshot: Optional[tuple[int, bytes]] = None) -> tuple[str, int]:
        """Store the world of a session after its delivered `chunks` (with `snapshot`, a restore point's chunk and
        file, where the key's bytes hold it): (its new id, its last chunk's index) once durable. ProtocolError
        (the session goes on) at a bound or when the store fails."""
        if not chunks:
            raise ProtocolError(ErrorCode.NOTHING_TO_SAVE, "the session has no chunk yet to save")
        if len(chunks) > self.max_chunks:
            raise ProtocolError(ErrorCode.WORLD_LIMIT, f"a world holds at most {self.max_chunks} chunks "
                                f"(max_world_chunks); this one has {len(chunks)}")
        journal = WorldJournal(facts.preset, facts.random_weights, start.width, start.height, start.fps, start.seed,
                               start.prompt, image_digest(start.image), start.decoder or facts.decoders[0],
                               start.flow_shift, start.window, start.trajectory,
                               [replace(c, profile=False) for c in chunks])
        world_id = secrets.token_hex(16)
        body = world_json(world_id, journal, interactions, start.action_script, frame_settings(facts), parent)
        frame = np.ascontiguousarray(start.image, dtype="<f4").tobytes()
        try:
            await self._run(self._store, world_id, body, frame, owner_hash(tenant), parent, len(chunks), snapshot)
        except OSError as e:
            log.warning("world %s: not saved (%s)", world_id, e)
            raise ProtocolError(ErrorCode.WORLD_UNAVAILABLE, "the world could not be stored now; the session goes "
                                "on") from None
        return world_id, len(chunks) - 1

    def _store(self, world_id: str, body: bytes, frame: bytes, owner: Optional[str], parent: Optional[str],
               chunks: int, snapshot: Optional[tuple[int, bytes]]) -> None:
        self.store.sweep(self.keep_s, 2 ** 62)
        mine = [m for m in self._metas() if m.get("owner") == owner]
        size = len(body) + len(frame)
        if len(mine) >= self.max_worlds:
            raise_limit(f"this key keeps {len(mine)} worlds (max_worlds_per_key {self.max_worlds}); delete one")
        held = sum(int(m.get("bytes", 0)) for m in mine)
        if held + size > self.max_bytes:
            raise_limit(f"this key's worlds hold {held} bytes; {size} more would pass max_world_bytes_per_key "
                        f"({self.max_bytes})")
        kept = None
        if snapshot is not None and held + size + len(snapshot[1]) <= self.max_bytes:   # else: a replay on resume
            index, data = snapshot
            self.store.put_bytes(f"{world_id}.snap", data)
            kept, size = {"index": index, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, \
                size + len(data)
        self.store.put_bytes(f"{world_id}.frame", frame)
        self.store.put_bytes(f"{world_id}.json", body)
        meta = {"id": world_id, "owner": owner, "created": time.time(), "chunks": chunks, "bytes": size,
                "parent": parent, "sha256": hashlib.sha256(body).hexdigest(), "snapshot": kept}
        self.store.put_bytes(f"{world_id}.meta.json", json.dumps(meta).encode())     # last: the world is whole

    def _metas(self) -> list[dict]:
        out = []
        for f in self.store.files():
            if f.name.endswith(".meta.json"):
                raw = self.store.get_bytes(f.name)
                try:
                    out.append(json.loads(raw))
                except (TypeError, ValueError):
                    continue
        return out

    # ---- finding ---------------------------------------------------------------------------------
    def _meta(self, world_id: str, tenant: str) -> Optional[dict]:
        if not isinstance(world_id, str) or not WORLD_ID.fullmatch(world_id):
            return None
        raw = self.store.get_bytes(f"{world_id}.meta.json")
        try:
            meta = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        if not isinstance(meta, dict) or meta.get("owner") != owner_hash(tenant) or \
                time.time() - float(meta.get("created", 0)) > self.keep_s:
            return None
        return meta

    async def load(self, world_id: str, tenant: str) -> World:
        """The world `world_id` for `tenant`; ProtocolError (closing) when there is none for it, it cannot be read
        back whole, or the store fails."""
        try:
            return await self._run(self._load, world_id, tenant)
        except OSError as e:
            log.warning("world %s: not read (%s)", world_id, e)
            raise ProtocolError(ErrorCode.WORLD_UNAVAILABLE, "the world store cannot be read now",
                                close=CLOSE_SERVER_ERROR) from None

    def _load(self, world_id: str, tenant: str, with_snapshot: bool = True) -> World:
        meta = self._meta(world_id, tenant)
        if meta is None:
            raise ProtocolError(ErrorCode.WORLD_NOT_FOUND, "no world has this id", close=CLOSE_POLICY)
        raw = self.store.get_bytes(f"{world_id}.json")
        try:
            if raw is None or hashlib.sha256(raw).hexdigest() != meta.get("sha256"):
                raise JournalError("the world's file is missing, truncated or altered")
            world = read_world(world_id, raw, self.store.get_bytes(f"{world_id}.frame"))
            kept = meta.get("snapshot")
            if with_snapshot and kept is not None:
                data = self.store.get_bytes(f"{world_id}.snap")
                if not isinstance(kept, dict) or data is None or hashlib.sha256(data).hexdigest() != kept.get("sha256"):
                    raise JournalError("the world's snapshot is missing, truncated or altered")
                world.snapshot = read_snapshot(data, int(kept.get("index", -1)), len(world.journal.chunks))
            return world
        except JournalError as e:
            log.warning("world %s: cannot be read back (%s)", world_id, e)
            raise ProtocolError(ErrorCode.WORLD_CORRUPT, f"this world cannot be read back: {e}",
                                close=CLOSE_POLICY) from None

    def first_frame(self, world_id: str, tenant: str) -> Optional[np.ndarray]:
        """(Blocking) The first frame of the tenant's world `world_id` (float32 [3, H, W]); None when it has none
        of that id or it cannot be read back whole."""
        try:
            return self._load(world_id, tenant, with_snapshot=False).image
        except ProtocolError:
            return None

    def listing(self, tenant: str) -> list[dict]:
        """(Blocking) The tenant's worlds, newest first: id, chunks, bytes, created, parent."""
        owner = owner_hash(tenant)
        now = time.time()
        mine = [m for m in self._metas() if m.get("owner") == owner and now - float(m.get("created", 0)) <= self.keep_s]
        return [{k: m.get(k) for k in ("id", "chunks", "bytes", "created", "parent")}
                for m in sorted(mine, key=lambda m: -float(m.get("created", 0)))]

    def delete(self, world_id: str, tenant: str) -> bool:
        """(Blocking) Delete the tenant's world `world_id`; False when it has none of that id."""
        if self._meta(world_id, tenant) is None:
            return False
        self.store.delete(f"{world_id}.meta.json")              # first: from here on it is not found
        for f in self.store.files():
            if stem(f.name) == world_id:
                self.store.delete(f.name)
        return True


def raise_limit(message: str):
    raise ProtocolError(ErrorCode.WORLD_LIMIT, message)


async def open_world(worlds: Optional[Worlds], start: StartRequest, tenant: str, facts: ModelFacts) -> World:
    """The saved world a start names, for `tenant`, that this deployment makes the frames of; ProtocolError
    (closing) otherwise."""
    if worlds is None:
        raise ProtocolError(ErrorCode.WORLDS_OFF, "this deployment keeps no worlds (worlds_dir is empty)",
                            close=CLOSE_POLICY)
    world = await worlds.load(start.world_id, tenant)
    mismatch = world.mismatch(facts)
    if mismatch is not None:
        raise mismatch
    return world


async def save_world(worlds: Optional[Worlds], start: StartRequest, ledger, tenant: str, resumed: Optional[World],
                     facts: ModelFacts, groups=None) -> tuple[str, int]:
    """A session's world after the chunks its client got (its `ledger`), with its newest restore point's snapshots
    (fetched through `groups`, the GroupLink) where there is one that fits: (the new world's id, its last chunk);
    a resumed world's save names it as its parent. ProtocolError (the session goes on) when it cannot."""
    if worlds is None:
        raise ProtocolError(ErrorCode.WORLDS_OFF, "this deployment keeps no worlds (worlds_dir is empty)")
    chunks = [c if c is not None else ChunkControls() for c in ledger.journal]
    snapshot = await snapshot_of(worlds, ledger, groups) if groups is not None and chunks else None
    return await worlds.save(start, chunks, ledger.interactions, facts, tenant, resumed and resumed.id, snapshot)


async def snapshot_of(worlds: Worlds, ledger, groups) -> Optional[tuple[int, bytes]]:
    """The session's newest restore point as a snapshot file, or None (none yet, too large, the keeper lost it)."""
    point = ledger.restore_keys()
    if point is None or worlds.max_snapshot_bytes <= 0:
        return None
    index, slot_keys, state_keys = point
    try:
        fetched = await groups.snapshots([k for keys in slot_keys for k in keys] + state_keys)
    except Exception as e:                                  # (the keeper restarted: its snapshots are gone)
        log.info("a world's snapshot could not be fetched (%s); it is saved without one", type(e).__name__)
        return None
    ranks, at = [], 0
    for keys in slot_keys:
        ranks.append([fetched[at:at + len(keys)], None])
        at += len(keys)
    for rank, state in enumerate(fetched[at:]):
        ranks[rank][1] = state
    data = await asyncio.get_running_loop().run_in_executor(worlds.executor, dump, ranks)
    return (index, data) if len(data) <= worlds.max_snapshot_bytes else None


async def restored(world: World, owner: Optional[SnapshotOwner], groups, ranks: int) -> Resume:
    """The Resume of a session that starts from `world`: its snapshot given to the session's keeper (`owner`) and
    restored where it has one of `ranks` ranks, else every chunk replayed."""
    if world.snapshot is None or owner is None or len(world.snapshot[1]) != ranks:
        return world.resume()
    try:
        restore = []
        for slots, state in world.snapshot[1]:
            keys = await groups.keep_snapshots(owner.session_id, slots, state)
            if keys is None:
                return world.resume()
            restore.append(RankRestore(tuple(keys[:-1]), keys[-1], owner))
    except Exception as e:                                  # (the keeper is gone): replayed instead
        log.warning("world %s: its snapshot could not be kept (%s); its chunks are replayed", world.id,
                    type(e).__name__)
        return world.resume()
    return world.resume(tuple(restore))
