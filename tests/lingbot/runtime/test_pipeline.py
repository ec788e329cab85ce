"""The whole pipeline in process: image + prompt + controls -> uint8 frames, chunk by chunk."""
import pytest
import torch

from lingbot.camera import Controls
from lingbot.runtime.snapshot import StateSnapshot
from tests.conftest import random_image
from tests.lingbot.runtime.states import assert_same_state, host


def test_chunks_give_9_then_12_uint8_frames(tiny, tiny_pipeline):
    session = tiny_pipeline.new_session(random_image(tiny), "a harbour", seed=1)
    chunks = [session.step(Controls(keys=("w", "", "l"))) for _ in range(3)]
    assert [c.frames.shape for c in chunks] == [(9, 64, 112, 3), (12, 64, 112, 3), (12, 64, 112, 3)]
    assert all(c.frames.dtype == torch.uint8 for c in chunks)
    assert set(chunks[1].timings) >= {"prepare", "probe_0", "probe_3", "commit", "decode"}
    with pytest.raises(ValueError, match=r"image must be \[3, 64, 112\]"):
        tiny_pipeline.new_session(torch.zeros(3, 10, 10), "x")


def test_a_failed_decode_fails_the_session_until_reset(tiny, tiny_pipeline):
    session = tiny_pipeline.new_session(random_image(tiny), "a harbour", seed=1)
    session.step()

    def boom(module, inputs, output):
        raise RuntimeError("injected decode failure")
    handle = tiny_pipeline.vae.decoder.conv_out.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected decode failure"):
            session.step()
    finally:
        handle.remove()
    with pytest.raises(RuntimeError, match="session failed earlier \\(RuntimeError while decoding chunk 1\\)"):
        session.step()
    session.reset()
    assert session.step().frames.shape == (9, 64, 112, 3)


def test_uint8_image_flow_shift_and_profiling_are_session_arguments(tiny, tiny_pipeline):
    """A uint8 [H, W, 3] first frame is the float [3, H, W] image (x / 255 - 0.5) / 0.5; the flow shift is
    per session; profiling only synchronises (the frames are the same)."""
    pixels = torch.randint(0, 256, (tiny.height, tiny.width, 3), generator=torch.Generator().manual_seed(3),
                           dtype=torch.uint8)
    as_float = (pixels.permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5
    a = tiny_pipeline.new_session(pixels.numpy(), "a harbour", seed=2).step()
    b = tiny_pipeline.new_session(as_float, "a harbour", seed=2).step(profile=True)
    assert torch.equal(a.frames, b.frames)
    shifted = tiny_pipeline.new_session(pixels, "a harbour", seed=2, flow_shift=10.0)
    assert shifted.dit.sampler.config.shift == 10.0
    assert not torch.equal(shifted.step().frames, a.frames)
    with pytest.raises(ValueError, match=r"a uint8 image must be \[H, W, 3\]"):
        tiny_pipeline.new_session(pixels.permute(2, 0, 1).contiguous(), "x")
    with pytest.raises(ValueError, match="flow_shift must be a finite number > 0"):
        tiny_pipeline.new_session(pixels, "x", flow_shift=-1.0)


class ForbidHostReads:
    """While active, .item(), .tolist(), .cpu(), .numpy() and truth-testing of a tensor raise, except `allow`
    calls of .cpu() on uint8 frames [F, H, W, 3] (the one copy a served chunk makes, at its end)."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__")

    def __init__(self, allow_frame_copies: int = 0):
        self.allowed = allow_frame_copies
        self.saved = {}

    def __enter__(self):
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def guard(tensor, *args, _name=name, _original=original, **kwargs):
                if _name == "cpu" and tensor.dtype == torch.uint8 and tensor.dim() == 4 and self.allowed > 0:
                    self.allowed -= 1
                    return _original(tensor, *args, **kwargs)
                raise AssertionError(f"host read on the step path: Tensor.{_name} of {tuple(tensor.shape)}")
            setattr(torch.Tensor, name, guard)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def owned_bytes(root, shared) -> int:
    """Bytes of the tensor storages reachable from `root`, not through `shared` objects or modules (the
    weights): what one session holds."""
    import gc
    import types
    opaque = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    seen, stack, storages = {id(x) for x in shared}, [root], {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, opaque):              # weights, code and its globals
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


@pytest.fixture(scope="module")
def past_the_fixed_point(tiny, tiny_pipeline):
    """One session (a first frame no test replays: its condition is encoded) run chunk by chunk to one chunk
    past its condition's fixed point (chunk 10), and what it owned after every chunk: the bytes of its
    tensors, then of its K/V window and its decoder cache. The steady-state test goes on with it."""
    pipeline = tiny_pipeline
    session = pipeline.new_session(random_image(tiny, seed=1234), "a castle", seed=0)
    held = []
    for _ in range(12):
        session.step(Controls(keys=("w", "", "l")))
        held.append(owned_bytes(session, [pipeline, pipeline.runner, pipeline.vae, pipeline.decoder,
                                          pipeline.condition_cache]))        # shared: counted once per rank
    return session, held, owned_bytes(session.dit.kv, []), session.decoder_cache.nbytes()


def test_steady_whole_chunks_read_nothing_back_but_their_frames(past_the_fixed_point):
    session = past_the_fixed_point[0]
    assert session.condition.fixed_latents is not None       # the encoder's fixed point: the steady state
    steady = 3
    with ForbidHostReads(allow_frame_copies=steady) as guard:
        for _ in range(steady):
            chunk = session.step(Controls(keys=("w", "i", "j")))
            chunk.frames.cpu()
    assert guard.allowed == 0
    with ForbidHostReads(), pytest.raises(AssertionError, match=r"host read on the step path: Tensor.item"):
        torch.ones(2).sum().item()                          # the guard does catch a read


def test_the_budget_covers_what_a_session_holds(tiny, past_the_fixed_point):
    """The admission budget's per-session bytes against the tensors a real session owns at every chunk
    (window filling, condition history growing until its fixed point, then freed): never more than the
    budget, and the budget no more than 5% above the peak. The parts with an exact size match exactly."""
    from lingbot.runtime.budget import session_footprint
    session, held, kv_window, decoder_cache = past_the_fixed_point
    footprint = session_footprint(tiny)
    assert session.condition.fixed_point_chunk is not None and held[-1] < held[0]     # history freed
    assert max(held) <= footprint.total <= 1.05 * max(held), (held, footprint)
    assert kv_window == footprint.kv_window
    assert decoder_cache == footprint.decoder_cache


def test_a_chunk_restarted_with_a_new_control_is_the_chunk_run_with_it(tiny, tiny_pipeline):
    """A chunk stopped in its probes changes nothing lasting, so restarting it with a control that arrived
    meanwhile gives exactly the chunk that had the control from the start (the serving path's restart of
    stale chunks rests on this)."""
    old, new = Controls(keys=("w", "w", "w")), Controls(keys=("l", "l", "i"))
    image = random_image(tiny, seed=7)
    restarted = tiny_pipeline.new_session(image, "a harbour", seed=3)
    direct = tiny_pipeline.new_session(image, "a harbour", seed=3)
    for s in (restarted, direct):
        s.step(old)
    checks = []

    def stop_in_probe_2():                          # checked before each of the 4 probes and the commit
        checks.append(1)
        return len(checks) == 3
    assert restarted.step(old, should_stop=stop_in_probe_2) is None
    a, b = restarted.step(new), direct.step(new)
    assert a.index == b.index == 1 and torch.equal(a.frames, b.frames)
    a, b = restarted.step(old), direct.step(old)     # and the chunks after it
    assert torch.equal(a.frames, b.frames)


def test_session_state_goes_through_copy_and_round_trips(tiny, tiny_pipeline):
    """Every tensor of a session's state is copied by the copy function given (a snapshot's copy to the host)
    but the RNG state (a host tensor already); a new session given it and the window's slots is the same."""
    image = random_image(tiny)
    a = tiny_pipeline.new_session(image, "a harbour", seed=4)
    for _ in range(2):
        a.step(Controls(keys=("w", "", "d")))
    copied = []

    def counted(t):
        copied.append(host(t))
        return copied[-1]
    state = a.state_dict(copy=counted)
    assert state.keys() == {"dit", "condition", "decoder", "decoder_name", "active_decoder", "ring"}
    assert state["decoder"] and state["decoder_name"] == state["active_decoder"] == "wan"
    assert state["ring"] == {"chunks": [], "latents": []}           # a session that never switches keeps no ring
    tensors = StateSnapshot(1, 0, 1, state).tensors()
    assert [t for t in tensors if not any(t is c for c in copied)] == [state["dit"]["rng"]]
    b = tiny_pipeline.new_session(image, "a harbour", seed=4)
    b.dit.kv.load_slots({c: a.dit.kv.slot_state(c, copy=host) for c in range(2)}, next_chunk=2)
    b.load_state(state)
    assert_same_state(b.state_dict(copy=host), state)
    assert b.chunk_index == 2
    assert torch.equal(a.step(Controls(keys=("s", "a", ""))).frames, b.step(Controls(keys=("s", "a", ""))).frames)


def test_a_failed_session_gives_no_state(tiny, tiny_pipeline):
    session = tiny_pipeline.new_session(random_image(tiny), "a harbour", seed=1)
    session.step()
    session.failed = "RuntimeError while decoding chunk 1"            # as step() marks a failed decode
    with pytest.raises(ValueError, match="session failed"):
        session.state_dict()
