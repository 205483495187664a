"""A stranger's mixed-precision loop: a ``torch.amp.GradScaler`` in a module global.

The scaler's loss scale and growth tracker change every step, and its per-optimizer record
(whether ``unscale_`` ran, the inf found) lives between ``scaler.step`` and ``scaler.update``.
The workload starts the scale near the top of float32 and grows it every step until the
scaled loss overflows; that step is skipped and the scale backs off, so the scale decides
which steps apply. Before the scaler was part of the committed schedule, recovery was wrong
both ways and said nothing: a replacement process began from the initial scale, and faults
in the step, recovered "in memory, state intact", re-ran it with the failed attempt's
per-optimizer record (``unscale_`` already done), stepping with scaled gradients. Bit-identity
covers the scaler (its ``state_dict`` in ``schedule/state``) and every parameter.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from _recovery import assert_identical, trial, workload_file
from meshpact.live.recovery.state import capture_schedule, restore_schedule, schedulers_of

pytestmark = [pytest.mark.live, pytest.mark.slow]

AMP_WORKLOAD = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    SCALER = None


    def build(mesh):
        global SCALER
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        # grows every step until the scaled loss overflows float32 (from about 2**115 here): that step
        # is skipped and the scale halves, so from step 5 on every other step is skipped
        SCALER = torch.amp.GradScaler("cpu", init_scale=2.0 ** 110, growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=1)
        return model, optimizer


    def batch(step, rank):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(31 * step + rank))


    def train_step(model, optimizer, batch):
        loss = model(batch).pow(2).sum() * 1e3
        SCALER.scale(loss).backward()
        SCALER.step(optimizer)
        SCALER.update()
        optimizer.zero_grad()
        logged = torch.stack([loss.detach(), SCALER.get_scale() * torch.ones(())])
        dist.all_reduce(logged)  # the loss and the scale for the log, after the update
        return float(logged[0])
""")


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return workload_file(tmp_path_factory, "amp_loop", AMP_WORKLOAD)


@pytest.mark.parametrize(
    "kind, faults, policies",
    [
        ("kill", 1, {"peer_restore": 1}),  # a replacement takes the loss scale with the state
        ("collective", 4, {}),  # faults inside the scaled step re-run it from the committed scale and record
    ],
)
def test_a_recovered_mixed_precision_loop_ends_bit_identical(workload, kind, faults, policies):
    result = trial(
        ranks=2, steps=10, faults=faults, fault_kind=kind, checkpoint_every=4, baselines=False, workload=workload
    )
    s = assert_identical(result, faults_recovered=faults, **policies)
    assert s["replacement_processes"] == (1 if kind == "kill" else 0)


def test_the_scaler_is_found_and_goes_back_with_its_per_optimizer_record_cleared():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    found = schedulers_of(opt)
    assert scaler in found
    saved = capture_schedule(opt, found)
    for _ in range(3):  # three applied steps: the scale grows each time
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    scaler.unscale_(opt)  # an attempt that failed between unscale_ and update
    assert scaler.get_scale() == 8192.0
    restore_schedule(opt, found, saved)
    assert scaler.get_scale() == 1024.0 and scaler.state_dict()["_growth_tracker"] == 0
    scaler.unscale_(opt)  # the re-run's: refused ("already been called") had the record stayed


def test_a_dead_weak_proxy_in_the_heap_does_not_stop_the_walks():
    """isinstance asks a weakref.proxy its __class__, and a dead one raises ReferenceError: the
    walks at resilient()'s entry (meshes, schedulers and scalers) met one in a pytest worker."""
    import weakref

    from meshpact.live.recovery.runtime import device_meshes

    class Held:
        pass

    target = Held()
    dead = [weakref.proxy(target)]
    del target
    with pytest.raises(ReferenceError):
        isinstance(dead[0], int)  # what the walks must not ask
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert schedulers_of(opt, [dead[0], scaler]) == [scaler]
    assert device_meshes([dead[0], scaler]) == []


def test_the_walk_finds_every_instance_of_a_class_and_its_subclasses_made_since_the_heap_was_frozen():
    """instances_of asks the collector for the referrers of the classes (in C) rather than looping
    over every object in Python: the same objects, in the same order, as that loop finds, frozen
    ones left out as gc.get_objects leaves them (the late-scheduler check sees only what was made
    after resilient() froze the heap)."""
    import gc
    import weakref

    from meshpact.live.recovery.state import instances_of

    class Base:
        pass

    class Sub(Base):
        pass

    class Slotted(Sub):
        __slots__ = ("x",)

    class Held:
        pass

    target = Held()
    dead = weakref.proxy(target)
    del target
    before = Base()
    gc.freeze()
    try:
        made = [Sub(), Slotted(), Base()]
        assert instances_of(Base) == made  # not the frozen one, the dead proxy asked nothing
        assert instances_of(Sub) == made[:2]
    finally:
        gc.unfreeze()
    loop = [o for o in gc.get_objects() if issubclass(type(o), Base)]
    assert instances_of(Base) == loop and before in loop and len(loop) == 4
    assert instances_of(Base, objects=[dead, made[1], 3]) == [made[1]]
