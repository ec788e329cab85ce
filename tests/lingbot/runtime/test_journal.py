"""A world's journal (lingbot/runtime/journal.py): a session's start and every chunk's controls, as JSON, replay
to the session's frames bitwise; a journal that cannot be replayed here says why."""
import json
import re

import numpy as np
import pytest

from lingbot.builder import build_pipeline
from lingbot.camera import CameraEvent, Trajectory
from lingbot.camera.poses import make_pose, rot_y
from lingbot.runtime.journal import ChunkControls, JournalError, WorldJournal, apply, image_digest, open_world, replay


@pytest.fixture(scope="module")
def pipeline():
    return build_pipeline("tiny", decoder=("wan", "tae"))


def first_frame(width, height, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (3, height, width)).astype(np.float32)


CONTROLS = [ChunkControls(keys=("w", "w", "wd")),
            ChunkControls(camera=CameraEvent("velocity", (0.0, 0.0, 0.05), (0.0, 0.05, 0.0, 1.0)), steps=2),
            ChunkControls(prompt="a desert road", prompt_transition_chunks=2, decoder="tae"),
            ChunkControls(keys=("a", "d", ""), prewarm="wan", profile=True)]


def test_a_journal_replays_to_the_sessions_frames_bitwise(pipeline):
    """A session of four chunks (keys, a camera event at a cheaper rung, a prompt change on the tiny decoder, a
    prewarm) run as a rank runs it; its journal through JSON replays to the same frames, bit for bit."""
    preset = pipeline.runner.preset
    image = first_frame(preset.width, preset.height)
    world = open_world(pipeline, image, "a forest path", 5, flow_shift=3.0, decoder="wan")
    made = [apply(world, c, i)[0].frames.numpy() for i, c in enumerate(CONTROLS)]
    journal = WorldJournal(preset.name, True, preset.width, preset.height, 16.0, 5, "a forest path",
                           image_digest(image), "wan", flow_shift=3.0, chunks=list(CONTROLS))
    text = journal.to_json()
    body = json.loads(text)
    assert [c["quality"] for c in body["chunks"]] == ["full", "steps2", "tiny", "full"]
    assert "profile" not in body["chunks"][3]                    # timings, not frames
    again = WorldJournal.from_json(text)
    assert [c.quality for c in again.chunks] == ["full", "steps2", "tiny", "full"]
    replayed = [c.frames.numpy() for c in replay(pipeline, again, image)]
    assert len(replayed) == 4
    for a, b in zip(made, replayed):
        assert np.array_equal(a, b)
    assert [c.frames.numpy().tobytes() for c in replay(pipeline, again, image, chunks=2)] == \
        [f.tobytes() for f in made[:2]]


def test_a_trajectory_and_a_window_survive_the_json(pipeline):
    preset = pipeline.runner.preset
    poses = np.stack([make_pose(rot_y(2 * i), (0.0, 0.0, 0.01 * i)) for i in range(9)])
    traj = Trajectory(poses, np.tile([[40.0, 40.0, 56.0, 32.0]], (9, 1)), 0.01)
    journal = WorldJournal(preset.name, True, preset.width, preset.height, 16.0, 1, "p", "0" * 64, "wan",
                           window=(1, 2), trajectory=traj, chunks=[ChunkControls()])
    again = WorldJournal.from_json(journal.to_json())
    assert again.window == (1, 2) and again.trajectory.unit == 0.01
    assert np.array_equal(again.trajectory.poses, poses) and np.array_equal(again.trajectory.intrinsics,
                                                                           traj.intrinsics)


def test_a_journal_that_cannot_be_replayed_here_says_why(pipeline):
    preset = pipeline.runner.preset
    image = first_frame(preset.width, preset.height)
    base = dict(preset=preset.name, random_weights=True, width=preset.width, height=preset.height, fps=16.0, seed=1,
                prompt="p", image_sha256=image_digest(image), decoder="wan")
    with pytest.raises(JournalError, match="not the session's first frame"):
        replay(pipeline, WorldJournal(**base), first_frame(preset.width, preset.height, seed=1))
    other = {**base, "preset": "lingbot-world-fast-v1", "width": 832, "height": 480}
    with pytest.raises(JournalError, match="made by preset lingbot-world-fast-v1 at 832x480; this pipeline runs tiny"):
        replay(pipeline, WorldJournal(**other), image)
    only_wan = build_pipeline("tiny")
    with pytest.raises(JournalError, match="decode with tae, which this pipeline did not load"):
        replay(only_wan, WorldJournal(**base, chunks=[ChunkControls(decoder="tae")]), image)
    with pytest.raises(JournalError, match="not a JSON journal"):
        WorldJournal.from_json("{")
    with pytest.raises(JournalError, match="not a version 1 or 2 world journal"):
        WorldJournal.from_json('{"version": 7}')
    with pytest.raises(JournalError, match="lacks or garbles a field: KeyError\\('seed'\\)"):
        WorldJournal.from_json(json.dumps({k: v for k, v in json.loads(WorldJournal(**base).to_json()).items()
                                           if k != "seed"}))
    bad_camera = json.loads(WorldJournal(**base).to_json())
    bad_camera["chunks"] = [{"camera": {"mode": "orbit", "translation": [0, 0, 0], "rotation": [0, 0, 0, 1]}}]
    with pytest.raises(JournalError, match="a chunk's controls are not valid: camera mode 'orbit'"):
        WorldJournal.from_json(json.dumps(bad_camera))


def long_prompt() -> str:
    """A 4,096-character prompt, a new str object each call (as prompts come from the group over Ray)."""
    return "".join(["a long desert road at dusk, "] * 146) + "and dust"


def start(**chunks) -> dict:
    return dict(preset="tiny", random_weights=True, width=64, height=48, fps=16.0, seed=5, prompt="a forest path",
                image_sha256="0" * 64, decoder="wan", **chunks)


def test_a_prompt_repeated_over_chunks_is_written_once():
    """50 chunks that each carry an equal 4,096-character prompt: the text is in the JSON once (the chunks
    refer to it by index), and reads back to the same controls."""
    assert len(long_prompt()) == 4096 and long_prompt() is not long_prompt()
    chunks = [ChunkControls(prompt=long_prompt(), prompt_transition_chunks=2) for _ in range(50)]
    text = WorldJournal(**start(chunks=chunks)).to_json()
    assert len(text.encode()) < 2 * 4096
    body = json.loads(text)
    assert body["version"] == 2 and body["prompts"] == [long_prompt()]
    assert body["chunks"][7] == {"quality": "full", "prompt_ref": 0, "prompt_transition_chunks": 2}
    assert WorldJournal.from_json(text).chunks == chunks


def test_each_distinct_prompt_gets_an_index_in_order_of_first_use():
    chunks = [ChunkControls(prompt="a desert road"), ChunkControls(keys=("a", "", "")),
              ChunkControls(prompt="a snowy pass", prompt_transition_chunks=3), ChunkControls(prompt="a desert road")]
    journal = WorldJournal(**start(chunks=chunks))
    body = json.loads(journal.to_json())
    assert body["prompt"] == "a forest path" and body["prompts"] == ["a desert road", "a snowy pass"]
    assert [c.get("prompt_ref") for c in body["chunks"]] == [0, None, 1, 0]
    assert not any("prompt" in c for c in body["chunks"])
    assert WorldJournal.from_json(journal.to_json()) == journal
    assert json.loads(WorldJournal(**start()).to_json())["prompts"] == []


V1_JOURNAL = """{"version": 1, "preset": "tiny", "random_weights": true, "width": 64, "height": 48, "fps": 16.0,
 "seed": 5, "prompt": "a forest path",
 "image_sha256": "0000000000000000000000000000000000000000000000000000000000000000", "decoder": "wan",
 "flow_shift": 3.0, "window": [1, 2], "trajectory": null, "chunks": [
  {"quality": "full", "keys": ["w", "w", "wd"]},
  {"quality": "tiny", "prompt": "a desert road", "prompt_transition_chunks": 2, "decoder": "tae"},
  {"quality": "steps2", "prompt": "a desert road", "prompt_transition_chunks": 0, "steps": 2}]}"""


def test_a_version_1_journal_still_reads():
    """Worlds and recordings stored before version 2 wrote each chunk's prompt inline."""
    journal = WorldJournal.from_json(V1_JOURNAL)
    assert journal == WorldJournal(**start(flow_shift=3.0, window=(1, 2), chunks=[
        ChunkControls(keys=("w", "w", "wd")),
        ChunkControls(prompt="a desert road", prompt_transition_chunks=2, decoder="tae"),
        ChunkControls(prompt="a desert road", steps=2)]))
    assert json.loads(journal.to_json())["prompts"] == ["a desert road"]
    assert WorldJournal.from_json(journal.to_json()) == journal


@pytest.mark.parametrize("chunk, message", [
    ({"prompt_ref": 1}, "prompt_ref 1 is not an index into the journal's 1 prompt"),
    ({"prompt_ref": -1}, "prompt_ref -1 is not an index into the journal's 1 prompt"),
    ({"prompt_ref": "0"}, "prompt_ref '0' is not an index into the journal's 1 prompt"),
    ({"prompt_ref": True}, "prompt_ref True is not an index into the journal's 1 prompt"),
    ({"prompt_ref": 0.0}, "prompt_ref 0.0 is not an index into the journal's 1 prompt"),
    ({"prompt": "a desert road"}, "a version 2 chunk names its prompt by prompt_ref, not its text"),
])
def test_a_bad_prompt_ref_is_refused(chunk, message):
    body = json.loads(WorldJournal(**start(chunks=[ChunkControls(prompt="a desert road")])).to_json())
    body["chunks"].append(chunk)
    with pytest.raises(JournalError, match=f"^{re.escape(message)}$"):
        WorldJournal.from_json(json.dumps(body))


def test_a_version_2_journal_without_its_prompts_is_refused():
    body = json.loads(WorldJournal(**start(chunks=[ChunkControls(prompt="a desert road")])).to_json())
    for prompts in (None, [3], "a desert road"):
        body["prompts"] = prompts
        with pytest.raises(JournalError, match=r"^the journal's prompts must be a list of strings$"):
            WorldJournal.from_json(json.dumps(body))
    del body["prompts"]
    with pytest.raises(JournalError, match="lacks or garbles a field: KeyError\\('prompts'\\)"):
        WorldJournal.from_json(json.dumps(body))
