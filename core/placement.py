"""Placements: where the values of a tensor live across the ranks of one native domain.

The vocabulary is DTensor's: ``Replicate()`` (every rank holds the whole tensor),
``Shard(dim)`` (rank *i* of *n* holds the *i*-th contiguous chunk along ``dim``) and
``Partial(op)`` (every rank holds a full-shaped addend; the value is their reduction).
Placements are frozen value types with a readable ``repr`` and a text form that
round-trips through :func:`parse_placement`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from .errors import FactError

__all__ = [
    "Replicate",
    "Shard",
    "Partial",
    "Placement",
    "REDUCE_OPS",
    "parse_placement",
    "shard_bounds",
]

REDUCE_OPS = ("sum", "max", "min", "avg")


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Rank *i* of *n* holds chunk *i* of the tensor split along ``dim``."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise FactError(f"Shard(dim): dim must be a non-negative integer, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a full-shaped addend; the tensor is their reduction by ``op``."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise FactError(f"Partial(op): op must be one of {', '.join(REDUCE_OPS)}, got {self.op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.op})"


Placement = Union[Replicate, Shard, Partial]

_PATTERN = re.compile(r"^\s*(Replicate|Shard|Partial)\s*\(\s*([A-Za-z0-9_]*)\s*\)\s*$")


def parse_placement(text: str) -> Placement:
    """Parse ``"Replicate()"``, ``"Shard(1)"`` or ``"Partial(sum)"`` into a placement."""
    match = _PATTERN.match(str(text))
    if not match:
        raise FactError(f"placement {text!r} is not understood; expected Replicate(), Shard(<dim>) or Partial(<op>)")
    kind, arg = match.groups()
    if kind == "Replicate":
        if arg:
            raise FactError(f"placement {text!r}: Replicate() takes no argument")
        return Replicate()
    if kind == "Shard":
        if not arg.isdigit():
            raise FactError(f"placement {text!r}: Shard needs a non-negative integer dim, e.g. Shard(1)")
        return Shard(int(arg))
    return Partial(arg or "sum")


def shard_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """Return ``[start, stop)`` of chunk ``index`` when ``size`` is split into ``parts``.

    Chunks follow ``torch.chunk``/DTensor: ``ceil(size / parts)`` elements each, the last
    ones shorter (possibly empty).
    """
    if parts <= 0:
        raise FactError(f"cannot split into {parts} parts; expected at least 1")
    if not 0 <= index < parts:
        raise FactError(f"chunk index {index} out of range for {parts} parts")
    step = -(-size // parts)
    start = min(size, index * step)
    return start, min(size, start + step)
