"""perf.frame_formats runs end to end at a small size and reports every format (its sizes are exact for raw)."""
from perf.frame_formats import FORMATS, main, measure, scene


def test_frame_formats_table(capsys):
    main(["--chunks", "2", "--width", "64", "--height", "32"])
    out = capsys.readouterr().out
    assert out.count("raw = 0.1 MiB") == 2
    rows = [line.strip() for line in out.splitlines() if line.startswith("  ") and "bytes/chunk" not in line]
    assert [row[:22].rstrip() for row in rows] == [name for name, _ in FORMATS] * 2
    raw = measure(FORMATS[1][1], scene("pan", 64, 32, 2), 64, 32, 16.0)
    assert raw["bytes"] == 12 * 64 * 32 * 3 and abs(raw["mbit_s"] - raw["bytes"] * 8 / 0.75 / 1e6) < 1e-9
