"""A session picks its frame decoder: the test app loads both (the tiny decoder the default, as on CPU), a
session on either decoder streams over both protocols with the in-process pipeline's frames for that decoder, a decoder
the deployment did not load is refused with its own code, and GET /v1/config lists the loaded ones. (Its
resume after a rank kill is in test_faults.py.)"""
import json
import urllib.request

import numpy as np

from lingbot.io.video import read_frames
from tests.deployments.clients import H, W, expect_error, frames_session, frames_url, run, session, start_msg
from tests.deployments.conftest import HTTP
from tests.deployments.expected_frames import in_process_frames, through_h264


def test_the_config_lists_the_loaded_decoders(serve_app):
    with urllib.request.urlopen(f"{HTTP}/v1/config", timeout=10) as r:
        assert json.loads(r.read())["decoders"] == ["tae", "wan"]


def test_each_decoders_session_shows_the_in_process_frames_of_that_decoder(serve_app):
    tae = in_process_frames(3, seed=6, prompt="a forest path", decoder="tae")
    wan = in_process_frames(3, seed=6, prompt="a forest path", decoder="wan")
    assert tae.shape == wan.shape == (33, H, W, 3) and np.abs(tae.astype(int) - wan).mean() > 2.0
    raw = run(frames_session(frames_url(serve_app), 3, seed=6, decoder="tae"))
    assert raw.errors == [] and raw.close_code == 1000
    # the tiny decoder runs on the root from the replicated latents: SP-2's latents may round apart by an ulp
    assert np.abs(raw.frames.astype(int) - tae).max() <= 1
    served = run(session(serve_app, 3, seed=6, decoder="tae"))
    assert served.error is None and served.done["chunks"] == 3, served.error
    assert np.abs(read_frames(served.video).astype(float) - through_h264(tae)).mean() < 0.25
    wan_raw = run(frames_session(frames_url(serve_app), 3, seed=6, decoder="wan"))   # the other decoder, asked for
    assert wan_raw.errors == [] and np.abs(wan_raw.frames.astype(int) - wan).mean() < 0.5   # SP-2 vs SP-1: +-1


def test_a_decoder_that_is_not_loaded_is_refused_with_its_code(serve_app):
    run(expect_error(serve_app, [start_msg(extra_params={"decoder": "vae"})], "decoder_not_loaded", close=1008))
    run(expect_error(serve_app, [start_msg(extra_params={"decoder": 7})], "invalid_field", close=1008))
