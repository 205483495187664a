"""Warm spares: started with the ranks, idle until a rank dies, then promoted to that rank."""

from __future__ import annotations

import pytest

from meshpact.live.launcher import Launch, LaunchError

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_a_dead_rank_is_handed_to_a_waiting_spare_and_a_second_death_finds_none_left():
    promoted: list[tuple[int, bool]] = []

    def on_exit(job: Launch, rank: int, rc: int) -> None:
        promoted.append((rank, job.promote(rank)))

    with Launch("meshpact.live.launcher:echo", 3, {"fail_ranks": [1, 2], "timeout_s": 60}, timeout_s=90,
                spares=1) as job:
        spare_pid = next(iter(job._spares.values()))[0].pid
        results = job.wait(on_exit=on_exit)
    assert sorted(promoted) == [(1, True), (2, False)] or sorted(promoted) == [(1, False), (2, True)]
    won = next(r for r, ok in promoted if ok)
    lost = next(r for r, ok in promoted if not ok)
    by_rank = {r.rank: r for r in results}
    assert by_rank[won].ok and by_rank[won].value["rank"] == won and by_rank[won].value["incarnation"] == 1
    assert by_rank[won].value["pid"] == spare_pid  # the spare itself, not a new process
    assert by_rank[lost].returncode == 3 and by_rank[0].ok


def test_spares_are_refused_where_ranks_run_under_a_prefix():
    with pytest.raises(LaunchError, match="own host"):
        Launch("meshpact.live.launcher:echo", 2, spares=1, prefix=lambda r: ["env"])
