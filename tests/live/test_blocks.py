"""Where ranks stand between steps, and what a recovery runs again so all resume at one point.

A rank can re-run an evaluation (``rt.run``) after step s while its peers, whose part of the
evaluation's all-reduce ended first, are already in step s + 1: the decision names the block every
rank resumes from, and the plan each rank runs again leads from there to where it stood, in the
order it first ran (pure functions: the live run is ``test_recovery_user_paths.py``)."""

from __future__ import annotations

import pytest

from meshpact.core.recovery import Policy
from meshpact.live.recovery.blocks import AT_STEP, BlockLog, BlockRun, Position, replay_plan, resume_block
from meshpact.live.recovery.consensus import Decision, Proposal, decide


def _p(rank: int, step: int = 7, block: int = AT_STEP, logged: int = 0, **kw) -> Proposal:
    return Proposal(rank, 2, step, f"digest{rank}", True, position=Position(block, logged), **kw)


def _latest(limit: int) -> int:
    return 0


def test_ranks_gone_on_into_the_step_run_the_evaluation_again_with_the_rank_still_in_it():
    props = {0: _p(0, block=0, logged=0), 1: _p(1, logged=1), 2: _p(2, logged=1)}
    d = decide(props, 3, 2, 3, _latest)
    assert d.policy is Policy.IN_MEMORY and d.block == 0
    count = {7: 1}.get
    assert replay_plan(7, d.block, 7, AT_STEP, lambda at: count(at, 0)) == [("block", 7, 0)]  # ranks 1 and 2
    assert replay_plan(7, d.block, 7, 0, lambda at: 0) == []  # rank 0 re-runs it itself
    assert Decision.from_dict(d.to_dict()) == d


def test_the_earliest_block_any_rank_stands_in_is_where_all_resume():
    props = {0: _p(0, block=2, logged=2), 1: _p(1, block=1, logged=1), 2: _p(2, logged=3)}
    assert decide(props, 3, 2, 3, _latest).block == 1
    assert replay_plan(7, 1, 7, 2, lambda at: 2) == [("block", 7, 1)]  # rank 0: block 1, then its own 2 again
    assert replay_plan(7, 1, 7, AT_STEP, lambda at: 3) == [("block", 7, 1), ("block", 7, 2)]  # rank 2


def test_all_at_the_step_run_nothing_again():
    d = decide({r: _p(r, logged=2) for r in range(3)}, 3, 2, 3, _latest)
    assert d.block == AT_STEP
    assert replay_plan(7, AT_STEP, 7, AT_STEP, lambda at: 2) == []


def test_a_replacement_at_the_step_ran_no_block_so_none_runs_again():
    """A new process starts at the next rt.step: the survivor in the evaluation drops it
    (GuardedBlockLost) rather than wait in it for a rank that never comes."""
    props = {0: _p(0, block=0), 1: _p(1, logged=1), 2: Proposal(2, 2, 7, "", True, incarnation=1)}
    assert decide(props, 3, 2, 3, _latest).block == AT_STEP


def test_an_excision_changes_the_world_so_no_block_runs_again_across_it():
    assert resume_block([(7, Position(0, 0)), (7, Position(AT_STEP, 1))], 7, can_replay=False) == AT_STEP
    assert resume_block([(7, Position(0, 0)), (7, Position(AT_STEP, 1))], 7) == 0


def test_ranks_at_another_committed_step_do_not_set_the_block():
    """Rolled back to step 7, a rank that had committed 8 runs step 7 again from its start, and
    its blocks after it: its position at 8 says nothing of step 7's blocks."""
    assert resume_block([(7, Position(AT_STEP, 2)), (8, Position(0, 0))], 7) == AT_STEP
    assert resume_block([(7, Position(1, 1)), (8, Position(0, 0))], 7) == 1


def test_a_rolled_back_rank_runs_steps_and_blocks_again_in_the_order_they_first_ran():
    blocks = {5: 1, 6: 2, 7: 1}
    plan = replay_plan(5, AT_STEP, 7, 0, lambda at: blocks.get(at, 0))  # it stood in step 7's first block
    assert plan == [("step", 5, 0), ("block", 6, 0), ("block", 6, 1), ("step", 6, 0)]
    plan = replay_plan(5, 0, 7, AT_STEP, lambda at: blocks.get(at, 0))  # from step 5's first block, to step 7
    assert plan == [("block", 5, 0), ("step", 5, 0), ("block", 6, 0), ("block", 6, 1), ("step", 6, 0),
                    ("block", 7, 0)]


def test_the_log_keeps_the_steps_a_restore_can_go_back_to_and_says_when_one_is_gone():
    log = BlockLog()
    for at in range(4):
        log.add(at, BlockRun(print, (at,)))
    log.add(3, BlockRun(None))  # a guarded block: counted, never run again
    assert log.count(3) == 2 and log.runs(3)[1].fn is None
    log.keep_from(2)
    assert log.count(1) == 0 and log.count(2) == 1
    with pytest.raises(LookupError, match="step 1 are no longer kept"):
        log.runs(1)
    log.keep_from(1)  # never back
    assert log.horizon == 2
