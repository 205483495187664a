"""An optimizer's state as the optimizer says it is: containers, their schedulers, ``state_dict`` ones.

One process, no group: what a commit lists, what a restore puts back and what the commit check
sees, for a container built the way torchtitan's ``OptimizersContainer`` is (an optimizer whose
own ``state`` is empty, its inner optimizers in an attribute, a ``LambdaLR`` on each inner one;
torchtitan's own classes are trained under ``meshpact launch`` in ``test_torchtitan.py``), and for
an optimizer that keeps its state away from ``self.state`` and says so through ``state_dict()``.
A state that cannot be read is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from meshpact.live.recovery.state import (
    CommitMark,
    OptimizerStateError,
    capture_schedule,
    check_optimizer,
    job_state,
    load_job_state,
    local_state,
    optimizer_parts,
    restore_schedule,
    schedulers_of,
)


class _Pair(torch.optim.Optimizer):
    """A user's container: two optimizers in a dict attribute, its own state left empty."""

    def __init__(self, first: list[torch.nn.Parameter], second: list[torch.nn.Parameter]) -> None:
        self.inner = {"sgd": torch.optim.SGD(first, lr=0.1, momentum=0.9), "adam": torch.optim.Adam(second, lr=0.01)}
        super().__init__([*first, *second], {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # a test double: no closure, no loss
        for o in self.inner.values():
            o.step()


def _loss(model: torch.nn.Module) -> None:
    model(torch.ones(2, 4)).sum().backward()


def _pair() -> tuple[torch.nn.Module, "_Pair", list[Any]]:
    """A model, its container (SGD with momentum for the first layer, Adam for the second) and a
    warm-up LambdaLR on each inner optimizer, as torchtitan's LRSchedulersContainer makes them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = _Pair(list(model[0].parameters()), list(model[1].parameters()))
    warmup = functools.partial(lambda step, n: min(1.0, (step + 1) / n), n=3)
    return model, opt, [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in opt.inner.values()]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, schedulers: list[Any], steps: range) -> None:
    for step in steps:
        model(torch.full((2, 4), float(step))).pow(2).sum().backward()
        opt.step()
        for s in schedulers:
            s.step()
        opt.zero_grad()


def _lrs(opt: "_Pair") -> list[float]:
    return [g["lr"] for o in opt.inner.values() for g in o.param_groups]


def test_a_container_is_committed_restored_and_checked_through_its_inner_optimizers():
    model, opt, schedulers = _pair()
    assert optimizer_parts(opt).by_param == (opt, *opt.inner.values())  # its own state (empty), then the inner ones
    assert schedulers_of(opt, schedulers) == schedulers
    _train(model, opt, schedulers, range(3))
    listed = local_state(model, opt, buffers=False)
    for o in opt.inner.values():  # every moment of every inner optimizer, as each holds it
        for p, slot in o.state.items():
            name = next(n for n, q in model.named_parameters() if q is p)
            assert all(torch.equal(listed[f"optim/{name}/{k}"], v) for k, v in slot.items())
    assert sum(k.startswith("optim/") for k in listed) == 2 + 3 * 2  # SGD's momentum; Adam's two moments and step

    # a replacement builds the loop afresh (no moments, its schedule at the start) and loads the
    # committed state (a copy, as a peer holds it): then both train on bit for bit
    saved = {k: v.clone() for k, v in job_state(model, opt, schedulers=schedulers).items()}
    fresh_model, fresh_opt, fresh_schedulers = _pair()
    load_job_state(fresh_model, fresh_opt, saved, fresh_schedulers)
    assert _lrs(fresh_opt) == _lrs(opt) != [0.1 / 3, 0.01 / 3]
    _train(model, opt, schedulers, range(3, 5))
    _train(fresh_model, fresh_opt, fresh_schedulers, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    assert all(
        torch.equal(a, b)
        for a, b in zip(local_state(model, opt).values(), local_state(fresh_model, fresh_opt).values())
    )

    # the commit check covers the inner state: one inner optimizer's moments written since the commit
    mark = CommitMark.take(5, model, opt)
    assert mark.verify(5, model, opt).changed == ""
    for slot in opt.inner["adam"].state.values():
        slot["exp_avg"].add_(1.0)
    assert mark.verify(5, model, opt).changed == "a sampled element of the state was written since the commit"


def test_the_schedule_of_a_container_is_every_inner_group_and_a_stepped_scheduler_goes_back():
    model, opt, schedulers = _pair()
    _train(model, opt, schedulers, range(1))
    committed = capture_schedule(opt, schedulers)
    assert [g.get("lr") for g in committed.groups] == [None, *_lrs(opt)]  # the container's own group has none
    lrs = _lrs(opt)
    for s in schedulers:  # a failed attempt stepped the schedule
        s.step()
    assert _lrs(opt) != lrs
    restore_schedule(opt, schedulers, committed)
    assert _lrs(opt) == lrs and [s.last_epoch for s in schedulers] == [1, 1]
    with pytest.raises(ValueError, match=r"this optimizer has 3 and \[.LambdaLR.\]$"):  # another job's optimizer
        restore_schedule(opt, schedulers[:1], committed)


def test_a_container_of_the_users_own_is_found_and_its_schedulers_paired_by_place_not_by_birth():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = _Pair(list(model[0].parameters()), list(model[1].parameters()))
    # made in the other order: the scheduler of the second optimizer is born first
    late = torch.optim.lr_scheduler.StepLR(opt.inner["adam"], 1, gamma=0.5)
    early = torch.optim.lr_scheduler.StepLR(opt.inner["sgd"], 1, gamma=0.9)
    assert schedulers_of(opt, [late, early]) == [early, late]
    _loss(model)
    opt.step()
    listed = local_state(model, opt)
    assert {k.rsplit("/", 1)[1] for k in listed if k.startswith("optim/")} == {
        "momentum_buffer",
        "exp_avg",
        "exp_avg_sq",
        "step",
    }
    assert sum(k.startswith("optim/0.") for k in listed) == 2  # SGD's momentum for both of the first layer's


class _Counting(torch.optim.SGD):
    """torch's layout with a number in each parameter's state (as LBFGS keeps its counters)."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # a test double: no closure, no loss
        super().step()
        for p in self.param_groups[0]["params"]:
            self.state[p]["seen"] = self.state[p].get("seen", 0) + 1


def test_a_number_in_an_optimizers_state_is_committed_with_the_schedule_and_put_back():
    model = torch.nn.Linear(4, 2)
    opt = _Counting(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        _loss(model)
        opt.step()
    committed = capture_schedule(opt)
    assert sorted(v for _, v in committed.values) == [2, 2]
    opt.step()  # a failed attempt counted once more
    restore_schedule(opt, [], committed)
    assert [s["seen"] for s in opt.state.values()] == [2, 2]


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_a_parameter_held_by_two_inner_optimizers_is_refused():
    model = torch.nn.Linear(4, 2)
    opt = _Pair(list(model.parameters()), list(model.parameters()))
    _loss(model)
    opt.step()
    with pytest.raises(OptimizerStateError, match="have state in two of the optimizers"):
        local_state(model, opt)


class _Moments(torch.optim.Optimizer):
    """An optimizer that keeps its moments and a step count of its own, not in ``self.state``, and
    says so through ``state_dict``/``load_state_dict``."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.moments = [torch.zeros_like(p) for g in self.param_groups for p in g["params"]]
        self.count = 0
        self.extra: Any = None

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # a test double: no closure, no loss
        self.count += 1
        with torch.no_grad():
            for m, p in zip(self.moments, (p for g in self.param_groups for p in g["params"])):
                m.mul_(0.5).add_(p.grad)
                p.sub_(self.param_groups[0]["lr"] * m / self.count)

    def state_dict(self) -> dict[str, Any]:
        out = {"moments": self.moments, "count": self.count, "lr": self.param_groups[0]["lr"]}
        if self.extra is not None:
            out["extra"] = self.extra
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for m, saved in zip(self.moments, state_dict["moments"]):
            m.copy_(saved)
        self.count = state_dict["count"]


def test_an_optimizer_read_through_its_state_dict_comes_back_whole_and_its_writes_are_seen():
    model = torch.nn.Linear(4, 2)
    opt = _Moments(list(model.parameters()), 0.1)
    assert optimizer_parts(opt).by_state_dict == (opt,)
    for _ in range(2):
        _loss(model)
        opt.step()
        opt.zero_grad()
    saved = {k: v.clone() for k, v in job_state(model, opt).items()}  # a copy, as a peer or checkpoint holds it
    assert [k for k in saved if k.startswith("optim_sd/")] == ["optim_sd/0/moments/0", "optim_sd/0/moments/1"]
    mark = CommitMark.take(2, model, opt)
    _loss(model)
    opt.step()
    assert mark.verify(2, model, opt).changed != ""  # the moments moved, and nothing in self.state did
    after = [m.clone() for m in opt.moments]
    load_job_state(model, opt, saved)
    assert opt.count == 2  # a number in the state: committed with the schedule, put back with it
    assert not any(torch.equal(a, b) for a, b in zip(after, opt.moments))
    assert all(torch.equal(m, saved[f"optim_sd/0/moments/{i}"]) for i, m in enumerate(opt.moments))


def test_an_optimizer_whose_state_cannot_be_read_is_refused_in_one_line():
    model = torch.nn.Linear(4, 2)
    opt = _Moments(list(model.parameters()), 0.1)
    opt.extra = lambda step: step  # a function in the state: nothing can copy or compare it
    with pytest.raises(OptimizerStateError, match=r"_Moments.state_dict\(\) holds a function at 'extra'") as info:
        check_optimizer(opt)
    assert "\n" not in str(info.value)

    class Broken(_Moments):
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("consolidate first")

    with pytest.raises(OptimizerStateError, match=r"Broken.state_dict\(\) failed \(RuntimeError: consolidate first\)"):
        check_optimizer(Broken(list(model.parameters()), 0.1))
