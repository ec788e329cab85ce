"""Frames on the wire without a codec: batching, delta-gzip round trips, preview sizes, image payloads."""
import gzip

import numpy as np
import pytest

from lingbot.io.frames import (
    RAW_DELTA_GZIP,
    FrameBatcher,
    FrameFormat,
    batch_slices,
    decode_images,
    delta_gzip,
    preview_size,
    restore_delta_gzip,
    split_images,
    xor_deltas,
)

H, W = 20, 36


def frames(n, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (n, H, W, 3), dtype=np.uint8)


def test_batches_hold_at_most_16_raw_or_6_image_frames():
    assert [(s.start, s.stop) for s in batch_slices(9, 16)] == [(0, 9)]
    assert [(s.start, s.stop) for s in batch_slices(33, 16)] == [(0, 16), (16, 32), (32, 33)]
    assert [(s.start, s.stop) for s in batch_slices(12, 6)] == [(0, 6), (6, 12)]
    assert [(s.start, s.stop) for s in batch_slices(0, 6)] == [(0, 0)]


def test_raw_batches_stay_under_8_mib():
    raw, jpeg = FrameFormat("raw"), FrameFormat("jpeg")
    assert raw.per_batch(112 * 64 * 3) == 16 and jpeg.per_batch(832 * 480 * 3) == 6
    assert raw.per_batch(832 * 480 * 3) == 7                    # 7 x 1.14 MiB; a 12-frame chunk in 2 batches
    assert raw.per_batch(1280 * 720 * 3) == 3 and raw.per_batch(10 ** 8) == 1
    big = np.zeros((12, 480, 832, 3), np.uint8)
    assert [b.num_frames for b in FrameBatcher(raw, 832, 480).batches(big)] == [7, 5]


def test_raw_batches_are_the_frames_bytes():
    f = frames(12)
    [batch] = FrameBatcher(FrameFormat("raw"), W, H).batches(f)
    assert batch.num_frames == 12 and batch.payload == f.tobytes() and batch.raw_size == f.nbytes
    assert not batch.delta_reference and batch.lengths == ()


def test_delta_gzip_is_xor_with_the_previous_frame_under_gzip_and_chains_across_chunks():
    a, b = frames(9, 1), frames(12, 2)
    batcher = FrameBatcher(FrameFormat("raw", delta=True), W, H)
    assert FrameFormat("raw", delta=True).content_type == RAW_DELTA_GZIP
    [first] = batcher.batches(a)
    [second] = batcher.batches(b)
    assert not first.delta_reference and second.delta_reference
    # by hand: frame 0 as is, then each frame XOR the one before it (the second chunk starts from a[-1])
    plain = gzip.decompress(first.payload)
    assert plain[:a[0].nbytes] == a[0].tobytes()
    assert plain[a[0].nbytes:2 * a[0].nbytes] == (a[1] ^ a[0]).tobytes()
    assert gzip.decompress(second.payload)[:b[0].nbytes] == (b[0] ^ a[-1]).tobytes()
    restored_a = restore_delta_gzip(first.payload, W, H, 9, None)
    restored_b = restore_delta_gzip(second.payload, W, H, 12, restored_a[-1])
    assert np.array_equal(restored_a, a) and np.array_equal(restored_b, b)
    with pytest.raises(ValueError, match="holds 4 bytes, expected"):
        restore_delta_gzip(gzip.compress(b"abcd"), W, H, 1, None)


def test_still_frames_compress_to_almost_nothing_as_deltas():
    still = np.repeat(frames(1), 12, axis=0)
    assert len(delta_gzip(still, None)) < still.nbytes / 8
    assert not xor_deltas(still, None)[1:].any()


def test_preview_size_keeps_the_aspect_and_only_shrinks():
    assert preview_size(832, 480, None) == (832, 480)
    assert preview_size(832, 480, 1000) == (832, 480)
    assert preview_size(832, 480, 416) == (416, 240)
    assert preview_size(832, 480, 100) == (100, 58)          # 57.69 rounds to 58
    assert preview_size(832, 480, 1) == (1, 1)


@pytest.mark.parametrize("kind", ["webp", "jpeg"])
def test_image_batches_decode_to_the_frames(kind):
    smooth = np.zeros((7, H, W, 3), np.uint8)
    smooth[..., 0] = np.linspace(0, 255, W, dtype=np.uint8)
    smooth[..., 1] = np.arange(7)[:, None, None] * 30
    batches = FrameBatcher(FrameFormat(kind, 95), W, H).batches(smooth)
    assert [b.num_frames for b in batches] == [6, 1]
    decoded = np.concatenate([decode_images(b.payload, b.lengths) for b in batches])
    assert decoded.shape == smooth.shape
    assert np.abs(decoded.astype(int) - smooth).mean() < 3.0
    small = FrameBatcher(FrameFormat(kind, 90, max_width=18), W, H).batches(smooth[:1])[0]
    assert decode_images(small.payload, small.lengths).shape == (1, 10, 18, 3)
    with pytest.raises(ValueError, match="add up to"):
        split_images(small.payload, [len(small.payload) + 1])
