"""With no data-path timeout set, a job whose first step outlasts the old fixed second trains,
and every rank fits its timeout to its measured steps; a step that waits on something that is
not communication is not called stalled by the heartbeat (live)."""

from __future__ import annotations

import textwrap

import pytest

from _recovery import assert_identical, trial, workload_file
from meshpact.core.recording import EventKind

pytestmark = [pytest.mark.live, pytest.mark.slow]

FIRST_STEP_S, STEP_S = 2.5, 0.35

# the shipped decoder, with rank 1 waiting (asleep, as on a data queue or a disk: no progress by the
# heartbeat's rule) 2.5 s in its first step and 0.35 s in every later one; rank 0 waits in the step's
# collectives
SLOW_RANK_WORKLOAD = textwrap.dedent(f"""
    import os
    import time

    from meshpact.live.recovery.workload import load_workload

    DECODER = load_workload("decoder", 1)  # the shipped one (no MESH: the rank count only checks one)
    RAN = []


    def build(mesh):
        return DECODER.build(mesh)


    def batch(step, rank):
        return DECODER.batch(step, rank)


    def train_step(model, optimizer, batch):
        if os.environ["RANK"] == "1":
            time.sleep({FIRST_STEP_S} if not RAN else {STEP_S})
        RAN.append(1)
        return DECODER.train_step(model, optimizer, batch)
""")


def test_a_first_step_past_a_second_trains_and_the_timeout_follows_the_longest_step(tmp_path_factory):
    workload = workload_file(tmp_path_factory, "slow_rank", SLOW_RANK_WORKLOAD)
    result = trial(
        ranks=2, steps=4, faults=1, fault_kind="collective", checkpoint_every=4, baselines=False, workload=workload
    )  # the fault in step 2: after every rank's first fit
    # rank 0 waited 2.5 s in step 0's collectives: a fixed 1 s timeout failed that step on every attempt;
    # and rank 1's pauses (7 of the heartbeat's looks in every step, 50 in the first) are the job's own:
    # a fixed bound of 3 looks severed each of those steps (the one recovery is the fault's)
    assert_identical(result, faults_recovered=1, in_memory=1)
    assert not [e.data for e in result.events() if e.event == EventKind.DETECTED and e.data.get("heartbeat_stalled")]
    fitted = [e for e in result.events() if e.event == EventKind.TIMEOUT_FITTED]
    for rank in (0, 1):
        mine = [e.data for e in fitted if e.rank == rank]
        assert mine, f"rank {rank} never fitted its data-path timeout"
        first, last = mine[0], mine[-1]
        assert first["step"] == 1 and first["before_s"] == 120.0  # the warm-up bound, until a step is measured
        # from then on: 4 x the longest step (each at least the slow rank's 0.35 s), never under 1 s
        assert last["seconds"] == pytest.approx(max(1.0, 4 * last["longest_step_s"]))
        assert last["longest_step_s"] >= STEP_S and last["seconds"] >= 4 * STEP_S
        assert all(b["seconds"] > a["seconds"] for a, b in zip(mine, mine[1:]))  # only rises after the first fit


# rank 1's step 2 waits 1.3 s (an evaluation inside the step, every time that step runs), where no step before it
# waited more than a few milliseconds: past the heartbeat's bound and the fitted 1 s data-path timeout both
EVAL_PAUSE_WORKLOAD = textwrap.dedent("""
    import os
    import time

    from meshpact.live.recovery.workload import load_workload

    DECODER = load_workload("decoder", 1)
    DONE = []


    def build(mesh):
        return DECODER.build(mesh)


    def batch(step, rank):
        return DECODER.batch(step, rank)


    def train_step(model, optimizer, batch):
        if os.environ["RANK"] == "1" and len(DONE) == 2:
            time.sleep(1.3)
        out = DECODER.train_step(model, optimizer, batch)
        DONE.append(1)
        return out
""")


def test_a_step_longer_than_any_before_it_is_run_again_with_room_and_the_job_goes_on(tmp_path_factory):
    """Its first run is taken for a stall or a timeout (no step before it says otherwise) and recovered in
    memory; each run again allows it more (its own pause, twice the wait), so it completes instead of
    failing every attempt, and the timeout then follows it."""
    workload = workload_file(tmp_path_factory, "eval_pause", EVAL_PAUSE_WORKLOAD)
    result = trial(
        ranks=2, steps=4, faults=0, fault_kind="collective", checkpoint_every=4, baselines=False, workload=workload
    )
    s = result.summary()
    assert s["bit_identical"], s["mismatches"]
    recoveries = result.recoveries()
    assert recoveries and all(r["step"] == 2 and r["policy"] == "in_memory" for r in recoveries)
    assert len(recoveries) <= 3, recoveries  # a stall, a timeout, and the run that completes
    fitted = [e.data for e in result.events() if e.event == EventKind.TIMEOUT_FITTED and e.rank == 0]
    assert fitted[-1]["seconds"] >= 4 * 1.3  # the data path now waits for that step with the margin
