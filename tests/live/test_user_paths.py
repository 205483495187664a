"""The user's own errors and connections stay the user's; collectives between steps are protected.

One real rank in this process (its session, control channel and gloo groups): a ``TimeoutError``
the user's data fetch raises propagates unchanged with no recovery, ``rt.run`` and ``rt.guard``
recover a collective that fails between steps, an unprotected one says how to protect it, and the
user's echo connections, opened before and after the session started, answer through all of it."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshpact.live.trials.ports import unclaimed_port
from meshpact.live.recovery.config import RecoveryConfig
from meshpact.live.recovery.faults import CollectiveFault, _RaiseOnCollective
from meshpact.live.recovery.runtime import GuardedBlockLost, UnsafeLoopError, resilient
from meshpact.live.recovery.session import Session, start_session

from _echo import EchoService

pytestmark = [pytest.mark.live, pytest.mark.slow]


def _answers(sock: socket.socket, word: bytes) -> bool:
    sock.sendall(word)
    return sock.recv(len(word)) == word


@pytest.fixture(scope="module")
def one_rank() -> Iterator[tuple[Session, EchoService, socket.socket]]:
    echo = EchoService()
    before = echo.connect()  # the user's connection, opened before the session started
    port = unclaimed_port()
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "MESHPACT_VENDOR": "cpu",
        "MESHPACT_RUN_ID": f"user-paths-{os.getpid()}",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        session = start_session(RecoveryConfig(standby=False))
        yield session, echo, before
    before.close()
    echo.close()
    for pg in list(c10d._world.pg_map):
        c10d._world.pg_map.pop(pg, None)
        c10d._world.pg_names.pop(pg, None)
        c10d._world.pg_group_ranks.pop(pg, None)
    c10d._world.default_pg = None


def _job(session: Session):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(batch).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()

    return model, optimizer, train_step


def test_a_users_timeout_error_propagates_unchanged_and_starts_no_recovery(one_rank):
    session, echo, before = one_rank
    after = echo.connect()  # the user's connection, opened after the session started
    model, optimizer, train_step = _job(session)
    raised = TimeoutError("the data server did not answer")

    def fetch_then_train(batch: torch.Tensor) -> None:
        if not fetched:
            fetched.append(1)
            raise raised  # the user's own data fetch, before any collective of the step
        train_step(batch)

    fetched: list[int] = []
    with resilient(model, optimizer, session) as rt:
        generation = session.generation
        with pytest.raises(TimeoutError) as got:
            rt.step(fetch_then_train, torch.ones(3, 4))
        assert got.value is raised and rt.recoveries == [] and session.generation == generation
        assert rt.committed_step == 0
        with pytest.raises(ConnectionResetError):  # any of the user's own connection errors
            rt.step(lambda batch: (_ for _ in ()).throw(ConnectionResetError("metrics service reset")), None)
        rt.step(fetch_then_train, torch.ones(3, 4))  # the user retries: the step runs, once
        assert rt.committed_step == 1 and rt.recoveries == []
        assert _answers(before, b"before") and _answers(after, b"after")
    after.close()


def test_run_recovers_a_failed_collective_between_steps_and_runs_it_again_from_the_same_generators(one_rank):
    session, echo, before = one_rank
    after = echo.connect()
    model, optimizer, train_step = _job(session)
    draws: list[float] = []

    def evaluate() -> float:
        noise = torch.rand(1)  # an evaluation that draws: its re-run draws the same
        draws.append(float(noise))
        total = torch.ones(1) + noise
        if len(draws) == 1:
            with _RaiseOnCollective(1, "injected: evaluation all-reduce"):
                dist.all_reduce(total)
        else:
            dist.all_reduce(total)
        return float(total)

    with resilient(model, optimizer, session) as rt:
        rt.step(train_step, torch.ones(3, 4))
        generation = session.generation
        drawn_before = torch.get_rng_state()
        got = rt.run(evaluate)
        assert len(draws) == 2 and draws[0] == draws[1] and got == pytest.approx(1 + draws[0])
        # the training's stream did not move: a replacement, which starts at the next step without
        # the evaluation, draws what this rank draws next
        assert torch.equal(torch.get_rng_state(), drawn_before)
        assert len(rt.recoveries) == 1 and session.generation == generation + 1
        rt.step(train_step, torch.ones(3, 4))  # training goes on over the new generation
        assert rt.committed_step == 2
        with pytest.raises(ValueError):  # the user's own error inside run(): unchanged, no recovery
            rt.run(lambda: int("not a number"))
        assert len(rt.recoveries) == 1
        assert _answers(before, b"ok") and _answers(after, b"ok")
    after.close()


def test_a_guarded_block_recovers_and_says_its_result_is_lost(one_rank):
    session, echo, before = one_rank
    model, optimizer, train_step = _job(session)
    with resilient(model, optimizer, session) as rt:
        rt.step(train_step, torch.ones(3, 4))
        generation = session.generation
        with pytest.raises(GuardedBlockLost, match="rt.run"):
            with rt.guard():
                with _RaiseOnCollective(1, "injected: logging all-reduce"):
                    dist.all_reduce(torch.ones(1))
        assert len(rt.recoveries) == 1 and session.generation == generation + 1
        with rt.guard():  # a block that does not fail runs once, as written
            value = torch.ones(1)
            dist.all_reduce(value)
        assert float(value) == 1.0 and len(rt.recoveries) == 1
        rt.step(train_step, torch.ones(3, 4))
        assert _answers(before, b"guarded")


def test_an_unprotected_collective_failing_between_steps_says_how_to_protect_it(one_rank):
    session, _, _ = one_rank
    model, optimizer, train_step = _job(session)
    with pytest.raises(CollectiveFault) as got:
        with resilient(model, optimizer, session) as rt:
            rt.step(train_step, torch.ones(3, 4))
            with _RaiseOnCollective(1, "injected: an unprotected metrics all-reduce"):
                dist.all_reduce(torch.ones(1))
    notes = getattr(got.value, "__notes__", [])
    assert len(notes) == 1 and "rt.run(fn)" in notes[0] and "rt.guard()" in notes[0]
    assert rt.recoveries == []
    with pytest.raises(ValueError) as other:  # the user's own error leaving the block: no note
        with resilient(model, optimizer, session):
            raise ValueError("bad config")
    assert not getattr(other.value, "__notes__", [])


def test_run_inside_a_step_leaves_the_fault_to_the_step_which_runs_again_whole(one_rank):
    """A logging helper wrapped in rt.run and called from the step too (a loss all-reduce for
    clipping): inside a step it is the step's collective. Its fault re-runs the whole step from
    the committed state, and the heartbeat keeps watching the rest of the step after it returns."""
    session, _, _ = one_rank
    model, optimizer, train_step = _job(session)
    ran: list[int] = []
    watched: list[bool] = []
    reduced: list[int] = []

    def global_loss(loss: torch.Tensor) -> torch.Tensor:
        reduced.append(1)
        if len(reduced) == 1:
            with _RaiseOnCollective(1, "injected: the step's loss all-reduce"):
                dist.all_reduce(loss)
        else:
            dist.all_reduce(loss)
        return loss

    with resilient(model, optimizer, session) as rt:
        rt.step(train_step, torch.ones(3, 4))

        def step_with_logging(batch: torch.Tensor) -> None:
            ran.append(1)
            rt.run(global_loss, model(batch).sum().detach())
            watched.append(rt.heartbeat is None or rt.heartbeat.watching)
            train_step(batch)

        generation = session.generation
        rt.step(step_with_logging, torch.ones(3, 4))
        assert len(ran) == 2 and len(rt.recoveries) == 1 and session.generation == generation + 1
        assert rt.committed_step == 2 and len(reduced) == 2 and watched == [True]
        with pytest.raises(UnsafeLoopError, match="inside a step"):  # a step in a step: refused, the outer one ends
            rt.step(lambda batch: rt.step(train_step, batch), torch.ones(3, 4))
        rt.step(train_step, torch.ones(3, 4))
        assert rt.committed_step == 3
