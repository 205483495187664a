"""Where each rank stands between two steps, so a recovery resumes every rank at one point.

A loop runs blocks of collectives between its steps (an evaluation's all-reduce through
``rt.run(fn)``, a logging block under ``with rt.guard():``). A collective completes on one rank
before another (a ring all-reduce ends on a rank once it has what it needs, while a peer still
waits for its last piece), so when a fault comes, one rank may be re-running the evaluation after
step ``s`` while its peers are already inside step ``s + 1``: all committed the same step, each at
another point of the program. Re-run as they stand, they would wait in different collectives
(the evaluation's group against the step's), each attempt severed again by the heartbeat's
quiet-data-path rule, until the step gave up.

So each rank logs the blocks it completed since its commit (:class:`BlockLog`), and its proposal
says its *position* (:class:`Position`): the block it re-runs (an ``rt.run`` block that failed),
or -1 when it is at the step (a rank in a step, between steps, or a replacement process, which
starts at the step). The decision names the block every rank resumes from
(:func:`resume_block`): the earliest block a rank stands at, which ranks that are further on run
again from their log (their results dropped, the block's own ones kept), or -1 (the step) where a
rank at the step could not run them again (a replacement has no log, an excision changes the
world): then a rank standing in a block drops it (:class:`~.runtime.GuardedBlockLost`).

A ``with rt.guard():`` block cannot be run again (its body is the caller's); a rank that failed
in one is past it, and a rank that would have to run one again ends the job in one line instead.

The log keeps the blocks of the steps a restore may take a rank back to (its own snapshots and
the newest checkpoint), so a replay after a peer restore runs the blocks between the replayed
steps in the order they first ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

__all__ = ["BlockRun", "BlockLog", "Position", "resume_block", "replay_plan", "position_order", "AT_STEP"]

AT_STEP = -1  # a position at the step: every block before it done (or dropped)


@dataclass(frozen=True)
class BlockRun:
    """One block that completed between steps: ``fn(*args, **kwargs)`` (``fn`` None: a
    ``with rt.guard():`` block, which cannot be run again)."""

    fn: Callable[..., Any] | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", "a guarded block") if self.fn is not None else "a guarded block"


@dataclass(frozen=True)
class Position:
    """What a proposal says of where its rank stands at its committed step: ``block``, the block it
    re-runs (or AT_STEP), and ``logged``, the blocks it completed there and can run again."""

    block: int = AT_STEP
    logged: int = 0


class BlockLog:
    """The blocks each committed step was followed by, in order, since the oldest step kept."""

    def __init__(self) -> None:
        self._by_step: dict[int, list[BlockRun]] = {}
        self.horizon = 0  # the oldest step whose blocks are kept (older ones were dropped)
        self.ran_any = False  # a block ever ran in this process
        self.replayed = 0  # blocks run again by recoveries (their results dropped)

    def add(self, at: int, run: BlockRun) -> None:
        """``run`` completed (or was dropped) with ``at`` the committed step."""
        self._by_step.setdefault(at, []).append(run)
        self.ran_any = True

    def count(self, at: int) -> int:
        return len(self._by_step.get(at, ()))

    def runs(self, at: int) -> list[BlockRun]:
        if at < self.horizon and self.ran_any:
            raise LookupError(f"the blocks run between steps at step {at} are no longer kept (kept from step "
                              f"{self.horizon})")
        return list(self._by_step.get(at, ()))

    def keep_from(self, step: int) -> None:
        """Drop the blocks of the steps before ``step`` (no restore goes back past it)."""
        if step <= self.horizon:
            return
        for at in [a for a in self._by_step if a < step]:
            del self._by_step[at]
        self.horizon = step


def position_order(block: int) -> float:
    """A block's place among its step's: AT_STEP (the step itself) after every block."""
    return math.inf if block == AT_STEP else block


def resume_block(positions: Iterable[tuple[int, Position]], step: int, can_replay: bool = True) -> int:
    """The block every rank resumes from at ``step``: the earliest a rank at ``step`` stands in,
    unless a rank at the step has not run the blocks from there (a replacement, with no log), or
    the world changes (``can_replay`` off: an excision); AT_STEP then. ``positions`` are
    (committed step, position) of every member."""
    at = [p for s, p in positions if s == step]
    behind = [p.block for p in at if p.block != AT_STEP]
    if not behind or not can_replay:
        return AT_STEP
    first = min(behind)
    if any(p.block == AT_STEP and p.logged <= first for p in at):
        return AT_STEP
    return first


def replay_plan(from_step: int, from_block: int, to_step: int, to_block: int, count: Callable[[int], int]
                ) -> Sequence[tuple[str, int, int]]:
    """What a rank runs again to go from (``from_step``, ``from_block``) to where it stood
    (``to_step``, ``to_block``), in the order it first ran: ("block", step, index) and ("step",
    step, 0). ``count(step)`` is how many blocks this rank logged at a step. AT_STEP as
    ``from_block`` starts at the step itself (no block of ``from_step`` again); as ``to_block``, the
    rank stood at the step (every logged block of ``to_step`` again)."""
    plan: list[tuple[str, int, int]] = []
    for at in range(from_step, to_step + 1):
        first = (from_block if from_block != AT_STEP else count(at)) if at == from_step else 0
        last = (to_block if to_block != AT_STEP else count(at)) if at == to_step else count(at)
        plan += [("block", at, i) for i in range(first, last)]
        if at < to_step:
            plan.append(("step", at, 0))
    return plan
