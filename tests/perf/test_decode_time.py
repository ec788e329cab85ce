"""perf/decode_time.py runs end to end at the tiny size, and its FLOP counts are the cost model's (the Wan
decoder's 40.7 TFLOP per steady chunk at 480x832) and the tiny decoder's 25x fewer."""
from lingbot.config import get_preset
from perf import decode_time
from perf.cost_model import vae_chunk_flops


def test_the_table_at_the_tiny_size(capsys):
    decode_time.main(["--sizes", "tiny", "--steps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("decode per steady chunk (3 latent frames) on cpu")
    rows = [line.split() for line in lines[2:]]
    assert [r[:2] for r in rows] == [["tiny", "wan"], ["tiny", "tae"]]
    assert rows[0][-1] == "0" and float(rows[1][-1]) > 1            # the wan/tae ratio on the tiny row


def test_flops_per_steady_chunk():
    big = get_preset("lingbot-world-v2-14b")
    wan, tae = (3 * decode_time.steady_step_flops(big, d) for d in ("wan", "tae"))
    assert wan == vae_chunk_flops(big)["decode_steady"] and round(wan / 1e12, 1) == 40.7
    assert round(tae / 1e12, 2) == 1.63 and round(wan / tae) == 25
    tiny = get_preset("tiny")                                      # narrowed alike, the ratio stays near the real one
    assert round(decode_time.steady_step_flops(tiny, "wan") / decode_time.steady_step_flops(tiny, "tae")) == 24
