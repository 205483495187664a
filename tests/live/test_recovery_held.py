"""A rank lost while its peers idle between steps is recovered from while they idle.

The runtime meets a fault inside a collective; ranks held before a step (the dashboard's
hold, or a user's long evaluation) are in none. Before ``Resilient.join_recovery`` the
replacement waited for them round after round and, after the rank-loss bound (four rounds of
30 s), declared the healthy, held survivors lost and had them killed and replaced; on the way
the held ranks crashed in the step reset (FSDP state never initialized before the first step).
Here rank 2 is killed while every rank is held before step 0: the survivors must join the
replacement's round while still held, in round 1, and the run must end bit-identical on
generation 1 with no other process replaced.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from meshpact.app.live_control import LiveJob
from meshpact.core.recording import read_recording
from meshpact.live.trials.trialconfig import Pace

pytestmark = [pytest.mark.live, pytest.mark.slow]


def _events(job: LiveJob, rank: int, incarnation: int = 0) -> list[dict]:
    path = job.trial_dir / "faulted" / f"events-rank{rank}-{incarnation}.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def _wait(cond, timeout_s: float, what: str, job: LiveJob) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if not job.running:
            break
        time.sleep(0.1)
    raise AssertionError(f"{what} (waited {timeout_s:g} s); result {job.result()}; log {job.log_tail(1500)}")


@pytest.mark.timeout(300)
def test_ranks_held_between_steps_join_the_replacements_round_and_no_survivor_is_replaced(tmp_path: Path):
    job = LiveJob(
        tmp_path / "held.jsonl",
        [
            "--ranks",
            "4",
            "--steps",
            "6",
            "--faults",
            "0",
            "--fault-kind",
            "kill",
            "--checkpoint-every",
            "3",
            "--no-baselines",
            "--heartbeat",
            "--on-rank-loss",
            "replace",
        ],
        world_size=4,
        pace=Pace(5.0, frozenset({"faulted"})),
    )
    try:
        _wait(
            lambda: all(any(e["event"] == "held" for e in _events(job, r)) for r in range(4)),
            240,
            "every rank of the faulted run held before step 0",
            job,
        )
        job.kill_rank(2)
        # still held (nobody pressed Resume): each survivor decides round 1 with the replacement
        _wait(
            lambda: all(any(e["event"] == "recovery_done" for e in _events(job, r)) for r in (0, 1, 3)),
            120,
            "the held survivors recovered with the replacement",
            job,
        )
        pace = Pace.read(job.trial_dir)
        assert pace is not None and pace.holds("faulted")  # the hold was never lifted
        for r in (0, 1, 3):
            evs = _events(job, r)
            detected = next(e for e in evs if e["event"] == "detected")
            assert "between steps" in detected["data"]["error"], detected
            decided = next(e for e in evs if e["event"] == "decided")
            assert decided["data"]["round"] == 1 and decided["data"]["policy"] == "peer_restore", decided
            assert not any(e["event"] == "step" for e in evs)  # no step ran: the recovery came while held
        # held again on generation 1, the replacement too: what the dashboard's rows show before Resume
        _wait(
            lambda: all(
                any(e["event"] == "held" and e["data"]["generation"] == 1 for e in _events(job, r, inc))
                for r, inc in ((0, 0), (1, 0), (2, 1), (3, 0))
            ),
            60,
            "every rank held on generation 1",
            job,
        )
        job.set_pace(Pace(5.0, frozenset()))
        _wait(lambda: job.result() is not None, 240, "the run to end after Resume", job)
    finally:
        job.stop()
    result = job.result()
    assert result is not None and result["ok"], result
    summary = result["summary"]
    assert summary["bit_identical"], summary.get("mismatches")
    assert summary["replacement_processes"] == 1, summary  # rank 2 only: no held survivor declared lost
    done = [e for e in read_recording(job.recording) if e.event == "recovery_done"]
    ranks = sorted(e.rank for e in done)  # type: ignore[type-var]  # a rank's events carry its rank
    assert ranks == [0, 1, 3] and {e.data["generation"] for e in done} == {1}, [(e.rank, e.data) for e in done]
