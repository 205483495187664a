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
that saw everyone cannot both win. One rank decides each round for everyone (the *decider*:
the lowest rank expected, not gone, that answered every earlier round of this agreement); the
others wait for the decision it copies to ``round<k>/adopted`` instead of reading every
proposal and deciding too, so after a fault three of four ranks spend no CPU on deciding while
the cores are short. A decider that does not decide within the round's timeout, or that the
launcher marks gone, is not waited for: the others decide as before, and the first decision
written stands.

Rank loss. A proposal also says which peer copies the rank holds in host memory
(:mod:`.peers`) and which of its own snapshots it keeps. When some ranks hold no intact
state (a replacement process) the decision is ``peer_restore`` if one step is held for every
rank (the survivors' own state or snapshot, a live holder's copy for each lost rank), naming
the holder each replacement fetches from; ``checkpoint_restore`` if a lost rank's state went
with all its holders; and, where the job asked to excise, ``excise`` once the lost ranks are
declared lost with no replacement and a survivor holds each one's copy (:attr:`Decision.lost`,
the step every copy is held at, the holders in ``restore_from``). A rank the launcher saw
exit is marked gone (:func:`mark_gone`) and, excising, declared lost at once. A rank missing
from ``max_rounds`` incomplete rounds in a row is *declared lost* (``lost/round<k>`` on the
channel, which the launcher watches to kill and replace it); the rounds then wait
``replacement_rounds`` more for its replacement: the replacement's deadline.

A replacement that misses its deadline, or one the launcher says will not come (it marked the
rank gone: no spare or replacement left, or the replacement process died), does not end the
job where it can excise: the survivors continue without the rank, as ``excise`` decides it,
the reason naming the missed deadline. Where the job cannot excise (``excise_refusal``: no
smaller world to build, a mesh that is not 1-D; or no survivor holds the lost
rank's copy) :class:`ConsensusError` names both the missing rank and why.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from meshpact.core.jsonform import JsonObject
from meshpact.core.recovery import Policy

from .blocks import AT_STEP, Point, resume_points
from .control import ControlChannel, ControlTimeout
from .refusal import RecoveryImpossible

__all__ = [
    "Proposal",
    "Decision",
    "Agreement",
    "rank_runs",
    "from_runs",
    "CounterMoves",
    "decide",
    "agree",
    "ConsensusError",
    "GENERATION_KEY",
    "ROUND_KEY",
    "EXCISE_NOT_OFFERED",
    "loss_bound_s",
    "give_up_bound_s",
    "declared_lost",
    "LOST_KEY",
    "GONE_KEY",
    "GONE_COUNT_KEY",
    "mark_gone",
    "gone_ranks",
    "open_round",
]

ROUND_KEY = "round"  # the last round decided, complete or not
GENERATION_KEY = "generation"  # the round of the last complete decision: the generation the job acts on
LOST_KEY = "lost/round"  # lost/round<k>: the ranks declared lost in round k (the launcher replaces them)
GONE_KEY = "gone/rank"  # gone/rank<r>: the launcher saw rank r's process exit and starts no replacement
ADOPTED = "adopted"  # round<k>/adopted: the decision that stands, copied there by the round's decider
GONE_COUNT_KEY = "gone/count"  # how many gone/rank<r> keys exist: read with the round counters, in one round trip
# the first slice of a wait for the round's decision blocks in the store, which wakes the waiter when the
# decision is set: no round trip until then, however many ranks wait. A decision that takes longer than a
# quarter second to come (a large job's decider reads every proposal) must not turn every waiting rank into
# a poller: at 1,024 light ranks, polling from 0.25 s on kept the control channel's host busy for 15 s of
# CPU. The decider's own wait for the proposals keeps quarter-second slices: one rank polls there, and a
# rank the launcher marks gone (a kill, when excising) is read at the first slice's end
FIRST_SLICE_S = 1.0
# why a replacement policy cannot excise a rank whose replacement never came, unless the caller says it can
EXCISE_NOT_OFFERED = "the job offers no excision (no build(mesh) for a smaller world was given)"


class ConsensusError(RecoveryImpossible):
    """No decision the group can act on (e.g. a rank stayed silent through every round): a recovery
    that cannot happen (:mod:`.refusal`)."""


@dataclass(frozen=True)
class Proposal:
    rank: int
    generation: int  # the generation this rank's state belongs to
    committed_step: int  # optimizer steps applied to the state in memory (-1: none)
    digest: str
    intact: bool  # digest equals the one taken when committed_step was committed
    incarnation: int = 0  # 0 for the first process of this rank, 1.. for replacements
    restore_before: int | None = None  # asks for a checkpoint restore from before this step (a drill)
    holds: tuple[tuple[int, int], ...] = ()  # (source rank, step) of each peer copy held in host memory
    own_steps: tuple[int, ...] = ()  # steps of this rank's own snapshots kept in host memory
    host: str = ""  # the host the rank is on (peer placement prefers other hosts)
    standby: JsonObject | None = None  # what the rank's standby can do (communicator.StandbyStatus); None: none
    refused: tuple[
        tuple[int, int], ...
    ] = ()  # (source rank, step) of copies this rank dropped: they failed their digest
    block: int = AT_STEP  # the block between steps it stands in at its committed step, or AT_STEP (blocks.py)

    def to_dict(self) -> JsonObject:
        # by hand: dataclasses.asdict deep-copies every field, a millisecond of each recovery
        return {
            "rank": self.rank,
            "generation": self.generation,
            "committed_step": self.committed_step,
            "digest": self.digest,
            "intact": self.intact,
            "incarnation": self.incarnation,
            "restore_before": self.restore_before,
            "holds": [list(h) for h in self.holds],
            "own_steps": list(self.own_steps),
            "host": self.host,
            "standby": dict(self.standby) if self.standby is not None else None,
            "refused": [list(r) for r in self.refused],
            "block": self.block,
        }

    @classmethod
    def from_dict(cls, d: JsonObject) -> "Proposal":
        kw = {
            k: d[k]
            for k in (
                "rank",
                "generation",
                "committed_step",
                "digest",
                "intact",
                "incarnation",
                "restore_before",
                "host",
                "standby",
            )
            if k in d
        }
        return cls(
            **kw,
            holds=tuple((int(a), int(b)) for a, b in d.get("holds", ())),
            own_steps=tuple(int(x) for x in d.get("own_steps", ())),
            refused=tuple((int(a), int(b)) for a, b in d.get("refused", ())),
            block=int(d.get("block", AT_STEP)),
        )


def _point(raw: Any) -> Point | None:
    """A point of the loop as the wire carries it ([step, block]; None: none said)."""
    return None if raw is None else (int(raw[0]), int(raw[1]))


def _alternates(
    proposals: dict[int, "Proposal"], sources: Sequence[tuple[int, int]], step: int
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """For each (rank, named holder) of a restore: the other ranks whose proposals say they hold
    that rank's copy of ``step``, in rank order (a copy refused at the named holder falls back to them)."""
    return tuple(
        (r, tuple(h for h in sorted(proposals) if h not in (r, named) and (r, step) in proposals[h].holds))
        for r, named in sources
    )


def rank_runs(ranks: Sequence[int]) -> list[list[int]]:
    """``ranks`` as inclusive runs ``[first, last]``: a job's members are a few runs whatever its size."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return runs


def from_runs(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(r for a, b in runs for r in range(int(a), int(b) + 1))


def _grouped(words: dict[int, JsonObject | None]) -> tuple[tuple[JsonObject | None, tuple[int, ...]], ...]:
    """Each distinct word and the ranks that said it, in the order first said."""
    out: dict[str, tuple[JsonObject | None, list[int]]] = {}
    for r in sorted(words):
        out.setdefault(json.dumps(words[r], sort_keys=True), (words[r], []))[1].append(r)
    return tuple((w, tuple(rs)) for w, rs in out.values())


def _standby_said(words: dict[int, JsonObject | None], generation: int) -> dict[int, JsonObject | None]:
    """The standby words a decision of ``generation`` carries: every rank's, in rank order, up to
    the first that cannot serve it (no word, not ready, or built for another generation), whose
    word every later rank carries too. The verdict (:func:`~.communicator.standby_refusal`, the
    first refusing rank's reason) is the one all words give, and the words are a few whatever
    the job's size: a data path silent on every rank makes each rank's reason its own."""
    out: dict[int, JsonObject | None] = {}
    refusing: JsonObject | None = None
    for r in sorted(words):
        w = words[r]
        if refusing is None and not (isinstance(w, dict) and w.get("ready") and w.get("generation") == generation):
            refusing = (
                w
                if w is not None
                else {
                    "generation": generation,
                    "ready": False,
                    "reason": f"rank {r} has no standby (a replacement process)",
                }
            )
        out[r] = w if refusing is None else refusing
    return out


@dataclass(frozen=True)
class Decision:
    """What a round decided, as every rank reads it. It names what changed (the ranks missing,
    lost, restored from whom) and not every rank's proposal: its size on the channel does not
    grow with the job (members as runs of ranks, the standbys' words grouped by word), so the
    ranks of a large job each read a few hundred bytes, not every proposal."""

    round: int  # the new generation
    policy: Policy
    step: int  # the step every rank resumes from
    reason: str
    members: tuple[int, ...] = ()  # the ranks whose proposals the decision rests on
    missing: tuple[int, ...] = ()
    standby: tuple[tuple[JsonObject | None, tuple[int, ...]], ...] = ()  # each rank's word on its standby, grouped
    restore_from: tuple[tuple[int, int], ...] = ()  # peer_restore / excise: (rank, the rank holding its copy at step)
    lost: tuple[int, ...] = ()  # excise: the original ranks leaving the job
    # peer_restore / excise: (rank, the other ranks holding its copy at step) where the named holder's is refused
    alternates: tuple[tuple[int, tuple[int, ...]], ...] = ()
    live: Point | None = None  # where the job resumes live, (step, block) (blocks.resume_points); None: at ``step``
    furthest: Point | None = None  # the furthest point a member stood at (a guarded block before it is skipped)

    def to_dict(self) -> JsonObject:
        return {
            "round": self.round,
            "policy": self.policy.value,
            "step": self.step,
            "reason": self.reason,
            "live": list(self.live) if self.live else None,
            "furthest": list(self.furthest) if self.furthest else None,
            "members": rank_runs(self.members),
            "missing": list(self.missing),
            "standby": [[w, rank_runs(rs)] for w, rs in self.standby],
            "restore_from": [list(p) for p in self.restore_from],
            "lost": list(self.lost),
            "alternates": [[r, list(hs)] for r, hs in self.alternates],
        }

    @classmethod
    def from_dict(cls, d: JsonObject) -> "Decision":
        return cls(
            int(d["round"]),
            Policy(d["policy"]),
            int(d["step"]),
            str(d["reason"]),
            from_runs(d.get("members", ())),
            tuple(d.get("missing", ())),
            tuple((w, from_runs(runs)) for w, runs in d.get("standby", ())),
            tuple((int(a), int(b)) for a, b in d.get("restore_from", ())),
            tuple(int(r) for r in d.get("lost", ())),
            tuple((int(r), tuple(int(h) for h in hs)) for r, hs in d.get("alternates", ())),
            _point(d.get("live")),
            _point(d.get("furthest")),
        )

    @property
    def resume_point(self) -> Point:
        """Where the job resumes live: (step, block)."""
        return self.live if self.live is not None else (self.step, AT_STEP)

    def standby_words(self) -> dict[int, JsonObject | None]:
        """Each member's word on its standby (None: it has none)."""
        return {r: w for w, rs in self.standby for r in rs}

    def summary(self) -> JsonObject:
        """What an event records of the decision (no proposals)."""
        return {
            "policy": self.policy.value,
            "round": self.round,
            "step": self.step,
            "reason": self.reason,
            "missing": list(self.missing),
            "restore_from": [list(p) for p in self.restore_from],
            "lost": list(self.lost),
            "live": list(self.resume_point),
        }

    @property
    def generation(self) -> int:
        """The generation the decision makes: the number of the round that decided it."""
        return self.round

    def holder_of(self, rank: int) -> int | None:
        """The rank ``rank`` takes its state from in a peer restore (itself: its own snapshot)."""
        return dict(self.restore_from).get(rank)

    @property
    def in_memory(self) -> bool:
        return self.policy is Policy.IN_MEMORY


@dataclass(frozen=True)
class CounterMoves:
    """The two counter moves that end a decided round: the round counter to the round, the
    generation counter from the group's generation to it. Idempotent: every rank makes them."""

    round: int
    from_generation: int

    def make(self, channel: ControlChannel) -> None:
        channel.advance(ROUND_KEY, self.round)
        channel.move(GENERATION_KEY, self.from_generation, self.round)


@dataclass(frozen=True)
class Agreement:
    """What :func:`agree` decided, and the counter moves it left to the caller (None: made)."""

    decision: Decision
    counters: CounterMoves | None = None


def decide(
    proposals: dict[int, Proposal],
    world_size: int,
    group_generation: int,
    round: int,
    checkpoint_step: Callable[[int], int],
    timeout_s: float = 0.0,
    **policy: Any,
) -> Decision:
    """The group's answer to one round (:func:`decide_policy`), with the points of the loop where the
    job resumes live and the furthest a member reached (:func:`~.blocks.resume_points`). A
    replacement (no committed step) starts at the decided step, and an excision changes the world
    under the blocks: no block before that step's own point is live then."""
    d = decide_policy(proposals, world_size, group_generation, round, checkpoint_step, timeout_s, **policy)
    members = [proposals[r] for r in d.members if r in proposals]
    fresh = any(p.committed_step < 0 for p in members)
    live, furthest = resume_points(
        ((p.committed_step, p.block) if p.committed_step >= 0 else (d.step, AT_STEP) for p in members),
        d.step,
        floor=fresh or d.policy is Policy.EXCISE,
    )
    return replace(d, live=live, furthest=furthest)


def decide_policy(
    proposals: dict[int, Proposal],
    world_size: int,
    group_generation: int,
    round: int,
    checkpoint_step: Callable[[int], int],
    timeout_s: float = 0.0,
    *,
    peer_copies: int = 0,
    on_rank_loss: Policy = Policy.PEER_RESTORE,
    declared: Sequence[int] = (),
    alive: Sequence[int] | None = None,
    overdue: Sequence[int] = (),
    overdue_why: str = "",
    excise_refusal: str | None = EXCISE_NOT_OFFERED,
) -> Decision:
    """The group's answer to one round of proposals (pure; every rank would compute the same).

    ``checkpoint_step(limit)`` returns the newest complete checkpoint at or before ``limit``;
    ``peer_copies`` is K of the job's peer copies (0: none kept); ``declared`` the ranks
    already declared lost; ``on_rank_loss`` is ``PEER_RESTORE`` (wait for a replacement) or
    ``EXCISE`` (continue without the declared ranks); ``alive`` the original ranks still in
    the job (default: all ``world_size``; fewer after an excision). Under ``PEER_RESTORE``,
    ``overdue`` are the lost ranks whose replacement will not come (``overdue_why`` says why:
    the deadline it missed, or the launcher's word); when they are all that is missing the
    survivors excise them, unless ``excise_refusal`` says why the job cannot.
    """
    members = tuple(sorted(proposals))
    expected = tuple(range(world_size)) if alive is None else tuple(sorted(alive))
    missing = tuple(r for r in expected if r not in proposals)
    standby = _grouped(_standby_said({r: p.standby for r, p in proposals.items()}, round))

    def fallback(reason: str) -> Decision:
        steps = [p.committed_step for p in proposals.values() if p.intact and p.committed_step >= 0]
        steps += [p.restore_before - 1 for p in proposals.values() if p.restore_before is not None]
        limit = max(min(steps), 0) if steps else 0
        try:
            found = checkpoint_step(limit)
            step = int(found)
            passed = found.note() if hasattr(found, "note") else ""  # a Checkpointer's: newer damaged ones, named
            reason = f"{reason}; checkpoints {passed}" if passed else reason
        except FileNotFoundError as exc:  # a round still missing ranks goes on; a complete one is refused where
            step, reason = -1, f"{reason}; no checkpoint to restore ({exc})"  # it is acted on (step -1)
        return Decision(round, Policy.CHECKPOINT_RESTORE, step, reason, members, missing, standby)

    def excision(why: str) -> Decision:
        plan = _excise_plan(proposals, missing, peer_copies)
        if isinstance(plan, str):
            return fallback(f"{why}; cannot excise: {plan}")
        step, sources = plan
        behind = sorted(r for r in members if proposals[r].committed_step > step)
        note = (
            (
                f"; rank(s) {behind} roll back to it from their own snapshot (a lost rank's newer copy was still "
                "in flight)"
            )
            if behind
            else ""
        )
        return Decision(
            round,
            Policy.EXCISE,
            step,
            f"{why}; copies at step {step} from holder(s) "
            + ", ".join(f"rank {r} <- rank {h}" for r, h in sources)
            + f"; the {len(members)} others continue without them{note}",
            members,
            missing,
            standby,
            sources,
            missing,
            _alternates(proposals, sources, step),
        )

    if missing and on_rank_loss is Policy.EXCISE and set(missing) <= set(declared) and members:
        return excision(f"rank(s) {list(missing)} declared lost with no replacement (--on-rank-loss excise)")
    if missing and on_rank_loss is Policy.PEER_RESTORE and overdue and set(missing) <= set(overdue) and members:
        why = (
            f"rank(s) {list(missing)} did not answer on the control channel within {timeout_s:.2f} s and "
            f"{overdue_why or 'no replacement will come'}"
        )
        if excise_refusal is not None:
            return fallback(f"{why}; cannot excise instead: {excise_refusal}")
        return excision(f"{why}, so the survivors excise them")
    if missing:
        return fallback(f"rank(s) {list(missing)} did not answer on the control channel within {timeout_s:.2f} s")
    # a rank holding state from an older generation than another's missed a recovery; ranks all at
    # one older generation never acted on a decided round (its groups could not be built: a rank
    # died after proposing), which leaves their states as good as they were
    held = {p.generation for p in proposals.values() if p.intact}
    newest = group_generation if group_generation in held or not held else max(held)
    stale = {r: p.generation for r, p in proposals.items() if p.intact and p.generation != newest}
    if stale:
        return fallback(
            f"stale generation: rank(s) {stale} (rank: generation) differ from the group's generation {newest}"
        )
    asked = {r: p.restore_before for r, p in proposals.items() if p.restore_before is not None}
    if asked:
        return fallback(
            f"rank(s) {sorted(asked)} asked for a checkpoint restore from before step {min(asked.values())} (a drill)"
        )
    broken = sorted(r for r, p in proposals.items() if not p.intact)
    if broken:
        why = (
            f"rank(s) {broken} hold no intact state in memory (a replacement process, a state written "
            "since the commit, or an optimizer step begun before the fault)"
        )
        plan = _peer_plan(proposals, broken, peer_copies)
        if isinstance(plan, str):
            return fallback(f"{why}; {plan}")
        step, sources = plan
        survivors = [r for r in members if r not in broken]
        behind = sorted(r for r in survivors if proposals[r].committed_step > step)
        note = (
            (
                f"; rank(s) {behind} roll back to it from their own snapshot (the lost rank's newer copy was "
                "still in flight)"
            )
            if behind
            else ""
        )
        return Decision(
            round,
            Policy.PEER_RESTORE,
            step,
            f"{why}; copies at step {step} from holder(s) "
            + ", ".join(f"rank {r} <- rank {h}" for r, h in sources)
            + f"; the other {len(survivors)} rank(s) keep their state in memory{note}",
            members,
            missing,
            standby,
            sources,
            alternates=_alternates(proposals, sources, step),
        )
    steps = {p.committed_step for p in proposals.values()}
    if len(steps) != 1:
        return fallback(
            "committed steps differ: "
            + ", ".join(f"rank {r}: {p.committed_step}" for r, p in sorted(proposals.items()))
        )
    step = steps.pop()
    return Decision(
        round,
        Policy.IN_MEMORY,
        step,
        f"all {world_size} ranks alive, at generation {group_generation}, committed step {step}, state intact",
        members,
        missing,
        standby,
    )


def _peer_plan(
    proposals: dict[int, Proposal], broken: list[int], peer_copies: int
) -> tuple[int, tuple[tuple[int, int], ...]] | str:
    """The newest step held for every rank and where each broken rank takes it from, or why none is."""
    if peer_copies < 1:
        return "no peer copies are kept (peer copies: 0)"
    options: dict[int, set[int]] = {}
    for r, p in proposals.items():
        options[r] = set(p.own_steps) | ({p.committed_step} if p.intact and p.committed_step >= 0 else set())
    held: dict[int, dict[int, list[int]]] = {}  # source -> step -> holders
    for h, p in sorted(proposals.items()):
        for src, step in p.holds:
            held.setdefault(src, {}).setdefault(step, []).append(h)
    lost = []
    for r in broken:
        options[r] = options[r] | set(held.get(r, {}))
        if not options[r]:
            lost.append(r)
    if lost:
        return "; ".join(_no_copy(proposals, r, peer_copies) for r in lost)
    common = set.intersection(*options.values())
    if not common:
        return "no step is held for every rank: " + ", ".join(
            f"rank {r}: {sorted(o)}" for r, o in sorted(options.items())
        )
    step = max(common)
    sources = tuple((r, r if step in set(proposals[r].own_steps) else held[r][step][0]) for r in broken)
    return step, sources


def _no_copy(proposals: dict[int, Proposal], src: int, peer_copies: int) -> str:
    """Why no rank holds ``src``'s state, naming its holders as the copier placed them (the ring
    over the ranks now in the job, K capped at their number less one, other hosts first) and what
    became of each: a replacement process (its copies went with the process it replaced) or a
    live rank holding no copy of it (a copy that never arrived)."""
    from .peers import placement

    ranks = sorted(proposals)
    hosts = [proposals[r].host for r in ranks] if all(proposals[r].host for r in ranks) else None
    ring = placement(ranks.index(src), len(ranks), min(peer_copies, len(ranks) - 1), hosts)
    holders = [ranks[i] for i in ring]
    if not holders:
        return f"no rank holds a copy of the state of rank {src}: no other rank is left to hold one"
    gone = [h for h in holders if not proposals[h].intact and proposals[h].incarnation > 0]
    empty = [h for h in holders if h not in gone]
    if not empty:
        return f"the state of rank {src} was lost with all its holder(s) {gone}"
    why = f"no rank holds a copy of the state of rank {src}: its holder(s) {empty} are alive but hold none of it"
    refused = [
        f"rank {h} refused its copy of step {step} (it failed its digest)"
        for h in empty
        for s, step in proposals[h].refused
        if s == src
    ]
    return why + (f", and {gone} were lost with it" if gone else "") + (f"; {', '.join(refused)}" if refused else "")


def _excise_plan(
    proposals: dict[int, Proposal], lost: Sequence[int], peer_copies: int
) -> tuple[int, tuple[tuple[int, int], ...]] | str:
    """The newest step every survivor can stand at (its committed state or its own snapshot)
    for which a survivor holds a copy of each lost rank, and that holder; or why none is."""
    if peer_copies < 1:
        return "no peer copies are kept (peer copies: 0)"
    broken = sorted(r for r, p in proposals.items() if not p.intact)
    if broken:
        return f"rank(s) {broken} hold no intact state in memory"
    options = [set(p.own_steps) | ({p.committed_step} if p.committed_step >= 0 else set()) for p in proposals.values()]
    held: dict[int, dict[int, int]] = {}  # lost rank -> step -> its first holder
    for h, p in sorted(proposals.items()):
        for src, step in p.holds:
            if src in lost:
                held.setdefault(src, {}).setdefault(step, h)
    gone = [r for r in lost if r not in held]
    if gone:
        return f"no survivor holds a copy of the state of rank(s) {gone}"
    common = set.intersection(*options, *(set(held[r]) for r in lost))
    if not common:
        return (
            "no step is held for every rank: survivors "
            + ", ".join(f"rank {r}: {sorted(o)}" for r, o in zip(proposals, options))
            + "; lost "
            + ", ".join(f"rank {r}: {sorted(held[r])}" for r in lost)
        )
    step = max(common)
    return step, tuple((r, held[r][step]) for r in sorted(lost))


def _collect(
    channel: ControlChannel,
    keys: list[str],
    timeout_s: float,
    ranks: Sequence[int],
    skip: list[int] | None,
    slice_s: float = 0.25,
    quiet: bool = False,
    gone_seen: int | None = None,
) -> JsonObject:
    """The round's proposals present within ``timeout_s``. With ``skip`` given the wait is cut
    in slices, and a rank the launcher marks gone meanwhile joins ``skip`` and is no longer
    waited for (excising: it is declared lost; replacing: no replacement comes). When every
    proposal waited for is there at once (the common case) this is one round trip.

    ``gone_seen`` is the gone count ``skip`` already reflects: the gone ranks are listed (a read
    of every rank's mark) only once the count moves past it."""
    if skip is None:
        try:
            return channel.wait(keys, timeout_s)
        except ControlTimeout:
            return channel.present(keys)
    deadline = time.monotonic() + timeout_s
    seen_gone = gone_seen  # the gone count skip reflects
    # the first slice of an agreement's first round blocks in the store (the common case: answered at once);
    # the rest, waiting on a slow rank, ask without a timed-out wait's two warning lines each (wait_quietly)
    wait = channel.wait_quietly if quiet else channel.wait
    while True:
        wanted = [(k, r) for k, r in zip(keys, ranks) if r not in skip]
        left = deadline - time.monotonic()
        try:
            got = wait([k for k, _ in wanted], max(min(slice_s, left), 0.01))
            skipped = [k for k, r in zip(keys, ranks) if r in skip]
            return {**got, **channel.present(skipped)} if skipped else got
        except ControlTimeout:
            if left <= slice_s:
                return channel.present(keys)
        wait = channel.wait_quietly
        gone_now = channel.counter(GONE_COUNT_KEY)  # one round trip; the names only when the count moved
        if gone_now != seen_gone:
            seen_gone = gone_now
            skip += [r for r in gone_ranks(channel, ranks) if r not in skip]


def _decider(expected: Sequence[int], skip: Sequence[int], misses: dict[int, int]) -> int | None:
    """The rank that decides a round for everyone: the lowest one expected (``expected`` is sorted) that is
    not known gone or declared lost and answered every earlier round of this agreement."""
    return next((r for r in expected if r not in skip and not misses.get(r)), None)  # expected is sorted


def _await_decision(
    channel: ControlChannel,
    key: str,
    timeout_s: float,
    decider: int | None,
    ranks: Sequence[int],
    skip: list[int],
    slice_s: float = 0.25,
    quiet: bool = False,
    gone_seen: int | None = None,
) -> JsonObject | None:
    """The round's decision once the decider has written it; None when it has not within
    ``timeout_s`` (the proposals' own bound) or the launcher marked the decider gone meanwhile:
    then this rank decides, and the first decision written stands either way. Ranks marked
    gone meanwhile join ``skip``, as :func:`_collect` adds them, listed only once the gone count
    moves past ``gone_seen``: every waiting rank reading every rank's mark would be N² reads
    whenever a decision takes longer than the first slice."""
    if decider is None:
        return None
    deadline = time.monotonic() + timeout_s
    seen_gone = gone_seen
    wait = channel.wait_quietly if quiet else channel.wait  # as in _collect
    first = not quiet
    while True:
        left = deadline - time.monotonic()
        try:
            return wait([key], max(min(FIRST_SLICE_S if first else slice_s, left), 0.01))[key]
        except ControlTimeout:
            if left <= (FIRST_SLICE_S if first else slice_s):
                return None
        wait, first = channel.wait_quietly, False
        gone_now = channel.counter(GONE_COUNT_KEY)
        if gone_now != seen_gone:
            seen_gone = gone_now
            skip += [r for r in gone_ranks(channel, ranks) if r not in skip]
            if decider in skip:
                return None


def mark_gone(channel: ControlChannel, rank: int) -> None:
    """Say that ``rank``'s process has exited and no replacement will come (the launcher, when
    the job excises lost ranks): consensus declares it lost in its next round."""
    channel.set(f"{GONE_KEY}{rank}", True)
    channel.add(GONE_COUNT_KEY)  # after the key: a reader that sees the count finds the key


def gone_ranks(channel: ControlChannel, ranks: Sequence[int]) -> tuple[int, ...]:
    """Which of ``ranks`` the launcher marked gone (:func:`mark_gone`)."""
    got = channel.present([f"{GONE_KEY}{r}" for r in ranks])
    return tuple(sorted(int(k[len(GONE_KEY) :]) for k in got))


def open_round(channel: ControlChannel, ranks: Sequence[int]) -> int | None:
    """The round a peer has proposed in and this rank has not (None: no round is open). A rank
    meets a fault only inside a collective; one idling between steps (a long evaluation, a
    held run) learns here that its peers are recovering, instead of being waited for round
    after round and declared lost. A round trip for the counter and one per peer looked at."""
    nxt = channel.counter(ROUND_KEY) + 1
    keys = [f"round{nxt}/rank{r}" for r in ranks if r != channel.rank]
    return nxt if channel.any_present(keys) else None


def declared_lost(channel: ControlChannel, after_round: int = 0) -> dict[int, tuple[int, ...]]:
    """Ranks declared lost in rounds after ``after_round``: round -> ranks (what a launcher watches)."""
    last = channel.counter(ROUND_KEY)
    got = channel.present([f"{LOST_KEY}{k}" for k in range(after_round + 1, last + 1)])
    return {int(k[len(LOST_KEY) :]): tuple(int(r) for r in v) for k, v in got.items()}


def give_up_bound_s(timeout_s: float, max_rounds: int = 4, replacement_rounds: int = 2) -> float:
    """How long :func:`agree` runs at most: the rank-loss bound, then ``replacement_rounds``
    more rounds for a replacement (plus the channel's round trips)."""
    return (max_rounds + replacement_rounds) * timeout_s


def loss_bound_s(timeout_s: float, max_rounds: int = 4) -> float:
    """How long :func:`agree` waits on a silent rank before declaring it lost: each round waits
    at most ``timeout_s`` for the missing proposals, and an incomplete round starts the next at
    once, so ``max_rounds * timeout_s`` (plus the channel's round trips)."""
    return max_rounds * timeout_s


def agree(
    channel: ControlChannel,
    make_proposal: Callable[[int], Proposal],
    checkpoint_step: Callable[[int], int],
    timeout_s: float | None = None,
    max_rounds: int = 4,
    *,
    peer_copies: int = 0,
    on_rank_loss: Policy = Policy.PEER_RESTORE,
    replacement_rounds: int = 2,
    alive: Sequence[int] | None = None,
    excise_refusal: str | None = EXCISE_NOT_OFFERED,
    view: tuple[int, int] | None = None,
    defer_counters: bool = False,
) -> "Agreement":
    """Run rounds until the group decides with every rank present (or, excising, without the
    declared ranks). A rank missing from ``max_rounds`` rounds in a row is declared lost
    (:func:`loss_bound_s`; ``lost/round<k>`` on the channel); its replacement has
    ``replacement_rounds`` more rounds to join (its deadline, :func:`give_up_bound_s`).

    Under ``PEER_RESTORE`` a replacement that misses its deadline, or that the launcher says
    will not come (:func:`mark_gone`), is answered by excising the rank where the job can
    (``excise_refusal`` None: the caller can build the smaller world); otherwise
    :class:`ConsensusError` names the rank, the deadline and why it cannot be excised.

    Rounds are numbered on the channel (``ROUND_KEY``); only a complete decision moves the
    group's generation (``GENERATION_KEY``) to its round. An incomplete round is acted on by
    nobody, so it makes nobody stale: a rank later than the timeout finds that round decided,
    moves to the next one and joins it, and the group can still resume from memory.
    ``make_proposal(group_generation)`` builds this rank's proposal for a round.

    Off the critical path: ``view`` (the last round decided and the generation, as this rank
    last saw them) spares the first round its read of the counters; a view gone stale (rounds
    decided without this rank) gets back a decision without its proposal, and the next round
    reads the counters. ``defer_counters`` leaves the final round's two counter moves to the
    caller (:attr:`Agreement.counters`), to make once it runs again (every rank makes them,
    idempotently; the caller makes them before its next consensus).

    Excising (``on_rank_loss`` ``EXCISE``), a rank the launcher marked gone (:func:`mark_gone`:
    its process exited) is declared lost at once and not waited for; ``alive`` names the
    original ranks still in the job after earlier excisions.
    """
    timeout = channel.timeout_s if timeout_s is None else timeout_s
    world = channel.world_size
    expected = list(range(world)) if alive is None else sorted(alive)
    last: Decision | None = None
    misses: dict[int, int] = {}
    declared: list[int] = []
    gone: list[int] = []  # replacing: the ranks the launcher starts no replacement for
    excising = on_rank_loss is Policy.EXCISE
    deadline_s = replacement_rounds * timeout
    gone_seen = 0  # the gone count last read: the gone ranks are listed only when it moves

    def overdue_of(absent: list[int]) -> tuple[list[int], list[str]]:
        """Of the ranks absent from a round, those not to wait for any longer, and why."""
        # a declared rank absent once more after replacement_rounds rounds: its replacement missed the deadline
        expired = [r for r in absent if r in declared and misses.get(r, 0) + 1 >= max_rounds + replacement_rounds]
        left = [r for r in absent if r in gone]
        whys = (
            [
                f"no replacement joined within its deadline of {deadline_s:g} s ({replacement_rounds} round(s) of "
                f"{timeout:g} s after rank(s) {expired} were declared lost)"
            ]
            if expired
            else []
        )
        whys += [f"the launcher starts no replacement for rank(s) {left}"] if left else []
        return sorted(set(expired) | set(left)), whys

    for attempt in range(max_rounds + replacement_rounds + (view is not None)):
        from_view = attempt == 0 and view is not None
        if from_view:
            last_round, group_generation = view  # type: ignore[misc]  # from_view: view is not None
        else:
            # one round trip for the counters. A round decided without us (we read the counter before the
            # others advanced it) needs no check of its own: our proposal was not in its decision, which
            # set_once hands back with us missing, so we go on to the next round as every rank does
            last_round, group_generation, gone_count = channel.counters([ROUND_KEY, GENERATION_KEY, GONE_COUNT_KEY])
            if gone_count != gone_seen:
                gone_seen = gone_count
                marked = gone_ranks(channel, expected)
                if excising:
                    declared += [r for r in marked if r not in declared]
                else:
                    gone += [r for r in marked if r not in gone]
        round_ = last_round + 1
        proposal = make_proposal(group_generation)
        channel.set(f"round{round_}/rank{channel.rank}", proposal.to_dict())
        skip = declared if excising else gone
        decider = _decider(expected, skip, misses)
        t_round = time.monotonic()
        quiet = attempt > (view is not None)  # a round after the first: some rank was missing, a slow path
        stored = (
            _await_decision(
                channel, f"round{round_}/{ADOPTED}", timeout, decider, expected, skip, quiet=quiet, gone_seen=gone_seen
            )
            if decider != channel.rank
            else None
        )
        if stored is None:  # the decider, or its decision did not come: decide, the first writer's stands
            got = _collect(
                channel,
                [f"round{round_}/rank{r}" for r in expected],  # every proposal: only a rank that decides reads them
                max(timeout - (time.monotonic() - t_round), 0.01),
                expected,
                skip,
                quiet=quiet,
                gone_seen=gone_seen,
            )
            proposals = {int(k.rsplit("rank", 1)[1]): Proposal.from_dict(v) for k, v in got.items()}
            overdue, whys = overdue_of([r for r in expected if r not in proposals])
            ours = decide(
                proposals,
                world,
                group_generation,
                round_,
                checkpoint_step,
                timeout,
                peer_copies=peer_copies,
                on_rank_loss=on_rank_loss,
                declared=tuple(declared),
                alive=alive,
                overdue=overdue,
                overdue_why="; ".join(whys),
                excise_refusal=excise_refusal,
            )
            stored = channel.set_once(f"round{round_}/decision", ours.to_dict())
            if channel.rank == decider:  # the decision that stands, where the others wait for it: a key only
                channel.set(f"round{round_}/{ADOPTED}", stored)  # the decider writes, and only once it is decided
        decision = Decision.from_dict(stored)
        if decision.missing:  # another rank's decision may rest on a gone mark this rank has not read yet
            skip += [r for r in gone_ranks(channel, expected) if r not in skip]
        overdue, _ = overdue_of(list(decision.missing))
        if from_view and channel.rank not in decision.members:
            continue  # the view was stale: that round was decided without this rank; read the counters
        final = not decision.missing or decision.policy is Policy.EXCISE
        if final:
            counters = CounterMoves(round_, group_generation)
            if defer_counters:
                return Agreement(decision, counters)
            counters.make(channel)
            return Agreement(decision, None)
        channel.advance(ROUND_KEY, round_)
        last = decision
        if not excising and overdue and set(decision.missing) <= set(overdue):  # nothing more to wait for
            raise ConsensusError(
                f"rank(s) {list(decision.missing)} declared lost, no replacement comes, and the job "
                f"cannot go on without them: {decision.reason}"
            )
        misses = {r: misses.get(r, 0) + 1 for r in decision.missing}  # in a row: a rank that answered starts over
        newly = [r for r in decision.missing if misses[r] >= max_rounds and r not in declared]
        if newly:
            declared += newly
            channel.set_once(f"{LOST_KEY}{round_}", newly)
    lost = [r for r in (last.missing if last else ()) if r in declared]
    if lost:
        raise ConsensusError(
            f"rank(s) {lost} declared lost after {max_rounds} round(s) of {timeout:.2f} s and no "
            f"replacement joined within {replacement_rounds} more; {last.reason if last else ''}"
        )
    raise ConsensusError(
        f"rank(s) {list(last.missing) if last else '?'} declared lost: no complete decision "
        f"after {max_rounds + replacement_rounds} round(s) of {timeout:.2f} s; "
        f"{last.reason if last else 'no round was decided'}"
    )
