"""Consensus on the committed step, over the control channel, before anything resumes.

After a fault every live rank publishes a :class:`Proposal`: the generation it belongs to,
the optimizer step it last committed, a digest of its local shards and optimizer state, and
whether that state is intact (the digest still equals the one taken at the commit). The
group resumes from memory only when every rank answered within the control timeout, all
are at the group's generation, all committed the same step and all states are intact.
Otherwise nobody resumes from memory: the decision names the reason and falls back to
restoring the newest checkpoint no later than the oldest committed step.

No split brain: each round's decision is written once (compare-and-set on the control
channel); every rank adopts the stored decision, whichever rank wrote it, so two ranks
never resume at different steps or generations. A rank's view that timed out and a view
that saw everyone cannot both win.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from meshpact.core.recovery import Policy

from .control import ControlChannel, ControlTimeout

__all__ = ["Proposal", "Decision", "decide", "agree", "ConsensusError", "GENERATION_KEY", "ROUND_KEY",
           "loss_bound_s"]

ROUND_KEY = "round"  # the last round decided, complete or not
GENERATION_KEY = "generation"  # the round of the last complete decision: the generation the job acts on


class ConsensusError(RuntimeError):
    """No decision the group can act on (e.g. a rank stayed silent through every round)."""


@dataclass(frozen=True)
class Proposal:
    rank: int
    generation: int  # the generation this rank's state belongs to
    committed_step: int  # optimizer steps applied to the state in memory (-1: none)
    digest: str
    intact: bool  # digest equals the one taken when committed_step was committed
    incarnation: int = 0  # 0 for the first process of this rank, 1.. for replacements
    restore_before: int | None = None  # asks for a checkpoint restore from before this step (a drill)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Proposal":
        return cls(**{k: d[k] for k in ("rank", "generation", "committed_step", "digest", "intact", "incarnation",
                                         "restore_before") if k in d})


@dataclass(frozen=True)
class Decision:
    round: int  # the new generation
    policy: Policy
    step: int  # the step every rank resumes from
    reason: str
    members: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    proposals: dict[int, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "policy": self.policy.value, "step": self.step, "reason": self.reason,
                "members": list(self.members), "missing": list(self.missing),
                "proposals": {str(k): v for k, v in self.proposals.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Decision":
        return cls(int(d["round"]), Policy(d["policy"]), int(d["step"]), str(d["reason"]),
                   tuple(d.get("members", ())), tuple(d.get("missing", ())),
                   {int(k): v for k, v in d.get("proposals", {}).items()})

    def summary(self) -> dict[str, Any]:
        """What an event records of the decision (no proposals)."""
        return {"policy": self.policy.value, "round": self.round, "step": self.step, "reason": self.reason,
                "missing": list(self.missing)}

    @property
    def in_memory(self) -> bool:
        return self.policy is Policy.IN_MEMORY


def decide(proposals: dict[int, Proposal], world_size: int, group_generation: int, round: int,
           checkpoint_step: Callable[[int], int], timeout_s: float = 0.0) -> Decision:
    """The group's answer to one round of proposals (pure; every rank would compute the same).

    ``checkpoint_step(limit)`` returns the newest complete checkpoint at or before ``limit``.
    """
    members = tuple(sorted(proposals))
    missing = tuple(r for r in range(world_size) if r not in proposals)
    raw = {r: p.to_dict() for r, p in proposals.items()}

    def fallback(reason: str) -> Decision:
        steps = [p.committed_step for p in proposals.values() if p.intact and p.committed_step >= 0]
        steps += [p.restore_before - 1 for p in proposals.values() if p.restore_before is not None]
        limit = max(min(steps), 0) if steps else 0
        return Decision(round, Policy.CHECKPOINT_RESTORE, checkpoint_step(limit), reason, members, missing, raw)

    if missing:
        return fallback(f"rank(s) {list(missing)} did not answer on the control channel within {timeout_s:.2f} s")
    stale = {r: p.generation for r, p in proposals.items() if p.generation != group_generation}
    if stale:
        return fallback(f"stale generation: rank(s) {stale} (rank: generation) differ from the group's "
                        f"generation {group_generation}")
    asked = {r: p.restore_before for r, p in proposals.items() if p.restore_before is not None}
    if asked:
        return fallback(f"rank(s) {sorted(asked)} asked for a checkpoint restore from before step "
                        f"{min(asked.values())} (a drill)")
    broken = [r for r, p in proposals.items() if not p.intact]
    if broken:
        return fallback(f"rank(s) {broken} hold no intact state in memory (replacement process, or the "
                        "digest differs from the one taken at the commit)")
    steps = {p.committed_step for p in proposals.values()}
    if len(steps) != 1:
        return fallback("committed steps differ: " + ", ".join(f"rank {r}: {p.committed_step}"
                                                                for r, p in sorted(proposals.items())))
    step = steps.pop()
    return Decision(round, Policy.IN_MEMORY, step, f"all {world_size} ranks alive, at generation "
                    f"{group_generation}, committed step {step}, state intact", members, missing, raw)


def loss_bound_s(timeout_s: float, max_rounds: int = 4) -> float:
    """How long :func:`agree` waits on a silent rank before declaring it lost: each round waits
    at most ``timeout_s`` for the missing proposals, and an incomplete round starts the next at
    once, so ``max_rounds * timeout_s`` (plus the channel's round trips)."""
    return max_rounds * timeout_s


def agree(channel: ControlChannel, make_proposal: Callable[[int], Proposal], checkpoint_step: Callable[[int], int],
          timeout_s: float | None = None, max_rounds: int = 4) -> Decision:
    """Run rounds until the group decides with every rank present; a rank still missing after
    ``max_rounds`` rounds (:func:`loss_bound_s`) is declared lost with :class:`ConsensusError`.

    Rounds are numbered on the channel (``ROUND_KEY``); only a complete decision moves the
    group's generation (``GENERATION_KEY``) to its round. An incomplete round is acted on by
    nobody, so it makes nobody stale: a rank later than the timeout finds that round decided,
    moves to the next one and joins it, and the group can still resume from memory.
    ``make_proposal(group_generation)`` builds this rank's proposal for a round.
    """
    timeout = channel.timeout_s if timeout_s is None else timeout_s
    world = channel.world_size
    last: Decision | None = None
    for _ in range(max_rounds):
        round_ = channel.counter(ROUND_KEY) + 1
        if channel.present([f"round{round_}/decision"]):  # decided without us (we were late): next round
            channel.advance(ROUND_KEY, round_)
            continue
        group_generation = channel.counter(GENERATION_KEY)
        proposal = make_proposal(group_generation)
        channel.set(f"round{round_}/rank{channel.rank}", proposal.to_dict())
        keys = [f"round{round_}/rank{r}" for r in range(world)]
        try:
            got = channel.wait(keys, timeout)
        except ControlTimeout:
            got = channel.present(keys)
        proposals = {int(k.rsplit("rank", 1)[1]): Proposal.from_dict(v) for k, v in got.items()}
        mine = decide(proposals, world, group_generation, round_, checkpoint_step, timeout)
        decision = Decision.from_dict(channel.set_once(f"round{round_}/decision", mine.to_dict()))
        channel.advance(ROUND_KEY, round_)
        last = decision
        if not decision.missing:
            channel.move(GENERATION_KEY, group_generation, round_)
            return decision
    raise ConsensusError(f"rank(s) {list(last.missing) if last else '?'} declared lost: no complete decision "
                         f"after {max_rounds} round(s) of {timeout:.2f} s; "
                         f"{last.reason if last else 'no round was decided'}")
