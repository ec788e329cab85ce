"""Saved worlds without Ray (deployments/session/worlds.py): a world stored and read back whole, on a folder and on
an fsspec store through the same code; its start and resume; a key's worlds are its own; the bounds; a truncated,
altered or garbled world refused with world_corrupt; a deployment that would make other frames, with
world_mismatch naming what differs; a saved interaction state restored by the group's planner."""
import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deployments.group.planner import ControlPlanner, _Progress
from deployments.session.codes import ErrorCode, ProtocolError
from deployments.session.events import InteractionState, ModelFacts
from deployments.session.requests import StartRequest
from deployments.session.worlds import Worlds, interactions_from_json, interactions_json, open_world, save_world
from deployments.settings import ServeSettings
from deployments.storage import Store
from lingbot.camera import CameraEvent
from lingbot.config import get_preset
from lingbot.runtime.journal import ChunkControls

W, H = 112, 64
FACTS = ModelFacts.of(get_preset("tiny"), random_weights=True, decoders=("tae", "wan"))
CHUNKS = [ChunkControls(keys=("w", "", "a")), ChunkControls(camera=CameraEvent("velocity", (0.1, 0, 0), (0, 0, 0, 1))),
          ChunkControls(prompt="a storm", prompt_transition_chunks=2, steps=2, decoder="wan", profile=True)]


def start_request(seed=3) -> StartRequest:
    image = np.random.default_rng(seed).uniform(-1, 1, (3, H, W)).astype(np.float32)
    return StartRequest("a harbour", image, W, H, 3, None, 16.0, seed, 4.0, [("w", "", "a")] * 3)


def ledger(chunks=CHUNKS, interactions=None):
    return SimpleNamespace(journal=list(chunks), interactions=interactions, facts=FACTS)


def worlds_at(url: str, **settings) -> Worlds:
    return Worlds(Store(url), ServeSettings(**settings))


def save(worlds, tenant="", resumed=None, chunks=CHUNKS, interactions=None, start=None):
    return asyncio.run(save_world(worlds, start or start_request(), ledger(chunks, interactions), tenant, resumed,
                                  FACTS))


def load(worlds, world_id, tenant="", facts=FACTS):
    asked = StartRequest("", np.zeros((3, 0, 0), np.float32), 0, 0, 4, None, 0.0, 0, None, [], world_id=world_id)
    return asyncio.run(open_world(worlds, asked, tenant, facts))


def refused(fn, *args, **kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        fn(*args, **kwargs)
    return e.value


@pytest.mark.parametrize("where", ["folder", "memory"])
def test_a_world_is_read_back_whole_and_resumes_as_it_was_saved(tmp_path, where):
    worlds = worlds_at(str(tmp_path) if where == "folder" else f"memory://worlds-{id(tmp_path)}")
    state = InteractionState({"3": _Progress("3", camera_chunks=2, keys=["w", ""])}, "wd")   # as a group reports it
    world_id, index = save(worlds, interactions=InteractionState(
        {"3": {"camera_chunks": 2, "keys": ["w", ""], "prompt_chunks": None}}, "wd"))
    assert index == 2 and len(world_id) == 32
    world = load(worlds, world_id)
    start = start_request()
    assert np.array_equal(world.image, start.image) and world.image.dtype == np.float32
    assert world.journal.chunks == [replace(c, profile=False) for c in CHUNKS]
    assert world.interactions == InteractionState({"3": {"camera_chunks": 2, "keys": ["w", ""],
                                                         "prompt_chunks": None}}, "wd")
    assert interactions_json(state) == {"events": {"3": {"camera_chunks": 2, "keys": ["w", ""],
                                                         "prompt_chunks": None}}, "held": "wd"}
    asked = StartRequest("", np.zeros((3, 0, 0), np.float32), 0, 0, 4, 48, 0.0, 0, None, [], paced=False,
                         quality="tiny", world_id=world_id)
    resumed = world.start(asked)
    assert (resumed.prompt, resumed.seed, resumed.width, resumed.height, resumed.fps, resumed.flow_shift) == \
        ("a harbour", 3, W, H, 16.0, 4.0)
    assert resumed.chunks == 3 + 4 and resumed.action_script == start.action_script
    assert (resumed.paced, resumed.quality, resumed.decoder) == (False, "tiny", "tae")
    resume = world.resume()
    assert resume.fresh_stream and resume.next_index == 3 and resume.frames_delivered == 0 and not resume.restore
    child, _ = save(worlds, resumed=world)
    assert load(worlds, child).parent == world_id
    assert [w["id"] for w in worlds.listing("")] == [child, world_id]          # newest first


def test_the_planner_takes_a_saved_interaction_state():
    planner = ControlPlanner([], 12)
    planner.restore(interactions_from_json({"events": {"5": {"camera_chunks": 1, "keys": None, "prompt_chunks": None}},
                                            "held": "w"}))
    assert planner.held == "w" and planner.events["5"].camera_chunks == 1 and planner.events["5"].event_id == "5"
    with pytest.raises(ValueError):
        interactions_from_json({"events": {"5": {"camera_chunks": "1"}}, "held": None})
    with pytest.raises(ValueError):
        interactions_from_json({"events": {"5": {"rm -rf": 1}}, "held": None})


def test_a_keys_worlds_are_its_own_and_the_bounds_hold(tmp_path):
    worlds = worlds_at(str(tmp_path), max_worlds_per_key=2, max_world_chunks=3, max_world_bytes_per_key=2 ** 20)
    mine, _ = save(worlds, "key:alpha")
    for tenant in ("key:beta", ""):                                   # another key, or none: as if it did not exist
        assert refused(load, worlds, mine, tenant).code == ErrorCode.WORLD_NOT_FOUND
        assert worlds.listing(tenant) == [] and not worlds.delete(mine, tenant)
        assert worlds.first_frame(mine, tenant) is None
    assert [w["id"] for w in worlds.listing("key:alpha")] == [mine]
    save(worlds, "key:alpha")
    assert refused(save, worlds, "key:alpha").code == ErrorCode.WORLD_LIMIT          # max_worlds_per_key
    assert refused(save, worlds, "key:beta", chunks=CHUNKS * 2).code == ErrorCode.WORLD_LIMIT   # max_world_chunks
    assert refused(save, worlds, "key:beta", chunks=[]).code == ErrorCode.NOTHING_TO_SAVE
    small = worlds_at(str(tmp_path / "small"), max_world_bytes_per_key=100_000)          # a world: ~90 KB
    save(small, "key:beta")
    error = refused(save, small, "key:beta")
    assert error.code == ErrorCode.WORLD_LIMIT and "max_world_bytes_per_key" in error.message and error.close is None
    assert worlds.delete(mine, "key:alpha") and refused(load, worlds, mine, "key:alpha").code == \
        ErrorCode.WORLD_NOT_FOUND
    assert refused(load, worlds, "not-an-id").code == ErrorCode.WORLD_NOT_FOUND
    off = refused(save, None)
    assert off.code == ErrorCode.WORLDS_OFF and off.close is None
    assert refused(load, None, mine).code == ErrorCode.WORLDS_OFF


def test_an_expired_world_is_gone_and_swept(tmp_path):
    worlds = worlds_at(str(tmp_path), world_keep_s=60)
    old, _ = save(worlds)
    meta = tmp_path / f"{old}.meta.json"
    body = json.loads(meta.read_text())
    meta.write_text(json.dumps({**body, "created": body["created"] - 120}))
    assert refused(load, worlds, old).code == ErrorCode.WORLD_NOT_FOUND and worlds.listing("") == []
    import os
    for f in tmp_path.glob(f"{old}.*"):
        os.utime(f, (0, 0))                                           # (the sweep goes by the files' age)
    save(worlds)
    assert not list(tmp_path.glob(f"{old}.*"))


@pytest.mark.parametrize("damage", ["truncated", "altered_json", "altered_frame", "short_frame", "no_frame",
                                    "garbled_state"])
def test_a_damaged_world_is_refused_as_corrupt(tmp_path, damage):
    worlds = worlds_at(str(tmp_path))
    world_id, _ = save(worlds)
    body, frame = tmp_path / f"{world_id}.json", tmp_path / f"{world_id}.frame"
    if damage == "truncated":
        body.write_bytes(body.read_bytes()[:-10])
    elif damage == "altered_json":
        body.write_bytes(body.read_bytes().replace(b'"seed": 3', b'"seed": 4'))
    elif damage == "altered_frame":
        frame.write_bytes(b"\x00" * 4 + frame.read_bytes()[4:])
    elif damage == "short_frame":
        frame.write_bytes(frame.read_bytes()[:-4])
    elif damage == "no_frame":
        frame.unlink()
    else:                                                             # consistent with its digest, garbled inside
        data = json.loads(body.read_bytes())
        data["interactions"] = {"events": {"1": {"keys": 5}}, "held": None}
        raw = json.dumps(data).encode()
        body.write_bytes(raw)
        meta = tmp_path / f"{world_id}.meta.json"
        import hashlib
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "sha256": hashlib.sha256(raw).hexdigest()}))
    error = refused(load, worlds, world_id)
    assert (error.code, error.close) == (ErrorCode.WORLD_CORRUPT, 1008), error.message


def test_a_world_of_other_frames_settings_is_refused_naming_them(tmp_path):
    worlds = worlds_at(str(tmp_path))
    world_id, _ = save(worlds)
    other = replace(FACTS, steps=FACTS.steps + 2, dtype="float16", decoders=("tae",))
    error = refused(load, worlds, world_id, facts=other)
    assert (error.code, error.close) == (ErrorCode.WORLD_MISMATCH, 1008)
    assert f"steps {FACTS.steps} (here {FACTS.steps + 2})" in error.message and "dtype" in error.message
    assert "decoders wan (not loaded here)" in error.message


class Keeper:
    """The GroupLink's snapshot calls, as the ingress's keeper answers them (keys in order; the objects kept)."""

    def __init__(self, held=None):
        self.held, self.kept = dict(held or {}), []

    async def snapshots(self, keys):
        return [self.held[k] for k in keys]

    async def keep_snapshots(self, session_id, slots, state):
        self.kept.append((session_id, slots, state))
        return [f"{session_id}.{len(self.kept)}.{i}" for i in range(len(slots) + 1)]


def point(index=2, ranks=2):
    """A restore point of `ranks` ranks after chunk `index` (slots of chunks 0..index), as a keeper holds it."""
    from lingbot.runtime.snapshot import SlotSnapshot, StateSnapshot
    held, slot_keys, state_keys = {}, [], []
    for rank in range(ranks):
        keys = []
        for c in range(index + 1):
            held[f"s{rank}.{c}"] = SlotSnapshot(c, rank, ranks, torch.full((2, 3), float(c)), torch.zeros(2, 3))
            keys.append(f"s{rank}.{c}")
        held[f"t{rank}"] = StateSnapshot(index, rank, ranks, {"dit": {"rng": torch.arange(4)}, "decoder_name": "tae"})
        slot_keys.append(keys)
        state_keys.append(f"t{rank}")
    ledger_ = SimpleNamespace(journal=list(CHUNKS), interactions=None, facts=FACTS,
                              restore_keys=lambda: (index, slot_keys, state_keys))
    return ledger_, Keeper(held)


def test_a_world_keeps_its_restore_point_where_it_fits_and_a_resume_restores_it(tmp_path):
    from deployments.session.events import SnapshotOwner
    from deployments.session.worlds import restored
    worlds = worlds_at(str(tmp_path))
    ledger_, keeper = point()
    world_id, _ = asyncio.run(save_world(worlds, start_request(), ledger_, "", None, FACTS, keeper))
    world = load(worlds, world_id)
    assert world.snapshot[0] == 2 and [len(slots) for slots, _ in world.snapshot[1]] == [3, 3]
    assert torch.equal(world.snapshot[1][1][0][2].keys, torch.full((2, 3), 2.0))
    owner = SnapshotOwner("the keeper", "sess")
    resume = asyncio.run(restored(world, owner, keeper, 2))
    assert (resume.snapshot_index, resume.next_index, resume.fresh_stream) == (2, 3, True)
    assert [r.state for r in resume.restore] == ["sess.1.3", "sess.2.3"] and resume.restore[0].owner is owner
    assert len(resume.restore[1].slots) == 3 and len(keeper.kept) == 2
    other_size = asyncio.run(restored(world, owner, keeper, 1))             # another group size: a replay
    assert other_size.snapshot_index == -1 and other_size.restore == () and len(keeper.kept) == 2
    # too large for max_world_snapshot_bytes, or for the key's bytes: the world is saved without it
    for i, settings in enumerate(({"max_world_snapshot_bytes": 100}, {"max_world_bytes_per_key": 86_016 + 1_500})):
        small = worlds_at(str(tmp_path / f"small{i}"), **settings)
        bare, _ = asyncio.run(save_world(small, start_request(), ledger_, "", None, FACTS, keeper))
        assert load(small, bare).snapshot is None
    (tmp_path / f"{world_id}.snap").write_bytes((tmp_path / f"{world_id}.snap").read_bytes()[:-8])
    assert refused(load, worlds, world_id).code == ErrorCode.WORLD_CORRUPT


def test_a_save_runs_beside_the_session_one_at_a_time_and_its_end_waits_for_it(tmp_path):
    """session.save is stored by a task of its own (the session's messages go on); a second one meanwhile is
    refused; the session's end waits for it, so the client is answered before it is told the session is done."""
    import time

    from deployments.session.outputs import Outputs
    from deployments.session.ports import SAVE

    class SlowStore(Worlds):
        def _store(self, *args):
            time.sleep(0.3)
            return super()._store(*args)

    sent, refused_ = [], []

    class Wire:
        dialect = "vllm"

        async def send(self, message):
            sent.append(message)

        def saved_message(self, world_id, index):
            return {"type": "session.saved", "world_id": world_id, "chunk_index": index}

    async def refuse(error):
        refused_.append(error.code)

    async def facts():
        return FACTS
    worlds = SlowStore(Store(str(tmp_path)), ServeSettings())
    outputs = Outputs("s", Wire(), SimpleNamespace(facts=facts), None, None, ServeSettings(), worlds)
    session_ledger = SimpleNamespace(journal=list(CHUNKS), interactions=None, facts=FACTS, restore_keys=lambda: None)

    async def scenario():
        lock = asyncio.Lock()
        first = await outputs.asked(SAVE, lock, start_request(), session_ledger, refuse)
        second = await outputs.asked(SAVE, lock, start_request(), session_ledger, refuse)
        answered_before_the_end = list(sent)
        await outputs.end(3, False)
        return first, second, answered_before_the_end

    first, second, before = asyncio.run(scenario())
    assert first is None and second.code == ErrorCode.WORLD_LIMIT and "one at a time" in second.message
    assert before == [] and [m["type"] for m in sent] == ["session.saved"] and refused_ == []
    assert worlds.listing("")[0]["id"] == sent[0]["world_id"]
