"""Generators are state: a dropout step faulted after its forward drew random numbers.

The fault is raised at the fourth collective of the step, in the backward, after every
dropout mask of the forward was drawn. Re-run with the generators restored, the job ends
bit-identical to the fault-free run; re-run without, it does not (which is what this test
proves the restore is for).
"""

from __future__ import annotations

import textwrap

import pytest

from _recovery import assert_recovered, trial, workload_file

pytestmark = [pytest.mark.live, pytest.mark.slow]

DROPOUT_WORKLOAD = textwrap.dedent("""
    import torch
    from torch.distributed.fsdp import fully_shard

    def build(mesh):
        torch.manual_seed(5)
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
                                      for _ in range(3)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batch(step, rank):
        return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))

    def train_step(model, optimizer, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)
""")


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return workload_file(tmp_path_factory, "dropout", DROPOUT_WORKLOAD)


def test_restored_generators_make_a_rerun_dropout_step_bit_identical(workload):
    result = trial(
        ranks=2,
        steps=5,
        faults=1,
        fault_kind="collective",
        checkpoint_every=5,
        baselines=False,
        workload=workload,
        nth_op=5,
    )
    assert_recovered(result, "in_memory")


def test_without_the_restore_the_rerun_step_draws_other_masks_and_the_state_differs(workload):
    result = trial(
        ranks=2,
        steps=5,
        faults=1,
        fault_kind="collective",
        checkpoint_every=5,
        baselines=False,
        workload=workload,
        nth_op=5,
        restore_rng=False,
    )
    s = result.summary()
    assert s["faults_injected"] == 1 and s["policy_counts"]["in_memory"] == 1
    assert not s["bit_identical"]
    assert any("param/" in m for m in result.mismatches), result.mismatches
    assert any("rng/torch_cpu" in m for m in result.mismatches), result.mismatches
