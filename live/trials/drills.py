"""The excising reference: a launcher worker that trains a workload through planned excisions.

Each survivor re-shards a departed rank's state from a copy kept in the launcher's store, the
way :func:`~meshpact.live.recovery.reshard.excise` does from peer copies, with no fault and no
consensus: the trial compares a faulted excision against it bit for bit.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from meshpact.core.jsonform import JsonObject

from ..recovery.checkpoint import state_bytes
from ..recovery.reshard import (
    ExcisionRefused,
    GradientWeight,
    Membership,
    adopt_objects,
    carry_schedule,
    excise,
    replica_of,
    share_batch,
)


@dataclass(frozen=True)
class _Plan:
    step: int
    rank: int  # original rank


def _holder(membership: Membership, lost: int) -> int:
    """The original rank that holds ``lost``'s copy: the next alive rank after it (cyclic)."""
    j = membership.group_rank(lost)
    return membership.alive[(j + 1) % membership.world]


_STORE_PIECE = 4 << 20  # bytes of a published copy per store value


def _copy_key(run_id: str, rank: int, step: int) -> str:
    return f"meshpact/{run_id}/peer-copy/rank{rank}/step{step}"


def _publish(store: Any, run_id: str, rank: int, step: int, state: Mapping[str, torch.Tensor]) -> None:
    """Keep ``rank``'s state of committed ``step`` in the launcher's store (the simulated peer
    copy); the previous step's copy is dropped."""
    buf = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in state.items()}, buf)
    data, key = buf.getvalue(), _copy_key(run_id, rank, step)
    pieces = range(0, len(data), _STORE_PIECE)  # a libuv store refuses a value over 8 MiB
    for i, at in enumerate(pieces):
        store.set(f"{key}/{i}", data[at : at + _STORE_PIECE])
    store.set(key, str(len(pieces)))  # last: a reader waiting on it finds every piece there
    if step > 0:
        old = _copy_key(run_id, rank, step - 1)
        for i in range(int(store.get(old))):
            store.delete_key(f"{old}/{i}")
        store.delete_key(old)


def _fetch(store: Any, run_id: str, rank: int, step: int) -> dict[str, torch.Tensor]:
    """``rank``'s copy of committed ``step``, waiting for it (the rank may still be publishing)."""
    key = _copy_key(run_id, rank, step)
    data = b"".join(store.get(f"{key}/{i}") for i in range(int(store.get(key))))
    return torch.load(io.BytesIO(data), weights_only=True)


def excision_drill(args: JsonObject) -> JsonObject:
    """A launcher worker: train ``args["workload"]`` for ``steps`` steps through the planned
    excisions ``[{"step", "rank"}]``: the excising reference of a live trial, in which each lost
    rank leaves before its step, without a fault, and its copy is the one it published at its
    last commit (a peer copy, kept in the launcher's store). The faulted side of the comparison
    is the runtime's own excision (``Resilient`` with ``on_rank_loss=excise``). Saves each survivor's final state
    to ``out_dir/final-rank<original>.pt`` (the last committed state where an excision was
    refused below ``min_ranks``; a rank leaving as the reference's lost rank saves its state to
    ``left-rank<original>.pt``), appends each committed step's digest and world size to
    ``digests-rank<original>.txt`` and returns its records."""
    import random
    import sys

    from ..recovery.session import RecoveryConfig, start_session
    from ..recovery.state import capture_schedule, digest, job_state, local_state, schedulers_of
    from ..recovery.workload import built, load_workload

    torch.manual_seed(0)
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    world = int(os.environ["WORLD_SIZE"])
    workload = load_workload(args["workload"], world)
    config = RecoveryConfig(
        data_timeout_s=float(args.get("data_timeout_s", 10.0)), vendor="cpu", peer_copies=0
    )  # the copies a reference re-shards from are kept in the store
    session = start_session(config, workload.mesh.shape, workload.mesh.names)
    shape = tuple(workload.mesh.shape)  # a 2-D (HSDP) mesh loses whole replicas: one shorter per replica lost
    me = session.rank
    plans = sorted((_Plan(int(p["step"]), int(p["rank"])) for p in args.get("excisions", ())), key=lambda p: p.step)
    victims = {p.rank for p in plans}
    membership, group, spec, generation = Membership.full(world), session.group, session.spec, 0
    model, optimizer = built(workload, session.mesh)
    schedulers = schedulers_of(optimizer)

    objects = dict(workload.state(me)) if workload.state is not None else {}  # a data loader's position...

    def state_now() -> dict[str, torch.Tensor]:
        return job_state(model, optimizer, schedulers=schedulers, objects=objects)

    weight = GradientWeight(model)
    records: list[JsonObject] = []
    downtime: list[float] = []
    digests: dict[int, str] = {}
    if me in victims:
        _publish(session.store, spec.run_id, me, 0, state_now())
    refused: JsonObject = {}
    for step in range(int(args["steps"])):
        due = [p for p in plans if p.step == step]
        leaving = (
            {membership.alive[q] for q in replica_of(shape, [membership.group_rank(due[0].rank)])}
            if due and len(shape) == 2
            else {due[0].rank}
            if due
            else set()
        )
        if me in leaving:
            # hands over its copy (already published) and leaves; keeps its state to compare
            torch.save(state_now(), os.path.join(args["out_dir"], f"left-rank{me}.pt"))
            return {"rank": me, "left_at": step}
        t_fault = time.perf_counter()
        if not due:  # (at an excision the step's batch is drawn once, from the smaller world's shares)
            share = share_batch(workload.batch, step, membership, me, drawn_once=bool(objects))
            weight.weight = share.weight
            workload.train_step(model, optimizer, share.batch)
        if due:
            lost = due[0].rank
            held: dict[int, Mapping[str, torch.Tensor]] = (
                {lost: _fetch(session.store, spec.run_id, lost, step)} if _holder(membership, lost) == me else {}
            )
            generation += 1
            committed = capture_schedule(optimizer, schedulers)
            try:
                out = excise(
                    state_now(),
                    held,
                    membership,
                    [lost],
                    step=step,
                    spec=spec,
                    store=session.store,
                    generation=generation,
                    old_group=group,
                    build=lambda mesh: built(workload, mesh),
                    min_ranks=int(args.get("min_ranks", 1)),
                    checkpoint_dir=args.get("checkpoint_dir"),
                    shape=shape,
                    names=workload.mesh.names if len(shape) == 2 else None,
                )
            except ExcisionRefused as exc:
                refused = {"refused": str(exc), "checkpoint": exc.checkpoint, "step": step}
                break
            weight.remove()
            model, optimizer, group, spec, membership = out.model, out.optimizer, out.group, out.spec, out.membership
            shape = out.shape
            schedulers = carry_schedule(committed, optimizer)
            if (
                objects and workload.state is not None
            ):  # the lost rank's objects continue here, from its copy's positions
                adopt_objects(objects, out.departed, workload.state)
            weight = GradientWeight(model)
            records.append(out.record.to_dict())
            downtime.append(time.perf_counter() - t_fault)  # from the fault (or the hand-over) to the state rebuilt
            share = share_batch(workload.batch, step, membership, me, drawn_once=bool(objects))
            weight.weight = share.weight
            workload.train_step(model, optimizer, share.batch)
        if me in victims:
            _publish(session.store, spec.run_id, me, step + 1, state_now())
        digests[step + 1] = digest(local_state(model, optimizer))
        with open(os.path.join(args["out_dir"], f"digests-rank{me}.txt"), "a", encoding="utf-8") as fh:
            fh.write(f"{step + 1} {membership.world} {digests[step + 1]}\n")  # kept if this rank is killed later
    state = state_now()
    torch.save({k: v.clone() for k, v in state.items()}, os.path.join(args["out_dir"], f"final-rank{me}.pt"))
    return {
        "rank": me,
        "group_rank": spec.rank,
        "world": membership.world,
        "alive": list(membership.alive),
        "records": records,
        "downtime_s": downtime,
        "digests": digests,
        "state_bytes": state_bytes(state),
        **refused,
    }
