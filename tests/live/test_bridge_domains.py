"""The two-domain layout: designated bridge ranks, bridge pairs, and the worker environment."""

from __future__ import annotations

import pytest

from meshpact.core.errors import MeshpactError
from meshpact.core.facts import LinkClass
from meshpact.live.plans.domains import RankEnv, bridge_pairs, designated_bridge_pairs, two_domain_mesh
from meshpact.live.launch.launcher import LaunchError


def test_two_domains_of_two_ranks_with_the_first_of_each_as_bridge_rank():
    mesh = two_domain_mesh(2)
    prod, cons = mesh.domains
    assert (prod.ranks, cons.ranks) == ((0, 1), (2, 3))
    assert (prod.backend.value, cons.backend.value) == ("nccl", "hccl")  # what each vendor asks for
    assert designated_bridge_pairs(mesh) == ((0, 2),)
    assert mesh.link_class(0, 2) is LinkClass.HOST_BRIDGE
    assert two_domain_mesh(2, producer_host="hostA", consumer_host="hostB").link_class(1, 3) is LinkClass.ETHERNET


def test_extra_bridge_pairs_join_two_domains_and_are_listed_once():
    mesh = two_domain_mesh(2)
    assert bridge_pairs(mesh, [(3, 0), (0, 3), (0, 2)]) == ((0, 2), (0, 3))
    with pytest.raises(MeshpactError, match="lies inside domain 'cann@localhost'"):
        bridge_pairs(mesh, [(2, 3)])


def test_worker_environment_is_torchruns_and_a_missing_variable_is_named():
    env = RankEnv.from_environ({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (2, 4, 2, 29500)
    with pytest.raises(LaunchError, match="MASTER_PORT"):
        RankEnv.from_environ({"RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(LaunchError, match="outside WORLD_SIZE"):
        RankEnv.from_environ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_PORT": "1"})
