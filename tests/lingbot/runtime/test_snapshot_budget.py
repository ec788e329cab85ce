"""The snapshots' host budget from the config: the issue's 14B figures, how the parts add up per group and
for N sessions, how many sessions a host budget holds, and `lingbot snapshot-budget`. (What real snapshots
hold against it: tests/lingbot/runtime/test_snapshot.py at SP-1, tests/lingbot/parallel/test_group_once.py
at SP-2.)"""
from lingbot.cli import main
from lingbot.config import get_preset
from lingbot.runtime.snapshot import SNAPSHOTS_IN_FLIGHT
from lingbot.runtime.snapshot_budget import _pinned, snapshot_footprint, snapshot_host

GIB = 2 ** 30
BIG = get_preset("lingbot-world-v2-14b")


def test_at_14b_dims_a_session_holds_what_the_issue_measured():
    """One device, 480x832, bf16: each chunk copies a 3.6 GiB K/V slot, 3.5 GiB of decoder cache and, until
    the fixed point, 2.1 GiB of encoder cache; the keeper holds 5 slots and a state: 23.5 GiB."""
    one = snapshot_footprint(BIG)
    assert round(one.slot / GIB, 2) == 3.57 and round(sum(one.decoder_cache) / GIB, 2) == 3.52
    assert round(sum(one.condition) / GIB, 2) == 2.09 and round(one.held / GIB, 2) == 23.47
    assert one.snapshot == one.per_chunk == one.slot + one.state and one.restore_slots == 5
    for sp in (2, 4, 8):
        ranks = [snapshot_footprint(BIG, sp, r) for r in range(sp)]
        assert all(r.slot == one.slot // sp for r in ranks)                  # 40 heads split evenly
        # rank 0 alone holds the encoder's cache; the others count a replayed first frame's latents instead
        assert sum(ranks[0].condition) == sum(one.condition) > sum(ranks[1].condition) == 16 * 16 * 3 * 60 * 104 * 4
        # the decoder's columns with their halo: a little more than one device's in all
        assert sum(one.decoder_cache) < sum(sum(r.decoder_cache) for r in ranks) < 1.1 * sum(one.decoder_cache)


def test_every_k_chunks_copies_less_per_chunk_but_no_less_at_once():
    one, three = snapshot_footprint(BIG), snapshot_footprint(BIG, interval=3)
    assert (three.snapshot_slots, three.steady_slots) == (3, 2)          # 1-3 while the window fills; then 2
    assert three.per_chunk == (2 * one.slot + one.state) / 3 < one.per_chunk / 2
    assert three.snapshot == one.snapshot + 2 * one.slot and three.held == one.held


def test_a_groups_host_bytes_add_up_and_a_budget_holds_whole_sessions(tiny):
    host = snapshot_host(BIG, 4)
    ranks = host.ranks
    assert host.in_flight == SNAPSHOTS_IN_FLIGHT == 2 and len(ranks) == 4
    assert host.per_session == sum(r.held + 2 * r.snapshot for r in ranks)            # the keeper's
    assert host.once == sum(2 * r.pinned() + 2 * r.snapshot for r in ranks)          # copies, the put
    assert host.for_sessions(3) == host.once + 3 * host.per_session
    assert host.sessions_within(host.for_sessions(3)) == 3 and host.sessions_within(host.for_sessions(3) - 1) == 2
    assert host.sessions_within(host.once - 1) == 0
    # pinned blocks are powers of two; plain host copies (cpu) are what the snapshot holds
    assert [_pinned(n) for n in (1, 3, 4, 5, 3 << 29)] == [1, 4, 4, 8, 2 * GIB]
    r = ranks[0]
    assert r.pinned(cuda=False) == r.snapshot < r.pinned() < 2 * r.snapshot
    assert snapshot_host(tiny, 2, cuda=False).once == sum(4 * x.snapshot for x in snapshot_host(tiny, 2).ranks)


def test_the_command_prints_the_table(capsys):
    assert main(["snapshot-budget", "--preset", "tiny", "--preset", "lingbot-world-v2-14b", "--sp", "1,4,8",
                 "--sessions", "1,3", "--host-gib", "128"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "preset" not in line]
    assert [row.split(" | ")[:2] for row in rows] == [["| tiny", "1"], ["| tiny", "4"], ["| lingbot-world-v2-14b", "1"],
                                                      ["| lingbot-world-v2-14b", "4"], ["| lingbot-world-v2-14b", "8"]]
    assert "| host, 3 sessions | sessions in 128.00 GiB |" in out and "| 3.57 GiB | " in rows[2]   # tiny: no SP-8
    host = snapshot_host(BIG, 8)
    assert rows[-1].endswith(f" | {host.sessions_within(128 * GIB)} |")
