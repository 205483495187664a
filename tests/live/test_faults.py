"""Fault plans and trial settings: bad input is refused with what was expected."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshpact.core.errors import MeshpactError
from meshpact.live.recovery.faults import CollectiveFault, FaultInjector, FaultKind, plan_faults
from meshpact.live.recovery.runtime import COMM_MODULES, is_comm_fault
from meshpact.live.trials.trial import TrialConfig
from meshpact.live.recovery.jobkey import draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with


def test_faults_land_on_distinct_steps_with_rotating_ranks():
    faults = plan_faults("collective", steps=40, count=10, world_size=4)
    assert len({f.step for f in faults}) == 10 and all(1 <= f.step < 40 for f in faults)
    assert [f.rank for f in faults[:5]] == [0, 1, 2, 3, 0]
    assert all(f.kind is FaultKind.COLLECTIVE for f in faults)


def test_stalls_are_placed_where_the_heartbeat_judges_them():
    # a rank's first completed step (the warm-up) teaches the heartbeat no usual pause: a stall in
    # step 1 would pass as a slow step, so three stalls in six steps go to steps 2..5
    stalls = plan_faults("stall", steps=6, count=3, world_size=4)
    assert len({f.step for f in stalls}) == 3 and min(f.step for f in stalls) >= 2
    assert min(f.step for f in plan_faults("collective", steps=6, count=3, world_size=4)) == 1
    with pytest.raises(MeshpactError, match=r"cannot place 5 fault\(s\) \(stall\) .* from step 2"):
        plan_faults("stall", steps=6, count=5, world_size=4)


def test_too_many_faults_for_the_steps_is_refused():
    with pytest.raises(MeshpactError, match="cannot place 12 fault"):
        plan_faults("stall", steps=10, count=12, world_size=2)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"ranks": 1}, "--ranks must be at least 2"),
        ({"checkpoint_every": 0}, "--checkpoint-every must be between 1"),
        (
            {"fault_kind": "stall", "stall_s": 0.5, "data_timeout_s": 1.0, "heartbeat": False},
            "must outlast the data-path timeout",
        ),
        (
            {"fault_kind": "partition", "down_s": 0.5, "data_timeout_s": 1.0, "heartbeat": False},
            r"must outlast the hang detection bound \(1 s: the data-path timeout\)",
        ),
        (
            {"fault_kind": "stall", "stall_s": 0.15, "data_timeout_s": 30.0},
            r"must outlast the heartbeat detection bound \(0.2",
        ),
        (
            {"fault_kind": "partition", "down_s": 0.15, "data_timeout_s": 30.0},
            r"must outlast the hang detection bound \(0.2 s: the heartbeat\)",
        ),
    ],
)
def test_trial_settings_are_checked(kw, message):
    with pytest.raises(MeshpactError, match=message):
        TrialConfig(**kw)


def test_unknown_fault_kind_is_refused():
    with pytest.raises(ValueError):
        TrialConfig(fault_kind="meteor")


def _raised_in(filename: str, exc: BaseException) -> BaseException:
    """``exc`` as if raised by code in ``filename`` (its innermost traceback frame there)."""
    namespace: dict = {}
    exec(compile("def fail(e):\n    raise e\n", filename, "exec"), namespace)
    try:
        namespace["fail"](exc)
    except BaseException as caught:  # noqa: BLE001
        return caught
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    "exc",
    [
        CollectiveFault("anything"),
        dist.DistBackendError("x"),
        dist.DistNetworkError("x"),
        dist.DistStoreError("x"),
    ],
)
def test_torchs_distributed_errors_and_injected_faults_are_comm_faults_by_type(exc):
    assert is_comm_fault(exc)


@pytest.mark.parametrize("exc", [TimeoutError("x"), ConnectionResetError("x"), BrokenPipeError("x"), OSError("x")])
def test_a_timeout_or_connection_error_is_the_users_unless_raised_in_torch_communication_code(exc):
    """A flaky data fetch or metrics client raises these in the user's code: no recovery for it."""
    assert not is_comm_fault(exc)
    assert not is_comm_fault(_raised_in("/home/user/data.py", type(exc)("x")))
    if type(exc) is not OSError:
        assert is_comm_fault(_raised_in(COMM_MODULES[0], type(exc)("x")))


def test_a_users_error_raised_from_a_failed_collective_is_a_comm_fault():
    """The user wrapped a collective's failure in an error of their own: the data path is still broken."""
    try:
        try:
            raise dist.DistBackendError("Connection closed by peer")
        except dist.DistBackendError as inner:
            raise ValueError("evaluation failed") from inner
    except ValueError as outer:
        assert is_comm_fault(outer)
    try:
        try:
            raise KeyError("missing sample")
        except KeyError:
            raise TimeoutError("data server")  # raised while handling the user's own error
    except TimeoutError as outer:
        assert not is_comm_fault(outer)


def test_a_plain_runtime_error_is_a_comm_fault_only_when_raised_in_torch_communication_code():
    c10d_file = COMM_MODULES[0]  # distributed_c10d.py
    assert is_comm_fault(_raised_in(c10d_file, RuntimeError("Connection closed by peer")))
    assert is_comm_fault(_raised_in(COMM_MODULES[3] + "_fully_shard/_fsdp_collectives.py", RuntimeError("x")))
    # the words of a gloo error do not make one: raised in the user's step, it is a bug
    assert not is_comm_fault(
        _raised_in(
            "/home/user/train.py",
            RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer; socket timed out"),
        )
    )
    assert not is_comm_fault(RuntimeError("peer socket collective timed out"))  # no traceback at all
    # another type raised in c10d is not a transport failure
    assert not is_comm_fault(_raised_in(c10d_file, ValueError("Invalid rank")))
    assert not is_comm_fault(_raised_in(c10d_file, KeyError("peer")))


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        NotImplementedError("reduce_scatter_tensor is not implemented for this dtype"),
        RecursionError("maximum recursion depth exceeded"),
    ],
)
def test_a_runtime_errors_subclass_raised_in_communication_code_is_not_a_fault(exc):
    """FSDP2's all-gather allocates its buffers in its collectives' code: running out of memory
    there, or an operation torch does not implement, is no broken data path. Recovered, it would
    fail again at every attempt and end in a checkpoint restore; it must reach the user at once."""
    fsdp_file = COMM_MODULES[3] + "_fully_shard/_fsdp_collectives.py"
    assert not is_comm_fault(_raised_in(fsdp_file, exc))
    assert not is_comm_fault(_raised_in(COMM_MODULES[0], type(exc)("x")))


class _Channel:
    """The control channel's surface the injector uses, in memory, recording the order of calls."""

    world_size = 2

    def __init__(self) -> None:
        self.keys: dict = {}
        self.log: list = []

    def set(self, key, value):
        self.keys[key] = value
        self.log.append(("set", key))

    def set_once(self, key, value):
        return self.keys.setdefault(key, value)

    def wait(self, keys, timeout_s=None):
        self.log.append(("wait", tuple(keys)))
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise TimeoutError(missing)
        return {k: self.keys[k] for k in keys}


def test_a_partition_is_cut_only_once_every_rank_has_entered_the_step(monkeypatch):
    """Cut earlier, a slower rank still receiving the previous step's tail would end it one
    committed step behind the others (seen at load average 6: a restore instead of memory)."""
    faults = plan_faults("partition", steps=8, count=1, world_size=2, injector_ranks=(0,))
    step = faults[0].step
    channel = _Channel()
    injector0 = FaultInjector(faults, 0, channel, down_s=1.0, data_iface="veth-test")
    injector1 = FaultInjector(faults, 1, channel, down_s=1.0, data_iface="veth-test")
    monkeypatch.setattr(injector0, "_partition", lambda: channel.log.append(("cut",)))
    with pytest.raises(TimeoutError):  # rank 1 has not entered the step: no cut
        with injector0.around_step(step):
            pass
    assert ("cut",) not in channel.log
    with injector1.around_step(step):
        pass
    # the arrivals and the cut are the injector's own work, done before the runtime watches the
    # step (a rank asleep on the control channel there would read as stalled): nothing is left to fire
    assert injector0.arm(step) is None
    assert channel.log[-1] == ("cut",)
    assert channel.log[-2] == ("wait", ("arrived/0/rank0", "arrived/0/rank1"))


def test_a_rank_and_its_holders_killed_at_one_step_die_only_once_all_of_them_are_in_it():
    """Each kill of a group at one step waits for the others' arrival before it fires: a holder still
    in the last step's tail would otherwise learn of the first death, restore the rank from its
    copy and die after, and the trial meant to lose the state with its holders would not."""
    import threading

    from meshpact.live.recovery.control import ControlChannel
    from meshpact.live.recovery.faults import Fault
    from meshpact.live.store import host_store

    faults = (Fault(0, FaultKind.KILL, 3, 0), Fault(1, FaultKind.KILL, 3, 1), Fault(2, FaultKind.KILL, 5, 2))
    server = host_store("127.0.0.1", 0)
    lost, holder, alone = (
        FaultInjector(faults, r, ControlChannel("127.0.0.1", server.port, r, 3, 5.0, key=KEY)) for r in range(3)
    )
    assert lost.kills_together == {3: [0, 1]}
    armed: list = []
    first = threading.Thread(target=lambda: armed.append(lost.arm(3)))
    first.start()
    first.join(0.5)
    assert first.is_alive() and not armed  # the holder is not in step 3 yet: rank 0 does not die
    assert holder.arm(3) == faults[1]
    first.join(5.0)
    assert armed == [faults[0]]  # both fire now, together
    assert alone.arm(5) == faults[2]  # a kill of its own waits for nobody
    # a partner that never comes (gone already) leaves the rank to die alone once the channel's bound ran out
    channel = _Channel()
    assert FaultInjector(faults, 0, channel).arm(3) == faults[0]
    assert ("wait", ("arrived/kill3/rank0", "arrived/kill3/rank1")) in channel.log
    del server


class _C10dOp:
    """What the injector's dispatch mode sees of a c10d operation: its namespace."""

    namespace = "c10d"

    def __call__(self, *args, **kwargs):
        return "done"


def test_a_raised_collective_is_timed_from_its_raise_not_from_the_step_it_was_armed_in():
    """The ops of the step before the n-th are the step's work (a 100 MB all-gather took 1.4 s at
    gpt100m): timed from the arming, a fault's detection counted them."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    faults = plan_faults("collective", steps=4, count=1, world_size=2, injector_ranks=(0,), nth_op=2)
    channel = _Channel()
    injector = FaultInjector(faults, 0, channel)
    fault = injector.arm(faults[0].step)
    armed = dict(channel.keys["fault/0"])
    with injector.fire(fault):
        (mode,) = _get_current_dispatch_mode_stack()
        assert mode.__torch_dispatch__(_C10dOp(), ()) == "done"  # the first op of the step goes through
        assert channel.keys["fault/0"] == armed
        with pytest.raises(CollectiveFault):
            mode.__torch_dispatch__(_C10dOp(), ())
    raised = channel.keys["fault/0"]
    assert raised["t_wall"] > armed["t_wall"]
    assert {k: v for k, v in raised.items() if k != "t_wall"} == {k: v for k, v in armed.items() if k != "t_wall"}
    # the claim still holds: a replayed step or a replacement process does not fire it again
    assert FaultInjector(faults, 0, channel).arm(faults[0].step) is None
