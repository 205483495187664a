"""Workload arithmetic: parameters, step time, state and checkpoint costs of a training job.

Everything the training simulator needs to know about the model and the checkpoint,
derived in one place from a scenario's ``workload`` and ``checkpointing`` sections and
the catalog's published model configurations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshpact.core.catalog import ModelConfig, get_model
from meshpact.core.errors import ScenarioError
from meshpact.core.scenario import CheckpointMode, CheckpointSpec, WorkloadSpec

__all__ = ["parameter_counts", "expected_max_of_normals", "Workload", "derive_workload"]


def parameter_counts(model: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of a decoder from its config.

    Untied input embedding and output head, attention projections (q, k, v, o) and a
    gated MLP (three matrices) per layer; an MoE layer holds ``num_experts`` MLPs and a
    router, of which ``experts_per_token`` are active. Norms are ignored (< 0.01 %).
    """
    h = model.hidden_size
    attn = h * model.num_heads * model.head_dim * 2 + h * model.num_kv_heads * model.head_dim * 2
    if model.is_moe:
        mlp_total = model.num_experts * 3 * h * model.moe_intermediate_size + h * model.num_experts
        mlp_active = model.experts_per_token * 3 * h * model.moe_intermediate_size + h * model.num_experts
    else:
        mlp_total = mlp_active = 3 * h * model.intermediate_size
    embed = 2 * model.vocab_size * h
    return embed + model.num_layers * (attn + mlp_total), embed + model.num_layers * (attn + mlp_active)


def expected_max_of_normals(n: int) -> float:
    """E[max of ``n`` independent standard normals], by integrating its distribution.

    E[M] = ∫₀^∞ (1 − Φ(x)ⁿ) dx − ∫₋∞⁰ Φ(x)ⁿ dx, on a grid fine enough for four digits at any
    ``n`` up to millions (0 for one rank).
    """
    if n <= 1:
        return 0.0
    x = np.linspace(-10.0, 10.0, 40001)
    phi = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x])
    with np.errstate(divide="ignore"):
        cdf_n = np.exp(n * np.log(phi))
    pos, neg = x >= 0, x <= 0
    return _trapezoid(1.0 - cdf_n[pos], x[pos]) - _trapezoid(cdf_n[neg], x[neg])


def _trapezoid(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2.0)


@dataclass(frozen=True)
class Workload:
    """A training job reduced to the numbers the simulator uses."""

    model: str
    ranks: int
    replica_ranks: int
    step_s: float
    state_bytes: float  # the whole training state (one copy)
    checkpoint_every: int
    checkpoint_mode: CheckpointMode
    checkpoint_write_s: float  # time to write one checkpoint to storage
    checkpoint_block_s: float  # time training stands still per checkpoint
    host_memory_bytes_per_rank: float  # pinned host memory an async snapshot holds
    straggler_factor: float = 1.0  # mean synchronous step time over the nominal one (slowest rank per step)
    reload_bytes_per_s: float | None = None  # checkpoint read bandwidth per rank, when the scenario gives one
    work_steps: int | None = None  # fixed-work mode: steps to commit

    @property
    def replicas(self) -> int:
        return self.ranks // self.replica_ranks

    @property
    def state_bytes_per_rank(self) -> float:
        return self.state_bytes / self.ranks


def derive_workload(
    workload: WorkloadSpec, checkpointing: CheckpointSpec, ranks: int, source: str = "scenario"
) -> Workload:
    """Step time, state size and checkpoint costs of ``workload`` on ``ranks`` ranks.

    Stragglers: one rank's step time is normal with mean ``step_s`` and standard deviation
    ``step_time_cv * step_s``, independent across ranks and steps; a synchronous step waits
    for the slowest rank, so it lasts ``step_s * (1 + cv * E[max of ranks normals])`` on
    average (``straggler_factor``).
    """
    model = get_model(workload.model)
    total, active = parameter_counts(model)
    replica = workload.parallelism.replica_ranks
    if ranks < 1 or ranks % replica:
        raise ScenarioError(
            f"{source}: workload.parallelism: a replica of tensor x pipeline = {replica} ranks must divide "
            f"the {ranks} ranks; choose parallelism that divides the rank count"
        )
    if workload.tokens_per_step is not None:
        flops = 6.0 * active * workload.tokens_per_step
        step_s = flops / (ranks * workload.peak_tflops_per_rank * 1e12 * workload.mfu)
    else:
        step_s = workload.step_seconds if workload.step_seconds is not None else 10.0
    state = total * workload.state_bytes_per_param
    shard = state / ranks
    write_s = (
        checkpointing.seconds
        if checkpointing.seconds is not None
        else shard / (checkpointing.write_gbyte_per_s_per_rank * 1e9)
    )
    if checkpointing.mode is CheckpointMode.SYNC:
        block_s, host = write_s, 0.0
    else:
        block_s, host = shard / (checkpointing.snapshot_gbyte_per_s_per_rank * 1e9), shard
        if host > checkpointing.host_memory_gib_per_rank * 2**30:
            raise ScenarioError(
                f"{source}: checkpointing.host_memory_gib_per_rank: an async snapshot needs "
                f"{host / 2**30:.1f} GiB per rank, more than the {checkpointing.host_memory_gib_per_rank} GiB given; "
                "use more ranks, more host memory or mode: sync"
            )
    straggle = 1.0 + workload.step_time_cv * expected_max_of_normals(ranks) if workload.step_time_cv else 1.0
    read = checkpointing.read_gbyte_per_s_per_rank
    return Workload(
        model=model.name,
        ranks=ranks,
        replica_ranks=replica,
        step_s=step_s,
        state_bytes=state,
        checkpoint_every=checkpointing.every_steps,
        checkpoint_mode=checkpointing.mode,
        checkpoint_write_s=write_s,
        checkpoint_block_s=block_s,
        host_memory_bytes_per_rank=host,
        straggler_factor=straggle,
        reload_bytes_per_s=None if read is None else read * 1e9,
        work_steps=workload.work_steps,
    )
