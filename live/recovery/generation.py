"""A generation: one set of data-path groups the whole job uses, as a value.

A job starts on generation 0; each recovery makes the next one (its number is the consensus
round that decided it, so numbers can skip: a round that did not decide makes none). A
generation never changes once made. The session holds the current one, and replacing it
(:meth:`~meshpact.live.recovery.session.Session.advance`) is the only write a recovery makes
to the session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch.distributed as dist

from . import communicator as comm

__all__ = ["Generation"]


@dataclass(frozen=True)
class Generation:
    """The groups, the mesh and the members of one generation of the job."""

    number: int
    spec: comm.GroupSpec  # this rank's place in the generation's groups (its group rank, the world size)
    groups: Mapping[str, dist.ProcessGroup]  # base name -> group (this rank a member)
    mesh: Any  # the DeviceMesh over ``groups``
    members: tuple[int, ...]  # the original ranks in the job (fewer than the world after an excision)
    checkpoint_subdir: str = ""  # after an excision the smaller world checkpoints apart from the larger one

    @property
    def group(self) -> dist.ProcessGroup:
        """The group over every member."""
        return self.groups[comm.WORLD]

    def __repr__(self) -> str:
        return f"Generation({self.number}, members={list(self.members)}, groups={sorted(self.groups)})"
