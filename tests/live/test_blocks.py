"""Where ranks stand between steps, and what a recovery runs again so all resume at one point.

A rank can re-run an evaluation (``rt.run``) after step s while its peers, whose part of the
evaluation's all-reduce ended first, are already in step s + 1: the decision names the point where
the job resumes live and the furthest point a rank reached, and the plan each rank runs again
leads from its decided state to where it stood, in the order it first ran (pure functions: the
live run is ``test_recovery_user_paths.py``)."""

from __future__ import annotations

import pytest

from meshpact.core.recovery import Policy
from meshpact.live.recovery.blocks import AT_STEP, KEPT_PER_STEP, BlockLog, BlockRun, replay_plan, resume_points
from meshpact.live.recovery.consensus import Decision, Proposal, decide


def _p(rank: int, step: int = 7, block: int = AT_STEP, **kw) -> Proposal:
    return Proposal(rank, 2, step, f"digest{rank}", True, block=block, **kw)


def _latest(limit: int) -> int:
    return 0


def test_ranks_gone_on_into_the_step_run_the_evaluation_again_with_the_rank_still_in_it():
    d = decide({0: _p(0, block=0), 1: _p(1), 2: _p(2)}, 3, 2, 3, _latest)
    assert d.policy is Policy.IN_MEMORY and d.resume_point == (7, 0) and d.furthest == (7, AT_STEP)
    one = {7: 1}.get
    assert replay_plan(7, d.resume_point, (7, AT_STEP), lambda at: one(at, 0)) == [("block", 7, 0)]  # ranks 1, 2
    assert replay_plan(7, d.resume_point, (7, 0), lambda at: 0) == []  # rank 0 re-runs it itself
    assert Decision.from_dict(d.to_dict()) == d


def test_the_earliest_point_any_rank_stands_at_is_where_all_resume_live():
    d = decide({0: _p(0, block=2), 1: _p(1, block=1), 2: _p(2)}, 3, 2, 3, _latest)
    assert d.resume_point == (7, 1)
    assert replay_plan(7, (7, 1), (7, 2), lambda at: 2) == [("block", 7, 1)]  # rank 0: block 1, then its own 2 again
    assert replay_plan(7, (7, 1), (7, AT_STEP), lambda at: 3) == [("block", 7, 1), ("block", 7, 2)]  # rank 2


def test_all_at_the_step_run_nothing_again():
    d = decide({r: _p(r) for r in range(3)}, 3, 2, 3, _latest)
    assert d.resume_point == (7, AT_STEP)
    assert replay_plan(7, d.resume_point, (7, AT_STEP), lambda at: 2) == []


def test_a_replacement_starts_at_the_step_so_the_evaluation_a_survivor_stands_in_is_dropped():
    """A new process (no committed step) starts at the next rt.step: the survivor standing in the
    evaluation drops it (GuardedBlockLost) rather than wait in it for a rank that never comes, and
    its peer at the step runs nothing again."""
    props = {
        0: _p(0, block=0, own_steps=(7,)),
        1: _p(1, own_steps=(7,), holds=((2, 7),)),
        2: Proposal(2, 2, -1, "", False, incarnation=1),
    }
    d = decide(props, 3, 2, 3, _latest, peer_copies=1)
    assert d.policy is Policy.PEER_RESTORE and d.step == 7 and d.resume_point == (7, AT_STEP)
    assert replay_plan(7, d.resume_point, (7, AT_STEP), lambda at: 1) == []


def test_a_replacement_restored_to_an_older_step_runs_the_blocks_after_it_live_so_survivors_run_them_again():
    """The lost rank's copy of step 8 was in flight: the job goes back to 7. The replacement's loop runs
    step 7, then step 8's evaluation, then step 8; the survivors, which stood at step 8, run the same
    again: step 7 and the evaluation (rank 0 stood in it: it re-runs it itself)."""
    live, furthest = resume_points([(8, 0), (8, AT_STEP), (7, AT_STEP)], 7, floor=True)
    assert live == (7, AT_STEP) and furthest == (8, AT_STEP)
    assert replay_plan(7, live, (8, AT_STEP), lambda at: 1) == [("step", 7, 0), ("block", 8, 0)]
    assert replay_plan(7, live, (8, 0), lambda at: {7: 1}.get(at, 0)) == [("step", 7, 0)]


def test_a_rollback_among_survivors_runs_the_steps_again_and_only_the_blocks_someone_runs_live():
    """Everyone stood at step 8 or in its blocks: step 7's evaluation, before every rank's point, is
    run live by no rank, so none runs it again (its result was dropped anyway)."""
    live, _ = resume_points([(8, 1), (8, AT_STEP)], 7, floor=False)
    assert live == (8, 1)
    counts = {7: 2, 8: 2}.get
    assert replay_plan(7, live, (8, AT_STEP), lambda at: counts(at, 0)) == [("step", 7, 0), ("block", 8, 1)]
    assert replay_plan(7, live, (8, 1), lambda at: counts(at, 0)) == [("step", 7, 0)]


def test_an_excision_changes_the_world_so_no_block_before_the_decided_step_is_live():
    assert resume_points([(7, 0), (7, AT_STEP)], 7, floor=True)[0] == (7, AT_STEP)
    assert resume_points([(7, 0), (7, AT_STEP)], 7, floor=False)[0] == (7, 0)
    props = {0: _p(0, block=0, own_steps=(7,), holds=((2, 7),)), 1: _p(1, own_steps=(7,))}
    d = decide(props, 3, 2, 3, _latest, peer_copies=1, on_rank_loss=Policy.EXCISE, declared=(2,))
    assert d.policy is Policy.EXCISE and d.resume_point == (7, AT_STEP)


def test_the_log_keeps_the_newest_blocks_of_the_steps_a_restore_can_go_back_to():
    log = BlockLog()
    for at in range(4):
        log.add(at, BlockRun(print, (at,)))
    log.add(3, BlockRun(None))  # a guarded block: counted, never run again
    assert log.count(3) == 2 and log.run_at(3, 1).fn is None
    log.keep_from(2)
    assert log.count(2) == 1
    for gone in (lambda: log.run_at(1, 0), lambda: log.count(1)):  # how many ran there is unknown now
        with pytest.raises(LookupError, match="step 1 are no longer kept"):
            gone()
    with pytest.raises(LookupError):  # so a plan through that step is refused, not one that skips its blocks
        replay_plan(0, (0, AT_STEP), (3, AT_STEP), log.count)
    fresh = BlockLog()  # a loop that never ran a block: nothing is unknown below its horizon
    fresh.keep_from(5)
    assert fresh.count(2) == 0 and replay_plan(2, (2, AT_STEP), (5, AT_STEP), fresh.count) == [
        ("step", 2, 0),
        ("step", 3, 0),
        ("step", 4, 0),
    ]
    log.keep_from(1)  # never back
    assert log.horizon == 2
    for i in range(KEPT_PER_STEP + 3):  # an evaluation loop of many blocks between two steps
        log.add(5, BlockRun(print, (i,)))
    assert log.count(5) == KEPT_PER_STEP + 3 and log.run_at(5, KEPT_PER_STEP + 2).args == (KEPT_PER_STEP + 2,)
    with pytest.raises(LookupError, match="block 2 of step 5 is no longer kept"):
        log.run_at(5, 2)


def test_a_decision_says_its_points_on_the_wire_and_an_older_one_without_them_resumes_at_its_step():
    d = decide({0: _p(0, block=1), 1: _p(1)}, 2, 2, 3, _latest)
    wire = d.to_dict()
    assert wire["live"] == [7, 1] and wire["furthest"] == [7, AT_STEP]
    del wire["live"], wire["furthest"]
    assert Decision.from_dict(wire).resume_point == (7, AT_STEP)
