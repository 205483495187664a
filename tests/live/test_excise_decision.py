"""Consensus deciding an excision: the lost ranks, the step, the holders, and the refusals."""

from __future__ import annotations

import threading
import time

import pytest

from meshpact.core.recovery import Policy
from meshpact.live.launch.launcher import host_store
from meshpact.live.recovery.consensus import Decision, Proposal, agree, decide, mark_gone
from meshpact.live.recovery.control import ControlChannel
from meshpact.live.recovery.jobkey import draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with


def _p(rank: int, step: int = 7, holds=(), own=(6, 7), intact: bool = True) -> Proposal:
    return Proposal(rank, 2, step, f"d{rank}", intact, holds=tuple(holds), own_steps=tuple(own))


def _latest(limit: int) -> int:
    return (limit // 5) * 5


def test_excise_asked_names_the_lost_ranks_the_step_and_their_holders():
    props = {0: _p(0, holds=[(3, 7)]), 1: _p(1), 2: _p(2, holds=[(1, 6)])}
    d = decide(props, 4, 2, 5, _latest, peer_copies=1, on_rank_loss=Policy.EXCISE, declared=(3,))
    assert d.policy is Policy.EXCISE and d.lost == (3,) and d.step == 7
    assert d.restore_from == ((3, 0),) and "excise" in d.reason and "rank 3 <- rank 0" in d.reason
    assert Decision.from_dict(d.to_dict()) == d


def test_excise_rolls_back_to_the_step_the_lost_copy_was_complete_at():
    """Rank 3's copy of step 7 was in flight when it died: the group excises at 6, from snapshots."""
    props = {0: _p(0, holds=[(3, 6)]), 1: _p(1), 2: _p(2)}
    d = decide(props, 4, 2, 5, _latest, peer_copies=1, on_rank_loss=Policy.EXCISE, declared=(3,))
    assert (d.policy, d.step, d.lost) == (Policy.EXCISE, 6, (3,)) and "roll back" in d.reason


def test_excise_after_an_earlier_excision_expects_only_the_ranks_still_alive():
    """Rank 1 left before; rank 3 is lost now; the survivors 0 and 2 excise it."""
    props = {0: _p(0, holds=[(3, 7)]), 2: _p(2)}
    d = decide(props, 4, 2, 5, _latest, peer_copies=1, on_rank_loss=Policy.EXCISE, declared=(3,), alive=(0, 2, 3))
    assert (d.policy, d.lost, d.missing, d.members) == (Policy.EXCISE, (3,), (3,), (0, 2))
    everyone = decide({0: _p(0), 2: _p(2)}, 4, 2, 5, _latest, alive=(0, 2))
    assert everyone.policy is Policy.IN_MEMORY and everyone.missing == ()


@pytest.mark.parametrize(
    "case, props, copies, declared, why",
    [
        ("no holder", {0: _p(0), 1: _p(1), 2: _p(2)}, 1, (3,), "no survivor holds a copy of the state of rank(s) [3]"),
        ("no copies", {0: _p(0, holds=[(3, 7)]), 1: _p(1), 2: _p(2)}, 0, (3,), "no peer copies"),
        ("not yet declared", {0: _p(0, holds=[(3, 7)]), 1: _p(1), 2: _p(2)}, 1, (), "did not answer"),
    ],
)
def test_excise_is_refused_with_the_reason_and_falls_back(case, props, copies, declared, why):
    d = decide(props, 4, 2, 5, _latest, peer_copies=copies, on_rank_loss=Policy.EXCISE, declared=declared)
    assert d.policy is Policy.CHECKPOINT_RESTORE and why in d.reason, (case, d.reason)
    assert d.lost == ()


def test_a_replacement_policy_never_excises():
    props = {0: _p(0, holds=[(3, 7)]), 1: _p(1), 2: _p(2)}
    d = decide(props, 4, 2, 5, _latest, peer_copies=1, declared=(3,))
    assert d.policy is Policy.CHECKPOINT_RESTORE


def test_a_rank_marked_gone_is_excised_in_the_first_round_without_waiting_the_timeout():
    server = host_store("127.0.0.1", 0, 4)
    chans = [ControlChannel("127.0.0.1", server.port, r, 4, timeout_s=20.0, key=KEY) for r in range(4)]
    out: dict[int, object] = {}

    def one(ch):
        try:
            out[ch.rank] = agree(
                ch,
                lambda g, r=ch.rank: Proposal(r, g, 5, "x", True, holds=((3, 5),) if r == 0 else (), own_steps=(5,)),
                _latest,
                peer_copies=1,
                on_rank_loss=Policy.EXCISE,
            ).decision
        except Exception as exc:  # noqa: BLE001
            out[ch.rank] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(chans[r],)) for r in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    mark_gone(chans[3], 3)
    for t in threads:
        t.join(15)
    elapsed = time.monotonic() - t0
    assert all(isinstance(d, Decision) for d in out.values()), out
    assert {(d.policy, d.lost, d.step, d.restore_from) for d in out.values()} == {(Policy.EXCISE, (3,), 5, ((3, 0),))}
    assert elapsed < 10, elapsed  # well inside one 20 s round: the gone rank is not waited for


def test_the_model_an_excision_replaced_refuses_a_forward_by_name_and_is_no_comm_fault():
    import torch

    from meshpact.live.recovery.runtime import StaleModelError, is_comm_fault, refuse_stale

    old = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    x = torch.randn(5, 3)
    before = old(x)
    refuse_stale(old, rank=2, step=7)
    with pytest.raises(StaleModelError, match=r"rank 2: .* excision at step 7; after an excision use rt.model") as got:
        old(x)
    assert not is_comm_fault(got.value)  # surfaces at once, never taken for a fault to recover from
    assert before.shape == (5, 2)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(fault_kind="collective"), "--fault-kind other than kill"),
        (dict(fault_kind="kill", peer_copies=0), "--peer-copies 0"),
        (dict(fault_kind="kill", spare_ranks=1), "--spare-ranks"),
        (dict(fault_kind="kill", faults=4), "at most --ranks - 1 (3) faults, got 4"),
        (dict(fault_kind="kill", min_ranks=5), "--min-ranks must be between 1 and --ranks (4), got 5"),
    ],
)
def test_an_excising_trial_refuses_what_it_cannot_do_in_one_line(kw, words):
    from meshpact.core.errors import MeshpactError
    from meshpact.live.trials.trialconfig import TrialConfig

    with pytest.raises(MeshpactError) as got:
        TrialConfig(ranks=4, steps=12, **{"faults": 2, "on_rank_loss": "excise", **kw})
    assert words in str(got.value) and "\n" not in str(got.value)


def test_an_unknown_rank_loss_policy_is_refused():
    from meshpact.core.errors import MeshpactError
    from meshpact.live.trials.trialconfig import TrialConfig

    with pytest.raises(MeshpactError, match="--on-rank-loss must be replace or excise, got 'shrink'"):
        TrialConfig(on_rank_loss="shrink")


def test_an_excising_trial_on_a_three_dimensional_mesh_is_refused_before_any_rank_starts(tmp_path):
    """A 2-D (HSDP) mesh is excised by replicas (tests/live/test_recovery_hsdp.py); one of more
    dimensions is refused in one line, before any rank starts."""
    from pathlib import Path

    from meshpact.live.trials.trial import run_trial
    from meshpact.live.trials.trialconfig import TrialConfig
    from meshpact.live.recovery.workload import WorkloadError

    hsdp = Path(__file__).resolve().parents[2] / "scenarios" / "workloads" / "llama_hsdp.py"
    text = hsdp.read_text()
    three = tmp_path / "llama_3d.py"
    three.write_text(
        text.replace(
            'MESH = {"shape": [2, 2], "names": ["replicate", "shard"]}',
            'MESH = {"shape": [2, 1, 2], "names": ["replicate", "pipe", "shard"]}',
        )
    )
    cfg = TrialConfig(
        ranks=4, steps=8, checkpoint_every=4, faults=1, fault_kind="kill", on_rank_loss="excise", workload=str(three)
    )
    with pytest.raises(
        WorkloadError, match=r"or drops replicas of a 2-D HSDP one; this workload's MESH is \[2, 1, 2\]"
    ):
        run_trial(cfg)
