"""Mesh views: rings, bridge links, drawing positions and health under failures.

The :class:`~meshpact.core.facts.Mesh` says which ranks live in which native domain.
This module derives what the dashboard, the CLI and the recovery model look at: each
domain's native ring (the order its ranks pass data in a ring collective), the bridge
links between the designated bridge ranks of every pair of domains (a host bridge on one
host, Ethernet across hosts), positions for drawing the mesh legibly up to a thousand
ranks, and, for a set of failed ranks, which communicators survive intact and how many
ranks are healthy. Everything here is pure and deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping

from .errors import FactError
from .facts import Domain, LinkClass, Mesh

__all__ = [
    "CommunicatorKind",
    "Communicator",
    "Link",
    "MeshHealth",
    "native_ring",
    "native_ring_links",
    "bridge_links",
    "communicators",
    "SPACING",
    "CIRCLE_MAX",
    "rank_positions",
    "validate_failed",
    "health",
    "healthy_count",
    "surviving_communicators",
    "bridge_after_failure",
]


class CommunicatorKind(str, Enum):
    NATIVE = "native"  # one domain's ranks on its vendor's collective library
    BRIDGE = "bridge"  # two bridge ranks of different domains, host-staged point to point


@dataclass(frozen=True)
class Communicator:
    """A communicator of the mesh: its name, kind, backend and member ranks."""

    name: str
    kind: CommunicatorKind
    backend: str
    ranks: tuple[int, ...]
    domains: tuple[str, ...]
    link: LinkClass

    def intact(self, failed: frozenset[int]) -> bool:
        """A communicator breaks when any one member fails: a collective needs every rank."""
        return not (failed & set(self.ranks))


@dataclass(frozen=True)
class Link:
    """One drawn link between two ranks."""

    a: int
    b: int
    link: LinkClass
    communicator: str


@dataclass(frozen=True)
class MeshHealth:
    """The mesh seen through a set of failed ranks."""

    world_size: int
    failed: frozenset[int]
    communicators: tuple[Communicator, ...]
    surviving: tuple[Communicator, ...]
    broken: tuple[Communicator, ...]
    bridges: Mapping[str, int | None]  # domain -> bridge rank after failure (None: domain lost)

    @property
    def healthy(self) -> int:
        return self.world_size - len(self.failed)

    @property
    def label(self) -> str:
        return f"{self.healthy}/{self.world_size}"


def native_ring(domain: Domain) -> tuple[int, ...]:
    """The ring order of a domain: its ranks ascending, starting at the bridge rank."""
    ranks = sorted(domain.ranks)
    i = ranks.index(domain.bridge_rank)  # type: ignore[arg-type]  # Domain.__post_init__ sets it
    return tuple(ranks[i:] + ranks[:i])


def native_ring_links(domain: Domain) -> tuple[Link, ...]:
    ring = native_ring(domain)
    if len(ring) < 2:
        return ()
    pairs = list(zip(ring, ring[1:] + ring[:1])) if len(ring) > 2 else [(ring[0], ring[1])]
    return tuple(Link(a, b, LinkClass.FABRIC, domain.name) for a, b in pairs)


def _bridge_name(a: Domain, b: Domain) -> str:
    return f"bridge {a.name} <-> {b.name}"


def bridge_links(mesh: Mesh) -> tuple[Link, ...]:
    """One link between the bridge ranks of every pair of domains."""
    out = []
    for i, a in enumerate(mesh.domains):
        for b in mesh.domains[i + 1 :]:
            cls = mesh.link_class(a.bridge_rank, b.bridge_rank)  # type: ignore[arg-type]  # Domain.__post_init__ sets both
            out.append(Link(a.bridge_rank, b.bridge_rank, cls, _bridge_name(a, b)))  # type: ignore[arg-type]  # (as above)
    return tuple(out)


def communicators(mesh: Mesh) -> tuple[Communicator, ...]:
    """Every communicator of the mesh: one native per domain, one bridge per domain pair."""
    out = [
        Communicator(
            d.name,
            CommunicatorKind.NATIVE,
            d.backend.value,  # type: ignore[union-attr]  # Domain.__post_init__ sets it
            native_ring(d),
            (d.name,),
            LinkClass.FABRIC,
        )
        for d in mesh.domains
    ]
    for i, a in enumerate(mesh.domains):
        for b in mesh.domains[i + 1 :]:
            ranks = (a.bridge_rank, b.bridge_rank)
            out.append(
                Communicator(
                    _bridge_name(a, b),
                    CommunicatorKind.BRIDGE,
                    "host-staged",
                    ranks,  # type: ignore[arg-type]  # bridge ranks: Domain.__post_init__ sets them
                    (a.name, b.name),
                    mesh.link_class(*ranks),  # type: ignore[arg-type]
                )
            )
    return tuple(out)


SPACING = 0.3  # distance between neighbouring ranks in drawing units
CIRCLE_MAX = 64  # larger domains are drawn as a serpentine grid


def _domain_layout(size: int, face: float) -> list[tuple[float, float]]:
    """Local positions (centred at the origin) of a domain's ranks in ring order.

    Up to 64 ranks sit on a circle whose first rank points at angle ``face``; a larger
    domain fills a square grid row by row, alternating direction (the ring reads as a
    serpentine), starting in the corner nearest ``face``.
    """
    if size == 1:
        return [(0.0, 0.0)]
    if size <= CIRCLE_MAX:
        radius = max(1.0, size * SPACING / (2 * math.pi))
        return [
            (radius * math.cos(face + 2 * math.pi * k / size), radius * math.sin(face + 2 * math.pi * k / size))
            for k in range(size)
        ]
    cols = math.ceil(math.sqrt(size))
    rows = math.ceil(size / cols)
    mirror = math.cos(face) > 1e-9  # start on the side that faces the centre
    out = []
    for k in range(size):
        r, c = divmod(k, cols)
        c = c if r % 2 == 0 else cols - 1 - c
        x = (c - (cols - 1) / 2) * SPACING
        y = ((rows - 1) / 2 - r) * SPACING
        out.append((-x if mirror else x, y))
    return out


def _extent(size: int) -> float:
    pts = _domain_layout(size, 0.0)
    return max(max(abs(x), abs(y)) for x, y in pts) if size > 1 else 0.0


def rank_positions(mesh: Mesh) -> dict[int, tuple[float, float]]:
    """Drawing positions: one column per host, domains of a host stacked in it, each
    domain's ranks in ring order starting at the bridge rank, which faces the centre.

    Neighbouring ranks keep the same spacing (:data:`SPACING`) from 8 ranks to 1,024, so
    the picture grows instead of crowding: small domains are circles, large ones grids.
    """
    hosts = list(mesh.hosts)
    by_host: dict[str, list[Domain]] = {h: [d for d in mesh.domains if d.host == h] for h in hosts}
    cell = 2 * max(_extent(d.size) for d in mesh.domains) + 1.2
    rows = max(len(v) for v in by_host.values())
    cx_mid, cy_mid = (len(hosts) - 1) * cell / 2, -(rows - 1) * cell / 2
    pos: dict[int, tuple[float, float]] = {}
    for hx, host in enumerate(hosts):
        for dy, dom in enumerate(by_host[host]):
            cx, cy = hx * cell, -dy * cell
            face = math.atan2(cy_mid - cy, cx_mid - cx) if (cx, cy) != (cx_mid, cy_mid) else math.pi / 2
            for r, (x, y) in zip(native_ring(dom), _domain_layout(dom.size, face)):
                pos[r] = (round(cx + x, 6), round(cy + y, 6))
    return pos


def validate_failed(mesh: Mesh, failed: Iterable[int]) -> frozenset[int]:
    """The failed ranks as a set; a rank outside the mesh is a readable error."""
    out = frozenset(int(r) for r in failed)
    stray = sorted(out - set(mesh.ranks))
    if stray:
        raise FactError(f"failed ranks {stray} are not in the mesh (ranks {mesh.ranks[0]}..{mesh.ranks[-1]})")
    return out


def bridge_after_failure(domain: Domain, failed: frozenset[int]) -> int | None:
    """The domain's bridge rank once ``failed`` are gone: the designated one if it lives,
    else the lowest surviving rank of the domain, else ``None`` (the domain is lost)."""
    if domain.bridge_rank not in failed:
        return domain.bridge_rank
    alive = [r for r in sorted(domain.ranks) if r not in failed]
    return alive[0] if alive else None


def health(mesh: Mesh, failed: Iterable[int] = ()) -> MeshHealth:
    """Which communicators survive ``failed`` intact, which break, and the healthy count."""
    dead = validate_failed(mesh, failed)
    comms = communicators(mesh)
    return MeshHealth(
        world_size=mesh.world_size,
        failed=dead,
        communicators=comms,
        surviving=tuple(c for c in comms if c.intact(dead)),
        broken=tuple(c for c in comms if not c.intact(dead)),
        bridges={d.name: bridge_after_failure(d, dead) for d in mesh.domains},
    )


def healthy_count(mesh: Mesh, failed: Iterable[int] = ()) -> int:
    return health(mesh, failed).healthy


def surviving_communicators(mesh: Mesh, failed: Iterable[int] = ()) -> tuple[Communicator, ...]:
    return health(mesh, failed).surviving
