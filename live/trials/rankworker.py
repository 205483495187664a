"""The rank side of a recovery trial: one rank trains the user's workload under ``resilient``.

:func:`worker` is the entry point each rank runs (through the launcher or ``torchrun``). It
loads the workload file, starts the session on the workload's mesh, builds the model and
optimizer, and trains for the trial's steps under
:func:`~meshpact.live.recovery.runtime.resilient` with this rank's share of the fault plan;
batches come from the workload's ``batch(step, rank)``, so any lost step is drawn again.
It can finish with a real checkpoint restore in the job (the *drill*) or start as a *cold
restart* from a checkpoint. It saves its final state (parameter shards, optimizer state and
generators) and returns a :class:`~meshpact.live.trials.outcome.RankOutcome` as JSON.

For a workload with compiled modules it profiles one step before the first fault and one
after the last recovery and counts the compiled regions that ran in each.

When the trial's work directory holds a pace file (:class:`~.trialconfig.Pace`, written by
the dashboard), each rank reads it before every step: it waits while its run is held
(recording one ``held`` event), keeps to the steps-per-second limit, and records a ``step``
event per committed step (generation, the world group and its sequence number), so a
person watching sees every rank move.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from meshpact.core.jsonform import JsonObject

__all__ = ["worker", "compiled_regions", "keep_pace"]

_COMPILED_REGION = "Torch-Compiled Region"


def compiled_regions(run: Any) -> int:
    """Compiled graphs that ran during ``run()`` (profiler events named ``Torch-Compiled Region``)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name.startswith(_COMPILED_REGION))


def _has_compiled(model: Any) -> bool:
    parts = model if isinstance(model, list) else [model]  # a list of model parts (pipeline parallel)
    return any(type(m).__name__ == "OptimizedModule" for part in parts for m in part.modules())


def keep_pace(
    work: Path,
    phase: str,
    step: int,
    last_start: float,
    max_period_s: float,
    emit: Any,
    idle: Callable[[], object] | None = None,
    gone: Callable[[], bool] | None = None,
) -> float:
    """Before ``step``: wait while ``phase`` is held (a ``held`` event), calling ``idle()``
    every look (the runtime's ``join_recovery``: a peer lost meanwhile is recovered from while
    held, not after the rank-loss bound), then until a step period has passed since
    ``last_start`` (``time.monotonic()``). The period is capped at ``max_period_s`` so ranks
    reading a changed pace a step apart never wait on each other past the data-path timeout.

    A peer whose process the launcher says is gone for good (``gone()``: no replacement will
    come, the job excises) opens no recovery round for ``idle`` to join: the hold is left for
    this one step, whose collectives meet the loss, and the next step holds again. Returns this
    step's start."""
    from meshpact.core.recording import EventKind

    from .trialconfig import Pace

    pace, held = Pace.read(work), False
    while pace is not None and pace.holds(phase):
        if not held:
            emit(EventKind.HELD, step=step)
            held = True
        if idle is not None and idle() is not None:
            held = False  # recovered while held: a held event again, on the new generation
        elif gone is not None and gone():
            break
        time.sleep(0.1)
        pace = Pace.read(work)
    if pace is not None and pace.steps_per_s:
        wait = last_start + min(1.0 / pace.steps_per_s, max_period_s) - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    return time.monotonic()


def worker(args: JsonObject) -> JsonObject:
    import os
    import signal

    import torch

    from meshpact.core.recording import EventKind

    from ..recovery import communicator as comm
    from ..recovery.faults import Fault, FaultInjector
    from dataclasses import asdict

    from .trialconfig import Pace
    from .outcome import Drill, FaultRecord, PeerCopyReport, RankOutcome, RetiredSummary
    from ..recovery.runtime import UnsafeLoopError, resilient
    from ..recovery.config import RecoveryConfig
    from ..recovery.session import start_session
    from ..recovery.state import digest
    from ..recovery.workload import WorkloadError, built, load_workload

    torch.manual_seed(0)  # every generator a step can draw from starts the same in every run
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    world = int(os.environ["WORLD_SIZE"])
    workload = load_workload(args["workload"], world)
    config = RecoveryConfig(
        data_timeout_s=args["data_timeout_s"],
        process_start_s=args["process_start_s"],
        group_create_s=args["group_create_s"],
        checkpoint_dir=args.get("checkpoint_dir"),
        checkpoint_every=args["checkpoint_every"],
        count_dispatch=args.get("count_dispatch", False),
        restore_rng=args.get("restore_rng", True),
        heartbeat=args.get("heartbeat", False),
        peer_copies=int(args.get("peer_copies", 0)),
        max_rounds=int(args.get("max_rounds", 4)),
        peer_copy_depth=int(args.get("peer_copy_depth", 2)),
    )
    t_start = time.time()
    session = start_session(config, workload.mesh.shape, workload.mesh.names)
    rank, steps = session.rank, int(args["steps"])
    out_dir = Path(args["out_dir"])
    session.attach_log(out_dir / f"events-rank{rank}-{session.incarnation}.jsonl")
    try:
        model, optimizer = built(workload, session.mesh)
    except WorkloadError as exc:
        return RankOutcome(rank, workload_error=str(exc)).to_dict()

    def train_step(batch: Any) -> Any:  # rt.model: after an excision the smaller world's model
        return workload.train_step(rt.model, rt.optimizer, batch)

    def batches(step: int) -> Any:  # this rank's share of the global batch (its own until an excision)
        return rt.share(workload.batch, step)

    faults = tuple(Fault.from_dict(f) for f in args.get("faults", ()))
    injector = FaultInjector(faults, rank, session.control, args.get("stall_s", 0.0), args.get("down_s", 0.0))
    fault_steps = sorted(f.step for f in faults)
    profile = _has_compiled(model)
    regions: dict[str, int] = {}
    step_s: list[float] = []
    drill: Drill | None = None
    cold_from = args.get("cold_from")
    work, phase = out_dir.parent, os.environ.get("MESHPACT_RUN_ID", out_dir.name)
    paced, last_start = Pace.read(work) is not None, 0.0
    from meshpact.core.recovery import Policy

    from ..recovery.consensus import gone_ranks
    from ..recovery.reshard import ExcisionRefused, LeftWithReplica

    refused: ExcisionRefused | None = None
    left: LeftWithReplica | None = None  # this rank's HSDP replica was excised: it left the job
    with resilient(
        model,
        optimizer,
        session,
        injector,
        batches,
        on_rank_loss=Policy(args.get("on_rank_loss", Policy.PEER_RESTORE.value)),
        min_ranks=int(args.get("min_ranks", 1)),
        build=lambda mesh: built(workload, mesh),
        state=workload.state(rank) if workload.state is not None else None,
        state_of=workload.state,
    ) as rt:  # also when replacing: a missed replacement excises
        if rank in args.get("die_after_proposing", ()) and session.incarnation == 0:
            # dies once its proposal is in and the round decided: the others meet it building the groups
            rt.on_decided = lambda decision: os.kill(os.getpid(), signal.SIGKILL)
        t_loaded = None
        if cold_from is not None:
            rt.restore(int(cold_from))
            t_loaded = time.time()
        for step in range(rt.committed_step, steps):
            if refused is not None:
                break
            try:
                if paced:  # a held rank joins a recovery its peers opened meanwhile (an excision may refuse)
                    last_start = keep_pace(
                        work,
                        phase,
                        step,
                        last_start,
                        0.5 * session.spec.timeout_s,
                        lambda kind, **data: session.emit(kind, generation=session.generation, **data),
                        rt.join_recovery,
                        lambda: bool(gone_ranks(session.control, [r for r in session.members if r != rank])),
                    )
                t0 = time.perf_counter()
                batch = batches(step)
                if profile and fault_steps and step in (fault_steps[0] - 1, fault_steps[-1] + 1):
                    key = "before_first_fault" if step < fault_steps[0] else "after_last_recovery"
                    regions[key] = compiled_regions(lambda: rt.step(train_step, batch))
                else:
                    rt.step(train_step, batch)
            except ExcisionRefused as exc:  # below --min-ranks: stopped, the state flushed to a checkpoint
                refused = exc
                continue
            except LeftWithReplica as exc:  # its replica lost a rank: the other replicas go on without it
                left = exc
                break
            except UnsafeLoopError as exc:  # the workload's loop, refused at the commit that found it: one line
                return RankOutcome(rank, workload_error=str(exc)).to_dict()
            step_s.append(time.perf_counter() - t0)
            if paced:
                pg = session.group
                session.emit(
                    EventKind.STEP,
                    step=rt.committed_step,
                    generation=session.generation,
                    group=pg.group_name,
                    seq=comm.sequence_number(comm.backend_of(pg, session.spec.device)),
                    seconds=step_s[-1],
                )
        t_caught_up = time.time()
        if args.get("drill") and refused is None and left is None:
            t0 = time.time()
            decision = rt.drill_checkpoint_restore()
            drill = Drill(t0, time.time(), decision.step, rt.recoveries[-1].lost_steps)
        state = rt.state()
        # a view of a much larger storage is saved compact; the rest as they are (a clone of everything
        # would hold the state twice as the run ends, counted in the run's peak memory)
        torch.save(
            {
                k: v.clone() if v.untyped_storage().nbytes() > 2 * v.numel() * v.element_size() + 4096 else v
                for k, v in state.items()
            },
            out_dir / f"final-rank{rank}.pt",
        )
        counts = rt.op_counts()
        gc.collect()  # a retired group no longer referenced is released (RetiredSummary.alive is False)
        retired = tuple(
            RetiredSummary(
                r.name,
                r.seq_ops_after,
                counts.get(f"dispatch:{r.name}", 0) - r.dispatch_ops_at_retirement
                if r.dispatch_ops_at_retirement is not None
                else None,
                r.alive,
            )
            for r in rt.retired
        )
        compiled_graphs = None
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import counters

            compiled_graphs = int(counters["stats"]["unique_graphs"])
        # every rank that finished reports the faults (the trial merges them): rank 0 may have been excised
        claimed = session.control.present([f"fault/{f.index}" for f in faults])
        records = {int(k.split("/")[1]): FaultRecord(**v) for k, v in claimed.items()}
        outcome = RankOutcome(
            rank,
            session.incarnation,
            digest(state),
            tuple(r.to_dict() for r in rt.recoveries),
            counts,
            retired,
            tuple(sorted(g.group_name for g in session.groups.values())),
            tuple(step_s),
            session.generation,
            drill,
            t_start,
            t_caught_up,
            t_loaded,
            regions,
            compiled_graphs,
            records,
            storage_bytes_read=rt.storage_bytes_read,
            peer=PeerCopyReport(**asdict(rt.peers.counters)) if rt.peers is not None else None,
            alive=session.members if session.excised else (),
            excisions=tuple(rt.excisions),
            excision_refused=str(refused) if refused is not None else None,
            flushed_checkpoint=refused.checkpoint if refused is not None else None,
            left_with_replica=str(left) if left is not None else None,
        )
    return outcome.to_dict()
