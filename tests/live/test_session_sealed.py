"""After start-up a session's fields are fixed but one: the current generation, which only
``advance`` replaces (every live recovery test runs on such a sealed session, so a module that
wrote another field would fail there by name)."""

from __future__ import annotations

import pytest

from meshpact.live.recovery import communicator as comm
from meshpact.live.recovery.config import RecoveryConfig
from meshpact.live.recovery.session import DataPath, Generation, Session


def _sealed() -> Session:
    s = Session(
        rank=1,
        world_size=4,
        incarnation=0,
        config=RecoveryConfig(),
        store=None,
        store_addr=("127.0.0.1", 0),
        control=None,  # type: ignore[arg-type]  # sealed before any channel is read
        mesh_shape=(4,),
        mesh_names=None,
        data_path=DataPath({}, (1234,)),
    )
    spec = comm.GroupSpec("gloo", "cpu", 1, 4, 1.0)
    s.advance(Generation(0, spec, {}, None, (0, 1, 2, 3)))
    s.seal()
    return s


@pytest.mark.parametrize(
    "field,value",
    [("current", None), ("rank", 2), ("joined", None), ("host", "elsewhere"), ("log", None), ("start_view", (5, 5))],
)
def test_a_sealed_session_refuses_every_write_by_name(field, value):
    s = _sealed()
    with pytest.raises(AttributeError, match=f"Session.{field} is fixed"):
        setattr(s, field, value)


def test_advance_is_the_one_write_and_only_forward():
    s = _sealed()
    first = s.current
    s.advance(Generation(3, first.spec, {}, None, (0, 2, 3), "world3-from-step7"))
    assert (s.generation, s.members, s.excised, s.view) == (3, (0, 2, 3), True, (3, 3))
    with pytest.raises(ValueError, match="does not follow generation 3"):
        s.advance(Generation(3, first.spec, {}, None, (0, 1, 2, 3)))
    assert s.generation == 3


def test_the_first_consensus_view_is_the_counters_read_at_start_until_a_decision_makes_a_generation():
    s = Session(
        rank=0,
        world_size=2,
        incarnation=0,
        config=RecoveryConfig(),
        store=None,
        store_addr=("127.0.0.1", 0),
        control=None,
        mesh_shape=(2,),
        mesh_names=None,
        data_path=DataPath({}, ()),
    )
    s.start_view = (4, 2)
    spec = comm.GroupSpec("gloo", "cpu", 0, 2, 1.0)
    s.advance(Generation(0, spec, {}, None, (0, 1)))
    s.seal()
    assert s.view == (4, 2) and not s.excised
    s.advance(Generation(5, spec, {}, None, (0, 1)))
    assert s.view == (5, 5)


def test_data_path_ports_grow_and_stay_protected():
    path = DataPath({}, (5, 1))
    path.protect_ports([9, 5])
    assert path.ports == (1, 5, 9)
