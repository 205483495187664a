"""The standby communicator in one process: two ranks as threads over one in-memory store.

A standby is built and exercised in the background; severing the data path (what detection
does) leaves its sockets alone, so it still carries traffic while the severed group does not;
a standby whose peer never comes is reported as not ready within the bound; and the verdict
over every rank's word is the same pure answer for every rank.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshpact.live.recovery import communicator as comm

pytestmark = pytest.mark.live


def _spec(rank: int, world: int = 2, timeout_s: float = 5.0) -> comm.GroupSpec:
    return comm.GroupSpec("gloo", "cpu", rank, world, timeout_s, connect_timeout_s=timeout_s, run_id="standby-test")


def _plan(world: int) -> comm.GroupPlan:
    return ((comm.WORLD, tuple(range(world))),)


def _both(fn, world: int = 2) -> list:
    """Run ``fn(rank)`` for every rank at once (threads); re-raise the first failure."""
    out: list = [None] * world
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def _all_reduce_sum(pg: dist.ProcessGroup, value: float, dtype: torch.dtype = torch.float64) -> float:
    x = torch.tensor([value], dtype=dtype)
    pg.allreduce([x]).wait()
    return float(x.item())


def test_a_standby_is_built_exercised_and_carries_traffic_after_the_data_path_is_severed():
    store = dist.HashStore()
    # the data path of generation 0, built the ordinary way but left out of c10d's world
    data = _both(lambda r: comm.build_group(_spec(r), store, 0, ranks=(0, 1), install=False))
    assert _both(lambda r: _all_reduce_sum(data[r], r + 1.5)) == [4.0, 4.0]
    standbys = [comm.Standby(_spec(r), lambda: store, 1, _plan(2)).start() for r in range(2)]
    statuses = [sb.status(_plan(2), wait_s=20.0) for sb in standbys]
    assert all(s.ready for s in statuses), statuses
    assert [s.generation for s in statuses] == [1, 1]
    keep = {fd: ino for sb in standbys for fd, ino in sb.sockets.items()}
    assert keep, "the standby opened no socket"
    # detection severs every connected data socket except the standby's
    severed = comm.sever(comm.data_sockets(keep)).sockets
    assert severed >= 1  # one end each; a loopback peer end already shut down may refuse a second shutdown
    with pytest.raises(RuntimeError):
        _both(lambda r: _all_reduce_sum(data[r], 1.0))
    groups = [sb._groups[comm.WORLD] for sb in standbys]  # not installed: the test's process stays clean
    # an odd value and an odd dtype: a silently stale or half-severed group cannot give this sum
    got = _both(lambda r: _all_reduce_sum(groups[r], 3.25 * (r + 1), torch.float16))
    assert got == [9.75, 9.75]
    for sb in standbys:
        sb.discard()
        assert not sb.sockets and sb.status(_plan(2), 0.0).reason == "discarded"
        assert sb.join(5.0)


def test_a_standby_whose_peer_never_comes_is_not_ready_within_the_bound_and_fails_its_check():
    store = dist.HashStore()
    sb = comm.Standby(_spec(0, timeout_s=1.0), lambda: store, 4, _plan(2)).start()  # rank 1 never builds
    status = sb.status(_plan(2), wait_s=0.2)
    assert not status.ready and status.reason.startswith("still being built after 0.2")
    assert sb.join(15.0)
    status = sb.status(_plan(2), wait_s=0.0)
    assert not status.ready and status.reason.startswith("failed its own check"), status


def test_a_standby_built_for_other_groups_than_the_jobs_is_refused():
    store = dist.HashStore()
    standbys = [comm.Standby(_spec(r), lambda: store, 2, _plan(2)).start() for r in range(2)]
    assert all(sb.status(_plan(2), 20.0).ready for sb in standbys)
    other = _plan(2) + (("meshpact_user", (0, 1)),)
    assert standbys[0].status(other, 0.0).reason == "the job's groups changed since it was built"
    for sb in standbys:
        sb.discard()


def test_the_verdict_over_every_ranks_word():
    ready = comm.StandbyStatus(5, True)
    assert comm.standby_refusal({0: ready, 1: ready, 2: ready}, 5, 3) == ""
    # a replacement process says nothing: everyone builds
    assert comm.standby_refusal({0: ready, 2: ready}, 5, 3) == "rank 1 has no standby (a replacement process)"
    # a decision on another generation than the standbys were built for (an incomplete round came between)
    assert "for generation 5, the decision is 6" in comm.standby_refusal({0: ready, 1: ready}, 6, 2)
    slow = comm.StandbyStatus(5, False, "rank 1's standby still being built after 1 s")
    assert comm.standby_refusal({0: ready, 1: slow}, 5, 2) == slow.reason
    # the words travel as JSON on the control channel
    assert comm.StandbyStatus.from_dict(slow.to_dict()) == slow


def test_the_wait_for_a_standby_is_derived_and_in_the_table():
    from meshpact.live.recovery.config import RecoveryConfig

    c = RecoveryConfig(data_timeout_s=45.0, group_create_s=7.0, process_start_s=7.0)
    assert c.standby_wait_s == 7.0  # a standby still connecting after group creation waits on a silent peer
    assert RecoveryConfig(data_timeout_s=0.3).standby_wait_s == 0.3
    assert (
        "wait for a standby still being built",
        7.0,
        "min(data_timeout_s or data_timeout_floor_s, group_create_s)",
    ) in c.table()


def test_only_an_error_that_waited_out_its_timeout_reads_as_a_silent_data_path():
    """What gloo really says: a recv whose peer never sends waits out its timeout ("Timed out
    waiting ..."); a recv whose peer severed the pair hears so at once ("Connection closed by
    peer"). Only the first makes a recovery distrust the standby, however long the step ran."""
    store = dist.HashStore()
    pgs = _both(lambda r: dist.ProcessGroupGloo(dist.PrefixStore("silent/", store), r, 2, timedelta(seconds=0.3)))
    with pytest.raises(RuntimeError) as waited:
        pgs[0].recv([torch.zeros(4)], 1, 0).wait()
    keep = comm.socket_fds()
    pgs = _both(lambda r: dist.ProcessGroupGloo(dist.PrefixStore("severed/", store), r, 2, timedelta(seconds=30)))
    work = pgs[0].recv([torch.zeros(4)], 1, 0)
    # both ends live in this process; the first shut down, gloo may close the other before its turn
    assert comm.sever(comm.data_sockets(keep)).sockets >= 1
    with pytest.raises(RuntimeError) as heard:
        work.wait()
    assert comm.timed_out(str(waited.value)), str(waited.value)
    assert not comm.timed_out(str(heard.value)), str(heard.value)
    assert not comm.timed_out("CollectiveFault: injected failure of c10d::allreduce_ at step 3")
