"""Undo a half-run FSDP2 step, so the failed step can run again from the committed state.

A collective that fails mid-step leaves FSDP2 part-way through: unsharded parameters on the
modules, an all-gather result or reduce-scatter states pending, hooks in a non-idle training
state and gradients (some accumulated in unsharded buffers). :func:`reset_step_state` puts
every FSDP state of the model back to idle and sharded and drops every gradient; the
committed state (parameter shards and optimizer state) is not touched. It reads FSDP2's
private fields as torch 2.13 names them (``torch/distributed/fsdp/_fully_shard/``).

Nothing of this is work per byte of the state, so none of it frees memory on a recovery's
path. With a :class:`Leftovers`:

- the unsharded parameters' buffers stay allocated behind the sharded parameters, as FSDP
  keeps them sized between an all-gather and its reshard: the re-run's all-gathers write them
  whole again instead of mapping and faulting in new ones;
- the last all-gather's output, which FSDP keeps until the next all-gather has its data
  (``all_gather_state``), is left where it is: the re-run's first all-gather drops it, as the
  failed step's next one would have;
- the failed attempt's gradients and pending collectives are handed to the leftovers, freed
  by :meth:`Leftovers.release` once every rank runs again.

Freeing them in the recovery cost a rank of ``gpt100m`` 15-18 ms of CPU (the root's 100 MB
of unsharded parameters and its 100 MB all-gather output unmapped page by page, 90-100 ms of
wall time at a load of 12 on two cores) when the fault came after the step's first all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .rebind import fsdp_states

__all__ = ["reset_step_state", "Leftovers", "parameters"]


@dataclass
class Leftovers:
    """What a failed step left that a recovery does not free on its path: the attempt's
    gradients and pending collectives (``held``), the FSDP param groups whose unsharded
    buffers were kept for the re-run (``kept``) and the communication contexts whose last
    all-gather output was left for the re-run to drop (``contexts``)."""

    held: list[Any] = field(default_factory=list)
    kept: list[Any] = field(default_factory=list)
    contexts: list[Any] = field(default_factory=list)

    def hold(self, obj: Any) -> None:
        if obj is not None:
            self.held.append(obj)

    def release(self, model_replaced: bool = False) -> None:
        """Let go of what is held (its memory goes back now). ``model_replaced``: the model the
        buffers belong to is done with (an excision builds another), so its kept unsharded
        buffers and its last all-gather output go too, rather than wait for a re-run that will
        not come."""
        self.held.clear()
        if model_replaced:
            for group in self.kept:
                for fp in group.fsdp_params:
                    fp.free_unsharded_param()
            for cc in self.contexts:
                cc.all_gather_state = None
        self.kept.clear()
        self.contexts.clear()


def reset_step_state(
    model: torch.nn.Module, states: list[Any] | None = None, leftovers: Leftovers | None = None
) -> list[torch.nn.Parameter]:
    """Undo what a failed step left behind in FSDP2: unsharded parameters, pending
    collectives, half-run hooks and gradients. The committed state is not touched.
    ``states``: the model's FSDP states when the caller has them (:func:`fsdp_states`).
    ``leftovers``: where given, the buffers are handed to it and the unsharded ones kept (see
    the module docstring); without it, everything is freed here.
    Returns the model's parameters as they stand after it (the sharded ones on the modules)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    hold = leftovers.hold if leftovers is not None else (lambda _: None)
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
        if leftovers is None:
            cc.all_gather_state = None
        elif cc.all_gather_state is not None and not any(c is cc for c in leftovers.contexts):
            leftovers.contexts.append(cc)
        if cc.reduce_scatter_states:
            hold(list(cc.reduce_scatter_states))
            cc.reduce_scatter_states.clear()
        cc.post_forward_order.clear()
        for group in state._fsdp_param_groups:
            group._training_state = TrainingState.IDLE
            hold(group._all_gather_result)
            group._all_gather_result = None
            group._post_forward_indices.clear()
            group._post_reduce_event = None
            group._reshard_after_forward_event = None
            if leftovers is None:
                _to_sharded(group)
            elif not group.is_sharded:  # a sharded group has its sharded parameters on the modules (FSDP's own test)
                _sharded_keeping_buffers(group)
                leftovers.kept.append(group)
            for fp in group.fsdp_params:
                if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                    hold(fp.unsharded_accumulated_grad)
                    fp.unsharded_accumulated_grad = None
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    hold(unsharded.grad)
                    unsharded.grad = None
    params = parameters(model)
    for p in params:
        if p.grad is not None:
            hold(p.grad)
            p.grad = None
    return params


def parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``list(model.parameters())``, in its order and with its de-duplication (a module or a
    parameter met twice is listed once), without its generator per member and its set of
    tensors hashed in Python: a third of its cost, on every recovery's path."""
    seen: set[int] = set()
    out = []
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _to_sharded(group: Any) -> None:
    """Put a param group back in its sharded state. FSDP frees the unsharded buffers on the
    way; buffers left by an all-gather that failed cannot always be resized, and are then
    kept (the next all-gather writes them whole) while the sharded parameters go back on
    the modules."""
    try:
        group.reshard()
        return
    except RuntimeError:
        pass
    _sharded_keeping_buffers(group)


def _sharded_keeping_buffers(group: Any) -> None:
    """The sharded parameters back on the modules and the group marked sharded, its unsharded
    buffers left allocated (FSDP's next all-gather finds them sized and writes them whole)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    for fp in group.fsdp_params:
        fp._setattr_on_modules(fp.sharded_param)
        fp.sharded_state = ShardedState.SHARDED
    group._sharded_state = ShardedState.SHARDED
