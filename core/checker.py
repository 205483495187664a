"""The symbolic checker: does a plan keep its contract? Decided before anything runs.

:func:`check` executes a plan over per-rank buffers of symbolic values,
``piece(tensor, region, reduction state, form)``, with the same step semantics as the
numeric interpreter (:mod:`meshpact.core.interpreter`), and reports every violated
obligation with the step, the rank and a reason a person can read:

* a native collective spanning two domains (``cross_domain_collective``);
* a step whose input is not present on that rank (``missing_input``), or whose
  arguments or shapes cannot work (``malformed_step``), a bridge message over the staging
  buffer (:data:`~meshpact.core.planbuild.CHUNK_BYTES`) not declared in chunks included;
* a partial sum reduced twice (``reduced_twice``) or not at all (``never_reduced``);
* a projection applied to partials (``projection_of_partial``): the argmax of one
  addend is not the argmax of the sum;
* a consumer that ends without its demanded observation (``demand_not_met``) or with a
  substitute the contract does not allow (``disallowed_substitute``);
* a rank outside the owner scope that holds owner-scoped rows (``non_owner_observes``);
* two senders of the same partial or inexact piece into one domain (``duplicate_sender``):
  which copy a consumer combines would decide the result (identical complete copies pass);
* a delivery before the delivered data is complete (``delivery_before_completion``);
* a declared figure that disagrees with the data: payload bytes other than the buffers'
  shapes and dtypes give (``payload_mismatch``), a link class other than the ranks' hosts
  and domains give (``link_mismatch``);
* partial addends combined outside the domain the contract's completion facet names
  (``completed_outside_domain``).

Buffers also carry their numeric shape, so a step that numpy or torch would refuse is
reported instead of being assumed to work.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from .contract import Contract, Equivalence, Form, Observation
from .pieces import Buf, Piece, PieceAlgebra, Refusal, garbage, rows_of_piece
from .placement import Partial, shard_bounds
from .facts import LinkClass
from .plan import MASKED_PROJECTIONS, Collective, Plan, Projection, Step, StepKind, collective_of, projection_of
from .planbuild import CHUNK_BYTES
from .region import Intervals, intervals_from_indices, intervals_indices, intervals_size, region_text

__all__ = ["ViolationKind", "Violation", "CheckReport", "check"]


class ViolationKind(str, Enum):
    CROSS_DOMAIN_COLLECTIVE = "cross_domain_collective"
    MISSING_INPUT = "missing_input"
    MALFORMED_STEP = "malformed_step"
    REDUCED_TWICE = "reduced_twice"
    NEVER_REDUCED = "never_reduced"
    PROJECTION_OF_PARTIAL = "projection_of_partial"
    DEMAND_NOT_MET = "demand_not_met"
    DISALLOWED_SUBSTITUTE = "disallowed_substitute"
    NON_OWNER_OBSERVES = "non_owner_observes"
    DUPLICATE_SENDER = "duplicate_sender"
    DELIVERY_BEFORE_COMPLETION = "delivery_before_completion"
    PAYLOAD_MISMATCH = "payload_mismatch"
    LINK_MISMATCH = "link_mismatch"
    COMPLETED_OUTSIDE_DOMAIN = "completed_outside_domain"


# Bytes per element of what each projection writes (None: the input's own).
_PROJECTED_ITEMSIZE: dict[Projection, int] = {
    Projection.ARGMAX: 8,
    Projection.COMBINE_MAX_ARG: 8,
    Projection.LOCAL_MAX_ARG: 8,
    Projection.LOCAL_SAMPLE_MAX_ARG: 8,
    Projection.LOCAL_LSE_STATS: 4,
    Projection.COMBINE_LSE_STATS: 4,
    Projection.LOGSOFTMAX_AT: 4,
    Projection.TOPK: 8,
    Projection.TOKEN_LOGPROB: 8,
    Projection.SAMPLE: 8,
}


# Groups of ops the checker branches on, named once (a frozenset test, not a tuple of member lookups).
_ROOTED = frozenset({Collective.GATHER, Collective.REDUCE, Collective.BROADCAST, Collective.SCATTER})
_FROM_ROOT = frozenset({Collective.BROADCAST, Collective.SCATTER})  # only the root contributes
_GATHERS = frozenset({Collective.ALL_GATHER, Collective.GATHER})
_REDUCES = frozenset({Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER})
# The form each combining projection reads (every other projection that needs one clean piece reads raw).
_COMBINED_FORM: dict[Projection, Form] = {
    Projection.COMBINE_MAX_ARG: Form.MAX_ARG,
    Projection.COMBINE_LSE_STATS: Form.LSE_STATS,
}
# Per-shard statistics of a vocabulary shard.
_PER_SHARD = frozenset({Projection.LOCAL_MAX_ARG, Projection.LOCAL_LSE_STATS, Projection.LOCAL_SAMPLE_MAX_ARG})
# Projections of full rows with the consumer's parameters.
_OF_FULL_ROWS = frozenset({Projection.TOPK, Projection.TOKEN_LOGPROB, Projection.SAMPLE})
# Projections whose input must be two-dimensional.
_NEEDS_2D = frozenset(
    {
        Projection.LOCAL_MAX_ARG,
        Projection.LOCAL_SAMPLE_MAX_ARG,
        Projection.LOCAL_LSE_STATS,
        Projection.LOGSOFTMAX_AT,
        Projection.COMBINE_MAX_ARG,
        Projection.COMBINE_LSE_STATS,
        Projection.TOPK,
        Projection.TOKEN_LOGPROB,
        Projection.SAMPLE,
    }
)
# Projections that rearrange or combine buffers (any pieces); every other one projects one clean piece.
_REARRANGING = frozenset({Projection.SUM, Projection.CONCAT, Projection.COPY, Projection.SLICE, Projection.CHUNK})
# Combining projections' packed input: entries per shard and what they are.
_PACKED_INPUT: dict[Projection, tuple[int, str]] = {
    Projection.COMBINE_MAX_ARG: (2, "(value, index) pairs"),
    Projection.COMBINE_LSE_STATS: (3, "statistic triples"),
}
# Projections whose output has a fixed width per row.
_FIXED_WIDTH: dict[Projection, int] = {
    Projection.LOCAL_MAX_ARG: 2,
    Projection.LOCAL_SAMPLE_MAX_ARG: 2,
    Projection.LOCAL_LSE_STATS: 3,
    Projection.TOKEN_LOGPROB: 2,
}


@dataclass(frozen=True)
class Violation:
    kind: ViolationKind
    step: int | None
    rank: int | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "step": self.step, "rank": self.rank, "reason": self.reason}

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "end of plan"
        who = f", rank {self.rank}" if self.rank is not None else ""
        return f"{self.kind.value} ({where}{who}): {self.reason}"


@dataclass(frozen=True)
class CheckReport:
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def kinds(self) -> set[ViolationKind]:
        return {v.kind for v in self.violations}

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "violations": [v.to_dict() for v in self.violations]}


def _rows_text(iv: Intervals) -> str:
    return region_text((iv,))[1:-1]


class _Checker(PieceAlgebra):
    def __init__(self, contract: Contract) -> None:
        super().__init__(contract)
        ranks = self.mesh.ranks
        self.mem: dict[int, dict[str, Buf]] = {r: {} for r in ranks}
        self.writes: dict[int, list[tuple[int, Buf]]] = {r: [] for r in ranks}
        self.observed: dict[int, tuple[int, Buf]] = {}
        self.pending: list[tuple[int, int, Piece]] = []
        self.senders: dict[tuple, int] = {}
        self.violations: list[Violation] = []
        itemsize = contract.provenance.dtype.itemsize
        for h in contract.provenance.holdings:
            shape = tuple(map(intervals_size, h.region))
            piece = Piece(self.tensor, Form.RAW, h.region, (h.rank,) if h.partial else None, True)
            self.mem[h.rank][self.tensor] = Buf((piece,), shape, itemsize)

    # -- helpers -----------------------------------------------------------------------
    def flag(self, kind: ViolationKind, step: int | None, rank: int | None, reason: str) -> None:
        self.violations.append(Violation(kind, step, rank, reason))

    def read(self, k: int, step: Step, rank: int, name: str) -> Buf:
        buf = self.mem.get(rank, {}).get(name)
        if buf is None:
            raise Refusal(ViolationKind.MISSING_INPUT, f"{step.op} reads {name!r}, which rank {rank} does not hold")
        return buf

    def write(self, k: int, rank: int, name: str, buf: Buf) -> None:
        self.mem[rank][name] = buf
        self.writes[rank].append((k, buf))
        auth = self.c.authority
        if auth.owner_of_row is not None:
            for p in buf.pieces:
                if rows_of_piece(p) and not auth.may_hold(rank, rows_of_piece(p)):
                    foreign = [r for r in intervals_indices(rows_of_piece(p)) if auth.owner_of_row[r] != rank]
                    self.flag(
                        ViolationKind.NON_OWNER_OBSERVES,
                        k,
                        rank,
                        f"rank {rank} receives rows {_rows_text(intervals_from_indices(foreign))} of "
                        f"{p.tensor}, owned by rank(s) {sorted({auth.owner_of_row[r] for r in foreign})}",
                    )
                    break

    # -- steps ------------------------------------------------------------------------------
    def run(self, plan: Plan) -> CheckReport:
        for k, step in enumerate(plan.steps):
            try:
                self.step(k, step)
            except Refusal as bad:
                self.flag(ViolationKind(bad.kind), k, None, bad.reason)
        self.finish()
        return CheckReport(tuple(self.violations))

    def step(self, k: int, step: Step) -> None:
        getattr(self, _STEP_METHOD[step.kind])(k, step)

    def deliver(self, k: int, step: Step) -> None:
        for r in step.ranks:
            try:
                buf = self.read(k, step, r, step.inputs[0])
            except Refusal as bad:
                self.flag(ViolationKind(bad.kind), k, r, bad.reason)
                continue
            self.observed[r] = (k, buf)
            for p in buf.pieces:
                if self.partial(p):
                    self.pending.append((k, r, p))

    def project_step(self, k: int, step: Step) -> None:
        proj = projection_of(step.op)
        summing = proj is Projection.SUM
        for i, r in enumerate(step.ranks):
            try:
                xs = [self.read(k, step, r, n) for n in step.inputs]
                out, issues = self.project(step, i, xs, proj)
            except Refusal as bad:
                self.flag(ViolationKind(bad.kind), k, r, bad.reason)
                continue
            for kind, why in issues:
                self.flag(ViolationKind(kind), k, r, why)
            size = _PROJECTED_ITEMSIZE.get(proj, xs[0].itemsize)
            if out.itemsize != size:
                out = Buf(out.pieces, out.shape, size)
            if summing and len(xs) * len(xs[0].pieces) > 1:
                self.completion_at(k, r, [p for x in xs for p in x.pieces])
            self.write(k, r, step.output, out)

    def completion_at(self, k: int, rank: int, pieces: list[Piece]) -> None:
        """Partial addends combined on ``rank``: only inside the completion facet's domain."""
        where = self.c.completion.inside_domain
        here = self.mesh.domain_of(rank).name
        if here != where and sum(p.contrib is not None for p in pieces) > 1:
            self.flag(
                ViolationKind.COMPLETED_OUTSIDE_DOMAIN,
                k,
                rank,
                f"partial {self.op} addends of {self.tensor} are combined in {here}; the contract completes "
                f"them inside {where} before anything crosses",
            )

    def declared(self, k: int, step: Step, rank: int, nbytes: int) -> None:
        """The step's declared payload bytes and link class against what its data and ranks give."""
        if nbytes != step.payload_bytes:
            self.flag(
                ViolationKind.PAYLOAD_MISMATCH,
                k,
                rank,
                f"{step.op} declares {step.payload_bytes} payload bytes; its buffers' shapes and dtypes give {nbytes}",
            )
        if step.kind is StepKind.SEND:
            link = self.mesh.link_class(*step.ranks)
        else:
            link = LinkClass.FABRIC
        declared = step.link or LinkClass.FABRIC
        if declared is not link:
            self.flag(
                ViolationKind.LINK_MISMATCH,
                k,
                rank,
                f"{step.op} over ranks {list(step.ranks)} is labelled {declared.value}; the ranks' hosts and "
                f"domains make it {link.value}",
            )

    def send(self, k: int, step: Step) -> None:
        src, dst = step.ranks
        try:
            buf = self.read(k, step, src, step.inputs[0])
        except Refusal as bad:
            self.flag(ViolationKind(bad.kind), k, src, bad.reason)
            return
        self.declared(k, step, src, buf.nbytes)
        chunks, staging = step.arg("chunks"), step.arg("staging_bytes")
        if chunks is None and staging is None and step.payload_bytes > CHUNK_BYTES:
            self.flag(
                ViolationKind.MALFORMED_STEP,
                k,
                src,
                f"send of {step.payload_bytes} bytes as one message; a message passes through a staging "
                f"buffer of at most {CHUNK_BYTES} bytes, so it needs ceil(payload / staging) chunks",
            )
        elif chunks is not None or staging is not None:
            if (
                not isinstance(chunks, int)
                or not isinstance(staging, int)
                or chunks < 1
                or staging < 1
                or staging > CHUNK_BYTES
                or chunks != -(-step.payload_bytes // staging)
            ):
                self.flag(
                    ViolationKind.MALFORMED_STEP,
                    k,
                    src,
                    f"send in {chunks} chunks through a {staging}-byte staging buffer cannot carry "
                    f"{step.payload_bytes} bytes; expected ceil(payload / staging) chunks and staging <= "
                    f"{CHUNK_BYTES}",
                )
        sd, dd = self.mesh.domain_of(src).name, self.mesh.domain_of(dst).name
        if sd != dd:
            for p in buf.pieces:
                if p.form is Form.GARBAGE or (p.exact and not self.partial(p)):
                    continue  # copies of complete, exact data are the same bits whoever sends them
                key = (dd, p.tensor, p.form, p.region, p.contrib)
                first = self.senders.setdefault(key, src)
                if first != src:
                    self.flag(
                        ViolationKind.DUPLICATE_SENDER,
                        k,
                        src,
                        f"rank {src} sends {p.form.value} {p.tensor}{region_text(p.region)} into {dd}, "
                        f"which rank {first} already sends: one authoritative sender per piece",
                    )
        self.write(k, dst, step.output, buf)

    def collective(self, k: int, step: Step) -> None:
        domain_of = self.mesh.domain_of
        domains = {domain_of(r).name for r in step.ranks}
        if len(domains) > 1:
            self.flag(
                ViolationKind.CROSS_DOMAIN_COLLECTIVE,
                k,
                None,
                f"{step.op} over ranks {list(step.ranks)} spans domains {sorted(domains)}; no native communicator "
                "covers two vendors: cross through a bridge send",
            )
            return
        op = collective_of(step.op)
        ranks = step.ranks
        name = step.inputs[0]
        root = step.arg("root")
        rooted = op in _ROOTED
        if rooted and root not in ranks:
            self.flag(ViolationKind.MALFORMED_STEP, k, None, f"{step.op} root {root} is not a participant")
            return
        needs = (root,) if op in _FROM_ROOT else ranks
        missing = [r for r in needs if name not in self.mem[r]]
        for r in missing:
            self.flag(ViolationKind.MISSING_INPUT, k, r, f"{step.op} reads {name!r}, which rank {r} does not hold")
        if missing:
            return
        contributed = [self.mem[r][name] for r in needs]
        self.declared(k, step, root if root is not None else ranks[0], sum(b.nbytes for b in contributed))
        try:
            dim = int(step.arg("dim", 0))
            if op is Collective.BROADCAST:
                for r in ranks:
                    self.write(k, r, step.output, self.mem[root][name])
                return
            if op is Collective.SCATTER:
                x = self.mem[root][name]
                outs = [self.chunk(x, dim, len(ranks), i) for i in range(len(ranks))]
                for r, out in zip(ranks, outs):
                    self.write(k, r, step.output, out)
                return
            xs = [self.mem[r][name] for r in ranks]
            if op in _GATHERS:
                out = self.concat(xs, dim)
                for r in ranks if op is Collective.ALL_GATHER else (root,):
                    self.write(k, r, step.output, out)
            elif op in _REDUCES:
                self.completion_at(k, root if root is not None else ranks[0], [p for x in xs for p in x.pieces])
                out, issues = self.reduce(xs, str(step.arg("op", "sum")), native=True)
                for kind, why in issues:
                    self.flag(ViolationKind(kind), k, None, why)
                if op is Collective.REDUCE_SCATTER:
                    outs = [self.chunk(out, dim, len(ranks), i) for i in range(len(ranks))]
                    for r, o in zip(ranks, outs):
                        self.write(k, r, step.output, o)
                else:
                    for r in ranks if op is Collective.ALL_REDUCE else (root,):
                        self.write(k, r, step.output, out)
            elif op is Collective.ALL_TO_ALL:
                sd, cd = int(step.arg("split_dim", 0)), int(step.arg("concat_dim", 0))
                outs = [self.concat([self.chunk(x, sd, len(ranks), j) for x in xs], cd) for j in range(len(ranks))]
                for r, o in zip(ranks, outs):
                    self.write(k, r, step.output, o)
        except Refusal as bad:
            self.flag(ViolationKind(bad.kind), k, None, f"{step.op}: {bad.reason}")

    def per_rank(self, step: Step, name: str, i: int, default: Any = None) -> Any:
        value = step.arg(name)
        if value is None:
            return default
        if not isinstance(value, tuple) or len(value) != len(step.ranks):
            raise Refusal(ViolationKind.MALFORMED_STEP, f"args.{name} must list one entry per participant")
        return value[i]

    def project(self, step: Step, i: int, xs: list[Buf], op: Projection) -> tuple[Buf, list[tuple[str, str]]]:
        x = xs[0]
        if op not in _REARRANGING:
            return self.project_piece(step, i, x, op)
        if op is Projection.SUM:
            parts = step.arg("parts")
            sop = str(step.arg("op", "sum"))
            if parts is not None and len(xs) == 1:
                parts = int(parts)
                dim = int(step.arg("dim", 0))
                if dim >= len(x.shape) or parts <= 0:
                    raise Refusal(
                        ViolationKind.MALFORMED_STEP, f"cannot split shape {list(x.shape)} in {parts} along {dim}"
                    )
                sizes = {
                    shard_bounds(x.shape[dim], parts, j)[1] - shard_bounds(x.shape[dim], parts, j)[0]
                    for j in range(parts)
                }
                if len(sizes) != 1:
                    raise Refusal(
                        ViolationKind.MALFORMED_STEP, f"{x.shape[dim]} does not split into {parts} equal parts"
                    )
                size = sizes.pop()
                shape = x.shape[:dim] + (size,) + x.shape[dim + 1 :]
                ext = [self.extent(p, dim) for p in x.pieces]
                if len(x.pieces) == parts and all(e == size for e in ext):
                    return self.reduce([Buf((p,), shape) for p in x.pieces], sop, native=False)
                return Buf(
                    (garbage(self.rows_of(x), "split does not fall on the gathered addends", self.tensor),), shape
                ), []
            return self.reduce(xs, sop, native=False)
        if op is Projection.CONCAT:
            return self.concat(xs, int(step.arg("dim", 0))), []
        if op is Projection.COPY:
            return x, []
        if op is Projection.SLICE:
            dim = int(step.arg("dim", 0))
            index = self.per_rank(step, "index", i)
            if index is not None:
                return self.narrow(x, dim, [int(v) for v in index]), []
            bounds = self.per_rank(step, "bounds", i)
            lo, hi = bounds if bounds is not None else (step.arg("start"), step.arg("stop"))
            if lo is None or hi is None:
                raise Refusal(ViolationKind.MALFORMED_STEP, "slice needs start/stop, bounds or index")
            return self.narrow(x, dim, range(int(lo), int(hi))), []
        # CHUNK
        return self.chunk(
            x, int(step.arg("dim", 0)), int(step.arg("parts", 0) or 0), int(self.per_rank(step, "index", i, -1))
        ), []

    def project_piece(self, step: Step, i: int, x: Buf, op: Projection) -> tuple[Buf, list[tuple[str, str]]]:
        """A projection of values (not a rearrangement): it needs one clean piece."""
        p = x.pieces[0] if len(x.pieces) == 1 else garbage(self.rows_of(x), "pieces that do not form one region")
        if p.form is Form.GARBAGE:
            return Buf((p,), self.proj_shape(op, x, step)), []
        want = _COMBINED_FORM.get(op, Form.RAW)
        if op is Projection.COMBINE_MAX_ARG and p.form is Form.SAMPLE_ARG:
            want = Form.SAMPLE_ARG
        shape = self.proj_shape(op, x, step)
        if p.form is not want:
            return Buf((garbage(rows_of_piece(p), f"{op.value} of {p.form.value} data", p.tensor),), shape), []
        if want is Form.RAW and len(p.region) != 2 and op is not Projection.ARGMAX:
            return Buf((garbage(rows_of_piece(p), f"{op.value} needs [rows, vocab] logits", p.tensor),), shape), []
        if op in MASKED_PROJECTIONS and step.arg("valid") != self.c.edge.producer.vocab_size:
            return Buf(
                (
                    garbage(
                        rows_of_piece(p),
                        f"{op.value} masks columns from {step.arg('valid')}; the real "
                        f"vocabulary ends at {self.c.edge.producer.vocab_size} "
                        f"(padding must be masked)",
                        p.tensor,
                    ),
                ),
                shape,
            ), []
        if op is Projection.LOCAL_MAX_ARG and self.op == "max" and p.contrib is not None and len(p.region) == 2:
            # per-addend (max, index) pairs: the winner over every addend's pairs is the argmax of the max
            off = int(self.per_rank(step, "offsets", i, 0))
            if off != (p.region[1][0][0] if p.region[1] else off):
                return Buf(
                    (garbage(rows_of_piece(p), f"offset {off} is not the addend's first column", p.tensor),), shape
                ), []
            return Buf((Piece(p.tensor, Form.MAX_ARG, p.region, p.contrib, p.exact),), shape), []
        if self.partial(p):
            why = (
                f"{op.value} of a partial addend (contributions of {list(p.contrib or ())} only): "
                f"the projection of a partial sum is not the projection of the sum"
            )
            return Buf((garbage(rows_of_piece(p), why, p.tensor),), shape), [("projection_of_partial", why)]
        rows = rows_of_piece(p)
        cols = p.region[-1]
        if op is Projection.ARGMAX:
            if len(p.region) != 2:
                return Buf((garbage(rows, "argmax of a tensor that is not [rows, vocab]", p.tensor),), shape), []
            return Buf((Piece(p.tensor, Form.TOKEN, (rows, cols), None, p.exact),), shape), []
        if op in _PER_SHARD:
            off = int(self.per_rank(step, "offsets", i, 0))
            if cols and (len(cols) != 1 or cols[0][0] != off):
                return Buf((garbage(rows, f"offset {off} is not the shard's first column", p.tensor),), shape), []
            if op is Projection.LOCAL_SAMPLE_MAX_ARG:
                cons = self.c.edge.consumer
                if (step.arg("seed", 0), float(step.arg("temperature", 1.0))) != (cons.seed, cons.temperature):
                    return Buf(
                        (garbage(rows, "perturbed with another seed or temperature than the consumer's", p.tensor),),
                        shape,
                    ), []
                if not self.rows_at(rows, int(self.per_rank(step, "row_offsets", i, 0))):
                    return Buf((garbage(rows, "perturbed with the noise of other rows", p.tensor),), shape), []
                return Buf((Piece(p.tensor, Form.SAMPLE_ARG, (rows, cols), None, p.exact),), shape), []
            if op is Projection.LOCAL_LSE_STATS and not self.rows_at(
                rows, int(self.per_rank(step, "row_offsets", i, 0))
            ):
                return Buf((garbage(rows, "target ids read from the wrong rows", p.tensor),), shape), []
            form = Form.MAX_ARG if op is Projection.LOCAL_MAX_ARG else Form.LSE_STATS
            return Buf((Piece(p.tensor, form, (rows, cols), None, p.exact),), shape), []
        if op is Projection.COMBINE_MAX_ARG:
            form = Form.SAMPLE if p.form is Form.SAMPLE_ARG else Form.TOKEN
            return Buf((Piece(p.tensor, form, (rows, cols), None, p.exact),), shape), []
        if op is Projection.COMBINE_LSE_STATS:
            return Buf((Piece(p.tensor, Form.LOGPROB, (rows, cols), None, False),), shape), []
        if op in _OF_FULL_ROWS:
            return self.row_projection(op, step, i, p, shape), []
        # LOGSOFTMAX_AT
        if cols != ((0, self.vocab),):
            raise Refusal(
                ViolationKind.MALFORMED_STEP,
                f"log-softmax over columns {_rows_text(cols)} of {self.vocab}: target ids fall outside",
            )
        if not self.rows_at(rows, int(self.per_rank(step, "row_offsets", i, 0))):
            return Buf((garbage(rows, "target ids read from the wrong rows", p.tensor),), shape), []
        return Buf((Piece(p.tensor, Form.LOGPROB, (rows, cols), None, p.exact),), shape), []

    def row_projection(self, op: Projection, step: Step, i: int, p: Piece, shape: tuple[int, ...]) -> Buf:
        """top-k, token + log-prob or a seeded sample: full rows in, with the consumer's parameters."""
        rows, cols = rows_of_piece(p), p.region[-1]
        if cols != ((0, self.vocab),):
            return Buf(
                (
                    garbage(
                        rows,
                        f"{op.value} over columns {_rows_text(cols)} only; it needs whole rows of {self.vocab}",
                        p.tensor,
                    ),
                ),
                shape,
            )
        cons = self.c.edge.consumer
        if op is Projection.TOPK and int(step.arg("k", 1)) != cons.k:
            return Buf((garbage(rows, f"top-{step.arg('k', 1)} where top-{cons.k} is demanded", p.tensor),), shape)
        if op is Projection.SAMPLE:
            if (step.arg("seed", 0), float(step.arg("temperature", 1.0))) != (cons.seed, cons.temperature):
                return Buf(
                    (
                        garbage(
                            rows,
                            f"sampled with seed {step.arg('seed', 0)}, temperature "
                            f"{step.arg('temperature', 1.0)}; the consumer's are {cons.seed}, "
                            f"{cons.temperature}",
                            p.tensor,
                        ),
                    ),
                    shape,
                )
            if not self.rows_at(rows, int(self.per_rank(step, "row_offsets", i, 0))):
                return Buf((garbage(rows, "sampled with the noise of other rows", p.tensor),), shape)
        form = {
            Projection.TOPK: Form.TOPK,
            Projection.TOKEN_LOGPROB: Form.TOKEN_LOGPROB,
            Projection.SAMPLE: Form.SAMPLE,
        }[op]
        return Buf((Piece(p.tensor, form, (rows, cols), None, p.exact),), shape)

    @staticmethod
    def rows_at(rows: Intervals, offset: int) -> bool:
        return not rows or (len(rows) == 1 and rows[0][0] == offset)

    def proj_shape(self, op: Projection, x: Buf, step: Step) -> tuple[int, ...]:
        s = x.shape
        if (op in _NEEDS_2D and len(s) != 2) or (not s and op is Projection.ARGMAX):
            raise Refusal(ViolationKind.MALFORMED_STEP, f"{op.value} cannot apply to shape {list(s)}")
        packed = _PACKED_INPUT.get(op)
        if packed is not None and s[1] % packed[0]:
            raise Refusal(ViolationKind.MALFORMED_STEP, f"{op.value} needs {packed[1]}, got width {s[1]}")
        width = _FIXED_WIDTH.get(op)
        if width is not None:
            return (s[0], width)
        if op is Projection.TOPK:
            k = int(step.arg("k", 1))
            if not 1 <= k <= s[1]:
                raise Refusal(ViolationKind.MALFORMED_STEP, f"top-{k} of rows of {s[1]} entries")
            return (s[0], 2 * k)
        return s[:-1]

    # -- the end of the plan: what each consumer observed ---------------------------------------
    def finish(self) -> None:
        for k, rank, p in self.pending:
            later = any(
                j > k
                and any(
                    q.tensor == p.tensor and q.form is p.form and q.region == p.region and not self.partial(q)
                    for q in buf.pieces
                )
                for j, buf in self.writes[rank]
            )
            have = sorted(p.contrib or ())
            if later:
                self.flag(
                    ViolationKind.DELIVERY_BEFORE_COMPLETION,
                    k,
                    rank,
                    f"rank {rank} is handed {p.tensor}{region_text(p.region)} with only the addends of "
                    f"{have} reduced in; the rest arrive after the delivery",
                )
            else:
                self.flag(
                    ViolationKind.NEVER_REDUCED,
                    k,
                    rank,
                    f"rank {rank} observes {p.tensor}{region_text(p.region)} holding only the addends of "
                    f"{have} of {list(self.order)}: the partial {self.op} is never completed",
                )
        demand = self.c.demand
        consumers = set(self.c.edge.consumer.ranks)
        for rank, (k, buf) in sorted(self.observed.items()):
            if rank in demand.silent or (rank not in consumers and self.c.authority.owner_of_row is not None):
                self.flag(
                    ViolationKind.NON_OWNER_OBSERVES,
                    k,
                    rank,
                    f"rank {rank} owns no rows, yet observes {self.describe(buf)}",
                )
            elif rank not in consumers:
                self.flag(
                    ViolationKind.DEMAND_NOT_MET,
                    k,
                    rank,
                    f"rank {rank} is not a consumer rank, yet observes {self.describe(buf)}",
                )
        for obs in demand.observations:
            self.judge(obs)

    def describe(self, buf: Buf) -> str:
        if len(buf.pieces) != 1:
            return f"{len(buf.pieces)} pieces that do not form one region"
        p = buf.pieces[0]
        if p.form is Form.GARBAGE:
            return f"values that mean nothing ({p.why})"
        return f"{p.form.value} {p.tensor}{region_text(p.region)}"

    def judge(self, obs: Observation) -> None:
        rank = obs.rank

        def want() -> str:
            return f"{obs.form.value} {self.tensor}{region_text(obs.region)}"

        if rank not in self.observed:
            self.flag(ViolationKind.DEMAND_NOT_MET, None, rank, f"rank {rank} ends without its demanded {want()}")
            return
        k, buf = self.observed[rank]
        if (
            obs.form is Form.RAW
            and 0 in obs.shape
            and buf.shape == obs.shape
            and all(p.form is Form.RAW and self.empty(p) for p in buf.pieces)
        ):
            return  # nothing to observe, and nothing observed, in the demanded shape
        if len(buf.pieces) != 1 or buf.pieces[0].form is Form.GARBAGE:
            self.flag(
                ViolationKind.DEMAND_NOT_MET, k, rank, f"rank {rank} observes {self.describe(buf)} instead of {want()}"
            )
            return
        p = buf.pieces[0]
        if self.partial(p):
            return  # reported as never_reduced / delivery_before_completion
        if p.form is not obs.form:
            if p.form is Form.RAW:
                self.flag(
                    ViolationKind.DEMAND_NOT_MET,
                    k,
                    rank,
                    f"rank {rank} observes raw {p.tensor}{region_text(p.region)}, more than its demanded {want()}",
                )
            else:
                self.flag(
                    ViolationKind.DISALLOWED_SUBSTITUTE,
                    k,
                    rank,
                    f"rank {rank} observes {p.form.value} where the contract demands {want()}; no substitute "
                    "allows that",
                )
            return
        region = p.region
        if obs.form is not Form.RAW and p.region[1] != obs.region[1]:
            self.flag(
                ViolationKind.DEMAND_NOT_MET,
                k,
                rank,
                f"rank {rank} observes {p.form.value} over columns {_rows_text(p.region[1])} only, not the "
                f"whole vocabulary {_rows_text(obs.region[1])}",
            )
            return
        if region != obs.region:
            self.flag(
                ViolationKind.DEMAND_NOT_MET, k, rank, f"rank {rank} observes {self.describe(buf)} instead of {want()}"
            )
            return
        if not p.exact and self.c.substitutability.equivalence is Equivalence.BITWISE:
            what = (
                "log-probabilities combined from per-shard statistics"
                if p.form is Form.LOGPROB and not isinstance(self.c.provenance.placement, Partial)
                else f"a {self.op or 'reduction'} in an order other than the reference"
            )
            self.flag(
                ViolationKind.DISALLOWED_SUBSTITUTE,
                k,
                rank,
                f"rank {rank} observes {what}; the contract demands bitwise equality with one device",
            )


# The checker's method for each step kind.
_STEP_METHOD: dict[StepKind, str] = {
    StepKind.SEND: "send",
    StepKind.DELIVER: "deliver",
    StepKind.PROJECT: "project_step",
    StepKind.COLLECTIVE: "collective",
}


def check(plan: Plan, contract: Contract) -> CheckReport:
    """Check ``plan`` against ``contract`` symbolically; the report lists every violation."""
    return _Checker(contract).run(plan)
