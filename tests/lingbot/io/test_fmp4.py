"""Reading what FragmentedMp4Encoder writes (lingbot/io/video.py): the init segment split off the first chunk, a
keyframe forced at a chunk's start, and a stream a viewer joins there: the init segment, then the fragments from
that chunk on, decodes to exactly the frames of those chunks."""
import numpy as np
import pytest

from lingbot.io.video import (
    FragmentedMp4Encoder,
    fragment_starts_with_keyframe,
    mp4_boxes,
    read_frames,
    split_init_segment,
)


def chunks(n, frames=12, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (64, 112, 3), dtype=np.uint8)
    return [np.stack([np.roll(base, 3 * (k * frames + f), axis=1) for f in range(frames)]) for k in range(n)]


def test_a_forced_keyframe_starts_a_chunk_and_a_viewer_can_join_there():
    encoder = FragmentedMp4Encoder(112, 64, 16.0)
    parts = [encoder.encode_chunk(c, keyframe=(k == 3)) for k, c in enumerate(chunks(5))]
    init, first = split_init_segment(parts[0])
    assert [kind for kind, _, _ in mp4_boxes(init)] == [b"ftyp", b"moov"]
    assert [kind for kind, _, _ in mp4_boxes(first)] == [b"moof", b"mdat"]
    assert split_init_segment(parts[1]) == (b"", parts[1])
    starts = [fragment_starts_with_keyframe(p) for p in [first, *parts[1:]]]
    assert starts == [True, False, False, True, False]     # x264's own GOP is far longer than 5 chunks
    whole = read_frames(parts[0] + b"".join(parts[1:]))
    joined = read_frames(init + parts[3] + parts[4])        # a viewer from chunk 3's keyframe on
    assert joined.shape == (24, 64, 112, 3)
    assert np.array_equal(joined, whole[36:])               # the same decoded frames as the owner's from there


def test_foreign_or_truncated_bytes_are_refused():
    with pytest.raises(ValueError, match="claims"):
        mp4_boxes(b"\x00\x00\x00\x20moof" + b"\x00" * 4)
    assert fragment_starts_with_keyframe(b"") is False
