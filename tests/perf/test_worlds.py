"""perf/worlds.py's arithmetic: the median resume, a replayed chunk against a steady one, the world's bytes, and
the modelled snapshot of a real preset (larger than the journal by orders of magnitude)."""
from deployments.settings import ServeSettings
from perf.worlds import median_resume, modelled, settings, table


def test_the_table_and_the_model():
    replays = [{"first_s": 2.0, "replay_s": 1.8, "replayed": 6, "restored": 0},
               {"first_s": 1.0, "replay_s": 0.6, "replayed": 6, "restored": 0},
               {"first_s": 1.5, "replay_s": 1.2, "replayed": 6, "restored": 0}]
    assert median_resume(replays)["replay_s"] == 1.2
    resumes = [{"first_s": 0.5, "replay_s": 0.1, "replayed": 1, "restored": 5}]
    row = {"chunks": 6, "first_s": 0.4, "chunk_s": 0.4, "save_s": 0.012,
           "bytes": {"json": 721, "frame": 86016, "meta.json": 200, "snap": 90000}, "resumes": resumes,
           "replays": replays}
    model = [{"preset": "p", "sp": 4, "chunks": 100, "journal_bytes": 5 * 2 ** 20, "snapshot_bytes": 24 * 2 ** 30}]
    text = table({"measured": [row], "modelled": model})
    assert "| 6 | 400 | 400 | 12 | 721 / 86016 / 90000 | 500 (5 + 1) | 1500 (6) | 0.50 |" in text   # 1.2 s / 6 / 0.4 s
    assert "| p | 4 | 100 | 5.0 MiB | 24.0 GiB |" in text
    rows = modelled((100,))
    assert {r["sp"] for r in rows} == {1, 4, 8} and all(r["snapshot_bytes"] > 1000 * r["journal_bytes"] for r in rows)
    assert ServeSettings(**settings("/tmp/w")).worlds_dir == "/tmp/w"
