"""A replacement that never comes: the survivors excise the lost rank where they can, else stop saying why.

The decisions are pure (``decide``); the rounds run on a real control channel (threads, a
rank that never answers); the launcher's budget of replacements is a real launch; and one
live trial under ``--on-rank-loss replace`` whose launcher starts no replacement and says
nothing ends in a world of three, bitwise equal to the excising reference, the decision
naming the deadline the replacement missed.
"""

from __future__ import annotations

import threading
import time

import pytest

from _warm import shared_forkserver
from meshpact.core.recovery import Policy
from meshpact.live.launch.agentjob import AgentJob
from meshpact.live.launch.launcher import host_store
from meshpact.live.recovery.consensus import (
    EXCISE_NOT_OFFERED,
    GONE_KEY,
    ConsensusError,
    Decision,
    Proposal,
    agree,
    decide,
    gone_ranks,
    mark_gone,
)
from meshpact.live.recovery.control import ControlChannel
from meshpact.live.recovery.jobkey import draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with


def _p(rank: int, step: int = 7, holds=(), own=(6, 7)) -> Proposal:
    return Proposal(rank, 2, step, f"d{rank}", True, holds=tuple(holds), own_steps=tuple(own))


def _latest(limit: int) -> int:
    return (limit // 5) * 5


PROPS = {0: _p(0), 1: _p(1), 3: _p(3, holds=[(2, 7)])}  # rank 2 is gone; rank 3 holds its copy


def test_an_overdue_replacement_is_excised_with_the_deadline_in_the_reason():
    d = decide(
        PROPS,
        4,
        2,
        9,
        _latest,
        peer_copies=1,
        declared=(2,),
        overdue=(2,),
        overdue_why="no replacement joined within its deadline of 6 s",
        excise_refusal=None,
    )
    assert (d.policy, d.lost, d.step, d.restore_from, d.members) == (Policy.EXCISE, (2,), 7, ((2, 3),), (0, 1, 3))
    assert "deadline of 6 s" in d.reason and "survivors excise" in d.reason
    assert Decision.from_dict(d.to_dict()) == d


@pytest.mark.parametrize(
    "case, props, copies, refusal, why",
    [
        ("not offered", PROPS, 1, EXCISE_NOT_OFFERED, "cannot excise instead: the job offers no excision"),
        ("2-D mesh", PROPS, 1, "excision re-shards a 1-D FSDP mesh only", "1-D FSDP mesh only"),
        ("no holder", {0: _p(0), 1: _p(1), 3: _p(3)}, 1, None, "no survivor holds a copy of the state of rank(s) [2]"),
        ("no copies", PROPS, 0, None, "no peer copies are kept"),
    ],
)
def test_an_overdue_replacement_that_cannot_be_excised_falls_back_saying_why(case, props, copies, refusal, why):
    d = decide(
        props,
        4,
        2,
        9,
        _latest,
        peer_copies=copies,
        declared=(2,),
        overdue=(2,),
        overdue_why="late",
        excise_refusal=refusal,
    )
    assert d.policy is Policy.CHECKPOINT_RESTORE and d.missing == (2,) and why in d.reason, (case, d.reason)


def test_a_missing_rank_not_yet_overdue_is_waited_for_and_a_partly_overdue_round_is_not_excised():
    still = decide(PROPS, 4, 2, 9, _latest, peer_copies=1, declared=(2,), excise_refusal=None)
    assert still.policy is Policy.CHECKPOINT_RESTORE and "did not answer" in still.reason
    two = {0: _p(0), 3: _p(3, holds=[(2, 7), (1, 7)])}  # ranks 1 and 2 missing, only 2 overdue
    partly = decide(two, 4, 2, 9, _latest, peer_copies=1, declared=(1, 2), overdue=(2,), excise_refusal=None)
    assert partly.policy is Policy.CHECKPOINT_RESTORE and partly.lost == ()


def _rounds(
    world: int, silent: int, timeout_s: float, *, refusal: str | None, mark: bool, holder_has_copy: bool = True
) -> tuple[dict[int, object], float]:
    """Every rank but ``silent`` runs agree under PEER_RESTORE; the silent rank's copy is held
    by the rank after it; with ``mark`` the launcher marks it gone after 0.3 s."""
    server = host_store("127.0.0.1", 0, world)
    chans = [ControlChannel("127.0.0.1", server.port, r, world, timeout_s=timeout_s, key=KEY) for r in range(world)]
    holder = (silent + 1) % world
    out: dict[int, object] = {}

    def one(ch: ControlChannel) -> None:
        held = ((silent, 5),) if ch.rank == holder and holder_has_copy else ()
        try:
            out[ch.rank] = agree(
                ch,
                lambda g: Proposal(ch.rank, g, 5, "x", True, holds=held, own_steps=(5,)),
                _latest,
                max_rounds=1,
                replacement_rounds=2,
                peer_copies=1,
                excise_refusal=refusal,
            ).decision
        except Exception as exc:  # noqa: BLE001
            out[ch.rank] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(chans[r],)) for r in range(world) if r != silent]
    for t in threads:
        t.start()
    if mark:
        time.sleep(0.3)
        mark_gone(chans[silent], silent)
    for t in threads:
        t.join(60)
    return out, time.monotonic() - t0


def test_rounds_excise_a_rank_whose_replacement_missed_its_deadline():
    out, elapsed = _rounds(3, 1, 1.0, refusal=None, mark=False)
    assert all(isinstance(d, Decision) for d in out.values()), out
    assert {(d.policy, d.lost, d.restore_from) for d in out.values()} == {(Policy.EXCISE, (1,), ((1, 2),))}
    (reason,) = {d.reason for d in out.values()}
    assert "no replacement joined within its deadline of 2 s" in reason
    assert 3.0 <= elapsed < 12.0, elapsed  # declared after one round, then two more: three rounds of 1 s


def test_rounds_excise_at_once_a_rank_the_launcher_says_gets_no_replacement():
    out, elapsed = _rounds(4, 3, 20.0, refusal=None, mark=True)
    assert all(isinstance(d, Decision) for d in out.values()), out
    (d,) = {(d.policy, d.lost) for d in out.values()}
    assert d == (Policy.EXCISE, (3,))
    assert all("launcher starts no replacement for rank(s) [3]" in x.reason for x in out.values())
    assert elapsed < 10.0, elapsed  # inside one 20 s round: nothing to wait for


def test_a_gone_decider_is_not_waited_for():
    """Rank 0 decides rounds for everyone; when the launcher marks it gone the others decide
    the round themselves at once, not at the round's 20 s timeout."""
    out, elapsed = _rounds(3, 0, 20.0, refusal=None, mark=True)
    assert all(isinstance(d, Decision) for d in out.values()), out
    assert {(d.policy, d.lost) for d in out.values()} == {(Policy.EXCISE, (0,))}
    assert elapsed < 10.0, elapsed


def test_rounds_that_cannot_excise_end_with_a_consensus_error_naming_both_reasons():
    out, elapsed = _rounds(3, 2, 20.0, refusal="excision re-shards a 1-D FSDP mesh only", mark=True)
    assert all(isinstance(e, ConsensusError) for e in out.values()), out
    for e in out.values():
        assert "launcher starts no replacement for rank(s) [2]" in str(e) and "1-D FSDP mesh only" in str(e)
    assert elapsed < 10.0, elapsed  # not the whole replacement bound: nothing more could come


@pytest.mark.live
@pytest.mark.slow
def test_the_launcher_starts_at_most_its_replacements_then_announces_the_rank_gone():
    """Ranks 1 and 2 die at start; the agent has one replacement: whichever death it sees first gets
    it, the other rank is announced gone on the job's control channel."""
    control = host_store("127.0.0.1", 0, 3)
    replaced: list[int] = []
    gone: list[int] = []
    with AgentJob(
        "meshpact.live.launch.launcher:echo",
        3,
        {"fail_ranks": [1, 2], "timeout_s": 30},
        timeout_s=90,
        max_replacements=1,
        control=("127.0.0.1", control.port),
        run_id="budget",
        forkserver=shared_forkserver(),
        on_replaced=lambda rank, rc, warm: replaced.append(rank),
        on_gone=lambda rank, rc: gone.append(rank),
    ) as job:
        ran = job.run()
    assert sorted(replaced + gone) == [1, 2] and len(replaced) == 1 and ran.replacements == 1
    (got,), (none,) = replaced, gone
    assert [(r.rank, r.incarnation, r.returncode) for r in ran.results] == sorted(
        [(0, 0, 0), (got, 1, 0), (none, 0, 3)]
    )
    channel = ControlChannel("127.0.0.1", control.port, 0, 3, 5.0, run_id="budget", key=job.job_key)
    channel.wait([f"{GONE_KEY}{none}"], 5.0)  # a store's set is not answered: the agent's write is waited for
    assert gone_ranks(channel, [0, 1, 2]) == (none,)  # the survivors learn it at once (see the rounds above)


@pytest.mark.live
@pytest.mark.slow
def test_a_replacement_that_never_arrives_is_excised_at_its_deadline_bitwise_equal_to_the_excising_reference(tmp_path):
    from meshpact.core.recording import EventKind, read_recording
    from meshpact.live.trials.trial import TrialConfig, run_trial

    cfg = TrialConfig(
        ranks=4,
        steps=8,
        checkpoint_every=4,
        faults=1,
        fault_kind="kill",
        peer_copies=1,
        baselines=False,
        max_rounds=1,
        process_start_s=3.0,
        group_create_s=3.0,
    )
    result = run_trial(cfg, work_dir=tmp_path, replacements=0, announce_missing=False, forkserver=shared_forkserver())
    s = result.summary()
    assert s["bit_identical"], s["mismatches"]
    assert s["final_world_size"] == 3 and s["replacement_processes"] == 0 and s["storage_bytes_read"] == 0
    assert s["policy_counts"]["excise"] == 1 and s["faults_recovered"] == 1
    exc = s["excision"]
    (killed,) = [f.rank for f in result.faults]
    assert exc["equal_to_excising_reference"] and [e["lost"] for e in exc["excisions"]] == [[killed]]
    (rec,) = [r for r in result.recoveries() if r["policy"] == "excise"]
    deadline = cfg.recovery().replacement_rounds * cfg.recovery().consensus_round_s
    assert f"no replacement joined within its deadline of {deadline:g} s" in rec["reason"], rec["reason"]
    missed = [
        e
        for e in read_recording(s["recording"])
        if e.event == EventKind.REPLACEMENT_STARTED and e.data.get("started") is False
    ]
    assert [e.rank for e in missed] == [killed] and missed[0].data["announced"] is False
