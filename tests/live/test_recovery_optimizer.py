"""An optimizer that fails part-way through its step: the state it wrote is never taken for intact.

The workload, written here as a user would, keeps 200 parameter tensors (more than the commit
check samples) and an optimizer that all-reduces the gradient's global norm inside ``step()``,
after it has written one parameter, as optimizers that gather across ranks in their step do.
A fault in the gradients' all-reduce (before the optimizer) is recovered in memory; a fault in
the optimizer's all-reduce leaves every rank with a parameter stepped once too often, which
the commit check's sample does not include: the runtime knows the optimizer's step began and
restores each rank's own snapshot from host memory. Either way the final state is bitwise the
reference's (before this guard, the second fault was "recovered in memory, state intact" and
diverged). The loop zeroes its gradients at the start of the step, so they outlive each
commit, already applied.

A loop that accumulates gradients over several ``rt.step`` calls leaves them for the next
call; no commit, copy or checkpoint holds them, and a recovery dropped them and went on,
bit-for-bit wrong. It is refused at its first commit, in one line.
"""

from __future__ import annotations

import textwrap

import pytest

from _recovery import recoveries_told, trial
from meshpact.live.recovery.workload import WorkloadError

pytestmark = [pytest.mark.live, pytest.mark.slow]

PART_WAY_WORKLOAD = textwrap.dedent('''
import torch
import torch.distributed as dist

N = 200  # parameter tensors: more than the commit check samples (64), so most go unsampled


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8)) for _ in range(N)])

    def forward(self, x):
        return torch.stack([(w * x[i]).sum() for i, w in enumerate(self.ws)])


class NormalisedSGD(torch.optim.Optimizer):
    """SGD scaled by the gradient's global norm, which it all-reduces inside step(): as optimizers
    that gather across ranks in their step do, it has written a parameter by then."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        ps = [p for g in self.param_groups for p in g["params"]]
        lr = self.param_groups[0]["lr"]
        ps[1].add_(ps[1].grad, alpha=-lr)
        norm = torch.stack([p.grad.norm() for p in ps]).norm().reshape(1)
        dist.all_reduce(norm)
        for p in ps[:1] + ps[2:]:
            p.add_(p.grad / (1.0 + norm), alpha=-lr)


def build(mesh):
    torch.manual_seed(5)
    model = Model()
    return model, NormalisedSGD(model.parameters(), lr=0.05)


def batch(step, rank):
    return torch.randn(N, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def train_step(model, optimizer, batch):
    optimizer.zero_grad()  # at the start, as many loops do: the gradients outlive the step, already applied
    loss = model(batch).pow(2).mean()
    loss.backward()
    grads = torch.cat([w.grad.reshape(-1) for w in model.ws])
    dist.all_reduce(grads)
    grads /= dist.get_world_size()
    for w, g in zip(model.ws, grads.split(8)):
        w.grad.copy_(g)
    optimizer.step()
    return float(loss)
''')

ACCUMULATING_WORKLOAD = textwrap.dedent("""
    import torch
    from torch.distributed.fsdp import fully_shard


    def build(mesh):
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


    def batch(step, rank):
        return step, torch.randn(8, 16, generator=torch.Generator().manual_seed(97 * step + rank))


    def train_step(model, optimizer, batch):
        step, x = batch
        model(x).pow(2).mean().backward()  # two calls per optimizer step: a micro-batch each
        if step % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
""")


def test_a_fault_inside_the_optimizers_step_restores_the_snapshot_and_one_before_it_stays_in_memory(tmp_path):
    path = tmp_path / "part_way.py"
    path.write_text(PART_WAY_WORKLOAD)
    # two faults: the first raises at the step's first collective (the gradients'), the second at
    # its second (the optimizer's)
    result = trial(
        ranks=2, steps=6, faults=2, fault_kind="collective", checkpoint_every=3, baselines=False, workload=str(path)
    )
    s = result.summary()
    assert s["bit_identical"], (s["mismatches"], recoveries_told(result))
    assert s["faults_injected"] == 2 and s["faults_recovered"] == 2
    by_step = {r["step"]: r for r in result.recoveries()}
    before, inside = (by_step[f.step] for f in sorted(result.faults, key=lambda f: f.step))
    assert before["policy"] == "in_memory", recoveries_told(result)
    assert inside["policy"] == "peer_restore" and "optimizer step begun" in inside["reason"], recoveries_told(result)
    assert s["storage_bytes_read"] == 0  # each rank's own snapshot, in host memory
    told = [e.data["state_changed"] for e in result.events() if e.event == "decided" and e.data.get("state_changed")]
    assert told and all("optimizer's step began" in t for t in told)


def test_gradients_accumulated_over_several_calls_are_refused_at_the_first_commit(tmp_path):
    path = tmp_path / "accumulating.py"
    path.write_text(ACCUMULATING_WORKLOAD)
    with pytest.raises(WorkloadError) as err:
        trial(
            ranks=2, steps=9, faults=2, fault_kind="collective", checkpoint_every=4, baselines=False, workload=str(path)
        )
    line = str(err.value)
    assert "\n" not in line and line.startswith("step 0 left nonzero gradients for the next rt.step call")
    assert "0.weight" in line and "Accumulate the micro-batches inside one train_step" in line
