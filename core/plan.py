"""Plans: a deterministic, backend-neutral sequence of communication and compute steps.

A :class:`Plan` is what every planner produces and what the checker, the numeric
interpreter, the simulator and the live executor consume. Each :class:`Step` names its
kind, participants, the buffers it reads and writes, its payload bytes and dtype.

Cost conventions (one place, used by every consumer of a plan):

* **startups**: one per collective call and one per bridge message; local ``project``
  steps and ``deliver`` start nothing. A bridge ``send`` over the chunking threshold is
  pipelined in ``args.chunks`` messages through a host staging buffer of
  ``args.staging_bytes`` (:data:`meshpact.core.planbuild.CHUNK_BYTES` at most), one
  startup per chunk.
* **payload bytes**: the logical payload, independent of algorithm: for a collective, the
  sum over participants of the bytes each one contributes (for ``broadcast``/``scatter``
  only the root's); for a bridge ``send``, the bytes sent. A live executor counts exactly
  this at each call, so planned and measured counts can be compared exactly.
* **time**: α-β per link class, with ring algorithms inside a domain
  (:func:`step_time_s`).
* **sizes of projected data**: (max, index) pairs 8 B per row per shard, log-sum-exp
  statistics 12 B, token ids 8 B, log-probabilities 4 B per row
  (:func:`meshpact.core.planbuild.form_bytes`).

What each step does to each rank's buffers (collectives, sends, projections, deliver) is
defined by the table in :mod:`meshpact.core.interpreter`, the numeric reference that the
live executor mirrors.

JSON round-trips byte for byte: ``Plan.from_json(plan.to_json()).to_json() == plan.to_json()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

from .errors import PlanError
from .facts import DType, LinkClass, Mesh

__all__ = [
    "StepKind",
    "Collective",
    "Projection",
    "MASKED_PROJECTIONS",
    "Step",
    "Plan",
    "PlanCost",
    "plan_cost",
    "step_time_s",
    "plan_time_s",
    "collective_of",
    "projection_of",
]


class StepKind(str, Enum):
    COLLECTIVE = "collective"  # a native collective inside one domain
    PROJECT = "project"  # local compute on each participant
    SEND = "send"  # one bridge message between ranks of different domains, host-staged
    DELIVER = "deliver"  # hand the named buffer to the consumer on each participant


class Collective(str, Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    GATHER = "gather"
    REDUCE = "reduce"
    BROADCAST = "broadcast"
    SCATTER = "scatter"
    ALL_TO_ALL = "all_to_all"


class Projection(str, Enum):
    """Local compute steps. Arguments travel in ``Step.args``."""

    ARGMAX = "argmax"  # token id of the max along the last dim (lowest index on ties)
    LOCAL_MAX_ARG = "local_max_arg"  # per-row (max value, global index) of a vocab shard
    COMBINE_MAX_ARG = "combine_max_arg"  # per-row winner among gathered (value, index) pairs
    LOCAL_SAMPLE_MAX_ARG = "local_sample_max_arg"  # (max, global index) of a shard's seeded, perturbed logits
    LOGSOFTMAX_AT = "logsoftmax_at"  # log-softmax of full rows, read at the requested ids
    LOCAL_LSE_STATS = "local_lse_stats"  # per-row (max, sum exp, target logit) of a vocab shard
    COMBINE_LSE_STATS = "combine_lse_stats"  # log-prob from gathered per-shard statistics
    SLICE = "slice"  # rows/cols selected by args (dim, start, stop) or rows by owner
    CHUNK = "chunk"  # this rank's chunk along args['dim'] (Replicate -> Shard locally)
    SUM = "sum"  # sum of gathered addends in a fixed order
    CONCAT = "concat"  # concatenate gathered chunks along args['dim']
    COPY = "copy"  # rename a buffer
    TOPK = "topk"  # the k largest entries' ids and log-probabilities of full rows (args k)
    TOKEN_LOGPROB = "token_logprob"  # argmax id and its log-probability of full rows
    SAMPLE = "sample"  # a seeded sample from softmax(rows / temperature) (args seed, temperature, row_offsets)


# Projections that read logits columns: with ``args.valid`` they mask the columns at and past it
# (a vocabulary padded to a multiple of TP x 128) to the lowest value before reading.
MASKED_PROJECTIONS = frozenset(
    {
        Projection.ARGMAX,
        Projection.LOCAL_MAX_ARG,
        Projection.LOCAL_SAMPLE_MAX_ARG,
        Projection.LOCAL_LSE_STATS,
        Projection.LOGSOFTMAX_AT,
        Projection.TOPK,
        Projection.TOKEN_LOGPROB,
        Projection.SAMPLE,
    }
)


# Each op enum by value, so reading or validating a step's op is one dict lookup.
_COLLECTIVE_OPS: dict[str, Collective] = {c.value: c for c in Collective}
_PROJECTION_OPS: dict[str, Projection] = {p.value: p for p in Projection}


def collective_of(op: str) -> Collective:
    """``Collective(op)``, by a dict lookup for the common case of a valid op string."""
    found = _COLLECTIVE_OPS.get(op) if type(op) is str else None
    return found if found is not None else Collective(op)


def projection_of(op: str) -> Projection:
    """``Projection(op)``, by a dict lookup for the common case of a valid op string."""
    found = _PROJECTION_OPS.get(op) if type(op) is str else None
    return found if found is not None else Projection(op)


# The enum a step kind's op belongs to, its values, and the kinds between exactly two ranks.
_OP_ENUM: dict[StepKind, type[Enum]] = {StepKind.COLLECTIVE: Collective, StepKind.PROJECT: Projection}
_OPS_OF: dict[type[Enum], Mapping[str, Enum]] = {Collective: _COLLECTIVE_OPS, Projection: _PROJECTION_OPS}
_PAIRWISE = frozenset({StepKind.SEND})
# The type sets of ranks and argument names that need no coercion.
_INT_ONLY = {int}
_STR_ONLY = frozenset({str})
# Argument values that freeze to themselves.
_ATOMS = frozenset({int, str, float, bool, type(None)})


@dataclass(frozen=True, init=False)
class Step:
    """One step of a plan.

    ``ranks`` are the participants. For ``send``, ``ranks == (src, dst)``. For collectives
    with a root (gather, reduce, broadcast, scatter) the root is ``args['root']``.
    ``inputs``/``output`` name per-rank buffers; ``args`` holds op arguments (``dim``,
    ``root``, ``op``, ``ids``...) as JSON-able values in sorted order.
    """

    kind: StepKind
    op: str
    ranks: tuple[int, ...]
    inputs: tuple[str, ...]
    output: str
    payload_bytes: int
    dtype: DType
    domain: str | None = None
    link: LinkClass | None = None
    args: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    def __init__(
        self,
        kind: StepKind | str,
        op: str,
        ranks: Iterable[int],
        inputs: Iterable[str],
        output: str,
        payload_bytes: int,
        dtype: DType | str,
        domain: str | None = None,
        link: LinkClass | str | None = None,
        args: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
        note: str = "",
    ) -> None:
        # Loose values (JSON strings, lists, mappings, bools) are coerced to the field types; values
        # that already have them (what every planner builds) pass as they are. The fields are stored
        # in one update: the dataclass is frozen, so nothing else writes them.
        if type(kind) is not StepKind:
            kind = StepKind(kind)
        if type(ranks) is not tuple or {*map(type, ranks)} != _INT_ONLY:
            ranks = tuple(int(r) for r in ranks)
        if type(inputs) is not tuple:
            inputs = tuple(inputs)
        if type(dtype) is not DType:
            dtype = DType(dtype)
        if link is not None and type(link) is not LinkClass:
            link = LinkClass(link)
        if type(args) is dict and _STR_ONLY.issuperset(map(type, args)) and _ATOMS.issuperset(map(type, args.values())):
            args = tuple(sorted(args.items()))  # string keys, values that freeze to themselves
        elif args or type(args) is not tuple:
            items = args.items() if type(args) is dict or isinstance(args, Mapping) else args
            args = tuple(
                sorted((k if type(k) is str else str(k), v if type(v) in _ATOMS else _freeze(v)) for k, v in items)
            )
        if not ranks:
            raise PlanError(f"step {op!r}: expected at least one participant rank")
        if payload_bytes < 0:
            raise PlanError(f"step {op!r}: payload_bytes must be >= 0, got {payload_bytes}")
        op_enum = _OP_ENUM.get(kind)
        if op_enum is not None:
            if type(op) is not str or op not in _OPS_OF[op_enum]:
                op_enum(op)  # raises ValueError naming the op that is not one of the kind's
        elif len(ranks) != 2 and kind in _PAIRWISE:
            raise PlanError(f"send step needs ranks (src, dst), got {list(ranks)}")
        self.__dict__.update(
            kind=kind,
            op=op,
            ranks=ranks,
            inputs=inputs,
            output=output,
            payload_bytes=payload_bytes,
            dtype=dtype,
            domain=domain,
            link=link,
            args=args,
            note=note,
        )

    def arg(self, name: str, default: Any = None) -> Any:
        for k, v in self.args:
            if k == name:
                return v
        return default

    @property
    def startups(self) -> int:
        if self.kind is StepKind.SEND:
            return max(1, int(self.arg("chunks", 1)))
        return 1 if self.kind is StepKind.COLLECTIVE else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "op": self.op,
            "ranks": list(self.ranks),
            "inputs": list(self.inputs),
            "output": self.output,
            "payload_bytes": self.payload_bytes,
            "dtype": self.dtype.value,
            "domain": self.domain,
            "link": self.link.value if self.link else None,
            "args": {k: _thaw(v) for k, v in self.args},
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Step":
        try:
            return cls(
                kind=StepKind(data["kind"]),
                op=str(data["op"]),
                ranks=tuple(data["ranks"]),
                inputs=tuple(data.get("inputs", ())),
                output=str(data["output"]),
                payload_bytes=int(data["payload_bytes"]),
                dtype=DType(data["dtype"]),
                domain=data.get("domain"),
                link=LinkClass(data["link"]) if data.get("link") else None,
                args=dict(data.get("args") or {}),
                note=str(data.get("note", "")),
            )
        except KeyError as exc:
            raise PlanError(f"plan step is missing field {exc.args[0]!r}: {dict(data)}") from None
        except ValueError as exc:
            raise PlanError(f"plan step {dict(data).get('op')!r}: {exc}") from None


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class PlanCost:
    startups: int
    payload_bytes: int
    bytes_by_link: Mapping[str, int]
    startups_by_link: Mapping[str, int]
    time_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "startups": self.startups,
            "payload_bytes": self.payload_bytes,
            "bytes_by_link": dict(self.bytes_by_link),
            "startups_by_link": dict(self.startups_by_link),
            "time_s": self.time_s,
        }


@dataclass(frozen=True)
class Plan:
    """A planner's output for one edge: ordered steps plus the planner's name."""

    edge: str
    planner: str
    steps: tuple[Step, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))

    @property
    def startups(self) -> int:
        return sum(s.startups for s in self.steps)

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.steps if s.startups)

    def to_dict(self) -> dict[str, Any]:
        return {"edge": self.edge, "planner": self.planner, "steps": [s.to_dict() for s in self.steps]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping) or "steps" not in data:
            raise PlanError("a plan is a JSON object with 'edge', 'planner' and 'steps'")
        return cls(
            edge=str(data.get("edge", "")),
            planner=str(data.get("planner", "")),
            steps=tuple(Step.from_dict(s) for s in data["steps"]),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def step_time_s(step: Step, mesh: Mesh) -> float:
    """α-β time of one step on ``mesh``; collectives use ring algorithms."""
    if not step.startups:
        return 0.0
    link = mesh.links[step.link or LinkClass.FABRIC]
    n = len(step.ranks)
    if step.kind is StepKind.SEND or n == 1:
        return link.time_s(step.startups, step.payload_bytes)
    op = collective_of(step.op)
    if op is Collective.ALL_REDUCE:
        # ring: reduce-scatter then all-gather, 2(n-1) rounds of size/n per rank
        per_rank = step.payload_bytes / n
        return link.time_s(2 * (n - 1), int(2 * (n - 1) * per_rank / n))
    if op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        per_rank = step.payload_bytes / n
        return link.time_s(n - 1, int((n - 1) * per_rank / (1 if op is Collective.ALL_GATHER else n)))
    # rooted collectives: (n-1) messages into or out of the root
    return link.time_s(n - 1, int(step.payload_bytes * (n - 1) / n))


def plan_cost(plan: Plan, mesh: Mesh) -> PlanCost:
    """Startups, payload bytes (total and per link class) and α-β time of ``plan``."""
    by_link: dict[str, int] = {}
    starts: dict[str, int] = {}
    for s in plan.steps:
        if not s.startups:
            continue
        key = (s.link or LinkClass.FABRIC).value
        by_link[key] = by_link.get(key, 0) + s.payload_bytes
        starts[key] = starts.get(key, 0) + 1
    return PlanCost(
        startups=plan.startups,
        payload_bytes=plan.payload_bytes,
        bytes_by_link=dict(sorted(by_link.items())),
        startups_by_link=dict(sorted(starts.items())),
        time_s=plan_time_s(plan, mesh),
    )


def plan_time_s(plan: Plan, mesh: Mesh) -> float:
    """α-β time of ``plan`` on ``mesh``: its steps' :func:`step_time_s`, summed in step order."""
    time_s = 0.0
    for s in plan.steps:
        if s.startups:
            time_s += step_time_s(s, mesh)
    return time_s
