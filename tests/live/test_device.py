"""The device primitives' CUDA branches, reached on the CPU through a fake ``torch.cuda`` that
records every call in order and refuses the one call a recovery must never make on the hot
path: a device synchronize (a hung NCCL kernel would hold it forever)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from meshpact.live.recovery import device
from meshpact.live.recovery.device import CudaOps, DeviceProgress, HostOps, PinnedSnapshot, StepFence


class FakeCuda:
    """``torch.cuda``'s shape: events complete when the test says, streams are names."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.done_after: dict[int, int] = {}  # event id -> queries before it reports done
        self.streams = 0
        self.current = "default"

    def synchronize(self, *a):  # pragma: no cover - the test fails if it is reached
        raise AssertionError("a device synchronize on the recovery's path")

    def Event(self):
        cuda = self

        class Ev:
            def __init__(self) -> None:
                self.id = len(cuda.calls)
                self.queries = 0

            def record(self, stream=None):
                cuda.calls.append(("record", self.id, stream))

            def query(self):
                self.queries += 1
                cuda.calls.append(("query", self.id))
                return self.queries > cuda.done_after.get(self.id, 0)

            def synchronize(self):  # pragma: no cover
                raise AssertionError("an event synchronize on the recovery's path")

        return Ev()

    def Stream(self):
        self.streams += 1
        name = f"side{self.streams}"
        self.calls.append(("stream", name))
        return FakeStream(self, name)

    def current_stream(self):
        return FakeStream(self, self.current)

    def stream(self, s):
        cuda = self

        class Ctx:
            def __enter__(self):
                cuda.calls.append(("enter", s.name))
                cuda.current, self.was = s.name, cuda.current

            def __exit__(self, *e):
                cuda.calls.append(("exit", s.name))
                cuda.current = self.was

        return Ctx()


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def __eq__(self, other: object) -> bool:  # a stream reads as its name in the call log
        return getattr(other, "name", other) == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def wait_event(self, ev):
        self.cuda.calls.append(("wait_event", self.name, ev.id))


class FakeCudaOps(CudaOps):
    """CudaOps over the fake; host buffers are plain (pinning needs a CUDA build)."""

    def host_buffer(self, like):
        self.cuda.calls.append(("host_buffer", tuple(like.shape)))
        return torch.empty(like.shape, dtype=like.dtype)


def test_a_fence_is_recorded_on_the_training_stream_and_queried_never_synchronized():
    cuda = FakeCuda()
    fence = StepFence(FakeCudaOps(cuda))
    fence.record(7)
    ev = fence.event.id
    cuda.done_after[ev] = 3
    assert ("record", ev, "default") in cuda.calls
    assert fence.done() is False
    assert fence.wait(timeout_s=1.0, poll_s=0.0) is True
    assert fence.step == 7


def test_a_fence_behind_a_hung_kernel_costs_its_bound_and_says_not_done():
    cuda = FakeCuda()
    fence = StepFence(FakeCudaOps(cuda))
    fence.record(1)
    cuda.done_after[fence.event.id] = 10**9  # a kernel that never ends
    t0 = time.monotonic()
    assert fence.wait(timeout_s=0.05) is False
    assert time.monotonic() - t0 < 1.0


def test_an_unrecorded_fence_is_not_done():
    assert StepFence(HostOps()).done() is False


def test_a_snapshot_waits_on_the_fence_on_its_side_stream_before_any_copy():
    cuda = FakeCuda()
    ops = FakeCudaOps(cuda)
    fence = StepFence(ops)
    fence.record(4)
    snap = PinnedSnapshot(ops)
    src = [torch.arange(6.0).reshape(2, 3), torch.ones(5)]
    snap.start(4, src, fence)
    names = [c[0] for c in cuda.calls]
    wait = names.index("wait_event")
    enter = names.index("enter")
    assert cuda.calls[wait] == ("wait_event", "side1", fence.event.id)  # the side stream waits on the step's fence
    assert wait < enter  # before the copies are enqueued on it
    record_copied = [c for c in cuda.calls if c[0] == "record" and getattr(c[2], "name", c[2]) == "side1"]
    assert len(record_copied) == 1 and names.index("exit") > cuda.calls.index(record_copied[0])
    assert all(torch.equal(b, t) for b, t in zip(snap.buffers, src))
    assert snap.step == 4 and snap.ready()


def test_a_snapshot_reuses_its_buffers_and_side_stream_across_steps():
    cuda = FakeCuda()
    ops = FakeCudaOps(cuda)
    fence, snap = StepFence(ops), PinnedSnapshot(ops)
    for step in range(3):
        fence.record(step)
        snap.start(step, [torch.full((4,), float(step))], fence)
    assert sum(1 for c in cuda.calls if c[0] == "host_buffer") == 1
    assert cuda.streams == 1
    assert torch.equal(snap.buffers[0], torch.full((4,), 2.0))


def test_a_snapshot_of_a_step_whose_fence_was_not_recorded_is_refused():
    ops = FakeCudaOps(FakeCuda())
    fence = StepFence(ops)
    fence.record(3)
    with pytest.raises(RuntimeError, match="before that step's fence was recorded"):
        PinnedSnapshot(ops).start(4, [torch.ones(2)], fence)


def test_the_host_snapshot_copies_at_once():
    ops = HostOps()
    fence = StepFence(ops)
    fence.record(0)
    snap = PinnedSnapshot(ops)
    t = torch.randn(3, 3)
    snap.start(0, [t], fence)
    t.add_(1)  # the copy is the step's value, not a view of the live tensor
    assert snap.ready() and not torch.equal(snap.buffers[0], t)


def test_progress_moves_only_with_fences_completed():
    cuda = FakeCuda()
    ops = FakeCudaOps(cuda)
    progress = DeviceProgress()
    fences = []
    for step in range(3):
        f = StepFence(ops)
        f.record(step)
        progress.track(f)
        fences.append(f)
    cuda.done_after[fences[2].event.id] = 10**9  # the last step's kernel hangs
    assert progress.count() == 2
    assert progress.count() == 2  # a host spinning in a sync behind it adds nothing


def test_nccl_groups_are_aborted_each_and_gloo_groups_are_left_to_the_sever():
    aborted: list[object] = []
    groups = [object(), object()]
    assert device.abort_groups(groups, "nccl", abort=aborted.append) == 2
    assert aborted == groups
    assert device.abort_groups(groups, "gloo", abort=aborted.append) == 0
    assert aborted == groups


def test_the_worker_environment_aborts_without_tearing_down():
    assert device.nccl_worker_env({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert device.nccl_worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert device.nccl_worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def test_determinism_on_cuda_sets_the_cublas_workspace_and_refuses_once_cuda_started(monkeypatch):
    turned: list[bool] = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on: turned.append(on))
    env: dict[str, str] = {}
    said = device.deterministic(True, "cuda", env, cuda_initialized=lambda: False)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and turned == [True] and "CUBLAS_WORKSPACE_CONFIG" in said.said
    with pytest.raises(RuntimeError, match="before CUDA starts"):
        device.deterministic(True, "cuda", {}, cuda_initialized=lambda: True)
    assert device.deterministic(False, "cuda", {}).on is False
    assert device.deterministic(True, "cpu", {}).on is True and turned == [True]


def test_device_ops_are_chosen_by_the_device():
    assert isinstance(device.device_ops("cpu"), HostOps)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="finds no CUDA device"):
            device.device_ops("cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would measure it")
def test_the_gpu_check_on_a_machine_without_cuda_says_so_and_writes_nothing():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    before = set((root / "bench" / "results").iterdir())
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "gpu_check.py")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert out.stdout.strip().splitlines() == [
        "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing measured, nothing written"
    ]
    assert set((root / "bench" / "results").iterdir()) == before


class _Group:
    def __init__(self, name: str, log: list, fence: StepFence | None = None) -> None:
        self.group_name, self.log, self.fence = name, log, fence

    def abort(self) -> None:
        self.log.append(
            ("abort", self.group_name) if self.fence is None else ("abort", self.group_name, self.fence.failed)
        )


def test_a_nccl_sever_aborts_every_group_of_the_generation_before_its_sockets(monkeypatch):
    from types import SimpleNamespace

    from meshpact.live.recovery import session as session_mod

    log: list = []
    monkeypatch.setattr(session_mod.comm, "sever", lambda socks, held: log.append(("sever sockets", len(socks))))
    for backend, aborted in (("nccl", ["g_world", "g_dim0"]), ("gloo", [])):
        log.clear()
        cuda = FakeCuda()
        fence, progress = StepFence(FakeCudaOps(cuda)), DeviceProgress()
        fence.record(5)
        cuda.done_after[fence.event.id] = 10**9  # the step's collective hangs when the sever comes
        progress.track(fence)
        groups = {"world": _Group("g_world", log, fence), "dim0": _Group("g_dim0", log, fence)}
        fake = SimpleNamespace(
            spec=SimpleNamespace(backend=backend),
            data_sockets=lambda: {},
            groups=groups,
            severed=None,
            progress=progress,
        )
        session_mod.Session.sever_data_path(fake, tell_peers=False)
        assert [e[1] for e in log if e[0] == "abort"] == aborted
        assert log[-1][0] == "sever sockets"  # the aborts come first
        # on NCCL the running step's fence is failed before any abort (an aborted kernel returns and the
        # fence behind it would then read done); on gloo the sever leaves it (a severed collective raises)
        assert all(e[2] for e in log if e[0] == "abort")
        assert fence.failed is (backend == "nccl")


def test_replaced_nccl_groups_are_retired_by_abort(monkeypatch):
    from types import SimpleNamespace

    from meshpact.core.recovery import CommunicatorAction
    from meshpact.live.recovery import pipeline

    log: list = []
    monkeypatch.setattr(pipeline, "retire", lambda rt, old, ops: log.append(("retire", old.group_name)))
    old = (_Group("a_g0", log), _Group("b_g0", log))
    for backend, want in (
        ("nccl", [("retire", "a_g0"), ("retire", "b_g0"), ("abort", "a_g0"), ("abort", "b_g0")]),
        ("gloo", [("retire", "a_g0"), ("retire", "b_g0")]),
    ):
        log.clear()
        rt = SimpleNamespace(counter=None, session=SimpleNamespace(spec=SimpleNamespace(backend=backend)))
        pipeline.retire_replaced(rt, pipeline.Rebound(0.0, 0.0, CommunicatorAction.REBUILD, old))
        assert log == want


# -- the runtime wired through the primitives ------------------------------------------------
class _Never(dict):
    """``done_after`` for a device whose kernels never end (a hung collective)."""

    def get(self, key, default=None):
        return 10**9


class _Slow(dict):
    """``done_after`` for a device whose work completes on the third query."""

    def get(self, key, default=None):
        return 2


class _LoggedSGD(torch.optim.SGD):
    """SGD whose update is written in the fake device's call log, where the device would run it."""

    def __init__(self, params, cuda: FakeCuda) -> None:
        super().__init__(params, lr=0.1)
        self.cuda = cuda

    def step(self, closure=None):
        self.cuda.calls.append(("update", self.cuda.current))
        return super().step(closure)


class _Stop(Exception):
    pass


def _runtime(cuda: FakeCuda, peers=None, buffers: bool = False):
    """A Resilient with only what ``step`` and the optimizer hooks read: no session, no groups."""
    from types import SimpleNamespace

    from meshpact.live.recovery.runtime import Resilient

    model = torch.nn.Linear(3, 2)
    rt: Any = Resilient.__new__(Resilient)
    rt.session = SimpleNamespace(
        ops=FakeCudaOps(cuda),
        progress=DeviceProgress(),
        spec=SimpleNamespace(timeout_s=0.05),
        generation=1,
        config=SimpleNamespace(restore_rng=False),
    )
    rt.model, rt.optimizer, rt.peers = model, _LoggedSGD(model.parameters(), cuda), peers
    rt.committed_step, rt.heartbeat, rt.injector, rt.objects, rt.fence = 0, None, None, {}, None
    rt._optimizer_hook, rt._first_step, rt.max_attempts, rt._in_step = None, False, 2, False
    rt._buffers = {"buffer/running_mean": torch.zeros(2)} if buffers else {}
    rt.refresh_objects = list
    rt.commits, rt.causes = [], []
    rt._commit = lambda step, batch: rt.commits.append(step)
    rt._measure = lambda *a: None

    def recover(cause):
        rt.causes.append(cause.message)
        raise _Stop

    rt._recover = recover
    rt.watch_optimizer()
    return rt


def _train(rt):
    def train_step(batch):
        rt.optimizer.zero_grad()
        rt.model(batch).sum().backward()
        rt.optimizer.step()

    return train_step


def test_a_step_is_committed_only_once_its_fence_recorded_after_the_optimizer_step_is_done():
    cuda = FakeCuda()
    rt = _runtime(cuda)
    rt.step(_train(rt), torch.ones(4, 3))
    assert rt.commits == [0]
    names = [c[0] for c in cuda.calls]
    fence = rt.fence.event.id
    assert names.index("update") < cuda.calls.index(("record", fence, "default"))  # after the update
    assert ("query", fence) in cuda.calls and rt.session.progress.count() == 1  # queried, and the heartbeat sees it


def test_a_step_whose_device_work_hangs_is_recovered_and_never_committed():
    cuda = FakeCuda()
    cuda.done_after = _Never()
    rt = _runtime(cuda)
    t0 = time.monotonic()
    with pytest.raises(_Stop):
        rt.step(_train(rt), torch.ones(4, 3))
    assert time.monotonic() - t0 < 5.0  # the fence's bound, the data-path timeout, not the hung kernel
    assert rt.commits == [] and "did not complete within 0.05 s" in rt.causes[0]


def test_a_step_whose_data_path_was_aborted_is_never_committed_though_its_fence_then_completes():
    cuda = FakeCuda()
    rt = _runtime(cuda)
    train = _train(rt)

    def aborted_under_it(batch):
        train(batch)
        rt.session.progress.fail_running()  # the heartbeat's sever aborts the groups before the fence was seen
        cuda.done_after.clear()  # the aborted kernels return: the event itself would now read done

    cuda.done_after = _Never()
    with pytest.raises(_Stop):
        rt.step(aborted_under_it, torch.ones(4, 3))
    assert rt.commits == [] and "aborted" in rt.causes[0]


def test_the_next_optimizer_update_waits_on_the_devices_copy_of_the_last_snapshot():
    from types import SimpleNamespace

    cuda = FakeCuda()
    rt = _runtime(cuda, peers=SimpleNamespace(protect=lambda: cuda.calls.append(("protect", cuda.current))))
    rt.step(_train(rt), torch.ones(4, 3))
    names = [c[0] for c in cuda.calls]
    assert names.count("protect") == 1 and names.index("protect") < names.index("update")
    # a model with buffers its forward updates: the wait comes before the forward too
    cuda = FakeCuda()
    rt = _runtime(
        cuda, peers=SimpleNamespace(protect=lambda: cuda.calls.append(("protect", cuda.current))), buffers=True
    )
    rt.step(_train(rt), torch.ones(4, 3))
    assert cuda.calls[0][0] == "protect"


def test_a_snapshots_copies_hold_the_training_streams_next_writes_once():
    cuda = FakeCuda()
    ops = FakeCudaOps(cuda)
    fence, snap = StepFence(ops), PinnedSnapshot(ops)
    fence.record(2)
    snap.start(2, [torch.ones(3)], fence)
    snap.protect()
    snap.protect()
    waits = [c for c in cuda.calls if c[0] == "wait_event" and c[1] == "default"]
    assert waits == [("wait_event", "default", snap.copied.id)]


class _TrainingStreamRefused(torch.overrides.TorchFunctionMode):
    """Refuses, while the fake device's current stream is the training stream, every call that
    computes on the state or copies it to the host: behind a hung kernel each would wait forever."""

    WORK = frozenset(
        {"cpu", "to", "cat", "stack", "copy_", "clone", "contiguous", "numpy", "item", "tolist", "ne", "eq"}
    )

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.cuda.current == "default" and name in self.WORK:
            raise AssertionError(f"{name} enqueued on the training stream")
        return func(*args, **(kwargs or {}))


def test_detection_reads_the_state_on_a_side_stream_and_never_waits_for_the_training_stream():
    from meshpact.live.recovery.state import CommitMark

    cuda = FakeCuda()
    ops = FakeCudaOps(cuda)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    fence = StepFence(ops)
    fence.record(0)
    cuda.calls.append(("logging all-reduce", "default"))  # enqueued after the optimizer step, before the commit
    with _TrainingStreamRefused(cuda):
        mark = CommitMark.take(1, model, opt, ops=ops, after=fence.event)  # at a commit: its fence is done
    take = [c for c in cuda.calls if c[0] == "wait_event"]
    # the reader waited for the state as the optimizer step left it, not for the collective after it
    assert take == [("wait_event", ops.reader, fence.event.id)]
    cuda.calls.clear()
    with _TrainingStreamRefused(cuda):
        assert mark.verify(1, model, opt, ops=ops).changed == ""
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1.0  # the failed step's update (the test's own write)
        assert "written" in mark.verify(1, model, opt, ops=ops).changed
        opt.state.clear()  # optimizer state gone: the full listing, read on the side stream too
        assert mark.verify(1, model, opt, ops=ops).changed
    # after the abort nothing orders the reads behind the training stream: no wait on it at all
    assert not [c for c in cuda.calls if c[0] == "wait_event"]
    assert {c[1] for c in cuda.calls if c[0] == "enter"} == {ops.reader.name}


def test_on_cuda_a_commit_only_enqueues_pinned_copies_and_never_waits_for_the_ship_in_flight(monkeypatch):
    import threading

    from meshpact.live.recovery import peers
    from meshpact.live.recovery.jobkey import draw

    key = draw().derive("peer")
    cuda = FakeCuda()
    cuda.done_after = _Slow()  # every copy lands on the third look
    ops = FakeCudaOps(cuda)
    release, shipped = threading.Event(), []

    def slow_put(address, src, step, payload, timeout_s, gate=None, *, key=None, digest=None):
        assert digest == peers.copy_digest(payload)  # the digest is of the landed copy
        shipped.append((step, bytes(payload[1])))
        cuda.calls.append(("put", step))
        release.wait(10)

    monkeypatch.setattr(peers, "put", slow_put)
    server, holder = peers.PeerServer("127.0.0.1", key=key), peers.PeerServer("127.0.0.1", key=key)
    table = {
        f"peer/rank{r}": {"host": "h", "addr": s.addr, "port": s.port, "incarnation": 0}
        for r, s in ((0, server), (1, holder))
    }

    class Channel:
        def wait(self, keys, timeout_s=None):
            return {k: table[k] for k in keys}

    copier = peers.PeerCopier(0, 2, 1, Channel(), server, timeout_s=5.0, ops=ops)
    try:
        copier.refresh()
        states = {
            s: {"param/w": torch.full((64,), float(s)), "optim/w/step": torch.tensor(float(s))} for s in (1, 2, 3)
        }
        copier.commit(1, states[1])
        deadline = time.monotonic() + 5
        while not shipped and time.monotonic() < deadline:
            time.sleep(0.005)
        assert [s for s, _ in shipped] == [1]  # step 1's ship is under way, held by the slow holder
        in_flight = copier._slabs[1]
        ended = threading.Event()

        def commits() -> None:
            copier.commit(2, states[2])
            copier.commit(3, states[3])
            ended.set()

        threading.Thread(target=commits, daemon=True).start()
        assert ended.wait(3.0), "a commit waited for the ship in flight"
        assert copier.own_steps() == (2, 3) and copier._slabs[3] is not in_flight  # the slab in flight not refilled
        release.set()
        assert copier.drain(5)
        assert [s for s, _ in shipped] == [1, 3] and copier.superseded == 1  # step 2 was superseded
        layout = copier._slabs[3].layout
        body = shipped[1][1]
        for name, n, at in zip(layout.names, layout.nbytes, layout.offsets):
            assert torch.equal(
                torch.frombuffer(bytearray(body[at : at + n]), dtype=torch.float32), states[3][name].reshape(-1)
            )
        copied = copier._slabs[3].snapshot.copied.id
        assert cuda.calls.index(("put", 3)) > max(i for i, c in enumerate(cuda.calls) if c == ("query", copied))
        assert sum(1 for c in cuda.calls if c == ("query", copied)) == 3  # shipped once the copies landed, not before
        hosts = [c for c in cuda.calls if c[0] == "host_buffer"]
        assert hosts and all(len(h[1]) == 1 for h in hosts)  # each slab one pinned buffer
        # every snapshot's side stream waited on an event of the training stream before its copies
        names = [c[0] for c in cuda.calls]
        assert names.count("enter") == 3
        for i, c in enumerate(cuda.calls):
            if c[0] == "enter":
                assert cuda.calls[i - 1][0] == "wait_event" and cuda.calls[i - 1][1] == c[1] != "default"
    finally:
        release.set()
        copier.close()
        server.close()
        holder.close()


def test_on_a_device_the_heartbeat_counts_fences_completed_not_a_host_spinning_in_a_sync():
    from meshpact.live.recovery.heartbeat import Look, device_moved, progressed

    cuda = FakeCuda()
    ops = FakeCudaOps(cuda)
    progress = DeviceProgress()
    fence = StepFence(ops)
    fence.record(0)
    cuda.done_after[fence.event.id] = 1  # done from its second query on
    progress.track(fence)
    moved, seen = device_moved(progress, 0)
    assert (moved, seen) == (False, 0)
    # the host spins in a CUDA call: its frame, CPU time and scheduler state all say busy
    spinning = {
        "watching": True,
        "in_comm": False,
        "moved": True,
        "main_cpu_s": 0.5,
        "state": "R",
        "native_cpu_s": 0.5,
        "in_torch": True,
    }
    assert progressed(Look(**spinning)) is True  # the CPU's rule (device_moved None) calls that progress
    assert progressed(Look(**spinning, device_moved=moved)) is False
    moved, seen = device_moved(progress, seen)
    assert (moved, seen) == (True, 1) and progressed(Look(**spinning, device_moved=moved)) is True
    assert device_moved(None, 7) == (None, 7)  # on the CPU nothing is counted
    # waiting on its peers in torch's communication code is progress on a device too, as on the CPU
    assert progressed(Look(**{**spinning, "in_comm": True}, device_moved=False)) is True


def test_on_nccl_the_standby_is_built_between_steps_on_the_training_thread_on_gloo_beside_it(monkeypatch):
    import threading
    from types import SimpleNamespace

    from meshpact.live.recovery.communicator import Standby

    ran: list[str] = []

    def build(self) -> None:  # what _run does, less the groups: where it runs
        ran.append(threading.current_thread().name)
        self._done.set()

    monkeypatch.setattr(Standby, "_run", build)
    for backend in ("nccl", "gloo"):
        ran.clear()
        sb = Standby(SimpleNamespace(backend=backend, device="cpu"), lambda: None, 1, ())
        sb.start()
        if backend == "nccl":
            assert ran == [] and not sb.status((), 0.0).ready  # nothing built beside the training thread's step
            assert "between steps" in sb.status((), 0.0).reason and sb.join(0.0)
            assert sb.build_between_steps() is True and ran == [threading.current_thread().name]
            assert sb.build_between_steps() is False and len(ran) == 1  # once
        else:
            assert sb.join(5.0) and ran and ran[0] != threading.current_thread().name
            assert sb.build_between_steps() is False and len(ran) == 1
    discarded = Standby(SimpleNamespace(backend="nccl", device="cpu"), lambda: None, 1, ())
    discarded.discard()
    assert discarded.build_between_steps() is False


def test_progress_holds_only_the_fences_still_running():
    progress = DeviceProgress()
    for step in range(1000):  # the CPU's fences, done at once: none is kept, however long the job
        f = StepFence(HostOps())
        f.record(step)
        progress.track(f)
    assert len(progress._fences) == 1 and progress.count() == 1000
