"""A live bridge run: plans executed across two native domains, verified and metered.

:func:`run_bridge` starts the ranks (2 + 2 by default) once through
:mod:`meshpact.live.launch.launcher` and runs every job in one go. Each rank executes
:func:`worker`: it joins its domain group and its bridges, compiles each job's contract from
the workload's facts, lowers it (or takes the job's own plan), and runs it through the
:class:`~meshpact.live.plans.executor.Executor`, which admits only checked, domain-local plans.
After the last job every rank hands its deliveries, buffer history and call records to rank
0 over the world group (verification traffic, outside every plan's count), and rank 0
verifies each job against the single-process reference, compares measured with planned
startups and bytes, and writes the run as a JSONL recording.

Under ``torchrun`` the same worker runs unchanged, and rank 0 prints one JSON line per job::

    torchrun --nproc-per-node 4 -m meshpact.live.launch.launcher --target meshpact.live.plans.bridge:worker \\
        --args '{"jobs": [{"request": "full"}], "preset": "tiny", "recording": "bridge.jsonl"}'

Worker arguments: ``jobs`` (``request``, optional ``plan`` JSON and ``label``), ``preset``,
``recording``, ``timeout_s``, and the mesh's ``producer_vendor``/``consumer_vendor`` (``cuda``,
``cann``, ``cpu``) and ``producer_host``/``consumer_host`` (two names: the bridge is Ethernet).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist

from meshpact.core.contract import Contract, compile_contract
from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Edge, Mesh
from meshpact.core.jsonform import JsonObject
from meshpact.core.lowerer import lower
from meshpact.core.placement import Shard, shard_bounds
from meshpact.core.plan import Plan, StepKind, plan_cost
from meshpact.core.recording import RecordingWriter

from .domains import RankEnv, init_domains, two_domain_mesh
from .executor import Executor, PlanRefused
from .meter import CallRecord, Meter, measure
from .workloads import TORCH_DTYPE, LiveRequest, get_preset, logprob_ids, producer_local, workload_edge

if TYPE_CHECKING:
    from ..launch.forkserver import ForkServer

__all__ = ["Job", "run_bridge", "worker", "plan_for", "initial_shapes", "job_summary"]


@dataclass(frozen=True)
class Job:
    """One plan to run: a request on the preset's workload, optionally with a given plan."""

    request: LiveRequest
    plan_json: str | None = None  # None: the lowerer's plan
    label: str = ""

    def to_dict(self) -> JsonObject:
        return {"request": self.request.value, "plan": self.plan_json, "label": self.label or self.request.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Job":
        return cls(LiveRequest(d["request"]), d.get("plan"), str(d.get("label") or d["request"]))


def plan_for(job: Job, edge: Edge) -> tuple[Contract, Plan]:
    """The job's contract, compiled from the workload's facts, and its plan (the lowerer's unless given)."""
    contract = compile_contract(edge)
    return contract, (Plan.from_json(job.plan_json) if job.plan_json else lower(contract))


def initial_shapes(edge: Edge) -> dict[int, dict[str, torch.Tensor]]:
    """Every producer rank's starting buffer, as a zero stand-in of its local shape."""
    p = edge.producer
    ranks = edge.mesh.domain(p.domain).ranks
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i, r in enumerate(ranks):
        shape = list(p.shape)
        if isinstance(p.placement, Shard):
            lo, hi = shard_bounds(shape[p.placement.dim], len(ranks), i)
            shape[p.placement.dim] = hi - lo
        out[r] = {p.name: torch.zeros(shape, dtype=TORCH_DTYPE[p.dtype])}
    return out


def _send_pairs(mesh: Mesh, plans: Sequence[Plan]) -> list[tuple[int, int]]:
    """Rank pairs of the plans' sends that join two domains (each becomes a bridge)."""
    pairs: set[tuple[int, int]] = set()
    for plan in plans:
        for s in plan.steps:
            if (
                s.kind is StepKind.SEND
                and all(r in mesh.ranks for r in s.ranks)
                and mesh.domain_of(s.ranks[0]).name != mesh.domain_of(s.ranks[1]).name
            ):
                low, high = sorted(s.ranks)
                pairs.add((low, high))
    return sorted(pairs)


def _native_rank_sets(mesh: Mesh, plans: Sequence[Plan]) -> list[tuple[int, ...]]:
    """Rank sets of the plans' collectives that lie inside one domain (the others are refused)."""
    sets = set()
    for plan in plans:
        for s in plan.steps:
            if (
                s.kind is StepKind.COLLECTIVE
                and all(r in mesh.ranks for r in s.ranks)
                and len({mesh.domain_of(r).name for r in s.ranks}) == 1
            ):
                sets.add(tuple(sorted(s.ranks)))
    return sorted(sets)


def worker(args: dict) -> dict:
    """One rank of a bridge run (the launcher's target; runs unchanged under torchrun)."""
    env = RankEnv.from_environ()
    torch.set_num_threads(int(args.get("threads", 1)))
    preset = get_preset(str(args.get("preset", "tiny")))
    if env.world_size % 2:
        raise MeshpactError(f"WORLD_SIZE={env.world_size}: two domains of equal size need an even world size")
    mesh = two_domain_mesh(
        env.world_size // 2,
        args.get("producer_vendor", "cuda"),
        args.get("consumer_vendor", "cann"),
        args.get("producer_host", "localhost"),
        args.get("consumer_host", "localhost"),
    )
    jobs = [Job.from_dict(j) for j in args.get("jobs") or [{"request": "full"}]]
    prepared = []
    for job in jobs:
        edge = workload_edge(job.request, preset, mesh)
        contract, plan = plan_for(job, edge)
        prepared.append((job, edge, contract, plan))
    plans = [p[3] for p in prepared]
    layout = init_domains(
        mesh, env, _send_pairs(mesh, plans), _native_rank_sets(mesh, plans), timeout_s=float(args.get("timeout_s", 60))
    )
    dist.barrier()
    executor = Executor(layout, Meter(env.rank))
    t0 = executor.meter.t0
    results: list[dict[str, Any]] = []
    for job, edge, contract, plan in prepared:
        initial = initial_shapes(edge)
        if env.rank in initial:
            parts = len(initial)
            index = mesh.domain(edge.producer.domain).ranks.index(env.rank)
            local = producer_local(job.request.value, preset.name, parts, index)
            initial[env.rank] = {edge.producer.name: local}
        start = time.monotonic() - t0
        ids = torch.tensor(logprob_ids(preset), dtype=torch.int64) if contract.demand.reads_target_ids else None
        mark = executor.meter.mark()
        try:
            outcome = executor.run(plan, contract, initial, ids)
        except PlanRefused as exc:  # every rank refuses alike; the meter shows what was attempted
            results.append(
                {
                    "label": job.label,
                    "refused": list(exc.reasons),
                    "t": [start, time.monotonic() - t0],
                    "records": [r.to_dict() for r in executor.meter.records[mark:]],
                }
            )
            continue
        results.append(
            {
                "label": job.label,
                "refused": None,
                "t": [start, time.monotonic() - t0],
                "records": [r.to_dict() for r in executor.meter.records[mark:]],
                "delivered": {k: v.cpu() for k, v in outcome.delivered.items()},
                "history": [(i, name, v.cpu()) for i, name, v in outcome.history]
                if env.rank in edge.consumer.ranks
                else [],
            }
        )
    mine = {"rank": env.rank, "layout": layout.describe(), "jobs": results}
    gathered: list[Any] | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    value: dict = {"rank": env.rank}
    if env.rank == 0:
        value = _report(args, preset.name, mesh, prepared, gathered or [])
        for job in value["jobs"]:  # under torchrun there is no launcher to collect the report
            print(json.dumps(job_summary(value, job)), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return value


def job_summary(report: JsonObject, job: JsonObject) -> JsonObject:
    """One job of a bridge run in the CLI's ``--json`` form."""
    measured = job.get("measured") or {}
    return {
        "request": job["request"],
        "preset": report["preset"],
        "verified": bool(job["verified"]),
        "equivalence": (job.get("verification") or {}).get("equivalence"),
        "startups": {"planned": job["planned"]["startups"], "measured": measured.get("startups")},
        "payload_bytes": {"planned": job["planned"]["payload_bytes"], "measured": measured.get("payload_bytes")},
        "recording": report["recording"],
    }


def _report(args: dict, preset: str, mesh: Mesh, prepared: list, gathered: list[dict]) -> dict:
    from .verify import verify_job

    layouts = [g["layout"] for g in gathered]
    out_jobs = []
    path = args.get("recording")
    writer = (
        RecordingWriter(
            path,
            "live",
            kind="bridge",
            preset=preset,
            ranks=len(layouts),
            layouts=layouts,
            mesh=[d.name for d in mesh.domains],
        )
        if path
        else None
    )
    for k, (job, edge, contract, plan) in enumerate(prepared):
        per_rank = {g["rank"]: g["jobs"][k] for g in gathered}
        refused = sorted({tuple(j["refused"]) for j in per_rank.values() if j["refused"] is not None})
        records = [CallRecord.from_dict(r) for j in per_rank.values() for r in j["records"]]
        cost = plan_cost(plan, mesh)
        entry: JsonObject = {
            "label": job.label,
            "request": job.request.value,
            "edge": edge.name,
            "planned": {
                "startups": cost.startups,
                "payload_bytes": cost.payload_bytes,
                "bytes_by_link": dict(cost.bytes_by_link),
                "startups_by_link": dict(cost.startups_by_link),
            },
            "calls_made": len(records),
        }
        if refused:
            entry.update(refused=list(refused[0]), verified=False)
        else:
            measured = measure(records)
            verdict = verify_job(job.request, preset, edge, contract, per_rank)
            entry.update(
                refused=None,
                measured=measured.to_dict(),
                verification=verdict.to_dict(),
                verified=verdict.ok,
                cost_matches=_cost_matches(entry["planned"], measured.to_dict()),
            )
        entry["plan"] = plan.to_dict()
        out_jobs.append(entry)
        if writer is not None:
            _record_job(writer, k, entry, per_rank, plan)
    recording = str(writer.close()) if writer is not None else None
    return {
        "rank": 0,
        "preset": preset,
        "mesh": [d.name for d in mesh.domains],
        "layouts": layouts,
        "jobs": out_jobs,
        "recording": recording,
    }


def _cost_matches(planned: Mapping[str, Any], measured: Mapping[str, Any]) -> bool:
    """Measured startups and payload bytes equal the plan's, in total and per link class."""
    keys = ("startups", "payload_bytes", "bytes_by_link", "startups_by_link")
    return all(planned[k] == measured[k] for k in keys)


def _record_job(writer: RecordingWriter, k: int, entry: dict, per_rank: dict, plan: Plan) -> None:
    """One job's events in time order: the plan, every call on every rank, each rank's end, the verdict."""
    start = min((j["t"][0] for j in per_rank.values()), default=0.0)
    writer.emit(
        "plan",
        t=start,
        data={
            "job": k,
            "label": entry["label"],
            "request": entry["request"],
            "planned": entry["planned"],
            "steps": [st.to_dict() for st in plan.steps],
        },
    )
    events = []
    for rank, j in per_rank.items():
        events += [(r["t"], rank, "call", {"job": k, **r}) for r in j["records"]]
        events.append((j["t"][1], rank, "rank_done", {"job": k, "refused": j["refused"]}))
    for t, rank, name, data in sorted(events, key=lambda e: (e[0], e[1])):
        writer.emit(name, rank=rank, t=t, data=data)
    end = max((j["t"][1] for j in per_rank.values()), default=start)
    summary = {key: entry.get(key) for key in ("refused", "measured", "verification", "verified", "cost_matches")}
    writer.emit("verified" if entry.get("verified") else "not_verified", t=end, data={"job": k, **summary})


def run_bridge(
    jobs: Sequence[Job],
    preset: str = "tiny",
    *,
    per_domain: int = 2,
    recording: str | os.PathLike[str] | None = None,
    timeout_s: float = 240.0,
    forkserver: "ForkServer | None" = None,
) -> dict:
    """Start ``2 * per_domain`` ranks on loopback, run ``jobs``, return rank 0's report.
    ``forkserver`` (a :class:`~meshpact.live.launch.forkserver.ForkServer`): the ranks are forked
    from it where it accepts their environment, warm, instead of started as fresh interpreters.

    The rendezvous store listens on 127.0.0.1 and gloo's sockets on the loopback interface
    (``GLOO_SOCKET_IFNAME=lo`` unless the environment names another).
    """
    from ..launch.launcher import launch

    get_preset(preset)
    args = {
        "jobs": [j.to_dict() for j in jobs],
        "preset": preset,
        "timeout_s": min(60.0, timeout_s),
        "recording": str(Path(recording).resolve()) if recording else None,
    }
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    results = launch(
        "meshpact.live.plans.bridge:worker",
        2 * per_domain,
        args,
        timeout_s=timeout_s,
        master_addr="127.0.0.1",
        env=lambda rank: {"GLOO_SOCKET_IFNAME": ifname},
        forkserver=forkserver,
    )
    report = results[0].value
    if not isinstance(report, dict) or "jobs" not in report:
        raise MeshpactError(f"rank 0 returned no report: {report!r}")
    return report
