"""An LR scheduler, as every real loop has one: its state and the optimizer's settings are committed state.

The workload, written here as a user would, makes a ``LambdaLR`` warm-up in ``build`` and steps
it after the optimizer, then all-reduces the loss for its log. Without the schedule in the
committed state a replacement process started its scheduler from zero, a checkpoint restore or
a cold restart kept the later learning rate, and a fault in the log's all-reduce (after the
scheduler stepped) stepped it twice: each trained on, bit-for-bit wrong, on recovered state.
Bit-identity here covers the schedule too (``schedule/state`` in every rank's final state: the
param groups' settings and the scheduler's ``state_dict``).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from _recovery import recoveries_told, trial
from meshpact.live.recovery.state import Schedule, capture_schedule, restore_schedule

pytestmark = [pytest.mark.live, pytest.mark.slow]

SCHEDULED_WORKLOAD = textwrap.dedent('''
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    SCHED = None


    def build(mesh):
        global SCHED
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        SCHED = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4) / (1 + 0.1 * step))
        return model, optimizer


    def batch(step, rank):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(97 * step + rank))


    def train_step(model, optimizer, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        SCHED.step()
        optimizer.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the loss for the log: after the optimizer and the scheduler stepped
        return float(logged)
''')


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("scheduled") / "scheduled.py"
    path.write_text(SCHEDULED_WORKLOAD)
    return str(path)


def test_a_replacement_a_checkpoint_restore_and_a_cold_restart_take_the_schedule_with_the_state(workload):
    result = trial(ranks=2, steps=8, faults=1, fault_kind="kill", checkpoint_every=3, baselines=True,
                   workload=workload)
    s = result.summary()
    assert s["bit_identical"], (s["mismatches"], recoveries_told(result))
    assert s["policy_counts"]["peer_restore"] == 1 and s["replacement_processes"] == 1, recoveries_told(result)
    # the drill (a checkpoint restore in the job, its final state compared above) and the cold restart
    # (a new job from the checkpoint, compared too: mismatches name it) both ran
    assert s["downtime_s"]["checkpoint_restore"] is not None and s["downtime_s"]["cold_restart"] is not None


def test_a_fault_after_the_scheduler_stepped_restores_it_with_the_snapshot(workload):
    # three raised collectives: the forward's all-gather, the backward's reduce-scatter (both before
    # the optimizer: in memory) and the log's all-reduce (the optimizer and the scheduler have stepped)
    result = trial(ranks=2, steps=8, faults=3, fault_kind="collective", checkpoint_every=3, baselines=False,
                   workload=workload)
    s = result.summary()
    assert s["bit_identical"], (s["mismatches"], recoveries_told(result))
    assert s["faults_recovered"] == 3
    assert s["policy_counts"]["in_memory"] == 2 and s["policy_counts"]["peer_restore"] == 1, recoveries_told(result)


def test_the_schedule_goes_back_exactly_and_another_optimizers_is_refused():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    saved = capture_schedule(opt, [sched])
    for _ in range(5):
        opt.step()
        sched.step()
    opt.param_groups[0]["betas"] = (0.5, 0.5)
    assert opt.param_groups[0]["lr"] != 0.1
    restore_schedule(opt, [sched], saved)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert sched.last_epoch == 0 and sched.get_last_lr() == [0.1]
    with pytest.raises(ValueError, match=r"schedulers \['StepLR'\]; this optimizer has 1 and \[\]"):
        restore_schedule(opt, [], saved)
    assert isinstance(saved, Schedule)
