"""Ten raised collectives on four ranks: recovered in memory, bit-identical, old groups silent."""

from __future__ import annotations

import socket
import threading

import pytest

from _attacker import ControlAttacker
from _recovery import assert_recovered, trial
from meshpact.commands.live_recover import json_view
from meshpact.core.recording import EventKind

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_ten_raised_collectives_recover_in_memory_bit_identical_with_baselines():
    result = trial(ranks=4, steps=12, faults=10, fault_kind="collective", checkpoint_every=4)
    s = assert_recovered(result, "in_memory")
    assert s["policy_counts"]["checkpoint_restore"] == 0
    # the checkpoint-restore drill and the cold restart ran in the same job and also ended
    # bit-identical (they are part of the comparison above)
    down = s["downtime_s"]
    assert down["in_memory"] and down["checkpoint_restore"] and down["cold_restart"]
    assert all(r["reason"].startswith("all 4 ranks alive") for r in result.recoveries())
    view = json_view(s)
    assert list(view) == [
        "ranks",
        "steps",
        "fault_kind",
        "faults_injected",
        "faults_recovered",
        "bit_identical",
        "policy_counts",
        "rebind_ms",
        "downtime_s",
        "downtime_includes",
        "storage_bytes_read",
        "final_world_size",
        "peer_copy_overhead",
        "excision",
        "recording",
    ]
    assert set(view["downtime_s"]) == {"in_memory", "peer_restore", "excise", "checkpoint_restore", "cold_restart"}
    assert view["storage_bytes_read"] == 0 and view["final_world_size"] == 4  # the drill's reads are apart
    assert {"step_latency", "host_bytes_per_rank", "network_bytes_per_hour"} <= set(view["peer_copy_overhead"])
    assert set(view["rebind_ms"]) == {"median", "max"}


def test_the_first_collective_on_the_new_group_is_inside_the_measured_recovery():
    # the same run is attacked on its control channel by a client without the job key (_attacker):
    # nothing it wrote first (decisions, lost, gone, recovering, readiness, peer addresses) is acted on;
    # the process also listens where no store answers (one port never answers, one answers garbage), as a
    # host does, and the attacker still finds the channel before the first fault
    with socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0)) as garbage:
        threading.Thread(target=_answer_garbage, args=(garbage,), daemon=True).start()
        attacker = ControlAttacker(ranks=2)
        attacker.start()
        try:
            result = trial(ranks=2, steps=6, faults=2, fault_kind="collective", checkpoint_every=3, baselines=False)
        finally:
            attacker.stop()
    s = assert_recovered(result, "in_memory")
    recs = result.recoveries()
    assert {f"round{r['generation']}/decision" for r in recs} | {"lost/round1", "gone/rank1"} <= attacker.landed
    assert {f"recovering/g{r['generation'] - 1}/rank{k}" for r in recs for k in (0, 1)} & attacker.landed
    assert s["policy_counts"]["excise"] == s["policy_counts"]["checkpoint_restore"] == 0 and s["final_world_size"] == 2
    assert attacker.connections == 0  # no copy or fetch went to the forged peer address
    firsts = [e for e in result.events() if e.event == EventKind.FIRST_COLLECTIVE]
    assert len(recs) == 2
    for r in recs:
        mine = [e for e in firsts if e.data["generation"] == r["generation"]]
        assert sorted(e.rank for e in mine) == [0, 1]  # every rank ran it on the new generation
        for e in mine:
            assert r["t_first_knew_wall"] < e.data["t_issued_wall"] <= e.data["t_done_wall"] <= r["t_all_resumed_wall"]
        assert r["recovery_s"] >= r["first_collective_s"] > 0
        # detection is reported on its own: injection to the first rank knowing; the detection stage
        # lasts until every rank knew, so it is never shorter
        assert r["downtime_s"] == pytest.approx(r["detection_s"] + r["recovery_s"], abs=1e-6)
        assert r["stages_s"]["detection"] >= r["detection_s"]
        # the stages follow the critical path: together they are the downtime, nothing counted twice
        assert sum(r["stages_s"].values()) == pytest.approx(r["downtime_s"], abs=1e-6)
        assert {"consensus", "communicator", "rebinding", "state"} <= set(r["stages_s"])
    # each rank's recovery CPU, by pipeline step: the six steps, adding up to the whole, the main
    # thread's share of each no more than the process's; what follows the resumption kept apart
    done = [e.data for e in result.events() if e.event == EventKind.RECOVERY_DONE]
    assert len(done) == 4
    for d in done:
        by_stage, main = d["cpu_s_by_stage"], d["thread_cpu_s_by_stage"]
        assert list(by_stage) == ["detect", "agree_on", "rebuild", "rebind", "restore", "resume"]
        assert all(v >= 0 for v in by_stage.values()) and sum(by_stage.values()) == pytest.approx(d["cpu_s"])
        assert all(main[k] <= by_stage[k] + 1e-3 for k in by_stage)
        assert d["cpu_s"] > 0 and d["after_resume_cpu_s"] >= 0


def _answer_garbage(server: socket.socket) -> None:
    """Answer every connection with bytes that are not a store's handshake, until the socket closes."""
    server.settimeout(0.2)  # so that a closed socket is noticed
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        with conn:
            conn.recv(64)
            conn.sendall(b"ERR not a store\n")
