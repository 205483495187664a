"""A stranger's training loop: BatchNorm, an LR scheduler, gradient clipping and a logged loss.

The workload, written here as a user would, trains a network with BatchNorm (its running
statistics are buffers, moved by every forward), a ``LambdaLR`` warm-up made in ``build`` and
stepped after the optimizer, ``clip_grad_norm_`` (an all-reduce of the gradients' norm) and an
all-reduce of the loss for its log, after the optimizer and the scheduler stepped. Before the
schedule and the buffers were committed state, recovery was bit-for-bit wrong five ways, each
reported "in memory, state intact" or restored without complaint: a replacement process
started its scheduler from zero and its statistics from their initial values, a checkpoint
restore or a cold restart kept the later learning rate (the same load as the replacement's), a fault in the log's all-reduce stepped
the scheduler twice, and a fault after the forward moved the statistics twice. Bit-identity
here covers the schedule (``schedule/state``: the param groups' settings and the scheduler's
``state_dict``) and every persistent buffer (``buffer/...``).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from _recovery import assert_identical, trial, workload_file
from meshpact.live.recovery.state import Schedule, capture_schedule, restore_schedule

pytestmark = [pytest.mark.live, pytest.mark.slow]

USER_LOOP_WORKLOAD = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    SCHED = None


    def build(mesh):
        global SCHED
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 16))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        SCHED = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4) / (1 + 0.1 * step))
        return model, optimizer


    def batch(step, rank):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(97 * step + rank))


    def train_step(model, optimizer, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        SCHED.step()
        optimizer.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the loss for the log: after the optimizer and the scheduler stepped
        return float(logged)
""")


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return workload_file(tmp_path_factory, "user_loop", USER_LOOP_WORKLOAD)


def test_a_replacement_takes_the_schedule_and_the_statistics_with_the_state(workload):
    # the replacement loads its peer's copy with load_job_state, as a checkpoint restore and a cold
    # restart load a checkpoint (the same call; the checkpoint is the same dict on disk)
    result = trial(
        ranks=2, steps=8, faults=1, fault_kind="kill", checkpoint_every=3, baselines=False, workload=workload
    )
    assert assert_identical(result, peer_restore=1)["replacement_processes"] == 1


def test_faults_before_and_after_the_optimizer_put_the_statistics_and_the_schedule_back(workload):
    # three raised collectives, the step's collectives in turn: the forward's all-gather (before the
    # BatchNorm moved), the backward's reduce-scatter (after it: in memory, the statistics put back)
    # and the log's all-reduce (the optimizer and the scheduler stepped: each rank's own snapshot).
    # clip_grad_norm_'s all-reduce is DTensor's, issued inside its dispatch, where the injector's
    # dispatch mode does not see it: it is not among the three
    result = trial(
        ranks=2, steps=8, faults=3, fault_kind="collective", checkpoint_every=3, baselines=False, workload=workload
    )
    assert_identical(result, faults_recovered=3, in_memory=2, peer_restore=1)


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


LATE_SCHEDULER_WORKLOAD = textwrap.dedent("""
    import torch
    from torch.distributed.fsdp import fully_shard

    OPT, SCHED, WHERE = None, None, "{where}"


    def build(mesh):
        global OPT
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        fully_shard(model, mesh=mesh)
        OPT = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, OPT


    def _late():
        global SCHED
        if SCHED is None and OPT is not None:  # made lazily, once training is under way
            SCHED = torch.optim.lr_scheduler.StepLR(OPT, step_size=2, gamma=0.5)


    def batch(step, rank):
        if WHERE == "batch":  # after resilient() was entered, before the first step
            _late()
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(97 * step + rank))


    def train_step(model, optimizer, batch):
        if WHERE == "step":  # inside the first step
            _late()
        model(batch).pow(2).mean().backward()
        optimizer.step()
        if SCHED is not None:
            SCHED.step()
        optimizer.zero_grad()
""")


@pytest.mark.parametrize(
    "where, says",
    [
        ("batch", "StepLR made after resilient() was entered"),
        ("step", "step 0: the optimizer's param groups carry initial_lr, an LR scheduler's mark"),
    ],
)
def test_a_scheduler_made_once_training_is_under_way_is_refused_with_one_line(tmp_path, where, says):
    """A scheduler made lazily after resilient() was entered would be in no commit, peer copy or
    checkpoint: a recovery would leave it where the failed attempt put it, a replacement would
    start it anew. Refused at the first step (made before it) or the first commit (made in it)."""
    from meshpact.live.recovery.workload import WorkloadError

    path = tmp_path / f"late_{where}.py"
    path.write_text(LATE_SCHEDULER_WORKLOAD.replace("{where}", where))
    with pytest.raises(WorkloadError) as err:
        trial(
            ranks=2, steps=4, faults=1, fault_kind="collective", checkpoint_every=2, baselines=False, workload=str(path)
        )
    line = str(err.value)
    assert "\n" not in line and says in line and "Make " in line, line
