"""Where each rank stands between two steps, so a recovery resumes every rank at one point.

A loop runs blocks of collectives between its steps (an evaluation's all-reduce through
``rt.run(fn)``, a logging block under ``with rt.guard():``). A collective completes on one rank
before another (a ring all-reduce ends on a rank once it has what it needs, while a peer still
waits for its last piece), so when a fault comes, one rank may be re-running the evaluation after
step ``s`` while its peers are already inside step ``s + 1``: all committed the same step, each at
another point of the program. Re-run as they stand, they would wait in different collectives
(the evaluation's group against the step's), each attempt severed again by the heartbeat's
quiet-data-path rule, until the step gave up.

A *point* of the loop is (committed step, block): the block a rank stands in at that step, or
:data:`AT_STEP`, the step itself, after every block. Each rank logs the blocks it completed
(:class:`BlockLog`) and its proposal says its block. The decision names two points
(:func:`resume_points`): where the job resumes *live* — the earliest point a member stands at,
and never before the step a new process starts at (a replacement runs its loop from the
decided step; an excision changes the world under the blocks) — and the furthest point a
member reached. Every rank, from the decided state, runs again what lies between the live
point and where it stood (:func:`replay_plan`: the steps, and the ``rt.run`` blocks from the
live point on, their results dropped), so its peers still before it find it in the same
collectives. A rank standing before the live point drops its block
(:class:`~.runtime.GuardedBlockLost`).

A ``with rt.guard():`` block cannot be run again (its body is the caller's): nobody replays one,
and a rank whose loop reaches one before the furthest point skips it at its entry
(``GuardedBlockLost`` there, the body not run), as the ranks past it did.

An ``rt.run`` block leaves the generators as it found them, and a replay runs it from the
generators it first ran from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

__all__ = ["BlockRun", "BlockLog", "Point", "resume_points", "replay_plan", "point_order", "AT_STEP", "KEPT_PER_STEP"]

AT_STEP = -1  # a rank at the step: every block before it done (or dropped)
KEPT_PER_STEP = 8  # the newest blocks of a step kept to run again (a peer is at most a block or two behind)
KEPT_STEPS = 64  # the steps whose blocks are kept at most (their arguments stay alive: evaluation batches)

Point = tuple[int, int]  # (committed step, block or AT_STEP)


def point_order(point: Point) -> tuple[int, float]:
    """A point's place in the loop: a step's blocks in order, then the step (AT_STEP)."""
    step, block = point
    return step, (math.inf if block == AT_STEP else block)


@dataclass(frozen=True)
class BlockRun:
    """One block that completed between steps: ``fn(*args, **kwargs)`` run from the generators
    ``rng`` (``fn`` None: a ``with rt.guard():`` block, or one dropped; never run again)."""

    fn: Callable[..., Any] | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    rng: Any = None


class BlockLog:
    """The blocks each committed step was followed by, in order: the newest
    :data:`KEPT_PER_STEP` of each step, for the steps since the oldest a restore can go back to."""

    def __init__(self) -> None:
        self._by_step: dict[int, list[BlockRun | None]] = {}  # None: a block no longer kept (counted)
        self.horizon = 0  # the oldest step whose blocks are kept (older ones were dropped)
        self.ran_any = False  # a block ran in this process: below the horizon, how many ran is unknown
        self.replayed = 0  # blocks run again by recoveries (their results dropped)

    def add(self, at: int, run: BlockRun) -> None:
        """``run`` completed (or was dropped) with ``at`` the committed step."""
        self.ran_any = True
        runs = self._by_step.setdefault(at, [])
        runs.append(run)
        if len(runs) > KEPT_PER_STEP:
            runs[len(runs) - KEPT_PER_STEP - 1] = None

    def count(self, at: int) -> int:
        """The blocks logged at step ``at``; LookupError below the horizon once any block ran (how
        many ran there is no longer known: a plan that counted none would skip what a peer runs)."""
        if at < self.horizon and self.ran_any:
            raise LookupError(
                f"the blocks run between steps at step {at} are no longer kept (kept from step {self.horizon})"
            )
        return len(self._by_step.get(at, ()))

    def run_at(self, at: int, index: int) -> BlockRun:
        """The block ``index`` of step ``at``, as it first ran; LookupError where it is not kept."""
        self.count(at)  # (below the horizon: LookupError)
        runs = self._by_step.get(at, [])
        run = runs[index] if index < len(runs) else None
        if run is None:
            raise LookupError(
                f"block {index} of step {at} is no longer kept (the newest {KEPT_PER_STEP} of a step are)"
            )
        return run

    def keep_from(self, step: int) -> None:
        """Drop the blocks of the steps before ``step`` (no restore goes back past it)."""
        if step <= self.horizon:
            return
        for at in [a for a in self._by_step if a < step]:
            del self._by_step[at]
        self.horizon = step


def resume_points(points: Iterable[Point], decided_step: int, floor: bool) -> tuple[Point, Point]:
    """(the live point, the furthest point) of a decision at ``decided_step`` whose members stand at
    ``points``; ``floor``: a member starts at the decided step (a replacement) or the world changes
    (an excision), so nothing before that step's own point is live."""
    pts = list(points) or [(decided_step, AT_STEP)]
    live = min(pts, key=point_order)
    if floor and point_order(live) < point_order((decided_step, AT_STEP)):
        live = (decided_step, AT_STEP)
    return live, max(pts, key=point_order)


def replay_plan(
    from_step: int, live: Point, stood: Point, count: Callable[[int], int]
) -> Sequence[tuple[str, int, int]]:
    """What a rank whose state is at ``from_step`` runs again to stand where it stood (``stood``), in
    the order it first ran: ("step", step, 0) for every step from ``from_step`` on, and
    ("block", step, index) for the blocks from the ``live`` point on (before it, no rank runs them
    live). ``count(step)`` is how many blocks the rank logged at a step."""
    to_step, to_block = stood
    start = point_order(live)
    plan: list[tuple[str, int, int]] = []
    for at in range(from_step, to_step + 1):
        last = (to_block if to_block != AT_STEP else count(at)) if at == to_step else count(at)
        plan += [("block", at, i) for i in range(last) if point_order((at, i)) >= start]
        if at < to_step:
            plan.append(("step", at, 0))
    return plan
