"""The tiny decoder at SP-2 on real gloo ranks: the root decodes the whole chunk alone, with no collective
and no pixel gather. On the same latents its frames are bitwise the SP-1 frames (same op, same shapes, one
process). Through a whole SP-2 session the frames come from the SP-2 DiT's latents, which differ from
SP-1's by float rounding (tests/lingbot/parallel/test_sequence_parallel.py: 6e-7), so there they agree
within one uint8 level, not bitwise."""
import pytest
import torch

from lingbot.config import get_preset
from lingbot.models.vae import CausalCache
from lingbot.parallel.launch import run_local
from lingbot.runtime.snapshot import take_snapshot
from tests.conftest import random_image

TINY = get_preset("tiny")


def _decode_chunks(decoder):
    latents = torch.randn(16, 9, *TINY.latent_hw, generator=torch.Generator().manual_seed(0))
    cache, frames = CausalCache(), []
    for k in range(3):
        frames.append(decoder.to_frames(decoder.decode(latents[:, 3 * k:3 * k + 3], cache)))
    return None if frames[0] is None else torch.cat(frames), cache.nbytes()


def _run(comm):
    """Frames and collective counts of the tiny decoder per pixel mode; then a 2-chunk session's frames and its
    snapshot's decoder cache."""
    from lingbot.builder import build_pipeline
    pipeline = build_pipeline(TINY, comm=comm, decoder=("tae", "wan"))
    decoder = pipeline.decoders["tae"]
    out = {}
    for mode in ("root_uint8_p2p", "native"):
        if comm.world_size > 1:
            decoder.pixel_mode = mode
        comm.reset_counts()
        out[mode] = (*_decode_chunks(decoder), dict(comm.counts))
    if comm.world_size > 1:
        decoder.pixel_mode = "root_uint8_p2p"
    session = pipeline.new_session(random_image(TINY, seed=5), "a castle", seed=3)
    frames = [session.step() for _ in range(2)]
    out["session"] = [None if c.frames is None else c.frames for c in frames]
    out["snapshot_decoder"] = len(take_snapshot(session, comm.rank, comm.world_size)[1].state["decoder"])
    return out


@pytest.fixture(scope="module")
def sp2():
    return run_local(_run, 2, timeout_s=300, threads_per_rank=1)


@pytest.fixture(scope="module")
def sp1():
    """SP-1 in a process of one thread, as each SP-2 rank: CPU convolutions sum in another order with another
    thread count, so the bitwise comparison holds the threads equal."""
    (result,) = run_local(_run, 1, timeout_s=300, threads_per_rank=1)
    return result


def test_the_root_decodes_alone_without_collectives(sp1, sp2):
    root, other = sp2
    frames, nbytes, counts = root["root_uint8_p2p"]
    assert frames.shape == (9 + 12 + 12, TINY.height, TINY.width, 3) and frames.dtype == torch.uint8
    assert torch.equal(frames, sp1["root_uint8_p2p"][0])                           # bitwise SP-1
    assert counts == {} and other["root_uint8_p2p"] == (None, 0, {})                # rank 1 does nothing
    assert nbytes == sp1["root_uint8_p2p"][1]                                        # the whole width's cache


def test_native_mode_decodes_on_every_rank(sp1, sp2):
    for rank in sp2:
        frames, _nbytes, counts = rank["native"]
        assert torch.equal(frames, sp1["native"][0]) and counts == {}


def test_a_session_at_sp2_shows_the_sp1_frames(sp1, sp2):
    root, other = sp2
    assert other["session"] == [None, None] and other["snapshot_decoder"] == 0     # no cache off the root
    assert root["snapshot_decoder"] == sp1["snapshot_decoder"] == 9
    for got, expected in zip(root["session"], sp1["session"]):
        assert got.shape == expected.shape
        assert (got.int() - expected.int()).abs().max() <= 1
