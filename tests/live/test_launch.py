"""``meshpact launch`` on one node: a killed worker is replaced alone and the job ends bit-identical.

The example script (``examples/resilient_train.py``, the README's ``resilient()`` loop) runs
twice side by side: under plain ``torchrun`` without a fault (the reference, and proof that
the script runs under torchrun unchanged) and under ``meshpact launch`` with rank 2 SIGKILLed
after its third step.
"""

from __future__ import annotations

import pytest

from meshpact.live.trials.launchdrill import Job, read_finals

pytestmark = [pytest.mark.live, pytest.mark.slow]

RANKS, STEPS = 4, 10


def test_a_killed_worker_is_replaced_alone_and_the_job_ends_bit_identical_to_one_without_a_fault(tmp_path):
    with Job(Job.torchrun("--standalone", "--nproc-per-node", str(RANKS)), tmp_path / "reference", STEPS) as ref, \
            Job(Job.meshpact("--standalone", "--nproc-per-node", str(RANKS), "--max-restarts", "1"),
                tmp_path / "faulted", STEPS, step_s=0.05) as job:
        others = {r: job.wait_for_step(r, 0, 120) for r in range(RANKS) if r != 2}
        killed = job.kill_rank(2, after_step=3)
        assert job.wait(180) == 0, job.tail()
        assert ref.wait(180) == 0, ref.tail()
    reference, faulted = read_finals(ref.out, RANKS), read_finals(job.out, RANKS)
    assert sorted(reference) == sorted(faulted) == list(range(RANKS))
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    # the three others were never restarted: the same processes from their first step to the end
    assert all(faulted[r].pid == p.pid and faulted[r].incarnation == 0 for r, p in others.items())
    assert faulted[2].incarnation == 1 and faulted[2].pid != killed.pid
    assert f"rank 2 (pid {killed.pid}) exited with -9" in job.log.read_text()
