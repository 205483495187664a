"""Undo a half-run FSDP2 step, so the failed step can run again from the committed state.

A collective that fails mid-step leaves FSDP2 part-way through: unsharded parameters on the
modules, an all-gather result or reduce-scatter states pending, hooks in a non-idle training
state and gradients (some accumulated in unsharded buffers). :func:`reset_step_state` puts
every FSDP state of the model back to idle and sharded and drops every gradient; the
committed state (parameter shards and optimizer state) is not touched. It reads FSDP2's
private fields as torch 2.13 names them (``torch/distributed/fsdp/_fully_shard/``).
"""

from __future__ import annotations

from typing import Any

import torch

from .rebind import fsdp_states

__all__ = ["reset_step_state"]


def reset_step_state(model: torch.nn.Module, states: list[Any] | None = None) -> list[torch.nn.Parameter]:
    """Undo what a failed step left behind in FSDP2: unsharded parameters, pending
    collectives, half-run hooks and gradients. The committed state is not touched.
    ``states``: the model's FSDP states when the caller has them (:func:`fsdp_states`).
    Returns the model's parameters as they stand after it (the sharded ones on the modules)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for state in fsdp_states(model) if states is None else states:
        if not hasattr(state._comm_ctx, "reduce_scatter_states"):
            continue  # never lazily initialized: no step ran through it (a recovery before the first step)
        ctx = state._state_ctx
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False
        ctx.is_last_backward = True
        state._training_state = TrainingState.IDLE
        state._modules_to_run_forward.clear()
        cc = state._comm_ctx
        cc.all_gather_state = None
        cc.reduce_scatter_states.clear()
        cc.post_forward_order.clear()
        for group in state._fsdp_param_groups:
            group._training_state = TrainingState.IDLE
            group._all_gather_result = None
            group._post_forward_indices.clear()
            group._post_reduce_event = None
            group._reshard_after_forward_event = None
            _to_sharded(group)
            for fp in group.fsdp_params:
                if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                    fp.unsharded_accumulated_grad = None
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
    params = list(model.parameters())
    for p in params:
        p.grad = None
    return params


def _to_sharded(group: Any) -> None:
    """Put a param group back in its sharded state. FSDP frees the unsharded buffers on the
    way; buffers left by an all-gather that failed cannot always be resized, and are then
    kept (the next all-gather writes them whole) while the sharded parameters go back on
    the modules."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    try:
        group.reshard()
        return
    except RuntimeError:
        pass
    for fp in group.fsdp_params:
        fp._setattr_on_modules(fp.sharded_param)
        fp.sharded_state = ShardedState.SHARDED
    group._sharded_state = ShardedState.SHARDED
