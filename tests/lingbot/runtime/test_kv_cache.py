"""K/V window semantics through the real forward, and the prompt LRU."""
import pytest
import torch

from lingbot.camera import Controls
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.kv_cache import KVWindow, LRUCache, slot_for_chunk, visible_chunks
from tests.conftest import random_condition
from tests.lingbot.runtime.states import host

NUM_CHUNKS = 11


def explicit_window(k: int) -> list[int]:
    """Chunks a forward of chunk k attends, written out from the design: {0,1,2} u {k-2,k-1} u {k}."""
    return [c for c in range(k + 1) if c in (0, 1, 2) or c in (k - 2, k - 1, k)]


class ConcatReferenceKV:
    """Keeps every committed chunk's K/V forever and attends the explicit concatenation."""

    def __init__(self, window=explicit_window):
        self.window = window
        self.committed: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.chunk = 0

    def reset(self):
        self.__init__(self.window)

    def begin_chunk(self, k):
        assert k == self.chunk
        self.current = {}

    def update(self, layer, key, value):
        self.current[layer] = (key.clone(), value.clone())
        history = [self.committed[c][layer] for c in self.window(self.chunk) if c != self.chunk]
        keys = torch.cat([k for k, _ in history] + [key], dim=2)
        values = torch.cat([v for _, v in history] + [value], dim=2)
        return keys, values

    def commit(self):
        self.committed[self.chunk] = self.current
        self.chunk += 1


def test_slot_assignment_follows_design():
    assert [slot_for_chunk(k, 3, 6) for k in range(13)] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3]
    for k in range(30):
        assert visible_chunks(k, 3, 6) == explicit_window(k)


def _controls(k):
    keys = ["w", "wa", "l", "s", "d", "ij", "", "k", "wd", "j", "a"]
    return Controls(keys=(keys[k], keys[(k + 3) % 11], keys[(k + 7) % 11]))


def test_slab_equals_explicit_concatenation_every_chunk(tiny, tiny_runner):
    cond = random_condition(tiny)
    slab = tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=11)
    ref = tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=11)
    ref.kv = ConcatReferenceKV()
    window_frames = tiny.transformer.sliding_window_num_frames
    assert slab.kv.keys.shape[3] == window_frames * tiny_runner.tokens_per_frame     # allocated once, 18 frames
    for k in range(NUM_CHUNKS):
        a = slab.run_chunk(_controls(k))
        b = ref.run_chunk(_controls(k))
        # Tolerance: the slab holds the same K/V rows in another order (chunk k >= 6 sits in the slot of
        # k-3), so softmax sums run in another order: fp32 rounding ~1e-7 per chunk, compounding through the
        # autoregressive history. Chunks 0-5 come out bitwise equal, chunks 6-10 within 7e-7 (measured);
        # latents are O(1). 1e-5 leaves a 10x margin, while attending one chunk too many moves them by
        # ~8e-3 with these random weights (test_wrong_window_is_detected).
        err = (a.latents - b.latents).abs().max().item()
        print(f"chunk {k}: max abs diff slab vs concatenation {err:.2e}")
        assert err < 1e-5, f"chunk {k}: slab vs explicit window differ by {err}"
        assert slab.kv.held_frames(3) <= window_frames
        assert sorted(c for c in slab.kv.slot_chunk if c >= 0) == explicit_window(k)


def test_wrong_window_is_detected(tiny, tiny_runner):
    """The comparison above is sensitive: attending one extra evicted chunk changes the output."""
    cond = random_condition(tiny)
    ref = tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=11)
    ref.kv = ConcatReferenceKV()
    wide = tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=11)
    wide.kv = ConcatReferenceKV(window=lambda c: list(range(c + 1)))      # never evicts
    for k in range(7):
        a, b = ref.run_chunk(_controls(k)), wide.run_chunk(_controls(k))
    # chunk 6 is the first whose window drops a chunk (3): seeing it moves the output far past the 1e-5 tolerance
    assert (a.latents - b.latents).abs().max().item() > 5e-3


def test_changing_chunk_k_never_changes_earlier_chunks(tiny, tiny_runner):
    cond = random_condition(tiny)
    k_changed = 7
    runs = []
    for variant in range(2):
        s = tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=5)
        outs = []
        for k in range(9):
            controls = _controls(k)
            if k == k_changed and variant == 1:
                controls = Controls(keys=("ll", "ll", "ll"))
            outs.append(s.run_chunk(controls).latents)
        runs.append((outs, s.kv))
    (a, kv_a), (b, kv_b) = runs
    for k in range(k_changed):
        assert torch.equal(a[k], b[k]), f"chunk {k} changed when chunk {k_changed}'s input changed"
    assert not torch.equal(a[k_changed], b[k_changed])
    # committed K/V of chunks before k_changed that are still held are identical bit for bit
    for slot, chunk in enumerate(kv_a.slot_chunk):
        if chunk < k_changed:
            n = kv_a.chunk_tokens
            assert torch.equal(kv_a.keys[:, :, :, slot * n:(slot + 1) * n], kv_b.keys[:, :, :, slot * n:(slot + 1) * n])
            assert torch.equal(kv_a.values[:, :, :, slot * n:(slot + 1) * n],
                               kv_b.values[:, :, :, slot * n:(slot + 1) * n])


@pytest.mark.parametrize("k", [2, 8])
def test_probes_never_modify_committed_slots(tiny, tiny_runner, k):
    s = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a quiet harbour", seed=2)
    for c in range(k):
        s.run_chunk(_controls(c))
    keys, values = s.kv.keys.clone(), s.kv.values.clone()
    calls = []

    def stop_before_commit():            # checked before each of the 4 probes and before the commit
        calls.append(1)
        return len(calls) == 5

    assert s.run_chunk(_controls(k), should_stop=stop_before_commit) is None
    n, slot = s.kv.chunk_tokens, slot_for_chunk(k, 3, 6)
    for other in range(6):
        if other != slot:
            sl = slice(other * n, (other + 1) * n)
            assert torch.equal(s.kv.keys[:, :, :, sl], keys[:, :, :, sl])
            assert torch.equal(s.kv.values[:, :, :, sl], values[:, :, :, sl])
    # the probes did write the current chunk's slot
    cur = slice(slot * n, (slot + 1) * n)
    assert not torch.equal(s.kv.keys[:, :, :, cur], keys[:, :, :, cur])
    assert s.chunk_index == k and s.kv.next_chunk == k
    # a stopped chunk changes nothing lasting: running it again equals an uninterrupted session
    again = s.run_chunk(_controls(k)).latents
    clean = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a quiet harbour", seed=2)
    for c in range(k):
        clean.run_chunk(_controls(c))
    assert torch.equal(again, clean.run_chunk(_controls(k)).latents)


def _fill(kv: KVWindow, chunks: int, seed: int = 0) -> None:
    """Commit `chunks` chunks of random K/V (every layer), as the forwards of a session would."""
    g = torch.Generator().manual_seed(seed)
    layers, batch, heads, _, dim = kv.keys.shape
    for k in range(chunks):
        kv.begin_chunk(k)
        for layer in range(layers):
            kv.update(layer, *torch.randn(2, batch, heads, kv.chunk_tokens, dim, generator=g))
        kv.commit()


@pytest.mark.parametrize("chunks", [2, 9])                 # inside the first window; after evictions
def test_slots_round_trip_into_a_fresh_window(tiny, chunks):
    cfg = tiny.transformer
    kv, fresh = KVWindow(cfg, tokens_per_frame=2), KVWindow(cfg, tokens_per_frame=2)
    _fill(kv, chunks)
    _fill(fresh, 4, seed=1)                                  # what a window held before is forgotten
    needed = visible_chunks(chunks, cfg.sink_chunks, cfg.window_chunks)[:-1]
    slots = {c: kv.slot_state(c, copy=host) for c in needed}
    assert all(t.shape == (cfg.num_layers, 1, cfg.num_attention_heads, kv.chunk_tokens, cfg.attention_head_dim)
               and t.is_contiguous() for pair in slots.values() for t in pair)
    fresh.load_slots(slots, next_chunk=chunks)
    assert fresh.next_chunk == chunks
    assert sorted(c for c in fresh.slot_chunk if c >= 0) == needed
    for c in needed:
        assert all(torch.equal(x, y) for x, y in zip(fresh.slot_state(c), slots[c]))
    # the next chunk attends the same K/V in both windows, bitwise
    new = torch.randn(2, 1, cfg.num_attention_heads, kv.chunk_tokens, cfg.attention_head_dim,
                      generator=torch.Generator().manual_seed(2))
    for window in (kv, fresh):
        window.begin_chunk(chunks)
    for layer in range(cfg.num_layers):
        seen, seen_fresh = kv.update(layer, *new), fresh.update(layer, *new)
        assert torch.equal(seen[0], seen_fresh[0]) and torch.equal(seen[1], seen_fresh[1])


def test_slots_refuse_what_the_window_does_not_hold(tiny):
    cfg = tiny.transformer
    kv = KVWindow(cfg, tokens_per_frame=2)
    _fill(kv, 8)
    with pytest.raises(ValueError, match="chunk 4 is not a committed chunk"):     # evicted by chunk 7
        kv.slot_state(4)
    with pytest.raises(ValueError, match="chunk 8 is not a committed chunk"):     # not run yet
        kv.slot_state(8)
    slot = kv.slot_state(7)
    fresh = KVWindow(cfg, tokens_per_frame=2)
    _fill(fresh, 3, seed=1)
    before = fresh.keys.clone(), fresh.values.clone(), list(fresh.slot_chunk)
    with pytest.raises(ValueError, match=r"chunks \[4\] are not in the window after chunk 7"):
        fresh.load_slots({4: slot, 7: slot}, next_chunk=8)
    with pytest.raises(ValueError, match="chunk 7: slots of"):
        fresh.load_slots({7: (slot[0][:, :, :1], slot[1][:, :, :1])}, next_chunk=8)    # another head count
    with pytest.raises(ValueError, match="chunk 7: slots of"):
        fresh.load_slots({7: (slot[0].double(), slot[1].double())}, next_chunk=8)
    assert torch.equal(fresh.keys, before[0]) and torch.equal(fresh.values, before[1])
    assert fresh.slot_chunk == before[2] and fresh.next_chunk == 3


def test_kv_window_budget_matches_design(tiny):
    from lingbot.config import get_preset
    real = get_preset("lingbot-world-v2-14b")
    per_frame = KVWindow.nbytes_for(real.transformer, real.tokens_per_frame, 40, torch.bfloat16) / 18
    assert real.tokens_per_frame == 1560
    assert abs(per_frame / 2 ** 30 - 1.19) < 0.01         # "about 1.19 GiB of K/V per latent frame"


def test_lru_keeps_recent_prompts():
    cache = LRUCache(2)
    computed = []
    for p in ["a", "b", "a", "c", "b"]:
        cache.get_or_compute(p, lambda p=p: computed.append(p) or p.upper())
    assert computed == ["a", "b", "c", "b"]            # "b" was evicted by "c" after "a" was reused
    assert (cache.hits, cache.misses) == (1, 4)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        LRUCache(0)


def test_runner_reuses_text_kv_across_sessions(tiny, tiny_runner):
    before = tiny_runner.prompt_cache.misses
    s1 = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a unique lighthouse", seed=0)
    s2 = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a unique lighthouse", seed=1)
    assert tiny_runner.prompt_cache.misses == before          # encoded at the first chunk, not at open
    s1.run_chunk()
    s2.run_chunk()
    assert tiny_runner.prompt_cache.misses == before + 1
    assert s1.text is s2.text


def test_a_sessions_own_window_is_the_default_until_it_drops_a_chunk_the_default_keeps(tiny, tiny_runner):
    """A session of its own window (sink 2 chunks instead of 3; or a window of 4 chunks instead of 6) runs the
    same forwards bitwise while both windows hold every chunk so far, and differs from the first chunk one of
    them drops: sink 2 at chunk 6 (it drops chunk 2, the default drops chunk 3), window 4 at chunk 4."""
    assert (tiny.transformer.sink_chunks, tiny.transformer.window_chunks) == (3, 6)
    cond = random_condition(tiny)

    def run(window, chunks=8):
        s = tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=11, window=window)
        assert (s.kv.sink_chunks, s.kv.window_chunks) == (window or (3, 6))
        return [s.run_chunk(_controls(k)).latents for k in range(chunks)]

    default, sink2, short = run(None), run((2, 6)), run((3, 5))
    assert all(torch.equal(default[k], sink2[k]) for k in range(6))
    assert not torch.equal(default[6], sink2[6]) and not torch.equal(default[7], sink2[7])
    assert all(torch.equal(default[k], short[k]) for k in range(5)) and not torch.equal(default[5], short[5])
    assert short[0].shape == default[0].shape


@pytest.mark.parametrize("window, message", [
    ((3, 7), r"the window may be at most 6 chunks \(the model's\), got 7"),
    ((3, 4), r"the window \(4 chunks\) must hold the sink \(3\), at least one chunk of history and the current"),
    ((-1, 6), "the sink may not be negative, got -1 chunks"),
])
def test_a_window_the_model_cannot_hold_is_refused(tiny, tiny_runner, window, message):
    cond = random_condition(tiny)
    with pytest.raises(ValueError, match=message):
        tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=11, window=window)
    KVWindow(tiny.transformer, 4, window=(0, 2))                       # no sink: two chunks of window suffice
