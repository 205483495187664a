"""Mesh views: rings, bridges, positions and health under failures."""

from __future__ import annotations

import math

import pytest

from meshpact.core.errors import FactError
from meshpact.core.facts import Domain, LinkClass, Mesh, Vendor
from meshpact.core.mesh import (
    CommunicatorKind,
    bridge_after_failure,
    bridge_links,
    communicators,
    health,
    healthy_count,
    native_ring,
    native_ring_links,
    SPACING,
    rank_positions,
    surviving_communicators,
)
from meshpact.core.scenario import default_scenario


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return default_scenario().mesh()


def _three_domains() -> Mesh:
    return Mesh(
        domains=(
            Domain("cuda@hostA", Vendor.CUDA, "hostA", (0, 1, 2, 3)),
            Domain("cann@hostA", Vendor.CANN, "hostA", (4, 5, 6, 7), bridge_rank=6),
            Domain("cann@hostB", Vendor.CANN, "hostB", (8, 9)),
        )
    )


def test_native_ring_starts_at_the_bridge_rank_and_covers_the_domain():
    m = _three_domains()
    assert native_ring(m.domain("cann@hostA")) == (6, 7, 4, 5)
    links = native_ring_links(m.domain("cuda@hostA"))
    assert [(ln.a, ln.b) for ln in links] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert all(ln.link is LinkClass.FABRIC for ln in links)


def test_two_rank_ring_is_one_link_and_one_rank_ring_none():
    assert len(native_ring_links(Domain("d", Vendor.CPU, "h", (3, 4)))) == 1
    assert native_ring_links(Domain("d", Vendor.CPU, "h", (3,))) == ()


def test_bridge_links_join_bridge_ranks_with_the_right_link_class():
    links = {(ln.a, ln.b): ln.link for ln in bridge_links(_three_domains())}
    assert links == {(0, 6): LinkClass.HOST_BRIDGE, (0, 8): LinkClass.ETHERNET, (6, 8): LinkClass.ETHERNET}


def test_default_mesh_has_two_native_and_one_bridge_communicator(mesh):
    comms = communicators(mesh)
    assert [c.kind for c in comms] == [CommunicatorKind.NATIVE, CommunicatorKind.NATIVE, CommunicatorKind.BRIDGE]
    assert comms[2].ranks == (0, 16) and comms[2].link is LinkClass.ETHERNET
    assert comms[0].backend == "nccl" and comms[1].backend == "hccl"


def test_two_failures_leave_30_of_32_and_break_both_native_rings(mesh):
    h = health(mesh, [3, 17])
    assert (h.healthy, h.world_size, h.label) == (30, 32, "30/32")
    assert [c.name for c in h.surviving] == ["bridge cuda@hostA <-> cann@hostB"]
    assert {c.name for c in h.broken} == {"cuda@hostA", "cann@hostB"}


def test_failed_bridge_rank_breaks_the_bridge_and_hands_over_to_lowest_survivor(mesh):
    h = health(mesh, [0])
    assert h.bridges == {"cuda@hostA": 1, "cann@hostB": 16}
    assert {c.name for c in h.broken} == {"cuda@hostA", "bridge cuda@hostA <-> cann@hostB"}
    assert [c.name for c in surviving_communicators(mesh, [0])] == ["cann@hostB"]


def test_a_domain_with_every_rank_failed_has_no_bridge():
    d = Domain("d", Vendor.CPU, "h", (1, 2))
    assert bridge_after_failure(d, frozenset({1, 2})) is None


def test_no_failures_everything_intact(mesh):
    assert healthy_count(mesh) == 32
    assert len(surviving_communicators(mesh)) == 3


def test_failed_rank_outside_the_mesh_is_a_readable_error(mesh):
    with pytest.raises(FactError, match=r"failed ranks \[40\] are not in the mesh \(ranks 0..31\)"):
        health(mesh, [40])


@pytest.mark.parametrize("per_domain", [4, 16, 512])
def test_positions_are_distinct_and_domains_do_not_overlap(per_domain):
    m = Mesh(
        domains=(
            Domain("cuda@hostA", Vendor.CUDA, "hostA", tuple(range(per_domain))),
            Domain("cann@hostB", Vendor.CANN, "hostB", tuple(range(per_domain, 2 * per_domain))),
        )
    )
    pos = rank_positions(m)
    assert set(pos) == set(m.ranks)
    assert len(set(pos.values())) == len(pos)
    left = max(pos[r][0] for r in range(per_domain))
    right = min(pos[r][0] for r in range(per_domain, 2 * per_domain))
    assert left < right  # hostA's circle lies wholly left of hostB's
    # neighbours on a ring keep a legible spacing whatever the size
    gap = math.dist(pos[0], pos[1])
    assert gap == pytest.approx(SPACING, rel=0.35) if per_domain >= 16 else gap >= SPACING


def test_bridge_ranks_face_each_other(mesh):
    pos = rank_positions(mesh)
    xs_a = [pos[r][0] for r in range(16)]
    xs_b = [pos[r][0] for r in range(16, 32)]
    assert pos[0][0] == max(xs_a) and pos[16][0] == min(xs_b)
