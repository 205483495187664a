"""Operation counting per process group: proof that a rebind took effect.

Every c10d collective, whoever issues it (FSDP2's all-gathers and reduce-scatters, DTensor,
the user), goes through a ``c10d::`` dispatcher operation that carries its process group.
:class:`OpCounter`, a ``TorchDispatchMode``, counts those operations by group name. After a
rebind the old group must receive zero operations: bit-identical numbers alone would not
prove it, because an old gloo group that was never rebound can keep working.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "group_of"]


def group_of(arg: Any) -> str | None:
    """The group name of a c10d op argument (a ProcessGroup or its boxed ScriptObject)."""
    if isinstance(arg, dist.ProcessGroup):
        return arg.group_name
    if type(arg).__name__ == "ScriptObject":
        try:
            return dist.ProcessGroup.unbox(arg).group_name
        except (RuntimeError, TypeError, AttributeError):
            return None
    return None


class OpCounter(TorchDispatchMode):
    """Counts c10d operations per group name while active (re-entrant across steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            for a in args:
                name = group_of(a)
                if name is not None:
                    self.counts[name] += 1
                    break
            else:
                self.counts["<unknown>"] += 1
        return func(*args, **(kwargs or {}))

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
