"""Probes of the communicator path alone: rebuild + rebind timing, the rebind audit, the peer.

:func:`rebind_probe` is a worker that builds the FSDP2 harness on a live job and then, round
after round, builds the next generation's group, installs it, rebinds every cached reference
and runs a training step on it. It times each part and audits the result: which objects
referred to the old group before and after (:func:`meshpact.live.recovery.rebind.find_references`),
whether the old group object was released (a weak reference), whether c10d still resolves
its name, and how many operations it received after the rebind (:class:`OpCounter`).

:func:`torchft_probe` measures the peer on the same machine: torchft's ``ProcessGroupGloo``
reconfigured in place (``configure`` under a fresh store prefix) plus its first collective.
:func:`checkpoint_probe` measures per-update asynchronous checkpointing.
:func:`false_alarm_probe` trains with no fault for a while at the default settings and counts
every recovery (each a false alarm) and every heartbeat alarm among them.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

from meshpact.core.jsonform import JsonValue

if TYPE_CHECKING:
    from ..recovery.checkpoint import AsyncCheckpointStats

__all__ = [
    "rebind_probe",
    "site_audit",
    "torchft_probe",
    "checkpoint_probe",
    "false_alarm_probe",
    "FalseAlarms",
    "ProbeArgs",
    "RebindAudit",
    "RebindResult",
    "SiteAudit",
    "SiteAuditResult",
    "TorchftResult",
    "CheckpointResult",
]

JsonArgs = Mapping[str, JsonValue]  # a probe's arguments as the launcher hands them over (JSON)


@dataclass(frozen=True)
class ProbeArgs:
    """Every probe's arguments, typed; absent ones take these defaults (each probe has its own)."""

    rounds: int | None = None
    steps: int | None = None
    data_timeout_s: float | None = None
    timeout_s: float | None = None
    model: Mapping[str, JsonValue] = field(default_factory=dict)
    skip_sites: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    mesh_names: tuple[str, ...] = ()
    dir: str | None = None

    @classmethod
    def of(cls, args: JsonArgs) -> "ProbeArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown probe argument(s) {unknown}; expected some of {sorted(known)}")
        seqs = {k: tuple(args[k]) for k in ("skip_sites", "mesh_shape", "mesh_names") if args.get(k) is not None}
        return cls(**{**args, **seqs})


@dataclass(frozen=True)
class RebindAudit:
    """One round of :func:`rebind_probe`: who referred to the old group before and after."""

    old_group: str
    new_group: str
    references_before: list[str]
    references_after: list[str]
    rebound: dict[str, int]
    old_released: bool
    old_name_resolvable: bool
    old_ops_after: int
    old_seq_ops_after: int
    new_ops: int


@dataclass(frozen=True)
class RebindResult:
    rank: int
    build_ms: list[float]
    rebind_ms: list[float]
    first_op_ms: list[float]
    audits: list[RebindAudit]
    median_rebind_ms: float
    reconfigure_available: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class SiteAudit:
    """One rebinding site skipped, then applied (see :func:`site_audit`)."""

    applied: int
    missed: list[str]
    clean: list[str]
    old_ops_after: int
    new_ops: int


@dataclass(frozen=True)
class SiteAuditResult:
    rank: int
    sites: dict[str, SiteAudit]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class TorchftResult:
    """torchft's configure + first allreduce per round (wall time, and the process's CPU over
    every thread: the measure a recovery's ``cpu_s`` takes), or why it could not run."""

    rank: int
    configure_first_op_ms: list[float]
    error: str | None = None
    configure_first_op_cpu_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        if self.error is None:
            del out["error"]
        return out


@dataclass(frozen=True)
class CheckpointResult:
    rank: int
    stats: "AsyncCheckpointStats"
    file_bytes_written: int

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, **self.stats.to_dict(), "file_bytes_written": self.file_bytes_written}


def rebind_probe(raw: JsonArgs) -> dict[str, object]:
    import torch
    import torch.distributed.distributed_c10d as c10d

    from ..recovery import communicator as comm
    from .harness import ModelConfig, build, make_batch, make_train_step
    from ..recovery.opcount import OpCounter
    from ..recovery.rebind import ModuleScan, default_roots, find_references, rebind
    from ..recovery.config import RecoveryConfig
    from ..recovery.session import c10d_default, start_session

    args = ProbeArgs.of(raw)
    session = start_session(
        RecoveryConfig(data_timeout_s=args.data_timeout_s or 10.0, checkpoint_dir=None, peer_copies=0)
    )
    cfg = ModelConfig(**args.model)
    model, optimizer = build(cfg, session.mesh)
    train_step = make_train_step(model, optimizer)
    counter = OpCounter()
    rounds = args.rounds or 3
    build_ms: list[float] = []
    rebind_ms: list[float] = []
    first_op_ms: list[float] = []
    audits: list[RebindAudit] = []
    scan = ModuleScan()  # kept between rounds, as a job keeps it between recoveries
    scan.modules()  # its first walk, which a job makes at its first recovery, is not a rebind's cost
    with counter:
        step = 0
        train_step(make_batch(cfg, step, session.rank))
        step += 1
        for gen in range(1, rounds + 1):
            old = session.group
            before = [p for p, g in find_references(default_roots(model, optimizer)) if g is old]
            t0 = time.perf_counter()
            new = comm.build_group(session.spec, session.store, gen)
            t1 = time.perf_counter()
            report = rebind(old, new, model, optimizer, [session.mesh], skip=args.skip_sites, scan=scan)
            c10d_default(new)
            t2 = time.perf_counter()
            session.groups[comm.WORLD] = new  # type: ignore[index]  # the probe swaps WORLD in place: a rebind of the one group
            old_name, ops_at_rebind = old.group_name, counter.counts.get(old.group_name, 0)
            old_backend = old._get_backend(torch.device("cpu"))
            seq_at_rebind = old_backend._get_sequence_number_for_group()  # type: ignore[attr-defined]  # private, not in the stub
            ref = weakref.ref(old)
            del old
            gc.collect()
            t3 = time.perf_counter()
            x = torch.ones(1)
            torch.distributed.all_reduce(x)
            t4 = time.perf_counter()
            train_step(make_batch(cfg, step, session.rank))
            step += 1
            seq_after = old_backend._get_sequence_number_for_group() - seq_at_rebind  # type: ignore[attr-defined]  # (as above)
            del old_backend
            after = [p for p, g in find_references(default_roots(model, optimizer)) if g.group_name == old_name]
            try:
                c10d._resolve_process_group(old_name)
                resolvable = True
            except (LookupError, RuntimeError, ValueError):
                resolvable = False
            build_ms.append((t1 - t0) * 1e3)
            rebind_ms.append((t2 - t1) * 1e3)
            first_op_ms.append((t4 - t3) * 1e3)
            audits.append(
                RebindAudit(
                    old_name,
                    new.group_name,
                    sorted(set(before)),
                    sorted(set(after)),
                    dict(report.counts),
                    ref() is None,
                    resolvable,
                    counter.counts.get(old_name, 0) - ops_at_rebind,
                    seq_after,
                    counter.counts.get(new.group_name, 0),
                )
            )
    return RebindResult(
        session.rank,
        build_ms,
        rebind_ms,
        first_op_ms,
        audits,
        statistics.median(rebind_ms),
        comm.can_reconfigure(session.group),
    ).to_dict()


def _stale(model: Any, optimizer: Any, meshes: list[Any], old: Mapping[str, Any]) -> list[str]:
    """Everything that still leads to a retired group: object paths, name paths, and names c10d
    still resolves."""
    import torch.distributed.distributed_c10d as c10d

    from ..recovery.rebind import default_roots, find_references

    old_ids = {id(g) for g in old.values()}
    old_names = frozenset(g.group_name for g in old.values())
    roots = {**default_roots(model, optimizer), "all_meshes": meshes}
    out = sorted({p for p, o in find_references(roots, names=old_names) if id(o) in old_ids or o in old_names})
    for name in sorted(old_names):
        try:
            c10d._resolve_process_group(name)
            out.append(f"c10d resolves {name}")
        except (LookupError, RuntimeError, ValueError):
            pass
    return out


def site_audit(raw: JsonArgs) -> dict[str, object]:
    """For each rebinding site in turn, on the harness sharded over ``mesh_shape``: replace every
    group of the job, rebind with that one site skipped and audit (the miss must be found, by
    object or by name), then apply the skipped site, audit again (nothing must be found) and
    train a step (the retired groups must receive no operation)."""
    from ..recovery import communicator as comm
    from .harness import ModelConfig, build, make_batch, make_train_step
    from ..recovery.rebind import SITES, rebind
    from ..recovery.runtime import device_meshes
    from ..recovery.config import RecoveryConfig
    from ..recovery.session import c10d_default, start_session

    args = ProbeArgs.of(raw)
    shape = args.mesh_shape
    session = start_session(
        RecoveryConfig(data_timeout_s=args.data_timeout_s or 30.0, peer_copies=0),
        shape or None,
        args.mesh_names or None,
    )
    cfg = ModelConfig()
    model, optimizer = build(cfg, session.mesh)
    train_step = make_train_step(model, optimizer)
    step = 0
    train_step(make_batch(cfg, step, session.rank))
    meshes = device_meshes()
    sites: dict[str, SiteAudit] = {}
    for gen, site in enumerate(SITES, start=1):
        old = dict(session.groups)
        new = session.build_groups(gen)
        rebound = 0
        for base in old:
            rebound += rebind(old[base], new[base], model, optimizer, meshes, skip=(site.name,)).total
        c10d_default(new[comm.WORLD])
        missed = _stale(model, optimizer, meshes, old)
        applied = sum(rebind(old[base], new[base], model, optimizer, meshes, only=(site.name,)).total for base in old)
        clean = _stale(model, optimizer, meshes, old)
        backends = [comm.backend_of(g, session.spec.device) for g in old.values()]
        seq0 = [comm.sequence_number(b) for b in backends]
        assert session.current is not None  # the session's first generation is built at its start
        session.advance(replace(session.current, number=gen, groups=new))
        del old
        step += 1
        train_step(make_batch(cfg, step, session.rank))
        sites[site.name] = SiteAudit(
            applied,
            missed,
            clean,
            sum(comm.sequence_number(b) - s0 for b, s0 in zip(backends, seq0)),
            sum(comm.sequence_number(comm.backend_of(g, session.spec.device)) for g in new.values()),
        )
        del backends
    return SiteAuditResult(session.rank, sites).to_dict()


def torchft_probe(raw: JsonArgs) -> dict[str, object]:
    """torchft 0.2.0's in-place reconfigure of a gloo group plus its first collective."""
    import torch
    from torch.distributed import AllreduceOptions

    args = ProbeArgs.of(raw)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        from torchft.process_group import ProcessGroupGloo
    except ImportError as exc:
        return TorchftResult(rank, [], f"torchft is not installed ({exc}); pip install 'meshpact[bench]'").to_dict()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout_s or 10.0))
    times, cpu = [], []
    for i in range(args.rounds or 10):
        t0, c0 = time.perf_counter(), time.process_time()
        pg.configure(f"{host}:{port}/torchft/{i}", "replica", rank, world)
        x = torch.ones(1)
        pg.allreduce([x], AllreduceOptions()).wait()
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return TorchftResult(rank, times, configure_first_op_cpu_ms=cpu).to_dict()


def checkpoint_probe(raw: JsonArgs) -> dict[str, object]:
    """Per-update asynchronous checkpointing: step latency with and without, host memory, bytes."""
    import tempfile

    from ..recovery.checkpoint import AsyncCheckpointer, AsyncCheckpointStats, state_bytes
    from .harness import ModelConfig, build, make_batch, make_train_step
    from ..recovery.state import local_state
    from ..recovery.config import RecoveryConfig
    from ..recovery.session import start_session

    args = ProbeArgs.of(raw)
    session = start_session(RecoveryConfig(data_timeout_s=30.0, checkpoint_dir=None, peer_copies=0))
    cfg = ModelConfig(**args.model)
    model, optimizer = build(cfg, session.mesh)
    train_step = make_train_step(model, optimizer)
    steps = args.steps or 20
    train_step(make_batch(cfg, 0, session.rank))  # warm-up (optimizer state allocated)
    plain = []
    for i in range(steps):
        t0 = time.perf_counter()
        train_step(make_batch(cfg, 1 + i, session.rank))
        plain.append(time.perf_counter() - t0)
    scratch = None if args.dir else tempfile.mkdtemp(prefix="meshpact-async-ckpt-")
    ckpt_dir = args.dir or scratch
    assert ckpt_dir is not None  # a scratch folder where none is given
    ckpt = AsyncCheckpointer(ckpt_dir, session.rank)
    with_ckpt = []
    for i in range(steps):
        t0 = time.perf_counter()
        train_step(make_batch(cfg, 1 + steps + i, session.rank))
        ckpt.snapshot(1 + steps + i, local_state(model, optimizer))
        with_ckpt.append(time.perf_counter() - t0)
    ckpt.close()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    stats = AsyncCheckpointStats(
        steps,
        statistics.median(plain),
        statistics.median(with_ckpt),
        ckpt.host_bytes,
        state_bytes(local_state(model, optimizer)),
        statistics.mean(ckpt.writes) if ckpt.writes else 0.0,
    )
    return CheckpointResult(session.rank, stats, ckpt.bytes_written).to_dict()


@dataclass(frozen=True)
class FalseAlarms:
    """One rank's fault-free run at the default settings: every recovery is a false alarm."""

    rank: int
    seconds: float
    steps: int
    recoveries: int  # recoveries of any cause (none is right: no fault was injected)
    heartbeat_alarms: int  # detections made by this rank's heartbeat watch
    heartbeat: bool  # whether the heartbeat ran (the default settings)
    load_avg_1m: float  # at the end of the run

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def false_alarm_probe(raw: JsonArgs) -> dict[str, object]:
    """Train the harness under :func:`~meshpact.live.recovery.runtime.resilient` for
    ``raw["seconds"]`` with no fault injected, ``RecoveryConfig()``'s defaults and the heartbeat
    on (what is measured), peer copies off (they are not)."""
    import torch
    import torch.distributed as dist

    from meshpact.core.recording import EventKind

    from ..recovery.config import RecoveryConfig
    from .harness import ModelConfig, build, make_batch, make_train_step
    from ..recovery.runtime import resilient
    from ..recovery.session import start_session

    config = RecoveryConfig(heartbeat=True, peer_copies=0)
    session = start_session(config)
    cfg = ModelConfig()
    model, optimizer = build(cfg, session.mesh)
    train_step = make_train_step(model, optimizer)
    seconds = float(raw.get("seconds", 60.0))
    t0 = time.time()
    steps = 0
    with resilient(model, optimizer, session, batches=lambda st: make_batch(cfg, st, session.rank)) as rt:
        while True:
            rt.step(train_step, make_batch(cfg, rt.committed_step, session.rank))
            steps += 1
            done = torch.tensor([1.0 if time.time() - t0 >= seconds else 0.0])
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=session.group)  # every rank stops at one step
            if done.item() > 0:
                break
    alarms = sum(
        1
        for e in session.events
        if e.event == EventKind.DETECTED and (e.data.get("heartbeat_stalled") or e.data.get("heartbeat_quiet"))
    )
    return FalseAlarms(
        session.rank,
        time.time() - t0,
        steps,
        len(rt.recoveries),
        alarms,
        config.heartbeat,
        round(os.getloadavg()[0], 2),
    ).to_dict()


def stuck_send_probe(raw: JsonArgs) -> dict[str, object]:
    """Three ranks and a pair nobody severs: in step 1 rank 0's step raises a communication
    fault while ranks 1 and 2 each wait to receive from the other. Rank 0 severs only its own
    sockets, so ranks 1 and 2 learn of the recovery from the control channel (the heartbeat
    reads the counter rank 0 bumps) or, without that, at the data-path timeout. Returns each
    rank's recovery records and how long its failed attempt ran before it knew."""
    import torch
    import torch.distributed as dist

    from ..recovery.config import RecoveryConfig
    from ..recovery.faults import CollectiveFault
    from ..recovery.session import start_session

    session = start_session(RecoveryConfig(data_timeout_s=float(raw["data_timeout_s"]), vendor="cpu", peer_copies=0))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attempts: list[int] = []
    began: list[float] = []

    def train_step(step: int) -> None:
        attempts.append(step)
        if step == 1 and attempts.count(1) == 1:  # the first attempt of step 1
            began.append(time.time())
            if session.rank == 0:
                raise CollectiveFault("rank 0's collective failed")
            dist.recv(torch.zeros(1), group=session.group, group_src=3 - session.rank)  # the peer waits on us too
        dist.all_reduce(torch.ones(1), group=session.group)

    return _three_steps(session, model, optimizer, train_step, began)


def _three_steps(session: Any, model: Any, optimizer: Any, train_step: Any, began: list[float]) -> dict[str, object]:
    """Run steps 0-2 under ``resilient``; each rank's recovery records, how long after its failed
    attempt began (``began[0]``) it knew of each, and the errors it detected."""
    from meshpact.core.recording import EventKind

    from ..recovery.runtime import resilient

    with resilient(model, optimizer, session, batches=lambda step: step) as rt:
        for step in range(3):
            rt.step(train_step, step)
    detected = [e for e in session.events if e.event == EventKind.DETECTED]
    return {
        "rank": session.rank,
        "recoveries": [r.to_dict() for r in rt.recoveries],
        "knew_after_s": [r.t_detect_wall - began[0] for r in rt.recoveries],
        "errors": [str(e.data.get("error", "")) for e in detected],
        "steps": rt.committed_step,
    }


def large_send_probe(raw: JsonArgs) -> dict[str, object]:
    """Two ranks and a large send in flight when the receiver's recovery severs its data path: in
    step 1 rank 1 sends ``send_mb`` MB to rank 0, and rank 0's step raises a communication fault
    once the transfer is under way. Returns each rank's recovery records, how long its failed
    attempt ran before it knew, and how long rank 1's send took to end."""
    import torch
    import torch.distributed as dist

    from ..recovery.config import RecoveryConfig
    from ..recovery.faults import CollectiveFault
    from ..recovery.session import start_session

    session = start_session(RecoveryConfig(data_timeout_s=float(raw["data_timeout_s"]), vendor="cpu", peer_copies=0))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    payload = torch.ones(int(float(raw["send_mb"]) * 2**20) // 4)
    attempts: list[int] = []
    began: list[float] = []
    send_s: list[float] = []
    pending: list[Any] = []  # rank 0's receive, left in flight when its step raises

    def train_step(step: int) -> None:
        attempts.append(step)
        if step == 1 and attempts.count(1) == 1:  # the first attempt of step 1
            began.append(time.time())
            if session.rank == 0:
                pending.append(dist.irecv(payload, group=session.group, group_src=1))
                time.sleep(float(raw["raise_after_s"]))  # the transfer is under way
                raise CollectiveFault("rank 0's collective failed during a large receive")
            t0 = time.perf_counter()
            try:
                dist.send(payload, group=session.group, group_dst=0)
            finally:
                send_s.append(time.perf_counter() - t0)
        dist.all_reduce(torch.ones(1), group=session.group)

    return {**_three_steps(session, model, optimizer, train_step, began), "send_s": send_s}
