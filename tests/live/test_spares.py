"""Warm spares: started with the ranks, idle until a rank dies, then promoted to that rank."""

from __future__ import annotations

import pytest

from meshpact.live.launch.agentjob import AgentJob
from meshpact.live.launch.launcher import LaunchedProcess

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_a_dead_rank_is_handed_to_a_waiting_spare_and_a_second_death_gets_a_new_process(tmp_path):
    replaced: list[tuple[int, int, bool]] = []
    registry = tmp_path / "processes.jsonl"
    with AgentJob(
        "meshpact.live.launch.launcher:echo",
        3,
        {"fail_ranks": [1, 2], "timeout_s": 60},
        timeout_s=120,
        spares=1,
        max_replacements=2,
        registry=registry,
        on_replaced=lambda rank, rc, warm: replaced.append((rank, rc, warm)),
    ) as job:
        ran = job.run()
    assert sorted(r for r, _, _ in replaced) == [1, 2] and all(rc == 3 for _, rc, _ in replaced)
    assert sorted(warm for _, _, warm in replaced) == [False, True]  # one spare: one of the two deaths takes it
    (won,) = [r for r, _, warm in replaced if warm]
    (spare,) = [p.pid for p in LaunchedProcess.read(registry) if p.spare is not None]
    by_rank = {r.rank: r for r in ran.results}
    assert all(r.ok for r in ran.results)
    assert by_rank[won].value["rank"] == won and by_rank[won].value["incarnation"] == 1
    assert by_rank[won].value["pid"] == spare  # the spare itself, not a new process
    other = by_rank[3 - won].value
    assert other["incarnation"] == 1 and other["pid"] != spare and ran.replacements == 2
