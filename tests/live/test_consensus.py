"""Consensus refuses to resume from memory unless every rank is present, current and agrees."""

from __future__ import annotations

import threading
import time

import pytest

from meshpact.core.recovery import Policy
from meshpact.live.recovery.consensus import (
    ConsensusError,
    Decision,
    Proposal,
    agree,
    decide,
    loss_bound_s,
    mark_gone,
)
from meshpact.live.recovery.control import ControlChannel, ControlTimeout
from meshpact.live.launch.launcher import host_store
from meshpact.live.recovery.jobkey import draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with


def _p(rank: int, step: int = 7, gen: int = 2, intact: bool = True, **kw) -> Proposal:
    return Proposal(rank, gen, step, f"digest{rank}", intact, **kw)


def _latest(limit: int) -> int:
    return (limit // 5) * 5  # checkpoints every 5 steps


def test_all_present_current_and_agreeing_resume_in_memory():
    d = decide({r: _p(r) for r in range(4)}, 4, group_generation=2, round=3, checkpoint_step=_latest)
    assert d.policy is Policy.IN_MEMORY and d.step == 7 and d.round == 3 and not d.missing


def test_mismatched_committed_steps_fall_back_to_the_checkpoint_before_the_oldest():
    props = {0: _p(0, 7), 1: _p(1, 8), 2: _p(2, 7), 3: _p(3, 7)}
    d = decide(props, 4, 2, 3, _latest)
    assert d.policy is Policy.CHECKPOINT_RESTORE
    assert "committed steps differ" in d.reason and "rank 1: 8" in d.reason
    assert d.step == 5


def test_a_rank_that_never_answers_is_named_and_nobody_resumes_from_memory():
    d = decide({0: _p(0), 1: _p(1), 3: _p(3)}, 4, 2, 3, _latest, timeout_s=0.25)
    assert d.policy is Policy.CHECKPOINT_RESTORE and d.missing == (2,)
    assert "[2] did not answer" in d.reason and "0.25 s" in d.reason


def test_a_stale_generation_is_refused():
    props = {r: _p(r) for r in range(4)}
    props[1] = _p(1, gen=1)
    d = decide(props, 4, 2, 3, _latest)
    assert d.policy is Policy.CHECKPOINT_RESTORE and "stale generation" in d.reason and "{1: 1}" in d.reason


def test_a_replacement_without_state_forces_a_checkpoint_restore():
    props = {r: _p(r) for r in range(4)}
    props[3] = Proposal(3, 2, -1, "", False, incarnation=1)
    d = decide(props, 4, 2, 3, _latest)
    assert d.policy is Policy.CHECKPOINT_RESTORE and "[3] hold no intact state" in d.reason and d.step == 5


def test_decision_round_trips_through_json():
    d = decide({0: _p(0), 1: _p(1)}, 2, 2, 3, _latest)
    assert Decision.from_dict(d.to_dict()) == d


@pytest.fixture()
def channels():
    server = host_store("127.0.0.1", 0, 4)
    made = [ControlChannel("127.0.0.1", server.port, r, 3, timeout_s=2.0, key=KEY) for r in range(3)]
    yield made
    del server


def _each_in_a_thread(fn, channels) -> None:  # noqa: ANN001
    """Run ``fn(channel)`` for every channel at once, a thread each, as the ranks of one job would."""
    threads = [threading.Thread(target=fn, args=(ch,)) for ch in channels]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _agree_all(channels, proposals, **kw):
    out: dict[int, object] = {}

    def one(ch):
        try:
            out[ch.rank] = agree(ch, lambda g, r=ch.rank: proposals[r](g), _latest, **kw).decision
        except Exception as exc:  # noqa: BLE001
            out[ch.rank] = exc

    _each_in_a_thread(one, channels)
    return out


def test_every_rank_adopts_one_decision_over_the_control_channel(channels):
    out = _agree_all(channels, {r: (lambda g, r=r: Proposal(r, g, 4, "x", True)) for r in range(3)})
    decisions = list(out.values())
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert len({(d.round, d.policy, d.step) for d in decisions}) == 1
    assert decisions[0].policy is Policy.IN_MEMORY and decisions[0].round == 1


def test_a_silent_rank_is_declared_lost_within_the_documented_bound(channels):
    t0 = time.monotonic()
    out = _agree_all(
        channels[:2], {r: (lambda g, r=r: Proposal(r, g, 4, "x", True)) for r in range(2)}, timeout_s=0.3, max_rounds=2
    )
    elapsed = time.monotonic() - t0
    assert all(
        isinstance(e, ConsensusError) and "[2] declared lost" in str(e) and "[2] did not answer" in str(e)
        for e in out.values()
    ), out
    assert elapsed >= loss_bound_s(0.3, 2)  # it did wait for the silent rank, every round
    assert elapsed < loss_bound_s(0.3, 2) + 20  # and no longer than the bound plus the channel's round trips


def _agree_with_rank_2_late(channels, delay_s: float, **kw) -> dict[int, object]:
    """Every rank agrees (rounds of 1 s) with its state at generation 0, as the runtime
    proposes it; rank 2 starts ``delay_s`` late."""
    out: dict[int, object] = {}

    def one(ch):
        time.sleep(delay_s if ch.rank == 2 else 0.0)
        try:
            out[ch.rank] = agree(
                ch, lambda g, r=ch.rank: Proposal(r, 0, 4, "x", True), _latest, timeout_s=1.0, max_rounds=4, **kw
            ).decision
        except Exception as exc:  # noqa: BLE001
            out[ch.rank] = exc

    _each_in_a_thread(one, channels)
    return out


def test_a_rank_later_than_the_timeout_joins_the_next_round_and_the_group_resumes_in_memory(channels):
    """The first round is decided without the late rank; nobody acted on it, so in the next
    round nobody is stale: every rank resumes from memory at the same step."""
    decisions = list(_agree_with_rank_2_late(channels, 2.0).values())
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert {(d.round, d.policy, d.step) for d in decisions} == {(decisions[0].round, Policy.IN_MEMORY, 4)}
    assert decisions[0].round >= 2  # round 1 was decided without rank 2 and acted on by nobody
    first = Decision.from_dict(channels[0].get("round1/decision"))
    assert first.missing == (2,) and first.policy is Policy.CHECKPOINT_RESTORE


class _Counting:
    """A control channel that counts which keys this rank wrote once (``set_once``)."""

    def __init__(self, channel: ControlChannel) -> None:
        self._ch = channel
        self.wrote: list[str] = []

    def set_once(self, key, value):
        self.wrote.append(key)
        return self._ch.set_once(key, value)

    def __getattr__(self, name):
        return getattr(self._ch, name)


def test_one_rank_decides_a_complete_round_and_the_others_adopt_its_decision(channels):
    """The lowest rank decides for everyone (the others wait for its decision, not for every
    proposal), so only it writes the decision; every rank acts on the same one."""
    counted = [_Counting(ch) for ch in channels]
    out: dict[int, object] = {}

    def one(ch):
        out[ch.rank] = agree(ch, lambda g, r=ch.rank: Proposal(r, 0, 4, "x", True), _latest, timeout_s=5.0).decision

    _each_in_a_thread(one, counted)
    assert {(d.round, d.policy, d.step, d.members) for d in out.values()} == {(1, Policy.IN_MEMORY, 4, (0, 1, 2))}
    assert [c.wrote for c in counted] == [["round1/decision"], [], []]


def test_a_silent_decider_costs_the_others_one_round_then_the_next_rank_decides(channels):
    """Rank 0 (the decider) starts later than the round's timeout: the others decide that round
    themselves without it, the next round's decider is rank 1, and once rank 0 joins every rank
    resumes from memory at the same step."""
    counted = [_Counting(ch) for ch in channels]
    out: dict[int, object] = {}

    def one(ch):
        time.sleep(1.6 if ch.rank == 0 else 0.0)
        out[ch.rank] = agree(
            ch, lambda g, r=ch.rank: Proposal(r, 0, 4, "x", True), _latest, timeout_s=1.0, max_rounds=4
        ).decision

    _each_in_a_thread(one, counted)
    decisions = list(out.values())
    assert len(decisions) == 3 and all(isinstance(d, Decision) for d in decisions), out
    assert {(d.round, d.policy, d.step) for d in decisions} == {(decisions[0].round, Policy.IN_MEMORY, 4)}
    first = Decision.from_dict(channels[1].get("round1/decision"))
    assert first.missing == (0,)
    assert "round2/decision" in counted[1].wrote and "round2/decision" not in counted[2].wrote


class _MarksRead(_Counting):
    """A control channel that also counts its reads of the ranks' gone marks (a read of every rank's key)."""

    def __init__(self, channel: ControlChannel) -> None:
        super().__init__(channel)
        self.mark_reads = 0

    def present(self, keys):
        self.mark_reads += any(k.startswith("gone/rank") for k in keys)
        return self._ch.present(keys)


def test_a_slow_decision_costs_the_waiting_ranks_no_read_of_every_ranks_gone_mark(channels):
    """The decider proposes 1.3 s late, past the others' first slice of waiting: they look whether the
    gone count moved (one counter), and read the ranks' gone marks only if it did. Every waiting rank
    reading every rank's mark would be N² reads at once on a large job whenever a decision is slow."""
    counted = [_MarksRead(ch) for ch in channels]
    out: dict[int, object] = {}

    def one(ch):
        time.sleep(1.3 if ch.rank == 0 else 0.0)
        out[ch.rank] = agree(ch, lambda g, r=ch.rank: Proposal(r, 0, 4, "x", True), _latest, timeout_s=5.0).decision

    _each_in_a_thread(one, counted)
    assert {(d.round, d.policy) for d in out.values()} == {(1, Policy.IN_MEMORY)} and len(out) == 3, out
    assert [c.mark_reads for c in counted] == [0, 0, 0]
    mark_gone(counted[2]._ch, 2)  # once a rank is marked gone, a slow round's waiters do read the marks
    out.clear()

    def two(ch):
        time.sleep(1.3 if ch.rank == 0 else 0.0)
        try:
            agree(ch, lambda g, r=ch.rank: Proposal(r, g, 4, "x", True), _latest, timeout_s=5.0, view=(1, 1))
        except ConsensusError as exc:  # rank 2 gone, no replacement and no excision offered
            out[ch.rank] = exc

    _each_in_a_thread(two, counted[:2])
    assert sorted(out) == [0, 1] and all("[2]" in str(e) for e in out.values()), out
    assert counted[1].mark_reads >= 1


def test_a_rank_that_dies_after_proposing_still_counts_as_answered_in_that_round():
    """Its proposal is on the channel, so the round is complete; the rank's death is then met
    on the data path when the group is built, which bounds it by the connect timeout."""
    d = decide({r: _p(r) for r in range(3)}, 3, 2, 3, _latest)
    assert d.policy is Policy.IN_MEMORY and d.members == (0, 1, 2)


def test_the_first_written_decision_wins_no_split_brain(channels):
    a, b = channels[0], channels[1]
    full = Decision(5, Policy.IN_MEMORY, 9, "all present")
    partial = Decision(5, Policy.CHECKPOINT_RESTORE, 5, "rank 2 silent", missing=(2,))
    first = Decision.from_dict(a.set_once("round5/decision", partial.to_dict()))
    second = Decision.from_dict(b.set_once("round5/decision", full.to_dict()))
    assert first == second == partial


def test_control_wait_names_the_missing_keys_within_its_bound_and_keeps_the_channel_timeout(channels):
    import time

    channels[0].set("k0", 1)
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout) as err:
        channels[0].wait(["k0", "k1"], timeout_s=0.2)
    assert err.value.missing == ["k1"]
    assert 0.15 < time.monotonic() - t0 < 5.0  # the wait's own bound, not the channel's
    channels[1].set("k1", [2, "x"])
    assert channels[0].wait(["k0", "k1"], timeout_s=0.2) == {"k0": 1, "k1": [2, "x"]}
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout):
        channels[0].wait(["k9"])  # no bound given: the channel's own
    assert time.monotonic() - t0 >= channels[0].timeout_s * 0.75
    # peek never waits: every value when all exist, else nothing
    t0 = time.monotonic()
    assert channels[2].peek(["k0", "k1"]) == [1, [2, "x"]]
    assert channels[2].peek(["k0", "k8"]) == [None, None]
    assert time.monotonic() - t0 < 1.0


def test_a_silent_rank_is_declared_lost_then_its_replacement_joins_and_is_restored_from_its_peer(channels):
    """The loss path without processes: rank 2 never answers; after max_rounds rounds it is
    declared on the channel (what the launcher watches), a replacement then proposes, and the
    group decides a peer restore from rank 2's holder (rank 0, the next in the ring)."""
    from meshpact.live.recovery.consensus import declared_lost

    out: dict[int, object] = {}

    def one(ch, make):
        try:
            out[ch.rank] = agree(
                ch, make, _latest, timeout_s=0.4, max_rounds=1, peer_copies=1, replacement_rounds=4
            ).decision
        except Exception as exc:  # noqa: BLE001
            out[ch.rank] = exc

    survivors = [
        threading.Thread(
            target=one,
            args=(
                channels[r],
                lambda g, r=r: Proposal(r, g, 4, "x", True, holds=((2, 4),) if r == 0 else (), own_steps=(3, 4)),
            ),
        )
        for r in (0, 1)
    ]
    t0 = time.monotonic()
    for t in survivors:
        t.start()
    declared: dict[int, tuple[int, ...]] = {}
    while not declared and time.monotonic() - t0 < 10:
        declared = declared_lost(channels[2])
        time.sleep(0.05)
    t_declared = time.monotonic() - t0
    replacement = threading.Thread(target=one, args=(channels[2], lambda g: Proposal(2, g, -1, "", False, 1)))
    replacement.start()
    for t in (*survivors, replacement):
        t.join(30)
    assert list(declared.values()) == [(2,)]
    assert loss_bound_s(0.4, 1) <= t_declared < loss_bound_s(0.4, 1) + 5
    decisions = list(out.values())
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert {(d.round, d.policy, d.step, d.restore_from) for d in decisions} == {
        (decisions[0].round, Policy.PEER_RESTORE, 4, ((2, 0),))
    }


def test_a_proposal_survives_a_trip_through_json_with_every_field():
    import json
    from dataclasses import fields

    p = Proposal(
        3,
        2,
        17,
        "ab12",
        False,
        incarnation=1,
        restore_before=9,
        holds=((0, 16), (2, 17)),
        own_steps=(16, 17),
        host="hostB",
        standby={"generation": 3, "ready": True, "reason": ""},
        block=2,
    )
    d = p.to_dict()
    assert set(d) == {f.name for f in fields(Proposal)}  # a field added later must be carried too
    assert Proposal.from_dict(json.loads(json.dumps(d))) == p


def test_a_rank_with_a_current_view_skips_the_counters_and_the_moves_wait_for_the_caller(channels):
    """With every rank's view current the round is the next one; with the counter moves
    deferred the counters move only when each rank makes the moves agree() handed back, and
    making them twice (every rank does) moves them once."""
    channels[0].counters(["round", "generation"])  # made at 0, as every session makes them at its start
    out = _agree_all(channels, {r: (lambda g, r=r: Proposal(r, g, 4, "x", True)) for r in range(3)}, view=(0, 0))
    assert {d.round for d in out.values()} == {1}
    assert channels[0].counters(["round", "generation"]) == [1, 1]

    got = {}

    def one(ch):
        got[ch.rank] = agree(
            ch, lambda g, r=ch.rank: Proposal(r, g, 5, "x", True), _latest, view=(1, 1), defer_counters=True
        )

    _each_in_a_thread(one, channels)
    assert {(a.decision.round, a.decision.policy, a.decision.step) for a in got.values()} == {(2, Policy.IN_MEMORY, 5)}
    assert channels[0].counters(["round", "generation"]) == [1, 1]  # nobody has made the moves yet
    for r in (2, 0, 1):
        moves = got[r].counters
        assert moves is not None and (moves.round, moves.from_generation) == (2, 1)
        moves.make(channels[r])
    assert channels[1].counters(["round", "generation"]) == [2, 2]


def test_a_rank_whose_view_went_stale_reads_the_counters_and_joins_the_round_under_way(channels):
    """Rank 2 missed round 1 (decided without it: it was late) and still holds the view from
    before it; its post into round 1 comes back without its proposal, so it reads the counters
    and joins round 2 with the others, and nobody resumes from a round it was not in."""
    channels[0].counters(["round", "generation"])  # made at 0, as every session makes them at its start
    decisions = list(_agree_with_rank_2_late(channels, 1.5, view=(0, 0)).values())
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert {(d.round, d.policy, d.step) for d in decisions} == {(2, Policy.IN_MEMORY, 4)}
    assert all(2 in d.members for d in decisions)
    assert Decision.from_dict(channels[0].get("round1/decision")).missing == (2,)


def test_a_round_a_peer_opened_is_seen_by_a_rank_between_steps_and_not_its_own(channels):
    """open_round is how an idle rank learns its peers are recovering: nothing open at first;
    a rank's own proposal opens nothing for itself; a peer's does, at the round after the last
    decided one, and the next round is what is looked at once that one is decided."""
    from meshpact.live.recovery.consensus import ROUND_KEY, open_round

    a, b, _ = channels
    assert open_round(a, [0, 1, 2]) is None and open_round(b, [0, 1, 2]) is None
    b.set("round1/rank1", Proposal(1, 0, -1, "", False, 1).to_dict())  # a replacement proposing
    assert open_round(a, [0, 1, 2]) == 1
    assert open_round(b, [0, 1, 2]) is None  # its own proposal
    assert open_round(a, [0, 2]) is None  # rank 1 not a member (excised): its keys are not looked at
    a.advance(ROUND_KEY, 1)  # round 1 decided
    assert open_round(a, [0, 1, 2]) is None
    b.set("round2/rank1", Proposal(1, 1, 3, "x", True).to_dict())
    assert open_round(a, [0, 1, 2]) == 2


def test_a_round_missing_ranks_with_no_checkpoint_yet_is_decided_not_raised():
    """Before the first checkpoint a round still missing ranks is decided (and not acted on:
    agree goes to the next round); its step says no checkpoint exists and its reason names why."""

    def none_yet(limit: int) -> int:
        raise FileNotFoundError(f"no complete checkpoint at or before step {limit}")

    d = decide({2: Proposal(2, 0, -1, "", False, 1)}, 4, 0, 1, none_yet, timeout_s=30.0)
    assert d.policy is Policy.CHECKPOINT_RESTORE and d.missing == (0, 1, 3) and d.step == -1
    assert "did not answer" in d.reason and "no checkpoint to restore" in d.reason


@pytest.mark.parametrize("world", [8, 4096])
def test_a_decision_on_the_channel_does_not_grow_with_the_job(world):
    """Every rank reads the decision: carrying every proposal made it the job's size at every
    rank (the job's size squared through one store). It names what changed instead."""
    import json

    ready = {"generation": 3, "ready": True, "reason": ""}
    proposals = {r: Proposal(r, 2, 9, f"digest{r}", True, standby=ready) for r in range(world)}
    proposals[5] = Proposal(5, 2, 9, "digest5", True, standby={"generation": 3, "ready": False, "reason": "late"})
    d = decide(proposals, world, 2, 3, lambda limit: 0)
    wire = json.dumps(d.to_dict())
    assert len(wire) < 600
    back = Decision.from_dict(json.loads(wire))
    assert back == d and back.members == tuple(range(world))
    assert back.standby_words()[5]["reason"] == "late" and back.standby_words()[4] == ready


@pytest.mark.parametrize("first_refusing", [0, 5, 4095])
def test_a_decision_stays_small_when_every_ranks_standby_word_differs(first_refusing):
    """A data path silent on every rank: each rank's word names itself and how long it waited,
    so no two are alike. The decision carries what the standby verdict reads (every rank's word
    up to the first that refuses), and every rank's verdict is the one all words would give."""
    import json

    from meshpact.live.recovery import communicator as comm

    world, ready = 4096, {"generation": 3, "ready": True, "reason": ""}
    words = {
        r: ready
        if r < first_refusing
        else {"generation": 3, "ready": False, "reason": f"rank {r}'s data path was silent for {1 + r / 1e4:.4f} s"}
        for r in range(world)
    }
    proposals = {r: Proposal(r, 2, 9, f"digest{r}", True, standby=words[r]) for r in range(world)}
    d = decide(proposals, world, 2, 3, lambda limit: 0)
    wire = json.dumps(d.to_dict())
    assert len(wire) < 800, len(wire)
    back = Decision.from_dict(json.loads(wire))

    def verdict(said: dict) -> str:
        return comm.standby_refusal(
            {r: comm.StandbyStatus.from_dict(w) if isinstance(w, dict) else None for r, w in said.items()},
            back.generation,
            world,
        )

    assert verdict(back.standby_words()) == verdict(words) == words[first_refusing]["reason"]
    assert set(back.standby_words()) == set(range(world))


def test_rank_runs_round_trip_any_set_of_ranks():
    from meshpact.live.recovery.consensus import from_runs, rank_runs

    for ranks in ((), (4,), (0, 1, 2, 7, 9, 10), tuple(range(0, 50, 2))):
        assert from_runs(rank_runs(ranks)) == tuple(sorted(ranks))
    assert rank_runs(range(4096)) == [[0, 4095]]


def test_a_peer_restore_names_every_other_holder_of_the_lost_ranks_copy_on_the_wire():
    """A copy refused at the named holder (its digest fails) falls back to the next holder: the
    decision every rank reads carries them, though it no longer carries the proposals."""
    import json

    from meshpact.live.recovery.pipeline import holders_in_order

    proposals = {
        0: Proposal(0, 1, 6, "a", True, holds=((2, 6), (3, 6))),
        1: Proposal(1, 1, 6, "b", True, holds=((2, 6),)),
        2: Proposal(2, 1, -1, "", False, incarnation=1),
        3: Proposal(3, 1, 6, "d", True, holds=((2, 6), (2, 5))),
    }
    d = Decision.from_dict(json.loads(json.dumps(decide(proposals, 4, 1, 2, lambda limit: 0, peer_copies=2).to_dict())))
    assert d.policy is Policy.PEER_RESTORE and d.step == 6
    named = d.holder_of(2)
    assert holders_in_order(d, 2, 6)[0] == named
    assert sorted(holders_in_order(d, 2, 6)) == [0, 1, 3]
    assert holders_in_order(d, 2, 5) == (named,)  # another step's copies are not this decision's
