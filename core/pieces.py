"""Symbolic values for the checker: pieces of a tensor and the algebra of combining them.

A :class:`Piece` says which region of which producer tensor some data covers, in what
reduction state (the partial addends summed in so far) and in what form (raw values,
per-shard statistics, tokens, log-probabilities, or garbage with the reason it went
wrong). A :class:`Buf` is what one rank holds under one buffer name: its pieces in layout
order and its numeric shape. :class:`PieceAlgebra` concatenates, slices and reduces
buffers exactly as the numeric interpreter does to arrays, and raises :class:`Refusal`
where numpy or a process group would refuse the operation.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .contract import Contract, Form
from .placement import shard_bounds
from .region import (
    Intervals,
    Region,
    concat_intervals,
    intervals_from_indices,
    intervals_indices,
    intervals_size,
    region_text,
    take_intervals,
    union_intervals,
)

__all__ = ["Piece", "Buf", "Refusal", "PieceAlgebra", "garbage", "rows_of_piece"]


# Forms that pack several statistics per row into columns (sliced only along rows).
_PACKED = frozenset({Form.MAX_ARG, Form.SAMPLE_ARG, Form.LSE_STATS})


class Piece(NamedTuple):
    """A symbolic value: which region of which tensor, in what reduction state and form."""

    tensor: str
    form: Form
    region: Region  # RAW: per tensor dim; other forms: (rows, columns covered)
    contrib: tuple[int, ...] | None  # partial addends summed in (None: complete by birth)
    exact: bool  # bitwise equal to the single-device value
    why: str = ""  # for GARBAGE: how it went wrong


class Buf(NamedTuple):
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]
    itemsize: int = 0  # bytes per element of the numeric buffer (0: unknown)

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n


class Refusal(Exception):
    """An operation that cannot work; ``kind`` is the checker's violation kind for it."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def garbage(rows: Intervals, why: str, tensor: str = "") -> Piece:
    return Piece(tensor, Form.GARBAGE, (rows,), None, False, why)


def rows_of_piece(p: Piece) -> Intervals:
    return p.region[0] if p.region else ()


class PieceAlgebra:
    """Concatenate, slice and reduce buffers of pieces for one contract."""

    def __init__(self, contract: Contract) -> None:
        self.c = contract
        self.mesh = contract.edge.mesh
        prov = contract.provenance
        self.order = contract.completion.contributors
        self.all = frozenset(self.order)
        self.tensor = prov.tensor
        self.floating = prov.dtype.is_floating
        self.op = contract.completion.reduce_op
        self.vocab = prov.shape[-1]

    def partial(self, p: Piece) -> bool:
        return p.contrib is not None and frozenset(p.contrib) != self.all

    # -- region algebra over buffers -----------------------------------------------------
    def merge2(self, a: Piece, b: Piece, dim: int) -> Piece | None:
        if (
            a.form is Form.MAX_ARG
            and b.form is Form.MAX_ARG
            and dim == 1
            and a.contrib != b.contrib
            and a.tensor == b.tensor
            and self.op == "max"
            and a.region == b.region
            and a.contrib is not None
            and b.contrib is not None
            and not set(a.contrib) & set(b.contrib)
        ):
            # (max, index) pairs of different max addends over the same columns combine like shards
            return a._replace(
                contrib=tuple(r for r in self.order if r in a.contrib or r in b.contrib), exact=a.exact and b.exact
            )
        if Form.GARBAGE in (a.form, b.form) or a.tensor != b.tensor or a.form != b.form or a.contrib != b.contrib:
            return None
        exact = a.exact and b.exact
        if a.form is Form.RAW:
            if any(a.region[i] != b.region[i] for i in range(len(a.region)) if i != dim):
                return None
            iv = concat_intervals(a.region[dim], b.region[dim])
            return (
                None
                if iv is None
                else Piece(a.tensor, a.form, a.region[:dim] + (iv,) + a.region[dim + 1 :], a.contrib, exact, a.why)
            )
        rows_a, cols_a = a.region
        rows_b, cols_b = b.region
        if a.form in _PACKED and dim == 1:
            if rows_a != rows_b:
                return None
            cols, overlap = union_intervals(cols_a, cols_b)
            if overlap and a.form is Form.LSE_STATS:
                return garbage(rows_a, "statistics of the same columns counted twice", a.tensor)
            return Piece(a.tensor, a.form, (rows_a, cols), a.contrib, exact, a.why)
        if dim == 0 and cols_a == cols_b:
            iv = concat_intervals(rows_a, rows_b)
            return None if iv is None else Piece(a.tensor, a.form, (iv, cols_a), a.contrib, exact, a.why)
        return None

    def concat(self, bufs: Sequence[Buf], dim: int) -> Buf:
        shapes = [b.shape for b in bufs]
        nd = len(shapes[0])
        if (
            dim >= nd
            or any(len(s) != nd for s in shapes)
            or any(s[i] != shapes[0][i] for s in shapes for i in range(nd) if i != dim)
        ):
            raise Refusal("malformed_step", f"cannot concatenate shapes {[list(s) for s in shapes]} along dim {dim}")
        shape = tuple(sum(s[dim] for s in shapes) if i == dim else shapes[0][i] for i in range(nd))
        pieces = [p for b in bufs for p in b.pieces]
        nonempty = [p for p in pieces if not self.empty(p)] or pieces
        out: list[Piece] = [nonempty[0]]
        for p in nonempty[1:]:
            m = self.merge2(out[-1], p, dim) if len(out) == 1 else None
            if m is None:
                out.append(p)
            else:
                out[-1] = m
        return Buf(tuple(out), shape, bufs[0].itemsize)

    def empty(self, p: Piece) -> bool:
        if p.form is Form.RAW:
            return any(not iv for iv in p.region)
        return p.form is not Form.GARBAGE and not rows_of_piece(p)

    def narrow(self, buf: Buf, dim: int, local: Sequence[int]) -> Buf:
        """Keep local positions ``local`` (increasing) along ``dim``."""
        if dim >= len(buf.shape):
            raise Refusal("malformed_step", f"dim {dim} does not exist in shape {list(buf.shape)}")
        size = buf.shape[dim]
        if isinstance(local, range) and local.step == 1:
            if len(local) and (local.start < 0 or local.stop > size):
                raise Refusal(
                    "malformed_step", f"positions {local.start}..{local.stop} outside 0..{size} along dim {dim}"
                )
        elif any(i < 0 or i >= size for i in local):
            raise Refusal("malformed_step", f"positions outside 0..{size} along dim {dim}")
        shape = buf.shape[:dim] + (len(local),) + buf.shape[dim + 1 :]
        if len(buf.pieces) != 1:
            return Buf(
                (garbage(self.rows_of(buf), "slice of pieces that do not form one region", self.tensor),),
                shape,
                buf.itemsize,
            )
        p = buf.pieces[0]
        if p.form is Form.GARBAGE:
            return Buf((p,), shape, buf.itemsize)
        if p.form in _PACKED and dim == 1:
            return Buf((garbage(rows_of_piece(p), "slice through packed statistics", p.tensor),), shape, buf.itemsize)
        if not isinstance(local, range) and list(local) != sorted(set(local)):
            return Buf((garbage(rows_of_piece(p), "rows reordered", p.tensor),), shape, buf.itemsize)
        if isinstance(local, range) and local.step == 1:
            iv = take_intervals(p.region[dim], local.start, local.stop)
        else:
            idx = intervals_indices(p.region[dim])
            iv = intervals_from_indices([idx[i] for i in local])
        return Buf(
            (Piece(p.tensor, p.form, p.region[:dim] + (iv,) + p.region[dim + 1 :], p.contrib, p.exact, p.why),),
            shape,
            buf.itemsize,
        )

    def chunk(self, buf: Buf, dim: int, parts: int, index: int) -> Buf:
        if dim >= len(buf.shape):
            raise Refusal("malformed_step", f"dim {dim} does not exist in shape {list(buf.shape)}")
        if parts <= 0 or not 0 <= index < parts:
            raise Refusal("malformed_step", f"chunk {index} of {parts} does not exist")
        lo, hi = shard_bounds(buf.shape[dim], parts, index)
        return self.narrow(buf, dim, range(lo, hi))

    def rows_of(self, buf: Buf) -> Intervals:
        rows: Intervals = ()
        for p in buf.pieces:
            rows, _ = union_intervals(rows, rows_of_piece(p))
        return rows

    def reduce(self, bufs: Sequence[Buf], op: str, native: bool) -> tuple[Buf, list[tuple[str, str]]]:
        out, issues = self._reduce(bufs, op, native)
        return Buf(out.pieces, out.shape, bufs[0].itemsize if bufs else 0), issues

    def _reduce(self, bufs: Sequence[Buf], op: str, native: bool) -> tuple[Buf, list[tuple[str, str]]]:
        shapes = {b.shape for b in bufs}
        if len(shapes) != 1:
            raise Refusal("malformed_step", f"reduction over shapes {sorted(list(s) for s in shapes)}")
        shape = bufs[0].shape

        def rows() -> Intervals:
            out: Intervals = ()
            for b in bufs:
                out, _ = union_intervals(out, self.rows_of(b))
            return out

        if op not in ("sum", "max", "min", "avg"):
            raise Refusal("malformed_step", f"unknown reduce op {op!r}")
        if any(len(b.pieces) != 1 for b in bufs):
            return Buf((garbage(rows(), "reduction of pieces that do not form one region", self.tensor),), shape), []
        ps = [b.pieces[0] for b in bufs]
        if len(ps) == 1:
            return bufs[0], []
        if any(p.form is Form.GARBAGE for p in ps):
            return Buf((ps[0] if ps[0].form is Form.GARBAGE else garbage(rows(), "reduction of garbage"),), shape), []
        if any(p.form is not Form.RAW for p in ps):
            return Buf((garbage(rows(), f"{op} of projected forms", self.tensor),), shape), []
        if any(p.region != ps[0].region for p in ps):
            return Buf(
                (garbage(rows(), f"{op} of different regions {[region_text(p.region) for p in ps]}", self.tensor),),
                shape,
            ), []
        if op in ("max", "min"):
            if self.op != op and not all(p.contrib is None for p in ps):
                return Buf((garbage(rows(), f"{op} of {self.op} addends", self.tensor),), shape), []
            contrib = (
                None
                if any(p.contrib is None for p in ps)
                else tuple(r for r in self.order if any(r in (p.contrib or ()) for p in ps))
            )
            return Buf((ps[0]._replace(contrib=contrib, exact=all(p.exact for p in ps)),), shape), []
        if self.op is not None and self.op != op:
            return Buf((garbage(rows(), f"{op} of {self.op} addends", self.tensor),), shape), []
        complete = [p for p in ps if p.contrib is None]
        if complete:
            why = (
                f"{op} over {len(ps)} copies of complete data counts it {len(ps)} times"
                if self.op is None
                else f"{op} adds an already complete {ps[0].tensor} to addends again"
            )
            return Buf((garbage(rows(), why, self.tensor),), shape), [("reduced_twice", why)]
        seen: list[int] = []
        for p in ps:
            dup = sorted(set(seen) & set(p.contrib or ()))
            if dup:
                why = f"addends of rank(s) {dup} would be summed twice"
                return Buf((garbage(rows(), why, self.tensor),), shape), [("reduced_twice", why)]
            seen.extend(p.contrib or ())
        if op == "avg":
            if frozenset(seen) != self.all or any(len(p.contrib or ()) != 1 for p in ps):
                return Buf(
                    (garbage(rows(), "an average is only correct over all addends at once", self.tensor),), shape
                ), []
        exact = self.fold_exact(ps, native)
        return Buf((ps[0]._replace(contrib=tuple(seen), exact=exact),), shape), []

    def fold_exact(self, ps: Sequence[Piece], native: bool) -> bool:
        """Whether folding ``ps`` left to right gives the reference fold's bits.

        Each addition of two operands is commutative, so ``acc + p`` is exact when one operand
        is the exact fold of a prefix of the reference order and the other is the next addend,
        in either position; a native reduction of more than two floating operands never is.
        """
        if not self.floating:
            return True
        if native and len(ps) > 2:
            return False
        acc_set = list(ps[0].contrib or ())
        ok = ps[0].exact
        for p in ps[1:]:
            pc = list(p.contrib or ())
            ok = ok and p.exact and (self._next_addend(acc_set, pc) or self._next_addend(pc, acc_set))
            acc_set += pc
        return ok

    def _next_addend(self, prefix: list[int], single: list[int]) -> bool:
        return (
            len(single) == 1
            and set(self.order[: len(prefix)]) == set(prefix)
            and len(prefix) < len(self.order)
            and single[0] == self.order[len(prefix)]
        )

    def extent(self, p: Piece, dim: int) -> int:
        if p.form is Form.GARBAGE or dim >= len(p.region):
            return -1
        return intervals_size(p.region[dim])
