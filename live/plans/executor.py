"""The live executor: runs a checked plan step by step on real process groups, metered.

Before any step runs, a plan is *admitted* (:func:`admit`): every native collective must lie
inside one domain and every bridge message must join two domains over a bridge pair, and the
symbolic checker must pass the plan against its contract; and, once shapes are known, every
collective must exchange equal chunks (what the process-group backends can do). A refused
plan raises :class:`PlanRefused` with the reasons on every rank alike and makes no call at
all: a native collective that spans domains is never attempted.

An admitted plan first runs on zero-filled stand-ins of every rank's buffers at once
(:func:`simulate`), which gives each receiver the shape of what it will receive, so a bridge
message is one message with no size header. (Stand-ins rather than ``meta`` tensors: plan
buffers are small, and the first ``meta`` concatenation costs seconds of import.) Then each
rank runs its own steps: collectives on its domain
group (on the domain's device), bridge messages host-staged (device → host → gloo bridge →
host → device), local projections through :mod:`meshpact.live.plans.ops`. Every collective call and
bridge message is recorded by the :class:`~meshpact.live.plans.meter.Meter` with the bytes this
rank contributed, which is how measured startups and payload bytes are compared to the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from meshpact.core.checker import CheckReport, check
from meshpact.core.contract import Contract
from meshpact.core.errors import PlanError
from meshpact.core.facts import LinkClass, Mesh
from meshpact.core.plan import Collective, Plan, Step, StepKind

from . import ops
from .domains import DomainLayout
from .meter import Meter

__all__ = [
    "PlanRefused",
    "locality_violations",
    "admit",
    "simulate",
    "stand_in",
    "StepShapes",
    "Executor",
    "RunOutcome",
]

Buffers = dict[str, torch.Tensor]


class PlanRefused(PlanError):
    """A plan the executor will not run; nothing was attempted."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons = tuple(reasons)
        super().__init__("plan refused before running: " + "; ".join(self.reasons))


def locality_violations(plan: Plan, mesh: Mesh, bridge_pairs: Sequence[tuple[int, int]] | None = None) -> list[str]:
    """Reasons the plan cannot run on ``mesh``'s native domains and bridges (empty: it can)."""
    out: list[str] = []
    pairs = None if bridge_pairs is None else {tuple(sorted(p)) for p in bridge_pairs}
    for i, s in enumerate(plan.steps):
        stray = [r for r in s.ranks if r not in mesh.ranks]
        if stray:
            out.append(f"step {i} ({s.op}): ranks {stray} are not in the mesh")
            continue
        domains = sorted({mesh.domain_of(r).name for r in s.ranks})
        if s.kind is StepKind.COLLECTIVE and len(domains) > 1:
            out.append(
                f"step {i} ({s.op}): native collective over ranks {list(s.ranks)} spans domains "
                f"{domains}; a native communicator cannot span vendors, use a bridge send"
            )
        elif s.kind is StepKind.SEND:
            if len(domains) == 1:
                out.append(
                    f"step {i} (send {s.ranks[0]}->{s.ranks[1]}): both ranks are in {domains[0]!r}; "
                    "a bridge message joins two domains (use a native collective inside one)"
                )
            elif pairs is not None and tuple(sorted(s.ranks)) not in pairs:
                out.append(
                    f"step {i} (send {s.ranks[0]}->{s.ranks[1]}): no bridge joins these ranks "
                    f"(bridges: {sorted(pairs)})"
                )
        elif s.kind is StepKind.COLLECTIVE and s.arg("root") is not None and s.arg("root") not in s.ranks:
            out.append(f"step {i} ({s.op}): root {s.arg('root')} is not a participant {list(s.ranks)}")
    return out


Checker = Callable[[Plan, Contract], CheckReport]


def admit(
    plan: Plan,
    contract: Contract,
    mesh: Mesh,
    bridge_pairs: Sequence[tuple[int, int]] | None = None,
    checker: Checker = check,
) -> CheckReport:
    """Refuse ``plan`` unless it is local to native domains and the checker passes it.

    Returns the checker's report. Both verdicts are collected, so a refusal names every reason.
    """
    reasons = locality_violations(plan, mesh, bridge_pairs)
    report = checker(plan, contract)
    if not report.ok:
        reasons += [f"checker: {v}" for v in report.violations]
    if reasons:
        raise PlanRefused(reasons)
    return report


def stand_in(t: torch.Tensor) -> torch.Tensor:
    """A zero tensor on the CPU with ``t``'s shape and dtype: what :func:`simulate` runs on."""
    return torch.zeros(t.shape, dtype=t.dtype)


@dataclass(frozen=True)
class StepShapes:
    """Shapes (stand-in tensors) around one step: each participant's input and output."""

    inputs: Mapping[int, torch.Tensor | None]
    outputs: Mapping[int, torch.Tensor | None]


def simulate(
    plan: Plan, initial: Mapping[int, Buffers], ids: torch.Tensor | None = None
) -> tuple[dict[int, Buffers], list[StepShapes]]:
    """Run ``plan`` over every rank's buffers in this process.

    On stand-ins (:func:`stand_in`) it gives every buffer's shape and dtype: the final
    buffers of every rank, and the shapes around each step. A step that reads a buffer its
    rank does not hold, or cannot apply to those shapes, raises :class:`PlanError`.
    """
    world: dict[int, Buffers] = {r: dict(b) for r, b in initial.items()}
    for r in {r for s in plan.steps for r in s.ranks}:
        world.setdefault(r, {})
    trace: list[StepShapes] = []
    for i, s in enumerate(plan.steps):
        ins: dict[int, torch.Tensor | None] = {}
        outs: dict[int, torch.Tensor | None] = {}
        try:
            if s.kind is StepKind.COLLECTIVE:
                ins = {r: _read(world[r], s, i) if _reads(s, r) else None for r in s.ranks}
                results = ops.collective_result(Collective(s.op), [ins[r] for r in s.ranks], s)
                outs = dict(zip(s.ranks, results))
            elif s.kind is StepKind.SEND:
                src, dst = s.ranks
                sent = _read(world[src], s, i)
                ins = {src: sent}
                outs = {dst: sent.clone()}
            elif s.kind is StepKind.PROJECT:
                for r in s.ranks:
                    outs[r] = ops.project(s, [_get(world[r], n, s, i) for n in s.inputs], r, ids)
            elif s.kind is StepKind.DELIVER:
                ins = {r: _read(world[r], s, i) for r in s.ranks}
        except PlanError:
            raise
        except Exception as exc:  # an op the plan cannot apply to these shapes
            raise PlanError(f"step {i} ({s.op} on ranks {list(s.ranks)}) cannot run: {exc}") from None
        for r, v in outs.items():
            if v is not None:
                world[r][s.output] = v
        trace.append(StepShapes(ins, outs))
    return world, trace


def _reads(s: Step, rank: int) -> bool:
    """Whether ``rank`` supplies an input to collective ``s`` (non-roots of broadcast/scatter do not)."""
    op = Collective(s.op)
    return not (op in (Collective.BROADCAST, Collective.SCATTER) and rank != s.arg("root"))


def _get(bufs: Buffers, name: str, s: Step, i: int) -> torch.Tensor:
    if name not in bufs:
        raise PlanError(f"step {i} ({s.op}): buffer {name!r} is not present on this rank")
    return bufs[name]


def _read(bufs: Buffers, s: Step, i: int) -> torch.Tensor:
    if not s.inputs:
        raise PlanError(f"step {i} ({s.op}): names no input buffer")
    return _get(bufs, s.inputs[0], s, i)


@dataclass
class RunOutcome:
    """What one rank did in one plan: its buffers (every value it ever held) and deliveries."""

    rank: int
    buffers: Buffers
    delivered: dict[str, torch.Tensor]
    history: list[tuple[int, str, torch.Tensor]] = field(default_factory=list)  # (step index, buffer, value)


class Executor:
    """Runs admitted plans on this rank's domain group and bridges, metering every call."""

    def __init__(self, layout: DomainLayout, meter: Meter | None = None) -> None:
        self.layout = layout
        self.meter = meter or Meter(layout.rank)

    def run(
        self,
        plan: Plan,
        contract: Contract,
        initial: Mapping[int, Buffers],
        ids: torch.Tensor | None = None,
        checker: Checker = check,
    ) -> RunOutcome:
        """Admit ``plan``, then run this rank's part of it.

        ``initial`` holds every rank's starting buffers: stand-ins (shapes only) for the
        other ranks, real tensors for this one; ``ids`` are the target id per row that a
        ``logprob`` request reads (every rank holds them, as the contract's demand says).
        """
        lay = self.layout
        admit(plan, contract, lay.mesh, lay.bridge_pairs, checker)
        _, trace = simulate(
            plan,
            {r: {k: stand_in(v) for k, v in b.items()} for r, b in initial.items()},
            None if ids is None else ids.cpu(),
        )
        uneven = [
            f"step {i}: {why}"
            for i, s in enumerate(plan.steps)
            if s.kind is StepKind.COLLECTIVE
            for why in ops.chunk_problems(s, [trace[i].inputs.get(r) for r in s.ranks])
        ]
        if uneven:
            raise PlanRefused(uneven)
        # copies: the plan never writes into the caller's tensors (nor into a cached reference)
        bufs: Buffers = {k: v.to(lay.device, copy=True) for k, v in initial.get(lay.rank, {}).items()}
        out = RunOutcome(lay.rank, bufs, {})
        for i, s in enumerate(plan.steps):
            if lay.rank not in s.ranks:
                continue
            if s.kind is StepKind.COLLECTIVE:
                value = self._collective(s, i, bufs, trace[i])
            elif s.kind is StepKind.SEND:
                value = self._bridge(s, i, bufs, trace[i])
            elif s.kind is StepKind.PROJECT:
                value = ops.project(s, [_get(bufs, n, s, i) for n in s.inputs], lay.rank, ids)
            else:
                out.delivered[s.output] = _read(bufs, s, i).clone()
                continue
            if value is not None:
                bufs[s.output] = value
                out.history.append((i, s.output, value))
        return out

    # -- native collectives inside the domain -------------------------------------------
    def _collective(self, s: Step, i: int, bufs: Buffers, shapes: StepShapes) -> torch.Tensor | None:
        op = Collective(s.op)
        me = self.layout.rank
        group, name = self.layout.native_group(s.ranks)
        value = _read(bufs, s, i) if _reads(s, me) else None
        contributed = ops.nbytes(value) if value is not None else 0
        started = time.monotonic()
        result = ops.run_collective(op, s, value, shapes.outputs.get(me), group, self.layout.device)
        self.meter.record(name, op.value, LinkClass.FABRIC.value, contributed, started)
        return result

    # -- one bridge message, host-staged ---------------------------------------------------
    def _bridge(self, s: Step, i: int, bufs: Buffers, shapes: StepShapes) -> torch.Tensor | None:
        lay = self.layout
        src, dst = s.ranks
        group = lay.bridge(src, dst)
        name = f"bridge:{min(src, dst)}-{max(src, dst)}"
        link = lay.mesh.link_class(src, dst).value
        started = time.monotonic()
        if lay.rank == src:
            staged = _read(bufs, s, i).to("cpu").contiguous()  # device -> host
            dist.send(staged, dst=dst, group=group)
            self.meter.record(name, "send", link, ops.nbytes(staged), started)
            return None
        meta = shapes.outputs[dst]
        assert meta is not None  # a send's receiver has an output
        host = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
        dist.recv(host, src=src, group=group)
        self.meter.record(name, "recv", link, 0, started)
        return host.to(lay.device)  # host -> device
