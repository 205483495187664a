"""Two native domains of real processes, joined only by a host-staged bridge.

Every rank belongs to one native domain of the mesh. Each domain gets its own process
group with the backend that capability detection (:mod:`meshpact.live.backends`) picks
for the domain's vendor: ``nccl`` on CUDA ranks, ``hccl`` on Ascend ranks with
``torch_npu``, gloo on CPU standing in for either. Cross-domain traffic goes only through *bridge* groups: gloo groups of two
ranks in different domains, over which one message is device → host → bridge → host →
device. The designated pair is the two domains' ``bridge_rank``; a plan may name more
pairs (an owner-scoped delivery sends straight from its authoritative sender to each
owner), and each becomes its own two-rank bridge. Every rank creates every group in one
global order (``new_group``'s rule); a rank that is not a member of a group takes no part in
it, so a CUDA host never constructs an Ascend communicator or the reverse.

Processes start with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so the same worker runs under ``torchrun`` across
hosts or under :mod:`meshpact.live.launch.launcher` on one machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Domain, Mesh, Vendor

from ..backends import BackendChoice, choose_backend
from ..launch.launcher import LaunchError

__all__ = [
    "RankEnv",
    "DomainLayout",
    "two_domain_mesh",
    "designated_bridge_pairs",
    "bridge_pairs",
    "init_domains",
]


@dataclass(frozen=True)
class RankEnv:
    """The torchrun-compatible environment of one worker process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RankEnv":
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_PORT") if k not in env]
        if missing:
            raise LaunchError(
                f"worker environment lacks {', '.join(missing)}; start workers with torchrun "
                "or meshpact's local launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)"
            )
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", env["RANK"]))
            port = int(env["MASTER_PORT"])
        except ValueError as exc:
            raise LaunchError(
                f"worker environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT must be integers ({exc})"
            ) from None
        if not 0 <= rank < world:
            raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), port)


def two_domain_mesh(
    per_domain: int = 2,
    producer: Vendor | str = Vendor.CUDA,
    consumer: Vendor | str = Vendor.CANN,
    producer_host: str = "localhost",
    consumer_host: str = "localhost",
) -> Mesh:
    """Producer domain on ranks ``0..n-1``, consumer domain on ``n..2n-1``; bridge ranks first of each.

    Both on one host by default, so the bridge is a host bridge (device → host → device);
    name two hosts and it is an Ethernet hop.
    """
    if per_domain < 1:
        raise MeshpactError(f"per_domain: expected at least 1 rank per domain, got {per_domain}")
    p, c = Vendor(producer), Vendor(consumer)
    return Mesh(
        domains=(
            Domain(f"{p.value}@{producer_host}", p, producer_host, tuple(range(per_domain))),
            Domain(f"{c.value}@{consumer_host}", c, consumer_host, tuple(range(per_domain, 2 * per_domain))),
        )
    )


def designated_bridge_pairs(mesh: Mesh) -> tuple[tuple[int, int], ...]:
    """The pair of designated bridge ranks between every two domains of ``mesh``."""
    ds = mesh.domains
    return tuple(
        tuple(sorted((a.bridge_rank, b.bridge_rank)))  # type: ignore[misc, type-var]  # Domain.__post_init__ sets every bridge_rank
        for i, a in enumerate(ds)
        for b in ds[i + 1 :]
    )


def _pair(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def bridge_pairs(mesh: Mesh, extra: Iterable[tuple[int, int]] = ()) -> tuple[tuple[int, int], ...]:
    """The designated bridge pairs plus ``extra``, each joining two domains, sorted, once each."""
    pairs: set[tuple[int, int]] = set()
    for a, b in (*designated_bridge_pairs(mesh), *extra):
        key = _pair(int(a), int(b))
        da, db = mesh.domain_of(key[0]).name, mesh.domain_of(key[1]).name
        if da == db:
            raise MeshpactError(f"bridge pair {list(key)} lies inside domain {da!r}; a bridge joins two domains")
        pairs.add(key)
    return tuple(sorted(pairs))


@dataclass
class DomainLayout:
    """One process's view of the two-domain world: its domain group and its bridges."""

    mesh: Mesh
    rank: int
    domain: Domain
    choice: BackendChoice
    domain_group: dist.ProcessGroup
    bridges: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    bridge_pairs: tuple[tuple[int, int], ...] = ()
    sub_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return torch.device(self.choice.device)

    def bridge(self, a: int, b: int) -> dist.ProcessGroup:
        """The bridge group between ranks ``a`` and ``b``; refuses pairs that are not bridges."""
        key = _pair(a, b)
        if key not in self.bridges:
            raise MeshpactError(
                f"ranks {a} and {b} share no bridge (bridges: {list(self.bridge_pairs)}); cross-domain "
                "traffic must use a bridge pair named when the domains were initialised"
            )
        return self.bridges[key]

    def native_group(self, ranks: Sequence[int]) -> tuple[dist.ProcessGroup, str]:
        """The native group of exactly ``ranks`` (this domain's, or a sub-group), with its name."""
        key = tuple(sorted(ranks))
        name = f"domain:{self.domain.name}"
        if key == tuple(sorted(self.domain.ranks)):
            return self.domain_group, name
        if key not in self.sub_groups:
            raise MeshpactError(
                f"no native group over ranks {list(key)} on rank {self.rank}; name it in "
                "init_domains(sub_groups=...) so every rank creates it in the same order"
            )
        return self.sub_groups[key], f"{name}:{','.join(map(str, key))}"

    def describe(self) -> dict:
        return {
            "rank": self.rank,
            "domain": self.domain.name,
            "domain_ranks": list(self.domain.ranks),
            "bridge_rank": self.domain.bridge_rank,
            "bridges": [list(p) for p in self.bridge_pairs if self.rank in p],
            **self.choice.to_dict(),
        }


def init_domains(
    mesh: Mesh,
    env: RankEnv,
    extra_bridge_pairs: Iterable[tuple[int, int]] = (),
    sub_groups: Iterable[Sequence[int]] = (),
    timeout_s: float = 60.0,
) -> DomainLayout:
    """Join the world and build the domain groups, any sub-groups and the bridge groups.

    Every rank creates every group in one global order (domains in mesh order, then
    sub-groups, then bridge pairs, each sorted), as ``new_group`` requires; a rank passes its
    own domain's backend for groups it belongs to and takes no part in the others. The world
    group itself (gloo) serves only rendezvous and the final hand-in; no plan step runs on it.
    ``sub_groups`` are rank sets inside one domain that a plan's collectives name.
    """
    if mesh.world_size != env.world_size:
        raise LaunchError(f"the mesh has {mesh.world_size} ranks but WORLD_SIZE={env.world_size}")
    bridge_pairs(mesh, extra_bridge_pairs)  # refuse a bad pair before joining anything
    domain = mesh.domain_of(env.rank)
    choice = choose_backend(domain.vendor, env.local_rank)
    if choice.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(choice.device))
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # env:// reads MASTER_ADDR/MASTER_PORT; under torchrun or the launcher the store is
        # hosted by the agent (TORCHELASTIC_USE_AGENT_STORE) and this rank joins as a client.
        dist.init_process_group("gloo", init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timeout)

    def native(ranks: Sequence[int]) -> dist.ProcessGroup:
        mine = env.rank in ranks
        return dist.new_group(list(ranks), backend=choice.backend.value if mine else "gloo", timeout=timeout)

    groups = {d.name: native(sorted(d.ranks)) for d in mesh.domains}
    subs: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in sorted({tuple(sorted(int(r) for r in g)) for g in sub_groups}):
        if len({mesh.domain_of(r).name for r in ranks}) != 1:
            raise MeshpactError(f"sub-group {list(ranks)} spans domains; a native group lies inside one domain")
        if ranks not in {tuple(sorted(d.ranks)) for d in mesh.domains}:
            subs[ranks] = native(ranks)
    pairs = bridge_pairs(mesh, extra_bridge_pairs)
    bridges = {key: dist.new_group(list(key), backend="gloo", timeout=timeout) for key in pairs}
    return DomainLayout(
        mesh,
        env.rank,
        domain,
        choice,
        groups[domain.name],
        {k: g for k, g in bridges.items() if env.rank in k},
        tuple(pairs),
        {k: g for k, g in subs.items() if env.rank in k},
    )
