"""The user's groups: those the job's own code makes after ``start_session``, matched by creation order.

A training script makes groups of its own once the session exists: a metrics reducer's
``dist.new_group``, ``new_subgroups``, a ``DeviceMesh`` of its own (``init_device_mesh`` makes
one group per slice of each dimension). torch requires every rank to make them in the same
order, so their creation order names them on every rank: the ``k``-th is ``user<k>``
(:func:`~.communicator.user_base`). :func:`start_session` routes torch's group creation
through :class:`UserGroups` (c10d's ``_new_group_with_tag``, which ``new_group``,
``new_subgroups`` and ``DeviceMesh`` all reach on CPU), which builds each as a data-path
group of the current generation (:func:`~.communicator.build_group`), so a recovery rebuilds
it under the same base name, and writes its ranks on the control channel.

A replacement process runs the same script. Its session joins the recovery in progress and
builds the decided generation's groups in the order every survivor rebuilds them
(:func:`~.communicator.build_order`): the session's, then the user's it is a member of,
read from the control channel (:meth:`UserGroups.prebuild`). When its script then asks
for its ``k``-th group, it gets the one built for ``user<k>`` (the same ranks, or a one-line
refusal naming both): it never builds a group against survivors that are not building, and
the survivors never wait for a script still importing, building its model or loading data.

Not routed (torch's own path, not matched for a replacement): a group with
``use_local_synchronization`` (only its members make it, so it has no job-wide order), with
``sort_ranks=False``, with backend options or a tag of its own, or on another backend than the
session's (a GPU job's ``new_group(backend="gloo")`` for CPU tensors: built by torch as asked). A group the job destroyed is still built for a replacement (its ranks stay on
the control channel), where no survivor builds it: the replacement's start then fails after
the group-connect bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import communicator as comm

__all__ = ["UserGroup", "UserGroups", "GroupCreation", "UserGroupMismatch", "plan_key", "route_group_creation"]


class UserGroupMismatch(RuntimeError):
    """A replacement's script asked for a group that differs from the one the survivors hold
    at its place in the creation order (its script is not the one the job runs)."""


def plan_key(ordinal: int) -> str:
    """The control-channel key that holds the ranks of the ``ordinal``-th user group."""
    return f"usergroups/{ordinal}"


@dataclass(frozen=True)
class UserGroup:
    """One group the job's code asked for: its place in the creation order and its ranks
    (in the default group's numbering, as torch sorts them)."""

    ordinal: int
    ranks: tuple[int, ...]

    @property
    def base(self) -> str:
        return comm.user_base(self.ordinal)


class UserGroups:
    """The groups this process's code asked for since ``start_session``, in creation order.

    ``where()`` gives the session's current ``(spec, store, control, generation)``: a group is
    built for the generation the job is in when it is asked for. ``record(names, opened)`` is
    told the sockets that appeared while each group was made (the session's
    :meth:`~.session.DataPath.record`): they are its data path, and a connection the user opened
    before, with whatever options, is not."""

    def __init__(
        self,
        where: Callable[[], tuple[comm.GroupSpec, Any, Any, int]],
        record: Callable[[Iterable[str], dict[int, str]], None] | None = None,
    ) -> None:
        self._where = where
        self.record = record
        self.made: list[UserGroup] = []
        self._prebuilt: dict[int, tuple[tuple[int, ...], dist.ProcessGroup | None]] = {}

    def prebuild(self, spec: comm.GroupSpec, store: Any, control: Any, generation: int) -> int:
        """A replacement, at start-up: build ``generation``'s user groups this rank is a member
        of, in creation order (the order the survivors rebuild them in), from the ranks the
        control channel holds. Returns how many groups the job had made."""
        plan: list[UserGroup] = []
        while (ranks := control.get(plan_key(len(plan)))) is not None:
            plan.append(UserGroup(len(plan), tuple(int(r) for r in ranks)))
        for g in plan:
            pg = comm.build_group(spec, store, generation, g.base, g.ranks) if spec.rank in g.ranks else None
            self._prebuilt[g.ordinal] = (g.ranks, pg)
        return len(plan)

    def create(self, ranks: list[int] | None, group_desc: str | None) -> Any:
        """The next group the job's code asks for: the one built ahead for it (a replacement),
        else built now for the current generation; ``GroupMember.NON_GROUP_MEMBER`` where this
        rank is not a member (torch's answer)."""
        spec, store, control, generation = self._where()
        default = c10d._get_default_group()
        world, me = default.size(), default.rank()
        got = tuple(range(world)) if ranks is None else tuple(sorted(int(r) for r in ranks))
        if len(set(got)) != len(got) or any(not 0 <= r < world for r in got):
            raise ValueError(f"new_group ranks {list(ranks or [])} must be distinct ranks of 0..{world - 1}")
        group = UserGroup(len(self.made), got)
        if group.ordinal in self._prebuilt:
            held, pg = self._prebuilt.pop(group.ordinal)
            if held != got:
                raise UserGroupMismatch(
                    f"this replacement's group number {group.ordinal} made after start_session has ranks {list(got)}, "
                    f"the job's has {list(held)}: a replacement must make its groups in the order and with the ranks "
                    "its rank's first process did"
                )
            self.made.append(group)
            return pg if pg is not None else c10d.GroupMember.NON_GROUP_MEMBER
        self.made.append(group)
        if got and got[0] == me:  # one writer per group: its first member (a group's ranks never change)
            control.set(plan_key(group.ordinal), list(got))
        if me not in got:
            return c10d.GroupMember.NON_GROUP_MEMBER
        here = dataclasses.replace(spec, rank=me, world_size=world)
        pg = comm.build_group(here, store, generation, group.base, got)
        if group_desc:
            pg._set_group_desc(f"{group_desc} (meshpact {group.base}, generation {generation})")
        return pg


class GroupCreation:
    """Stands in for c10d's ``_new_group_with_tag``: the groups it can build as data-path groups
    go to :meth:`UserGroups.create`, any other to torch's own function."""

    def __init__(self, original: Callable[..., Any], groups: UserGroups, backend: str) -> None:
        self.original = original
        self.groups = groups
        self.backend = backend

    def __call__(
        self,
        ranks: Any = None,
        timeout: Any = None,
        backend: Any = None,
        backend_options: Any = None,
        pg_tag: Any = None,
        use_local_synchronization: bool = False,
        group_desc: Any = None,
        device_id: Any = None,
        sort_ranks: bool = True,
    ) -> Any:
        ours = (
            not use_local_synchronization
            and backend_options is None
            and pg_tag is None
            and sort_ranks
            and (backend is None or str(backend).lower() == self.backend)
        )
        before = comm.socket_fds() if self.groups.record is not None else {}
        if not ours:
            pg = self.original(
                ranks,
                timeout,
                backend,
                backend_options,
                pg_tag,
                use_local_synchronization=use_local_synchronization,
                group_desc=group_desc,
                device_id=device_id,
                sort_ranks=sort_ranks,
            )
        else:
            pg = self.groups.create(ranks, group_desc)
        name = getattr(pg, "group_name", None)
        if self.groups.record is not None and isinstance(name, str):
            self.groups.record([name], comm.opened_since(before))
        return pg


def route_group_creation(groups: UserGroups, backend: str) -> GroupCreation:
    """Route torch's group creation in this process through ``groups`` (a later session's
    routing replaces an earlier one's)."""
    current = c10d._new_group_with_tag
    original = current.original if isinstance(current, GroupCreation) else current
    routed = GroupCreation(original, groups, backend)
    c10d._new_group_with_tag = routed
    return routed
