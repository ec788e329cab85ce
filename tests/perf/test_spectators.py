"""perf/spectators.py's arithmetic: a viewer's lag is its arrival of a chunk against the owner's, slow viewers are
kept out of the lag and counted apart, and costs are per viewer."""
from perf.spectators import settings, summarise, table


def test_lags_costs_and_the_table():
    owner = {0: 100.0, 1: 100.75, 2: 101.5}
    crowd = [{"arrivals": {0: 100.01, 1: 100.77, 2: 101.53}, "end": "done", "slow": False},
             {"arrivals": {1: 100.79, 2: 101.54}, "end": "done", "slow": False},       # joined at chunk 1
             {"arrivals": {0: 100.2}, "end": "ConnectionClosedError", "slow": True}]
    metrics = {"video_rtf": 1.02, "control_to_display": {"median_ms": 850.0}}
    before = {"ingress": {"cpu_s": 10.0, "uss": 100 * 2 ** 20}, "proxy": {"cpu_s": 5.0, "uss": 50 * 2 ** 20}}
    after = {"ingress": {"cpu_s": 10.3, "uss": 103 * 2 ** 20}, "proxy": {"cpu_s": 5.6, "uss": 51 * 2 ** 20}}
    row = summarise(2, 1, metrics, owner, crowd, before, after, 0.75)
    assert abs(row["lag_p50_ms"] - 30.0) < 1e-6 and abs(row["lag_p99_ms"] - 40.0) < 0.5      # (float seconds)
    assert (row["viewer_chunks_min"], row["viewer_chunks_max"], row["viewers_done"]) == (2, 3, 2)
    assert row["slow_ends"] == ["ConnectionClosedError"]
    assert abs(row["cost"]["ingress"]["cpu_s"] - 0.3) < 1e-9 and row["cost"]["ingress"]["uss_mib_delta"] == 3
    idle = {"ingress": {"cpu_s": 10.15, "uss": 100 * 2 ** 20}, "proxy": {"cpu_s": 5.0, "uss": 50 * 2 ** 20}}
    alone = summarise(0, 0, {"video_rtf": 1.0, "control_to_display": {"count": 0}}, owner, [], before, idle, 0.75)
    assert alone["lag_p50_ms"] is None and alone["owner_control_p50_ms"] is None
    text = table([alone, row])
    assert "| 0 (0) | 1.000 | 1.000 | - | - / - (750) | None-None | 0 | - | - | - | 0.0 | 1: - |" in text
    # per viewer: CPU beyond the row without viewers (0.15 s ingress, 0 s proxy), over 3 viewers
    spread = {**row, "ingress_replicas": 2, "where": {"owners_replica": 1, "elsewhere": 2}}
    assert "| 2 (1) | 1.020 | 1.020 | 850 | 30 / 40 (750) | 2-3 | 2 | ConnectionClosedError | 50.0 | 200.0 | 3.0 | " \
           "2: 1 / 2 |" in table([alone, spread])
    s = settings(1000)
    assert s["max_viewers_per_session"] >= 1000 and s["max_ingress_sessions"] > 1000
    assert (s["min_ingress_replicas"], s["max_ingress_replicas"]) == (1, 1)
    assert settings(10, 2)["min_ingress_replicas"] == settings(10, 2)["max_ingress_replicas"] == 2
    assert s["max_connections_per_address"] == 0
